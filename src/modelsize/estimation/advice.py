"""What would shrink the peak: each suggestion is re-traced, never guessed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from modelsize.estimation.result import Estimate, MemoryCategory, Suggestion

Retrace = Callable[..., Estimate]


def suggest(retrace: Retrace, base: Estimate, *, batch: int | None,
            repeated_block: str = "", float32_model: bool = True) -> list[Suggestion]:
    """Re-trace the program with one change at a time; keep the changes that lower the peak.

    ``retrace(**overrides)`` runs the same estimate with ``batch``, ``checkpoint``,
    ``implementation`` or ``amp`` replaced.
    """
    setup = base.setup
    train = setup.mode == "train"
    tries: list[tuple[str, str, dict[str, Any]]] = []
    if batch is not None and batch > 1:
        tries.append((f"half the batch ({batch // 2})", f"--batch {batch // 2}",
                      {"batch": batch // 2}))
    acts = base.categories[MemoryCategory.ACTIVATIONS]
    if train and repeated_block and not setup.checkpoint and acts > base.peak_bytes // 5:
        tries.append((f"activation checkpointing of every {repeated_block}",
                      f"--checkpoint {repeated_block}", {"checkpoint": (repeated_block,)}))
    if (train and setup.optimizer in ("adam", "adamw")
            and setup.implementation != "fused"):
        tries.append((f"fused {setup.optimizer} (one kernel, no parameter-sized temporaries)",
                      "--impl fused", {"implementation": "fused"}))
    if setup.amp is None and float32_model:
        tries.append(("bf16 autocast", "--amp bf16", {"amp": "bf16"}))
    out = []
    for label, change, overrides in tries:
        try:
            est = retrace(**overrides)
        except Exception:  # a suggestion that cannot be traced is not a suggestion
            continue
        if est.peak_bytes < base.peak_bytes:
            out.append(Suggestion(label, change, est.peak_bytes,
                                  est.device_estimate.total_bytes))
    return out

