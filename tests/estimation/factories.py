"""Factories the CLI tests load as ``factories:NAME`` (the user's own code, by design)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def mlp() -> nn.Module:
    """Needs ``--input``."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))


def mlp_with_inputs() -> tuple[nn.Module, tuple[Any, ...]]:
    """Brings its own inputs."""
    return mlp(), (torch.randn(4, 32),)


def not_a_model() -> int:
    """Returns something else."""
    return 3
