"""Fake-tensor rules for ops whose meta kernel does not match what the real kernel does.

:data:`RULES` maps an ATen overload to ``rule(mode, func, args, kwargs) -> outputs``; the
counting mode calls it instead of the op's own fake implementation. A rule must allocate its
outputs the way the real (CPU/CUDA) kernel does, through ``torch.empty_strided`` and friends
under the mode, so the tracker counts them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: ATen overload -> the rule that replaces its fake implementation.
RULES: dict[Any, Callable[..., Any]] = {}
