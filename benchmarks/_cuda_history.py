"""The CUDA caching allocator's own record of one measured run, compact enough to keep.

``record(program)`` runs ``program()`` under ``torch.cuda.memory._record_memory_history`` and
returns the allocator's state before it (every segment, its blocks and their states, from
``torch.cuda.memory._snapshot()``) and every event of the run in order, each as
``[action, address, size, stream, where]``: ``a`` alloc (the requested size), ``f`` free
requested (the statistics drop here), ``F`` free completed (the block returns to the pool),
``s``/``S`` segment alloc/free, ``m``/``u`` segment map/unmap (expandable segments), ``o`` OOM;
``where`` indexes ``frames``, the two innermost Python frames outside ``Module.__call__``. With
the addresses, a replay can follow the allocator block by block
(:mod:`modelsize.estimation.cuda_allocator`); ``max_memory_allocated`` is kept beside them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

_ACTIONS = {"alloc": "a", "free_requested": "f", "free_completed": "F", "segment_alloc": "s",
            "segment_free": "S", "segment_map": "m", "segment_unmap": "u", "oom": "o",
            "snapshot": "p"}


def _where(frames: list[dict[str, Any]], depth: int = 2) -> str:
    out = []
    for f in frames:
        path = f.get("filename", "?")
        if ("torch/cuda/memory" in path or path.startswith("<")
                or path.endswith(os.path.join("nn", "modules", "module.py"))):
            continue
        out.append(f"{os.path.basename(path)}:{f.get('line', 0)}:{f.get('name', '?')}")
        if len(out) >= depth:
            break
    return " < ".join(out)


def _segments(snapshot: dict[str, Any]) -> list[list[Any]]:
    """``[address, total size, stream, [[size, requested size, state], ...]]`` per segment."""
    out = []
    for seg in snapshot.get("segments", []):
        blocks = [[int(b.get("size", 0)), int(b.get("requested_size", 0)),
                   str(b.get("state", ""))] for b in seg.get("blocks", [])]
        out.append([int(seg.get("address", 0)), int(seg.get("total_size", 0)),
                    int(seg.get("stream", 0)), blocks])
    return out


def record(program: Callable[[], Any], max_entries: int = 2_000_000) -> dict[str, Any]:
    """Run ``program()`` with the allocator's history on; its state before and its events."""
    torch.cuda.synchronize()
    before = _segments(torch.cuda.memory._snapshot())
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                             max_entries=max_entries)
    try:
        program()
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    frames: dict[str, int] = {}
    events = []
    for trace in snap.get("device_traces", []):
        for e in trace:
            where = _where(e.get("frames", [])) if e["action"] == "alloc" else ""
            index = frames.setdefault(where, len(frames))
            events.append([_ACTIONS.get(e["action"], e["action"]), int(e.get("addr", 0)),
                           int(e.get("size", 0)), int(e.get("stream", 0)), index])
    return {"segments_before": before, "events": events,
            "frames": sorted(frames, key=frames.__getitem__),
            "max_entries_reached": len(events) >= max_entries}
