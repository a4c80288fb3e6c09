"""Replayed decode steps (``estimation/decode_replay.py``) give the full trace, tick for tick.

Each test traces the same generation twice, every op of every step dispatched
(``fast=False``) and with the decode steps replayed where they follow the steps before them,
and compares everything the estimate is made of: the bytes live after every op, every
allocation record (size, creation, free, phase, module, flags), the ops, the kernels'
scratch, the phases, the peak, and the cache's numbers. Where a model's steps stop being
affine at a length nothing names, a real step contradicts the replayed ones and the estimate
is traced again: the answer is still the full trace's.
"""

from __future__ import annotations

import gc
import re
from typing import Any

import pytest
import torch

from modelsize.estimation.decode_replay import config_lengths
from modelsize.estimation.generate import (
    GenerateProgram,
    GenerateTrace,
    estimate_generate,
    trace_generate,
)
from tests.estimation import generators as gen
from tests.estimation.generators import FAMILIES

#: A prompt long enough that the tiny models' eager attention is past the size where CPU
#: ``bmm`` stops taking a copy-free loop (scratch.py: 400 elements), and every sliding window
#: of the families (8 tokens) is already full: nothing changes course during the generation.
PROMPT = 30
NEW = 9  # decode steps 1-3 traced, 4-7 replayed, 8 traced and compared with its prediction


def _state(traced: GenerateTrace) -> dict[str, Any]:
    gc.collect()  # storages held in cycles are freed now in both traces alike
    m = traced.trace.mode
    return {
        "timeline": list(m.timeline),
        "allocations": [(a.nbytes, a.origin, a.created, a.phase, a.module, a.freed, a.is_grad,
                         a.is_state, a.saved, a.recomputed, a.host) for a in m.allocations],
        "ops": list(m.ops),
        "scratch": (dict(m.scratch_at), dict(m.scratch_parts)),
        "phases": [(p.name, p.step, p.micro_batch, p.start, p.end) for p in m.phases],
        "peak": (m.peak_bytes, m.peak_tick, m.peak_scratch, m.peak_scratch_op),
        "end": (m.tick, m.live_bytes, dict(m.first_calls)),
        "cache": (traced.cache.prefill_bytes, traced.cache.final_bytes, traced.cache.groups,
                  traced.cache.cache_class, len(traced.cache.records)),
    }


def _both(model: Any, inputs: Any, new: int, **options: Any
          ) -> tuple[GenerateTrace, GenerateTrace]:
    program = GenerateProgram(new, options)
    full = trace_generate(model, inputs, program, fast=False)
    expected = _state(full)
    fast = trace_generate(model, inputs, program)
    got = _state(fast)
    for key in expected:
        assert got[key] == expected[key], key
    assert not full.decode.replayed
    return full, fast


#: Families that tests/estimation/test_generate_blocks.py traces deeper, where blocks and decode
#: steps are replayed together and compared with the full trace (with the same decode steps
#: replayed as here, asserted there by :func:`assert_steps_replayed`): here, on two layers,
#: they would prove the decode replay a second time. Llama stays: the plain decoder.
BLOCK_FAMILIES = ["llama", "mistral", "gemma3", "gpt_oss", "deepseek_v3", "qwen3_moe",
                  "mamba", "jamba", "qwen3_next", "falcon", "t5", "bart", "whisper"]


def assert_steps_replayed(traced: GenerateTrace) -> None:
    """Decode steps 4-7 of :data:`NEW` replayed, the last one traced."""
    # a sliding window's first step frees the prompt's keys: its numbers start the pattern
    # one step later
    assert traced.decode.replayed in ([4, 5, 6, 7], [5, 6, 7]), traced.decode.describe()
    assert traced.decode.real[-1] == NEW - 1


@pytest.mark.parametrize("family", ["llama"] + [f for f in FAMILIES if f not in BLOCK_FAMILIES])
def test_replayed_steps_equal_the_full_trace(family: str) -> None:
    model, inputs = FAMILIES[family]()
    if "input_ids" in inputs:
        inputs = gen.tokens(prompt=PROMPT)
    _, fast = _both(model, inputs, NEW)
    assert_steps_replayed(fast)


# llama, gemma3, mamba and whisper with a static cache: test_generate_blocks.py (deeper)
@pytest.mark.parametrize("family", ["qwen3_next", "t5"])
def test_static_cache(family: str) -> None:
    model, inputs = FAMILIES[family]()
    if "input_ids" in inputs:
        inputs = gen.tokens(prompt=PROMPT)
    _, fast = _both(model, inputs, NEW, cache_implementation="static")
    assert fast.decode.replayed


# Beam search (llama and T5), chunked prefill, the FP8 cache and left padding (dynamic and
# static caches): test_generate_blocks.py, on deeper models, blocks and steps replayed.


def test_peak_in_a_decode_step() -> None:
    # one short prompt, a long generation: the cache outgrows the prefill's temporaries
    # (the estimates compared whole: a trace-level comparison as _both's would trace it twice
    # more, the slowest test of the suite)
    model, _ = gen.llama()
    est = estimate_generate(model, gen.tokens(batch=1, prompt=2), GenerateProgram(60),
                            name="llama")
    slow = estimate_generate(model, gen.tokens(batch=1, prompt=2), GenerateProgram(60),
                             name="llama", fast=False)
    assert est.phase.name == "decode" and est.phase.step > 3
    assert (est.peak_bytes, est.phase, est.categories, est.timeline) == \
        (slow.peak_bytes, slow.phase, slow.categories, slow.timeline)
    assert est.generation is not None and slow.generation is not None
    assert est.generation.final_cache_bytes == slow.generation.final_cache_bytes
    assert est.generation.groups == slow.generation.groups
    replayed = re.search(r"(\d+) replayed from them", est.generation.decode_trace)
    assert replayed is not None and int(replayed.group(1)) > 40, est.generation.decode_trace
    assert "replayed" not in slow.generation.decode_trace


@pytest.mark.parametrize("cache", [{}, {"cache_implementation": "static"}],
                         ids=["dynamic", "static"])
@pytest.mark.parametrize("family", ["mistral", "gemma3", "gpt_oss"])
def test_sliding_windows_filled_mid_generation(family: str, cache: dict[str, Any]) -> None:
    # window 8, prompt 2: the window fills at decode step 6; the steps around it are traced,
    # the pattern is learnt again after it, and the rest replayed
    model, _ = FAMILIES[family]()
    assert 8 in config_lengths(model)
    inputs = gen.tokens(batch=1, prompt=2)
    if family == "gpt_oss":  # past the copy-free bmm sizes from the start: see PROMPT
        inputs = gen.tokens(batch=1, prompt=26)
        model.config.sliding_window = model.model.config.sliding_window = 32
    _, fast = _both(model, inputs, 16, **cache)
    assert fast.decode.replayed and fast.decode.replayed[-1] == 14
    assert not fast.decode.retraces


def test_a_change_nothing_names_is_found_and_traced() -> None:
    # Falcon's eager attention: past 400 elements CPU bmm takes BLAS copies (scratch.py), a
    # length no config names: the last step contradicts the replayed ones, and the trace runs
    # again with those steps traced
    model, _ = gen.falcon()
    _, fast = _both(model, gen.tokens(prompt=12), 20)
    assert fast.decode.retraces == 1
    assert "differs from its prediction" in fast.decode.note


def test_caches_that_are_not_affine_are_traced_step_by_step() -> None:
    model, _ = gen.llama()
    model = model.to(torch.bfloat16)
    program = GenerateProgram(NEW, {"cache_implementation": "offloaded"}, device="cuda")
    traced = trace_generate(model, gen.tokens(prompt=PROMPT), program)
    assert not traced.decode.replayed
    assert "not affine" in traced.decode.note


def test_a_cuda_estimate_is_the_full_traces() -> None:
    model, _ = gen.llama()
    model = model.to(torch.bfloat16)
    inputs = gen.tokens(prompt=PROMPT)
    program = GenerateProgram(NEW, device="cuda")
    fast = estimate_generate(model, inputs, program, name="llama")
    full = estimate_generate(model, inputs, program, name="llama", fast=False)
    assert fast.device_estimate == full.device_estimate
    assert (fast.peak_bytes, fast.categories, fast.timeline) == \
        (full.peak_bytes, full.categories, full.timeline)
    assert fast.generation is not None and "replayed" in fast.generation.decode_trace
