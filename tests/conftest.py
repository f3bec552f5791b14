import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("PYTHONPATH", ROOT)
# The environment's own tools first on PATH (as scripts/test.sh does): DeepSpeed keys its JIT-compiled
# ops on the ninja/compiler it finds, and a different one triggers a minute-long rebuild in every rank.
_bin = os.path.dirname(sys.executable)
if not os.environ.get("PATH", "").startswith(_bin + os.pathsep):
    os.environ["PATH"] = _bin + os.pathsep + os.environ.get("PATH", "")
