"""Optional compiled kernels (``_speedups.c``); absent where the extension was not built."""

from typing_extensions import Buffer

def cast_f32_bf16(src: Buffer, /) -> tuple[bytes, float, float, int]:
    """float32 bytes -> (bfloat16 bytes, max abs error, max rel error, overflows)."""

def cast_f32_f16(src: Buffer, /) -> tuple[bytes, float, float, int]:
    """float32 bytes -> (float16 bytes, max abs error, max rel error, overflows)."""
