"""The optional compiled kernels (``modelsize._speedups``); everything else is in pyproject.toml.

``optional=True``: where no C compiler is at hand the install goes on without them and
modelsize uses its NumPy paths (the same results, slower).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "modelsize._speedups",
            ["src/modelsize/_speedups.c"],
            # -O3 vectorizes the cast loop; never -ffast-math (NaN, subnormals and the order
            # of rounding must be IEEE's).
            extra_compile_args=["-O3", "-fno-trapping-math"],
            optional=True,
        )
    ]
)
