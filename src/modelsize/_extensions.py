"""The optional compiled extensions, loaded in one place.

``modelsize._speedups`` (slim's casts), ``modelsize._pickleops`` (the pickle parser's frequent
opcodes) and ``modelsize._headers`` (the common entries of a safetensors header) are built by
``pip install`` where a C compiler is at hand. Their callers fall back to
Python (and NumPy) where one is missing, with the same results; ``MODELSIZE_PURE_PYTHON=1``
makes them fall back where it is built too.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType


def compiled(name: str) -> ModuleType | None:
    """The extension ``modelsize.<name>``, or ``None`` where it is not built or not wanted."""
    if os.environ.get("MODELSIZE_PURE_PYTHON"):
        return None
    try:
        return importlib.import_module(f"modelsize.{name}")
    except ImportError:
        return None
