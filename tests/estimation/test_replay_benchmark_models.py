"""Every model of the accuracy benchmark (benchmarks/estimate_accuracy.py ``CASES``, at its
real size), traced with block replay and the optimizer replay on and off: the same bytes at
every tick, the same allocation records, the same peak (issue 22's proof that replaying
repeated blocks is exact where it is used, and changes nothing where it is not)."""

from __future__ import annotations

import functools
import importlib.util
import sys
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from modelsize.estimation.trace import Program, run_trace
from tests.estimation.replay_helpers import snapshot

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _accuracy() -> ModuleType:
    """benchmarks/estimate_accuracy.py, imported with its global warning filter undone (it
    silences warnings for the benchmark's output; the test suite keeps them errors)."""
    name = "_accuracy_benchmark"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / "estimate_accuracy.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while it runs
    sys.path.insert(0, str(BENCHMARKS))
    try:
        with warnings.catch_warnings():
            spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    finally:
        sys.path.remove(str(BENCHMARKS))
    return module


CASE_NAMES = ["seed CNN", "ResNet-50", "LSTM 2x512", "BERT-base", "GPT-2 small",
              "Llama 4 layers"]


def test_the_list_is_the_benchmarks() -> None:
    assert [c.name for c in _accuracy().CASES] == CASE_NAMES


@functools.lru_cache(maxsize=1)
def _model(name: str) -> Any:
    """The benchmark's model ``name``, built once for its four traces (a trace leaves the
    model's parameters, buffers, gradients and modes as they were; building GPT-2 or BERT
    draws 110M+ random weights, seconds each). One at a time: the cases run in order."""
    case = next(c for c in _accuracy().CASES if c.name == name)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return case.build()


@pytest.mark.parametrize("mode", ["train", "infer"])
@pytest.mark.parametrize("name", CASE_NAMES)
def test_replayed_and_full_traces_are_identical(name: str, mode: str) -> None:
    bench = _accuracy()
    case = next(c for c in bench.CASES if c.name == name)
    model = _model(name)
    out: dict[bool, dict[str, Any]] = {}
    summary = ""
    for replay in (True, False):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.manual_seed(0)
            inputs = case.inputs(1)
            # The benchmark's program (AdamW for-loop, fp32; or one forward), one training
            # step where the benchmark runs two: the second repeats the first's blocks, and
            # two-step programs are compared both ways in test_train_blocks.py (this file
            # stays a minute of the suite's time).
            trace = run_trace(model, inputs, Program(
                mode=mode, optimizer=bench.ADAMW, steps=1, replay_blocks=replay,
                replay_optimizer=replay))
        out[replay] = snapshot(trace)
        if replay:
            summary = f"{trace.blocks} / {trace.optimizer_replay}"
    for key in out[False]:
        assert out[True][key] == out[False][key], f"{name} {mode}: {key} differs ({summary})"
