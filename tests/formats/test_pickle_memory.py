"""What parsing a checkpoint's pickle keeps in memory, and the limits that must not move with it.

The parser's placeholders are most of the memory ``inspect`` takes on a checkpoint of many small
tensors; these tests pin what it keeps per tensor and that the depth and hashing-cost limits
(:data:`MAX_DEPTH`, :data:`MAX_HASH_COST`) still fall exactly where they did when every tuple
was recorded.
"""

from __future__ import annotations

import io
import tracemalloc
import zipfile

import pytest

from modelsize.formats._pickle import (
    MAX_DEPTH,
    MAX_HASH_COST,
    Call,
    PickleError,
    UnhashableKey,
    scan,
)

TENSORS = 5_000


@pytest.fixture(scope="module")
def state_dict_pickle() -> bytes:
    """``data.pkl`` of torch.save({name: tensor of 2 floats} x TENSORS)."""
    torch = pytest.importorskip("torch")
    sd = {f"layer.{i}.weight": torch.zeros(2) for i in range(TENSORS)}
    buf = io.BytesIO()
    torch.save(sd, buf)
    with zipfile.ZipFile(buf) as zf:
        name = next(n for n in zf.namelist() if n.endswith("/data.pkl"))
        return zf.read(name)


def test_parse_keeps_under_1000_bytes_a_tensor(state_dict_pickle: bytes) -> None:
    # Measured with tracemalloc: 2,250 B a tensor when every call carried three empty containers
    # and every tuple its depth record; 1,410 B after that; 729 B at 5,000 tensors and 750 B
    # at 20,000 (the count this test took four times as long with) since flat tuples are not
    # recorded.
    tracemalloc.start()
    try:
        parsed = scan(state_dict_pickle, persistent_load=lambda pid: pid[2])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert isinstance(parsed.value, dict) and len(parsed.value) == TENSORS
    assert peak / TENSORS < 1000, f"{peak / TENSORS:.0f} bytes a tensor"


def test_calls_get_containers_of_their_own_when_filled() -> None:
    # Three calls of one function, the second given APPENDS, the third SETITEMS.
    data = (b"\x80\x02ccollections\nOrderedDict\nq\x00)Rh\x00)R(K\x01K\x02eh\x00)R"
            b"(X\x01\x00\x00\x00aK\x03u\x87.")
    first, second, third = scan(data).value  # type: ignore[misc]
    assert all(isinstance(c, Call) for c in (first, second, third))
    assert list(first.items) == [] and list(first.dictitems) == []
    assert second.items == [1, 2] and list(second.dictitems) == []
    assert third.dictitems == [("a", 3)] and list(third.items) == []
    data = b"\x80\x02ccollections\nOrderedDict\n)R(K\x01K\x02e(K\x03e."
    call = scan(data).value
    assert isinstance(call, Call) and call.items == [1, 2, 3]


@pytest.mark.parametrize("first", [b"K\x01\x85", b"K\x01K\x02\x86", b"(K\x01K\x02K\x03K\x04t"])
def test_depth_limit_is_exact(first: bytes) -> None:
    # A flat tuple is depth 1; each TUPLE1 around it adds one.
    ok = b"\x80\x02" + first + b"\x85" * (MAX_DEPTH - 1) + b"."
    assert isinstance(scan(ok).value, tuple)
    with pytest.raises(PickleError, match="nested more than"):
        scan(b"\x80\x02" + first + b"\x85" * MAX_DEPTH + b".")


@pytest.mark.parametrize("n", [MAX_HASH_COST - 1, MAX_HASH_COST])
def test_costly_flat_keys_are_wrapped_exactly_past_the_limit(n: int) -> None:
    # A flat tuple of n items costs n + 1 to hash: used as a key past MAX_HASH_COST it is
    # wrapped (compared by identity), not hashed again at every use.
    key = b"(" + b"K\x01" * n + b"t"
    value = scan(b"\x80\x02}" + key + b"K\x00s.").value
    assert isinstance(value, dict)
    (k,) = value
    assert isinstance(k, UnhashableKey) == (n + 1 > MAX_HASH_COST)
    # Inside another tuple its cost still counts: (flat,) costs n + 3.
    value = scan(b"\x80\x02}" + key + b"\x85K\x00s.").value
    assert isinstance(value, dict)
    (k,) = value
    assert isinstance(k, UnhashableKey) == (n + 3 > MAX_HASH_COST)
