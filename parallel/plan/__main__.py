"""`python -m parallel.plan`: see parallel/plan/cli.py."""
import sys

from parallel.plan.cli import main

sys.exit(main())
