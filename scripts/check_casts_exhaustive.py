"""Every float32 bit pattern (2**32 of them) through the compiled casts of
``modelsize._speedups`` and through the NumPy path they replace: the same bytes, and the same
errors (largest absolute and relative, overflows) per block of 2**22 elements.

    python scripts/check_casts_exhaustive.py bfloat16   # about 1 minute here
    python scripts/check_casts_exhaustive.py float16    # about 10 minutes here

float16 runs on the CPU's F16C conversion where it has one: run the float16 check a second time
with ``MODELSIZE_NO_F16C=1`` for the portable loops.

Too long for the test suite, which checks the values that matter
(tests/slimming/test_cast_compiled.py); run this after changing ``_speedups.c``.
"""

from __future__ import annotations

import math
import sys
import time

import numpy as np

from modelsize import _speedups
from modelsize.slimming import cast

STEP = 1 << 22


def numpy_cast(chunk: bytes, dst: str) -> tuple[bytes, float, float, int]:
    c = cast.Cast.__new__(cast.Cast)
    c.src, c.dst, c.np, c.compiled = "float32", dst, np, None
    with np.errstate(all="ignore"):
        return c._cast(chunk)


def main() -> int:
    dst = sys.argv[1] if len(sys.argv) > 1 else "bfloat16"
    compiled = {"bfloat16": _speedups.cast_f32_bf16, "float16": _speedups.cast_f32_f16}[dst]
    start_time = time.time()
    bad = 0
    for start in range(0, 1 << 32, STEP):
        chunk = np.arange(start, start + STEP, dtype=np.uint64).astype(np.uint32).tobytes()
        a, b = compiled(chunk), numpy_cast(chunk, dst)
        same = a[0] == b[0] and a[3] == b[3] and all(
            x == y or (math.isnan(x) and math.isnan(y))
            for x, y in zip(a[1:3], b[1:3], strict=True))
        if not same:
            bad += 1
            print(f"block at {start:#010x}: compiled {a[1:]}, NumPy {b[1:]}, "
                  f"bytes {'equal' if a[0] == b[0] else 'differ'}")
    print(f"{dst}: {(1 << 32) // STEP} blocks, {bad} differ ({time.time() - start_time:.0f} s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
