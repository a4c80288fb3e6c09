"""The same model traced twice in one process gives the same trace, the first time too.

Two things used to make the first trace differ: the fake-tensor dispatch cache, shared by the
process, answers a repeated call with outputs its first (uncached) call shares (the oneDNN
LSTM backward's two bias gradients, one tensor on the first call), and the garbage collector
stamped a free on the records of whatever a reference cycle of the trace held, if it reached
the cycle before the trace was read.
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from modelsize.estimation import probe_cache
from modelsize.estimation.trace import Program, Trace, run_trace
from modelsize.estimation.tracker import Origin
from modelsize.inventory import paused_gc
from tests.estimation.replay_helpers import snapshot


class _Tagger(nn.Module):
    """One small LSTM layer and a linear head: the oneDNN LSTM kernels on CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 16, 1)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(x)[0])


def _conv() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))


def _trace(make: Callable[[], nn.Module], inputs: tuple[torch.Tensor, ...], mode: str
           ) -> Trace:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_trace(make(), inputs, Program(mode=mode, steps=1))


def test_first_lstm_trace_equals_the_next(monkeypatch: pytest.MonkeyPatch) -> None:
    # a process that has traced nothing yet: no cached fake result, no kept probe answer
    FakeTensorMode.cache_clear()
    monkeypatch.setattr(probe_cache, "_KNOWN", {})
    monkeypatch.setenv("MODELSIZE_PROBE_CACHE", "0")
    inputs = (torch.randn(5, 2, 8),)
    first = _trace(_Tagger, inputs, "train")
    second = _trace(_Tagger, inputs, "train")
    a, b = snapshot(first), snapshot(second)
    for key in a:
        assert a[key] == b[key], f"{key} differs between the first trace and the second"
    # A real backward gets the two bias gradients as two tensors, and autograd takes each
    # as the parameter's gradient without a copy: every gradient is an output of a backward
    # kernel, none a copy made by the gradient accumulation.
    made = [str(r.op) for r in first.mode.allocations if r.is_grad]
    assert len(made) == len(list(_Tagger().parameters()))
    assert "aten.new_empty_strided.default" not in made
    assert made.count("aten.mkldnn_rnn_layer_backward.default") == 4


@pytest.mark.parametrize("mode", ["infer", "train"])
def test_records_do_not_depend_on_the_garbage_collector(mode: str) -> None:
    inputs = (torch.randn(2, 1, 8, 8),)
    with paused_gc():
        kept = snapshot(_trace(_conv, inputs, mode))
    trace = _trace(_conv, inputs, mode)
    gc.collect()  # whatever a reference cycle of the trace held is freed now
    collected = snapshot(trace)
    for key in kept:
        assert kept[key] == collected[key], f"{key} differs with a collection after the trace"
    # the model's parameters and the input outlive the program: never freed
    lasting = [r.freed for r in trace.mode.allocations
               if r.origin in (Origin.PARAMETER, Origin.INPUT)]
    assert lasting == [-1] * (len(list(_conv().parameters())) + 1)
