"""The for-loop optimizer step of periodic parameters replayed from one real unit gives the
very trace that steps every parameter for real (estimation/optim_replay.py): the same bytes at
every tick, the same allocation records, the same peak."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from modelsize.estimation.optim_replay import find_period
from modelsize.estimation.optimizers import Implementation
from modelsize.estimation.trace import Program, Trace, run_trace

transformers = pytest.importorskip("transformers")


def _snapshot(trace: Trace) -> dict[str, Any]:
    mode = trace.mode
    index = {id(a): i for i, a in enumerate(mode.allocations)}
    allocs = [(a.nbytes, a.origin, a.created, a.freed, a.phase, a.module, a.is_grad,
               a.is_state, a.saved, a.recomputed, a.host, str(a.op), a.shape, a.dtype, a.state,
               a.saved_by, a.kept_in, tuple(index.get(id(s)) for s in a.sources))
              for a in mode.allocations]
    return {"timeline": list(mode.timeline), "ops": [str(o) for o in mode.ops],
            "allocations": allocs, "scratch": dict(mode.scratch_at),
            "parts": dict(mode.scratch_parts),
            "peak": (mode.peak_bytes, mode.peak_tick, mode.peak_scratch),
            "phases": [(p.name, p.start, p.end) for p in mode.phases]}


def _both(make: Callable[[], nn.Module], inputs: Any, **program: Any) -> str:
    out, note = {}, ""
    for replay in (True, False):
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trace = run_trace(make(), inputs, Program(replay_optimizer=replay, **program))
        out[replay] = _snapshot(trace)
        if replay:
            note = trace.optimizer_replay
    for key in out[False]:
        assert out[True][key] == out[False][key], f"{key} differs with optimizer replay ({note})"
    return note


def _ids(vocab: int = 128) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def _llama(layers: int = 6) -> nn.Module:
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=layers, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128)
    return transformers.LlamaForCausalLM(cfg)


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
