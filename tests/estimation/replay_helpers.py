"""What the replay tests compare: a trace's every tick, op and allocation record, traced with
a replay switched on and off (test_train_blocks.py, test_optim_replay.py)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from modelsize.estimation.trace import Program, Trace, run_trace


def snapshot(trace: Trace) -> dict[str, Any]:
    """Everything a replay must reproduce: the timeline, the ops, every allocation's fields
    (sources by index), scratch, the peak, the phases and the packed-weight keepers."""
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
            "phases": [(p.name, p.start, p.end) for p in mode.phases],
            "packed": sorted(mode.packed_keepers)}


def both(make: Callable[[], nn.Module], inputs: Any, switch: str,
         summary: Callable[[Trace], str], **program: Any) -> str:
    """Trace with the ``Program`` flag ``switch`` on and off; assert the snapshots equal;
    return ``summary`` of the replaying trace."""
    out: dict[bool, dict[str, Any]] = {}
    note = ""
    for replay in (True, False):
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trace = run_trace(make(), inputs, Program(**{switch: replay}, **program))
        out[replay] = snapshot(trace)
        if replay:
            note = summary(trace)
    for key in out[False]:
        assert out[True][key] == out[False][key], f"{key} differs with {switch} ({note})"
    return note


def ids(vocab: int = 128) -> dict[str, torch.Tensor]:
    """A batch of 2 x 16 token ids, labels the same."""
    tokens = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    return {"input_ids": tokens, "labels": tokens}


def llama(layers: int) -> nn.Module:
    """A tiny Llama of ``layers`` decoder layers."""
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=layers, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128)
    return transformers.LlamaForCausalLM(cfg)
