"""The standard-library modules of the `cudelta` package that the installer shares, loaded by path.

Importing `cudelta` itself would import torch (seconds, and often not installed yet), so a module
the installer and the run time must agree on lives in cudelta/ (it ships in the wheel) and is
loaded here from its file, under a name of its own.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

# The source tree, or the unpacked sdist: cudelta/, installer/, csrc/ and kernels/ side by side.
SOURCE_ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIR = SOURCE_ROOT / "cudelta"


def load(stem: str) -> ModuleType:
    """cudelta/<stem>.py as module `cudelta<stem>` (loaded once per process)."""
    name = "cudelta" + stem
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, PACKAGE_DIR / f"{stem}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up by name
        spec.loader.exec_module(module)
    return sys.modules[name]
