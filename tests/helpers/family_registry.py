"""The helpers and fixtures of tests/unit/test_family_registry.py that other test modules use too: `toy_registry` (a
test module imports no other test module)."""
from __future__ import annotations

import contextlib
import sys




@contextlib.contextmanager
def toy_registry():
    """The registry and the imported toy modules as they were before the body."""
    from models.registry import FAMILIES
    before, modules = dict(FAMILIES), set(sys.modules)
    try:
        yield
    finally:
        FAMILIES.clear()
        FAMILIES.update(before)
        for name in set(sys.modules) - modules:
            if name.startswith("tests.toy_family"):
                del sys.modules[name]
