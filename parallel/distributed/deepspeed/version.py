"""The DeepSpeed release the patches of this package were written against, and a warning for another."""
from __future__ import annotations

import functools
import warnings

import deepspeed

TESTED_DEEPSPEED = "0.19"             # the series check_deepspeed_version accepts
WRITTEN_AGAINST = "0.19.8"            # the release every patch was written and tested against


def major_minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def check_deepspeed_version(installed: str | None = None) -> bool:
    """True when the installed DeepSpeed is the major.minor these patches were written against; else
    warn (once per version and process) and return False."""
    installed = installed or deepspeed.__version__
    if major_minor(installed) == TESTED_DEEPSPEED:
        return True
    _warn_untested(installed)
    return False


@functools.cache
def _warn_untested(installed: str) -> None:
    warnings.warn(f"deepspeed {installed} is installed; parallel/distributed/deepspeed/ was written against "
                  f"{TESTED_DEEPSPEED}.x. Run `python -m pytest tests/unit/test_deepspeed_compat.py`: it names any "
                  f"patch whose DeepSpeed internals changed.", RuntimeWarning, stacklevel=3)
