"""One table for every dtype: name -> (elements per block, bytes per block).

Plain dtypes are blocks of one element. Quantized GGML types pack ``block`` elements into
``block_bytes`` bytes (values from gguf-py ``GGML_QUANT_SIZES``). Every reader maps its own
spelling to these canonical names with :func:`canonical`, so reports speak one language.
"""

from __future__ import annotations

from modelsize._records import record


@record(frozen=True)
class DType:
    """A canonical dtype and its storage size."""

    name: str
    block: int
    block_bytes: int
    floating: bool = False

    @property
    def itemsize(self) -> float:
        """Bytes per element (fractional for packed types)."""
        return self.block_bytes / self.block

    def nbytes(self, numel: int) -> int:
        """Bytes needed for ``numel`` elements, whole blocks only."""
        blocks = -(-numel // self.block)
        return blocks * self.block_bytes


def _plain(name: str, size: int, floating: bool = False) -> DType:
    return DType(name, 1, size, floating)


_TABLE: tuple[DType, ...] = (
    _plain("float64", 8, True),
    _plain("float32", 4, True),
    _plain("float16", 2, True),
    _plain("bfloat16", 2, True),
    _plain("float8_e4m3fn", 1, True),
    _plain("float8_e4m3fnuz", 1, True),
    _plain("float8_e5m2", 1, True),
    _plain("float8_e5m2fnuz", 1, True),
    _plain("float8_e8m0fnu", 1, True),
    DType("float4_e2m1fn_x2", 1, 1, True),
    # safetensors counts sub-byte floats per element: F4 packs 2 in a byte, F6 packs 4 in 3.
    DType("float4_e2m1fn", 2, 1, True),
    DType("float6_e2m3fn", 4, 3, True),
    DType("float6_e3m2fn", 4, 3, True),
    _plain("complex32", 4, True),
    _plain("complex64", 8, True),
    _plain("complex128", 16, True),
    _plain("int8", 1),
    _plain("uint8", 1),
    _plain("int16", 2),
    _plain("uint16", 2),
    _plain("int32", 4),
    _plain("uint32", 4),
    _plain("int64", 8),
    _plain("uint64", 8),
    _plain("bool", 1),
    _plain("qint8", 1),
    _plain("quint8", 1),
    _plain("qint32", 4),
    DType("int4", 2, 1),
    DType("uint4", 2, 1),
    DType("int2", 4, 1),
    DType("uint2", 4, 1),
    DType("quint4x2", 2, 1),
    DType("quint2x4", 4, 1),
    _plain("bits8", 1),
    _plain("bits16", 2),
    # GGML block-quantized types: (elements per block, bytes per block).
    DType("q4_0", 32, 18, True),
    DType("q4_1", 32, 20, True),
    DType("q5_0", 32, 22, True),
    DType("q5_1", 32, 24, True),
    DType("q8_0", 32, 34, True),
    DType("q8_1", 32, 36, True),
    DType("q2_K", 256, 84, True),
    DType("q3_K", 256, 110, True),
    DType("q4_K", 256, 144, True),
    DType("q5_K", 256, 176, True),
    DType("q6_K", 256, 210, True),
    DType("q8_K", 256, 292, True),
    DType("iq2_xxs", 256, 66, True),
    DType("iq2_xs", 256, 74, True),
    DType("iq3_xxs", 256, 98, True),
    DType("iq1_s", 256, 50, True),
    DType("iq4_nl", 32, 18, True),
    DType("iq3_s", 256, 110, True),
    DType("iq2_s", 256, 82, True),
    DType("iq4_xs", 256, 136, True),
    DType("iq1_m", 256, 56, True),
    DType("tq1_0", 256, 54, True),
    DType("tq2_0", 256, 66, True),
    DType("mxfp4", 32, 17, True),
    DType("nvfp4", 64, 36, True),
    DType("q1_0", 128, 18, True),
)

DTYPES: dict[str, DType] = {d.name: d for d in _TABLE}

_ALIASES: dict[str, str] = {
    # safetensors
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
    "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F4": "float4_e2m1fn", "F6_E2M3": "float6_e2m3fn", "F6_E3M2": "float6_e3m2fn",
    "C64": "complex64",
    "I8": "int8", "U8": "uint8", "I16": "int16", "U16": "uint16", "I32": "int32",
    "U32": "uint32", "I64": "int64", "U64": "uint64", "BOOL": "bool",
    # torch spellings
    "float": "float32", "double": "float64", "half": "float16", "long": "int64", "int": "int32",
    "short": "int16", "byte": "uint8", "char": "int8", "cfloat": "complex64",
    "cdouble": "complex128", "chalf": "complex32",
    # ggml plain types
    "f64": "float64", "f32": "float32", "f16": "float16", "bf16": "bfloat16",
    "i8": "int8", "i16": "int16", "i32": "int32", "i64": "int64",
}

#: Legacy torch storage classes (``torch.FloatStorage``...) and Lua Torch tensor types.
STORAGE_CLASSES: dict[str, str] = {
    "DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32",
    "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8",
    "BoolStorage": "bool", "ComplexFloatStorage": "complex64",
    "ComplexDoubleStorage": "complex128", "QInt8Storage": "qint8", "QUInt8Storage": "quint8",
    "QInt32Storage": "qint32", "QUInt4x2Storage": "quint4x2", "QUInt2x4Storage": "quint2x4",
    "UntypedStorage": "uint8", "CudaTensor": "float32", "CudaDoubleTensor": "float64",
    "CudaHalfTensor": "float16", "CudaLongTensor": "int64", "CudaByteTensor": "uint8",
    "CudaStorage": "float32",
}


def canonical(name: str) -> str | None:
    """The canonical dtype name for any spelling we know (``torch.float32``, ``F32``, ...)."""
    bare = name.removeprefix("torch.")
    if bare in DTYPES:
        return bare
    if bare in _ALIASES:
        return _ALIASES[bare]
    if bare in STORAGE_CLASSES:
        return STORAGE_CLASSES[bare]
    low = bare.lower()
    for key in DTYPES:
        if key.lower() == low:
            return key
    return None


def lookup(name: str) -> DType:
    """The :class:`DType` for a canonical name or alias; ``KeyError`` if unknown."""
    found = canonical(name)
    if found is None:
        raise KeyError(name)
    return DTYPES[found]


def numel(shape: tuple[int, ...]) -> int:
    """Number of elements of a shape (1 for a scalar)."""
    n = 1
    for dim in shape:
        n *= dim
    return n
