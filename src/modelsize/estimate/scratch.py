"""Kernel scratch: memory the allocator hands out that no output tensor owns."""

from __future__ import annotations

from typing import Any


def table(device_type: str) -> dict[Any, Any]:
    """Scratch models for the kernels of ``device_type``, keyed by ATen op overload."""
    return {}
