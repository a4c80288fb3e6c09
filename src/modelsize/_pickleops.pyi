"""The pickle parser's frequent opcodes, compiled (``_pickleops.c``); absent where not built."""

from collections.abc import Callable
from typing import Any

from typing_extensions import Buffer

def setup(
    global_type: type, call_type: type, persistent_id_type: type,
    plain_calls: frozenset[str], safe_calls: frozenset[str], max_depth: int, max_hash_cost: int,
    call: object, /,
) -> None:
    """The placeholder classes, the judgement's sets and ``Call(None, ())`` (what a Call made
    by the loop holds but its func and args), once, at import of ``_pickle``."""

def run(
    data: Buffer, size: int, pos: int, limit: int, stack: list[Any], metastack: list[list[Any]],
    memo: list[Any], far: dict[int, Any], depths: dict[int, tuple[int, int, object]],
    texts: tuple[Any, Any], persistent_load: Callable[[object], object] | None,
    keep: bytes | None = None, shared: dict[tuple[int, ...], tuple[int, ...]] | None = None, /,
) -> tuple[int, list[Any], int, int, tuple[Any, Any], BaseException | None]:
    """Up to ``limit`` opcodes from ``pos``: (pos, stack, ran, found, texts, exc)."""

def memo_reads(data: Buffer, size: int, pos: int, /) -> bytes | None:
    """Which memo entries the pickle at ``pos`` reads (a byte an entry), None if it uses GET."""
