"""The optional compiled kernels (``modelsize._speedups``, ``modelsize._pickleops``,
``modelsize._headers``); everything else is in pyproject.toml.

``optional=True``: where no C compiler is at hand (or it fails) the install goes on without
them and modelsize uses its NumPy paths (the same results, slower).
"""

import sys

from setuptools import Extension, setup

# -O3 vectorizes the cast loops, -fno-trapping-math lets them select without branches (no
# floating-point exception flag is ever read); never -ffast-math: NaN, subnormals and the order
# of rounding must be IEEE's. MSVC takes its defaults.
FLAGS = [] if sys.platform == "win32" else ["-O3", "-fno-trapping-math"]

setup(
    ext_modules=[
        Extension(
            "modelsize._speedups",
            ["src/modelsize/_speedups.c"],
            extra_compile_args=FLAGS,
            optional=True,
        ),
        # The pickle parser's frequent opcodes (formats/_pickle.py runs them itself without).
        Extension(
            "modelsize._pickleops",
            ["src/modelsize/_pickleops.c"],
            extra_compile_args=[] if sys.platform == "win32" else ["-O2"],
            optional=True,
        ),
        # The common entries of a safetensors header (formats/safetensors.py scans them itself
        # without).
        Extension(
            "modelsize._headers",
            ["src/modelsize/_headers.c"],
            extra_compile_args=[] if sys.platform == "win32" else ["-O2"],
            optional=True,
        ),
    ]
)
