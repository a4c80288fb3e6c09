from __future__ import annotations

import pytest

from modelsize.dtypes import DTYPES, canonical, lookup


@pytest.mark.parametrize(
    ("spelling", "name"),
    [("torch.float32", "float32"), ("F32", "float32"), ("BF16", "bfloat16"), ("double", "float64"),
     ("FloatStorage", "float32"), ("q4_K", "q4_K"), ("Q4_k", "q4_K"), ("f16", "float16")],
)
def test_spellings_map_to_canonical_names(spelling: str, name: str) -> None:
    assert canonical(spelling) == name


def test_quantized_blocks_round_up() -> None:
    assert lookup("q4_0").nbytes(32) == 18
    assert lookup("q4_0").nbytes(33) == 36
    assert lookup("q6_K").nbytes(256 * 3) == 3 * 210
    assert lookup("float32").nbytes(7) == 28


def test_torch_itemsizes_agree() -> None:
    torch = pytest.importorskip("torch")
    for name, dt in DTYPES.items():
        tdt = getattr(torch, name, None)
        if isinstance(tdt, torch.dtype) and dt.block == 1:
            assert dt.block_bytes == tdt.itemsize, name
