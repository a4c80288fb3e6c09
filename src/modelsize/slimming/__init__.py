"""``modelsize slim``: write a smaller copy of a checkpoint, streamed, staged and verified.

Modules: ``plan`` (what to keep, drop, cast, rename: decided from the Inventory alone),
``source`` (a tensor's bytes, a chunk at a time: contiguous, strided, decoded, concatenated),
``cast`` (chunked casts and their error), ``writers`` (one module per output format),
``zipwriter`` (the zip container torch and NumPy files share), ``output`` (unnamed files,
staging, atomic commit), ``verify`` (the output read back and checked), ``consolidate``
(sharded training checkpoints put back together), ``core`` (:func:`slim`), ``result``
(:class:`SlimReport`).
"""

from __future__ import annotations

from modelsize.slimming.core import plan_slim, slim
from modelsize.slimming.plan import Plan, SlimOptions
from modelsize.slimming.result import Dropped, KeptTensor, SlimReport

__all__ = ["Dropped", "KeptTensor", "Plan", "SlimOptions", "SlimReport", "plan_slim", "slim"]
