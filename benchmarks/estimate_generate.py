"""Generation memory: modelsize's traced ``generate()`` beside the formula tools, and a real run.

Run from the repository root: ``python benchmarks/estimate_generate.py`` (about 10 minutes on
2 cores; ``--quick`` skips the 70B timing rows). Writes the ``estimate_generate`` section of
benchmarks/RESULTS.md.

Accuracy, on the same tiny configs (random weights, float32, built in code, nothing
downloaded), batch 2, a 256-token prompt, 32 new tokens:

* **measured**: ``model.generate(**inputs, max_new_tokens=32, min_new_tokens=32,
  do_sample=False)`` for real on CPU under ``torch.profiler(profile_memory=True)``: the
  allocator's peak plus the parameters, buffers and inputs resident before it;
* **modelsize**: ``modelsize.estimate(model, inputs, mode="generate", new_tokens=32,
  device="cpu")``;
* **accelerate**: ``accelerate estimate-memory``'s total size (``calculate_maximum_sizes`` in
  ``accelerate/utils/modeling.py``: the parameters and buffers; no cache, no activations),
  computed here as that sum when accelerate is not installed;
* **hf-mem**: the weights (its safetensors path counts the parameters' bytes) plus its KV
  formula, ``compute_safetensors_kv_cache_size`` in ``src/hf_mem/safetensors/kv_cache.py``
  (alvarobartt/hf-mem, commit 37d26e2): ``2 x full-attention layers x KV heads x head_dim x
  context x batch x dtype bytes``, where sliding layers are left out (``layer_types`` or
  ``sliding_window_pattern``) and every other layer counts as full attention;
* **llm-d-planner**: the weights plus ``KVCacheDetail`` in ``src/planner/capacity_planner.py``
  (llm-d-incubation/llm-d-planner, commit 753e55a): ``layers x 2 x head_dim x KV heads x
  dtype bytes`` per token, or ``layers x (kv_lora_rank + qk_rope_head_dim) x dtype bytes``
  for the DeepSeek MLA architectures, times context and batch; its activation constants
  (4.8 GiB Llama, 5.6 GiB Qwen, 5.5 GiB other dense, 8 GiB MoE, measured on vLLM) are shown
  apart, as they describe vLLM's warm-up, not ``generate()``;
* **vLLM plan**: the paged KV cache vLLM 0.33.0 reserves for the same requests, from its own
  rules (``modelsize.estimation.engine_vllm``: ``v1/kv_cache_interface.py`` pages of 16
  tokens, ``v1/core/kv_cache_planning.py`` groups, in float32 like the measured run):
  ``batch x bytes_per_block x blocks per request of prompt + new tokens``. A sliding layer
  reserves ``min(window - 1 + 2 x max_num_batched_tokens, context)`` tokens plus a block,
  a Mamba layer one state; "n/a" where vLLM's rules for the layer type are not modelled.
  It is the cache's share only (vLLM's weights and activations are another program).

Every error is ``(tool - measured) / measured``. Formulas that need a config field the
architecture does not have (Mamba has no KV heads) are "n/a".

Speed, each in a fresh process (wall time with the model build, ``ru_maxrss``):
``modelsize estimate llama-3-70b --generate N --seq 32768 --dtype bfloat16`` (the built-in
published Llama 3 70B config on the meta device: no weights).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from _results import write_section

BATCH, PROMPT, NEW = 2, 256, 32
GIB = 2**30


def _configs() -> dict[str, Callable[[], Any]]:
    import transformers as tf

    base = dict(num_hidden_layers=4, hidden_size=256, intermediate_size=512,
                num_attention_heads=8, num_key_value_heads=2, vocab_size=4096,
                max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    mla = dict(kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
               n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
               first_k_dense_replace=1)
    return {
        "llama (GQA)": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**base)),
        "mistral (sliding 128)": lambda: tf.MistralForCausalLM(tf.MistralConfig(
            **base, sliding_window=128)),
        "gemma3 (5 sliding : 1 full)": lambda: tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(
            **{**base, "num_hidden_layers": 6}, head_dim=32, sliding_window=128,
            layer_types=["sliding_attention"] * 5 + ["full_attention"])),
        "deepseek-v3 (MLA, MoE)": lambda: tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(
            **{**base, "num_key_value_heads": 8}, q_lora_rank=96, n_group=2, topk_group=1,
            **mla)),
        "mixtral (MoE)": lambda: tf.MixtralForCausalLM(tf.MixtralConfig(
            **base, num_local_experts=8, num_experts_per_tok=2)),
        "mamba": lambda: tf.MambaForCausalLM(tf.MambaConfig(
            num_hidden_layers=4, hidden_size=256, state_size=16, vocab_size=4096, expand=2,
            conv_kernel=4, bos_token_id=1, eos_token_id=2, pad_token_id=0)),
        "qwen3-next (linear + full)": lambda: tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(
            **base, head_dim=32, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=128, shared_expert_intermediate_size=128,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
            linear_value_head_dim=32, linear_conv_kernel_dim=4)),
    }


# -- the formula tools, written out from their sources -----------------------------------------


def weights_bytes(model: Any) -> int:
    """accelerate's ``calculate_maximum_sizes`` total: every parameter and buffer."""
    try:
        from accelerate.utils import calculate_maximum_sizes
    except ImportError:
        seen = {id(t): t.numel() * t.element_size()
                for t in (*model.parameters(), *model.buffers())}
        return sum(seen.values())
    return int(calculate_maximum_sizes(model)[0])


def _head_dim(cfg: Any) -> int:
    head = getattr(cfg, "head_dim", None)
    return int(head) if head else cfg.hidden_size // cfg.num_attention_heads


def hf_mem_kv(cfg: Any, context: int, batch: int, dtype_bytes: int) -> int | None:
    """hf-mem's ``compute_safetensors_kv_cache_size``."""
    if not hasattr(cfg, "num_attention_heads"):
        return None
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    layers = cfg.num_hidden_layers
    raw = cfg.to_dict()
    if raw.get("sliding_window_pattern"):
        layers = cfg.num_hidden_layers // raw["sliding_window_pattern"]
    elif raw.get("layer_types"):
        layers = sum(1 for t in raw["layer_types"]
                     if t in {"attention", "full_attention", "global_attention"})
    return 2 * layers * kv_heads * _head_dim(cfg) * context * dtype_bytes * batch


def planner_kv(cfg: Any, arch: str, context: int, batch: int, dtype_bytes: int) -> int | None:
    """llm-d-planner's ``KVCacheDetail``: MLA for the DeepSeek-V2/V3 architectures."""
    if arch in ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"):
        per_token = cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    elif hasattr(cfg, "num_key_value_heads") and hasattr(cfg, "num_attention_heads"):
        per_token = cfg.num_hidden_layers * 2 * _head_dim(cfg) * cfg.num_key_value_heads
    else:
        return None
    return per_token * dtype_bytes * context * batch


def vllm_kv(cfg: Any, context: int, batch: int) -> int | None:
    """The KV cache vLLM 0.33.0 reserves for ``batch`` requests of ``context`` tokens."""
    from modelsize.errors import UsageError
    from modelsize.estimation import engine_vllm as ev

    try:
        specs = ev.layer_specs(cfg, "float32", ev.VllmSettings(ev.Gpu("H100", 80 * GIB)))
    except (UsageError, AttributeError, KeyError):
        return None
    plan = ev.plan_kv(specs, 0, context, 8192)
    return batch * plan["bytes_per_block"] * plan["blocks_per_request"]


def planner_activation_gib(arch: str, moe: bool) -> float:
    """llm-d-planner's ``estimate_vllm_activation_memory`` (tiers 1 and 2)."""
    profiles = {"LlamaForCausalLM": 4.8, "Qwen2ForCausalLM": 5.6, "Qwen3ForCausalLM": 5.6}
    return profiles.get(arch, 8.0 if moe else 5.5)


# -- accuracy ----------------------------------------------------------------------------------


def measure(model: Any, inputs: dict[str, Any]) -> int:
    """The real CPU peak of ``generate()`` (allocator events + what was resident)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    tensors = [*model.parameters(), *model.buffers(), *inputs.values()]
    before = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                  for t in tensors}.values())
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, \
            torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        del out
    cur = high = 0
    for e in prof.profiler.kineto_results.events():
        if e.name() == "[memory]":
            cur += e.nbytes()
            high = max(high, cur)
    return before + high


def _pct(value: int | None, measured: int) -> str:
    return "n/a" if value is None else f"{100.0 * (value - measured) / measured:+.1f}%"


def accuracy() -> tuple[list[str], list[str]]:
    """One row per config: measured, and each tool's bytes and error."""
    import torch
    import transformers

    from modelsize.estimation import MemoryCategory, estimate
    from modelsize.estimation.generate import generation_inputs

    transformers.logging.set_verbosity_error()
    rows, notes = [], []
    for name, build in _configs().items():
        torch.manual_seed(0)
        model = build().eval()
        cfg = model.config
        arch = type(model).__name__
        inputs = generation_inputs(model, BATCH, PROMPT)
        real = measure(model, inputs)
        t0 = time.perf_counter()
        est = estimate(model, inputs, mode="generate", new_tokens=NEW, device="cpu")
        seconds = time.perf_counter() - t0
        weights = weights_bytes(model)
        context = PROMPT + NEW
        hf = hf_mem_kv(cfg, context, BATCH, 4)
        pl = planner_kv(cfg, arch, context, BATCH, 4)
        vl = vllm_kv(cfg, context, BATCH)
        moe = any(hasattr(cfg, k) for k in ("num_local_experts", "n_routed_experts",
                                            "num_experts"))
        gen = est.generation
        assert gen is not None
        rows.append(
            f"| {name} | {real:,} | {est.peak_bytes:,} | {_pct(est.peak_bytes, real)} | "
            f"{_pct(weights, real)} | "
            f"{_pct(None if hf is None else weights + hf, real)} | "
            f"{_pct(None if pl is None else weights + pl, real)} | "
            f"{est.categories[MemoryCategory.KV_CACHE]:,} / {gen.final_cache_bytes:,} | "
            f"{'n/a' if hf is None else f'{hf:,}'} | {'n/a' if pl is None else f'{pl:,}'} | "
            f"{'n/a' if vl is None else f'{vl:,}'} | {est.phase.name} | {seconds:.1f} |")
        notes.append(f"{name}: modelsize's cache by layer kind "
                     + "; ".join(f"{g.kind.value} x{g.layers}: {g.bytes_per_token:,} B/token"
                                 + (f", {g.bytes_per_sequence:,} B/sequence"
                                    if g.bytes_per_sequence else "")
                                 + (f", capacity {g.capacity}" if g.capacity else "")
                                 for g in gen.groups)
                     + f"; llm-d-planner's activation constant would add "
                       f"{planner_activation_gib(arch, moe):.1f} GiB "
                       f"({100.0 * planner_activation_gib(arch, moe) * GIB / real:+,.0f}%).")
        print(rows[-1], flush=True)
    return rows, notes


# -- speed -------------------------------------------------------------------------------------


def _child(name: str, seq: int, new: int) -> None:
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "modelsize", "estimate", name, "--generate", str(new),
         "--batch", "1", "--seq", str(seq), "--dtype", "bfloat16", "--json"],
        capture_output=True, text=True, timeout=3600)
    seconds = time.perf_counter() - start
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        print(json.dumps({"error": (proc.stderr.strip().splitlines() or ["?"])[-1]}))
        return
    data = json.loads(proc.stdout)
    print(json.dumps({"seconds": seconds, "rss": usage.ru_maxrss * 1024,
                      "cpu": usage.ru_utime + usage.ru_stime,
                      "trace": data["trace_seconds"], "ops": data["op_count"],
                      "peak": data["peak_bytes"],
                      "total": data["device_estimate"]["total_bytes"],
                      "kv": data["categories"]["kv_cache"],
                      "phase": data["phase"]["name"]}))


def speed(runs: list[tuple[str, int, int]]) -> list[str]:
    """One row per (model, prompt, new tokens), each in a fresh process."""
    rows = []
    for name, seq, new in runs:
        proc = subprocess.run([sys.executable, __file__, "--child", name, str(seq), str(new)],
                              capture_output=True, text=True, timeout=3600)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        r = json.loads(lines[-1]) if lines else {"error": proc.stderr[-200:]}
        if "error" in r:
            rows.append(f"| {name} | {seq:,} | {new} | failed: {r['error']} | | | | | |")
        else:
            rows.append(f"| {name} | {seq:,} | {new} | {r['seconds']:.1f} | {r['cpu']:.1f} | "
                        f"{r['trace']:.1f} | {r['ops']:,} | {r['rss'] / 2**20:,.0f} | "
                        f"{r['total'] / GIB:,.2f} (cache {r['kv'] / GIB:,.2f}, peak in "
                        f"{r['phase']}) |")
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    """Run the accuracy rows, then the timing rows, and write the RESULTS.md section."""
    import torch
    import transformers

    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="skip the 70B timing rows")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    acc, notes = accuracy()
    runs = [("llama-3-8b", 32768, 1), ("llama-3-8b", 32768, 8)]
    if not args.quick:
        runs += [("llama-3-70b", 32768, 1), ("llama-3-70b", 32768, 8)]
    spd = speed(runs)
    text = "\n".join([
        "## estimate_generate",
        "",
        f"Command: `python benchmarks/estimate_generate.py`. torch {torch.__version__}, "
        f"transformers {transformers.__version__}, {torch.get_num_threads()} threads, "
        f"{os.cpu_count()} cores (1-minute load average {load:.1f} before, "
        f"{os.getloadavg()[0]:.1f} after). The tools and their sources are named in the "
        "script's docstring.",
        "",
        f"Accuracy: `generate()` of {NEW} new tokens after a {PROMPT}-token prompt, batch "
        f"{BATCH}, float32, greedy, default (dynamic) cache; real CPU peak against each "
        "tool's total (weights + its KV formula; accelerate: weights only).",
        "",
        "| config | measured B | modelsize B | modelsize | accelerate | hf-mem | llm-d-planner "
        "| modelsize cache at peak / at end B | hf-mem KV B | llm-d-planner KV B "
        "| vLLM 0.33 plan KV B | peak in | modelsize s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *acc,
        "",
        *(f"- {n}" for n in notes),
        "",
        "Speed: `modelsize estimate MODEL --generate N --batch 1 --seq PROMPT --dtype "
        "bfloat16 --json` in a fresh process (wall s includes the imports and the meta-device "
        "build; RSS is the child's `ru_maxrss`). Device CUDA (the CLI's default).",
        "",
        "| model | prompt | new tokens | wall s | CPU s | trace s | ops | RSS MiB | device "
        "total GiB |",
        "|---|---|---|---|---|---|---|---|---|",
        *spd,
    ])
    write_section("estimate_generate", text)
    print(text)


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        _child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        main()
