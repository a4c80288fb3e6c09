"""The for-loop optimizer step of periodic parameters replayed from one real unit gives the
very trace that steps every parameter for real (estimation/optim_replay.py): the same bytes at
every tick, the same allocation records, the same peak."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from modelsize.estimation.optim_replay import find_period
from modelsize.estimation.optimizers import Implementation

transformers = pytest.importorskip("transformers")

from tests.estimation.replay_helpers import both, ids, llama  # noqa: E402


def _both(make: Callable[[], nn.Module], inputs: Any, **program: Any) -> str:
    """Trace with and without optimizer replay; assert equal; return the replay's summary."""
    return both(make, inputs, "replay_optimizer", lambda trace: trace.optimizer_replay, **program)


def _ids(vocab: int = 128) -> dict[str, torch.Tensor]:
    return ids(vocab)


def _llama(layers: int = 6) -> nn.Module:
    return llama(layers)


@pytest.mark.parametrize("program", [
    {"optimizer": "adamw"},
    {"optimizer": "adam", "amp": torch.bfloat16, "steps": 3},
    {"optimizer": functools.partial(torch.optim.Adam, amsgrad=True, weight_decay=0.1)},
    {"optimizer": functools.partial(torch.optim.AdamW, maximize=True), "accumulate": 2},
], ids=["adamw", "adam-bf16-3-steps", "amsgrad-l2", "maximize-accumulate"])
def test_llama_optimizer_step_replays_exactly(program: dict[str, Any]) -> None:
    note = _both(_llama, _ids(), mode="train", implementation=Implementation.FOR_LOOP,
                 **program)
    assert note.startswith("the optimizer step of") and "replayed" in note


def test_no_replay_without_a_period_and_with_foreach() -> None:
    make = functools.partial(_llama, 2)  # 2 layers: too few units to pay
    assert _both(make, _ids(), mode="train", optimizer="adamw",
                 implementation=Implementation.FOR_LOOP) == ""
    assert _both(_llama, _ids(), mode="train", optimizer="adamw",
                 implementation=Implementation.FOREACH) == ""


def test_find_period() -> None:
    assert find_period(list("abcdcdcdcde")) == (2, 2, 4)
    assert find_period(list("xaaaay")) == (1, 1, 4)
    assert find_period(list("abcabcab")) is None
