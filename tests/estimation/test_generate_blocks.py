"""Replayed repeated blocks (``estimation/block_replay.py``) and decode steps
(``estimation/decode_replay.py``) give the full trace, byte for byte.

The families of :mod:`tests.estimation.generators` rebuilt with enough layers that blocks
are replayed (two of a kind run for real, the last of a kind runs for real as a check, the
ones between are replayed), each traced twice: every op of every layer and every step
dispatched (``fast=False``), and with blocks and decode steps replayed, as an estimate of a
real model runs (each test checks that both were replayed: test_generate_fast.py proves the
decode replay alone, on two-layer models, for the families not here). Everything the
estimate is made of must be equal (the bytes live after every op, every allocation record,
the ops, the scratch, the phases, the peak, the cache), and so must the estimate itself
(categories, peak, its phase, the final cache, bytes per token by layer kind).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from modelsize.estimation import block_replay
from modelsize.estimation import generate as generate_module
from modelsize.estimation import trace as trace_module
from modelsize.estimation.generate import GenerateProgram, estimate_generate, trace_generate
from tests.estimation import generators as gen
from tests.estimation.generators import FAMILIES
from tests.estimation.test_generate_fast import (
    BLOCK_FAMILIES,
    NEW,
    PROMPT,
    _both,
    _state,
    assert_steps_replayed,
)

#: Layer counts per family: enough that at least one block of each repeated kind sits between
#: the two recorded ones and the last one (hybrids repeat each kind every second or third
#: layer).
_LAYERS = {"gemma3": 6, "jamba": 8, "qwen3_next": 6, "gemma2": 8, "gpt_oss": 8}
_COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "num_decoder_layers",
           "encoder_layers", "decoder_layers")


def deep(family: str) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The family's tiny model with more layers (same config otherwise), and its inputs."""
    model, inputs = FAMILIES[family]()
    n = _LAYERS.get(family, 5)
    d = model.config.to_dict()
    for key in _COUNTS:
        if isinstance(d.get(key), int):
            d[key] = n
    if family == "gemma3":
        d["layer_types"] = ["sliding_attention", "sliding_attention", "full_attention"] * 2
    else:
        d.pop("layer_types", None)  # derived again from the layer count
    torch.manual_seed(0)
    deeper = type(model)(type(model.config).from_dict(d)).eval()
    if "input_ids" in inputs:
        inputs = gen.tokens(prompt=PROMPT)
    return deeper, inputs


#: Families whose estimates are compared too (test_the_estimate_is_the_full_traces, which
#: compares their traces as this test does: each pair of traces is made once).
_ESTIMATED = ["llama", "gemma3", "deepseek_v3", "jamba", "whisper"]


@pytest.mark.parametrize("family", [f for f in BLOCK_FAMILIES if f not in _ESTIMATED])
def test_replayed_blocks_equal_the_full_trace(family: str) -> None:
    model, inputs = deep(family)
    _, fast = _both(model, inputs, NEW)
    assert fast.blocks.replayed > 0, fast.blocks
    assert not fast.decode.retraces, fast.decode.note
    assert_steps_replayed(fast)


@pytest.mark.parametrize(("family", "options"), [
    ("llama", {"cache_implementation": "static"}),
    ("gemma3", {"cache_implementation": "static"}),
    ("mamba", {"cache_implementation": "static"}),
    ("whisper", {"cache_implementation": "static"}),
    ("llama", {"num_beams": 3}),
    ("t5", {"num_beams": 2}),
    ("llama", {"prefill_chunk_size": 7}),
    ("llama", {"cache_implementation": "quantized", "cache_config": {"backend": "fp8"}}),
], ids=["llama-static", "gemma3-static", "mamba-static", "whisper-static", "llama-beams",
        "t5-beams", "llama-chunked", "llama-fp8"])
def test_replayed_blocks_with_other_caches_and_searches(
        family: str, options: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    if options.get("cache_implementation") == "static":
        # as with a real model's cache: tensors too large for real values (trace.py), so
        # that writing into them forgets none (see test_left_padding for the other case)
        monkeypatch.setattr(trace_module, "VALUE_LIMIT", 1024)
    model, inputs = deep(family)
    _, fast = _both(model, inputs, NEW, **options)
    assert fast.blocks.replayed > 0, fast.blocks
    assert_steps_replayed(fast)


def test_left_padding() -> None:
    model, _ = deep("llama")
    inputs = gen.tokens(prompt=PROMPT, left_pad=5)
    _, fast = _both(model, inputs, NEW)
    assert fast.blocks.replayed > 0
    assert_steps_replayed(fast)
    # a tiny static cache's tensors are zeros with real values: the layers that write into
    # them (forgetting the values, which a replay would not) run for real
    _, fast = _both(model, inputs, NEW, cache_implementation="static")
    assert fast.blocks.refused == ["LlamaDecoderLayer writes into a tensor with a real value"]
    assert_steps_replayed(fast)


@pytest.mark.parametrize("family", _ESTIMATED)
def test_the_estimate_is_the_full_traces(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The traces the two estimates are made of, compared as _both compares them (its state
    # taken right after each trace): test_replayed_blocks_equal_the_full_trace for these.
    traces: list[tuple[Any, dict[str, Any]]] = []

    def traced(*args: Any, **kwargs: Any) -> Any:
        t = trace_generate(*args, **kwargs)
        traces.append((t, _state(t)))
        return t

    monkeypatch.setattr(generate_module, "trace_generate", traced)
    model, inputs = deep(family)
    program = GenerateProgram(NEW)
    full = estimate_generate(model, inputs, program, name=family, fast=False).to_dict()
    fast = estimate_generate(model, inputs, program, name=family).to_dict()
    (full_trace, expected), (fast_trace, got) = traces
    for key in expected:
        assert got[key] == expected[key], key
    assert not full_trace.decode.replayed
    assert fast_trace.blocks.replayed > 0, fast_trace.blocks
    assert not fast_trace.decode.retraces, fast_trace.decode.note
    assert_steps_replayed(fast_trace)
    for d in (fast, full):
        d.pop("trace_seconds")
        d["generation"].pop("decode_trace")
    assert fast == full
    assert fast["generation"]["groups"]  # bytes per token by layer kind, compared above


def test_a_cache_that_is_not_affine_replays_no_block() -> None:
    model, inputs = deep("llama")
    model = model.to(torch.bfloat16)
    program = GenerateProgram(NEW, {"cache_implementation": "offloaded"}, device="cuda")
    traced = trace_generate(model, inputs, program)
    assert not traced.blocks.replayed


# -- a block whose code depends on its index ----------------------------------------------------


def _odd_layer_class() -> type:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    class OddLayer(LlamaDecoderLayer):
        """Layer 2 keeps a copy of its output: its bytes depend on its index alone."""

        def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            out = super().forward(hidden_states, *args, **kwargs)
            if self.self_attn.layer_idx == 2:
                self.kept = out * 2
                del self.kept
                out = out + 0
            return out

    return OddLayer


def test_a_block_whose_code_reads_its_index_is_traced() -> None:
    odd = _odd_layer_class()
    assert "uses .layer_idx" in block_replay.index_uses(odd)
    model, inputs = deep("llama")
    for layer in model.model.layers:
        layer.__class__ = odd
    _, fast = _both(model, inputs, NEW)
    assert not fast.blocks.replayed
    assert fast.blocks.refused and "OddLayer uses .layer_idx" in fast.blocks.refused[0]


def test_without_the_index_check_that_block_would_be_replayed_wrong(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # why index_uses() exists: layer 2 differs from the layers recorded before it, and the
    # last layer (the check) does not; replaying it would change the timeline unnoticed
    monkeypatch.setattr(block_replay, "index_uses", lambda cls: "")
    model, inputs = deep("llama")
    odd = _odd_layer_class()
    for layer in model.model.layers:
        layer.__class__ = odd
    program = GenerateProgram(NEW)
    full = _state(trace_generate(model, inputs, program, fast=False))
    fast = trace_generate(model, inputs, program)
    assert fast.blocks.replayed
    assert _state(fast)["timeline"] != full["timeline"]


def test_index_uses_reads_the_code() -> None:
    class Addressing(nn.Module):
        def __init__(self, layer_idx: int) -> None:
            super().__init__()
            self.layer_idx = layer_idx
            if self.layer_idx == 0:  # __init__ runs before the trace: its effects are seen
                self.first = True

        def forward(self, x: torch.Tensor, past_key_values: Any = None,
                    cache_params: Any = None) -> torch.Tensor:
            past_key_values.update(x, x, self.layer_idx)
            cache_params.conv_states[self.layer_idx] = x
            return x

    class Config(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.config.layer_types[self.layer_idx] == "full":
                return x + 1
            return x

    class Helper(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self._apply_rope(x, self.layer_idx)

    assert block_replay.index_uses(Addressing) == ""
    assert "Config uses .layer_idx" in block_replay.index_uses(Config)
    assert "Helper uses .layer_idx" in block_replay.index_uses(Helper)
