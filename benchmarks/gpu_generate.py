"""GPU check of ``estimate(mode="generate", device="cuda")`` against ``max_memory_allocated``.

Run from the repository root on a machine with one CUDA GPU (no network needed: the models
are built in code from configs, random weights):

    PYTHONPATH=src:benchmarks python benchmarks/gpu_generate.py     # about 2 minutes, H100
    PYTHONPATH=src:benchmarks python benchmarks/gpu_generate.py --device cpu --tiny   # CPU path

For two bf16 models of realistic width (a Llama-like one: hidden 2048, 16 layers, 32 heads
over 8 KV heads; a Gemma-3-like one: hidden 2048, 16 layers, head dim 256, five sliding
layers of 1024 tokens per full one) at (batch, context) in {1, 8} x {2k, 16k}, it runs the
real ``model.generate(input_ids, attention_mask, max_new_tokens=N, min_new_tokens=N,
do_sample=False)`` on the device and records ``torch.cuda.max_memory_allocated()``, beside
modelsize's estimate of the same call with ``device="cuda"`` (``DeviceEstimate
.allocated_bytes``: the trace replayed through the caching allocator's rules, with the cuBLAS
workspaces), and the SDPA backend PyTorch picks for the prefill and the decode steps
(``torch._fused_sdp_choice``).

Each real run is a fresh process (``--measure``), as a user's program is: the model built on
the device, the inputs moved, the cache emptied, the peak statistics reset, then
``generate()``; nothing an earlier row left in the allocator (a cuBLAS workspace, cached
segments) counts. The estimate runs meanwhile in this process. With ``--history`` (the
default on CUDA) each run also records the allocator's own events, addresses included, and
its segments before the run (benchmarks/_cuda_history.py), all rows in one
``gpu_generate_history.json.gz``. On CPU (``--device cpu``) the real peak is the CPU
allocator's, read from the profiler's memory events, in this process.

Writes ``gpu_generate.json`` and ``gpu_generate.md`` to ``$OUT`` (default ``./gpu_out``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import transformers

from modelsize.estimation import MemoryCategory, estimate
from modelsize.estimation.generate import generation_inputs

NEW_TOKENS = 8


def llama_like(tiny: bool) -> Any:
    """A Llama-3-like decoder: GQA (32 query heads over 8 KV heads, head dim 64)."""
    if tiny:
        return transformers.LlamaConfig(num_hidden_layers=2, hidden_size=128,
                                        intermediate_size=256, num_attention_heads=4,
                                        num_key_value_heads=2, vocab_size=1000,
                                        max_position_embeddings=32768)
    return transformers.LlamaConfig(num_hidden_layers=16, hidden_size=2048,
                                    intermediate_size=8192, num_attention_heads=32,
                                    num_key_value_heads=8, vocab_size=32000,
                                    max_position_embeddings=32768, rope_theta=500000.0)


def gemma3_like(tiny: bool) -> Any:
    """A Gemma-3-like decoder: five sliding layers (window 1024) per full one, head dim 256."""
    layers = 2 if tiny else 16
    pattern = ["sliding_attention"] * 5 + ["full_attention"]
    types = [pattern[i % 6] for i in range(layers)] if not tiny else \
        ["sliding_attention", "full_attention"]
    if tiny:
        return transformers.Gemma3TextConfig(num_hidden_layers=2, hidden_size=128,
                                             intermediate_size=256, num_attention_heads=4,
                                             num_key_value_heads=2, head_dim=32,
                                             vocab_size=1000, sliding_window=64,
                                             layer_types=types, max_position_embeddings=32768)
    return transformers.Gemma3TextConfig(num_hidden_layers=layers, hidden_size=2048,
                                         intermediate_size=8192, num_attention_heads=8,
                                         num_key_value_heads=4, head_dim=256,
                                         vocab_size=262144, sliding_window=1024,
                                         layer_types=types, max_position_embeddings=32768)


MODELS = {"llama-like": (transformers.LlamaForCausalLM, llama_like),
          "gemma3-like": (transformers.Gemma3ForCausalLM, gemma3_like)}


def build(cls: Any, config: Any, device: str, dtype: torch.dtype) -> Any:
    """The model built directly on ``device`` in ``dtype`` (random weights)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(config)
    finally:
        torch.set_default_dtype(old)
    return model.eval()


def measured_cuda(model: Any, inputs: dict[str, torch.Tensor],
                  history: bool = False) -> dict[str, Any]:
    """``max_memory_allocated`` of ``generate()`` (reset with the model and inputs resident),
    and the allocator's record of the run when ``history``."""
    on_gpu = {k: v.to("cuda") for k, v in inputs.items()}
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()

    def program() -> None:
        with torch.no_grad():
            out = model.generate(**on_gpu, max_new_tokens=NEW_TOKENS,
                                 min_new_tokens=NEW_TOKENS, do_sample=False)
        del out

    record: dict[str, Any] | None = None
    if history:
        import _cuda_history

        record = _cuda_history.record(program)
    else:
        program()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    reserved = torch.cuda.max_memory_reserved()
    stats = torch.cuda.memory_stats()
    return {"max_memory_allocated": peak, "allocated_before": before,
            "max_memory_reserved": reserved,
            "requested_peak": int(stats.get("requested_bytes.all.peak", 0)),
            "num_alloc_retries": int(stats.get("num_alloc_retries", 0)), "history": record}


def measure_in_child(name: str, batch: int, context: int, history: bool) -> None:
    """``--measure``: build the model on the GPU, run one row, print its numbers (JSON)."""
    transformers.logging.set_verbosity_error()
    cls, make = MODELS[name]
    config = make(False)
    model = build(cls, config, "cuda", torch.bfloat16)
    inputs = generation_inputs(model, batch, context - NEW_TOKENS)
    inputs = {k: v.cpu() for k, v in inputs.items()}
    m = measured_cuda(model, inputs, history)
    m["sdpa"] = sdpa_choices(config, batch, context, torch.bfloat16)
    print(json.dumps(m))


def spawn_measure(name: str, batch: int, context: int, history: bool) -> subprocess.Popen[str]:
    """The real run of one row in a fresh process (see :func:`measure_in_child`)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--measure", name, str(batch),
           str(context)] + (["--history"] if history else [])
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)


def collect(child: subprocess.Popen[str]) -> dict[str, Any]:
    """The numbers a :func:`spawn_measure` child printed (its last line)."""
    out, _ = child.communicate()
    if child.returncode:
        raise RuntimeError(f"the measuring process failed ({child.returncode})")
    return dict(json.loads(out.strip().splitlines()[-1]))


def measured_cpu(model: Any, inputs: dict[str, torch.Tensor]) -> dict[str, int]:
    """The CPU allocator's peak (profiler memory events) plus what was resident before."""
    from torch.profiler import ProfilerActivity, profile

    tensors = [*model.parameters(), *model.buffers(), *inputs.values()]
    before = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                  for t in tensors}.values())
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, \
            torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False)
        del out
    cur = high = 0
    for e in prof.profiler.kineto_results.events():
        if e.name() == "[memory]":
            cur += e.nbytes()
            high = max(high, cur)
    return {"max_memory_allocated": before + high, "allocated_before": before,
            "max_memory_reserved": 0, "requested_peak": before + high}


def sdpa_choices(config: Any, batch: int, context: int, dtype: torch.dtype) -> dict[str, str]:
    """The backend ``torch._fused_sdp_choice`` picks for the prefill and a decode step."""
    out: dict[str, str] = {}
    heads = config.num_attention_heads
    kv = config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    try:
        backends = torch.nn.attention.SDPBackend.__members__.items()
        names = {int(b.value): name.lower() for name, b in backends}
        for phase, q_len, causal in (("prefill", context, True), ("decode", 1, False)):
            q = torch.empty(batch, heads, q_len, dim, dtype=dtype, device="cuda")
            k = torch.empty(batch, kv, context, dim, dtype=dtype, device="cuda")
            choice = torch._fused_sdp_choice(q, k, k, None, 0.0, causal, scale=None,
                                             enable_gqa=True)
            out[phase] = names.get(int(choice), str(choice))
            del q, k
    except Exception as exc:  # the probe is informative only
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


def run(device: str, tiny: bool, out_dir: Path, history: bool = False,
        only: set[str] | None = None) -> list[dict[str, Any]]:
    """Every (model, batch, context) row, printed as it goes."""
    transformers.logging.set_verbosity_error()
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    contexts = (64, 256) if tiny else (2048, 16384)
    rows: list[dict[str, Any]] = []
    records: dict[str, Any] = {}
    started = time.perf_counter()
    for name, (cls, make) in MODELS.items():
        config = make(tiny)
        real = build(cls, config, device, dtype) if device == "cpu" else None
        meta = build(cls, config, "meta", dtype)
        for batch in (1, 8):
            for context in contexts:
                label = f"{name} {batch} {context}"
                if only and label not in only:
                    continue
                prompt = context - NEW_TOKENS
                inputs = generation_inputs(meta, batch, prompt)
                t0 = time.perf_counter()
                child = spawn_measure(name, batch, context, history) if device == "cuda" \
                    else None
                est = estimate(meta, inputs, mode="generate", new_tokens=NEW_TOKENS,
                               device=device)
                est_s = time.perf_counter() - t0
                m = collect(child) if child is not None else measured_cpu(real, inputs)
                real_s = time.perf_counter() - t0
                record = m.pop("history", None)
                if record is not None:
                    records[label] = record
                dev = est.device_estimate
                predicted = dev.allocated_bytes
                actual = m["max_memory_allocated"]
                row = {
                    "model": name, "batch": batch, "context": context, "prompt": prompt,
                    "new_tokens": NEW_TOKENS, "measured": actual, "estimated": predicted,
                    "error_pct": round(100.0 * (predicted - actual) / actual, 4),
                    "error_bytes": predicted - actual,
                    "estimated_tensor_peak": est.peak_bytes,
                    "estimated_terms": {t.name: t.nbytes for t in dev.terms},
                    "estimated_kv_cache": est.categories[MemoryCategory.KV_CACHE],
                    "peak_phase": est.phase.name + (f" {est.phase.step}"
                                                    if est.phase.name == "decode" else ""),
                    "measured_before": m["allocated_before"],
                    "measured_requested_peak": m["requested_peak"],
                    "estimated_resident": sum(est.categories[c] for c in (
                        MemoryCategory.PARAMETERS, MemoryCategory.BUFFERS,
                        MemoryCategory.INPUTS)),
                    "max_memory_reserved": m["max_memory_reserved"],
                    "num_alloc_retries": m.get("num_alloc_retries", 0),
                    "estimate_seconds": round(est_s, 2), "run_seconds": round(real_s, 2),
                }
                if "sdpa" in m:
                    row["sdpa"] = m["sdpa"]
                rows.append(row)
                print(f"[{time.perf_counter() - started:6.1f}s] {name} batch {batch} context "
                      f"{context}: measured {actual:,} estimated {predicted:,} "
                      f"({row['error_pct']:+.4f}%, {predicted - actual:+,} B), peak in "
                      f"{row['peak_phase']}; estimate {est_s:.1f}s", flush=True)
                _write(rows, device, tiny, out_dir)
        del real, meta
    if records:
        with gzip.open(out_dir / "gpu_generate_history.json.gz", "wt") as f:
            json.dump({"environment": _environment(device), "rows": records}, f)
    return rows


def _environment(device: str) -> dict[str, Any]:
    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "transformers": transformers.__version__, "device": device,
                           "new_tokens": NEW_TOKENS}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env |= {"gpu": props.name, "sm": f"{props.major}.{props.minor}",
                "sms": props.multi_processor_count, "cuda": torch.version.cuda,
                "cudnn": torch.backends.cudnn.version()}
    return env


def _write(rows: list[dict[str, Any]], device: str, tiny: bool, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    env = _environment(device)
    (out_dir / "gpu_generate.json").write_text(json.dumps(
        {"environment": env, "tiny": tiny, "rows": rows}, indent=1))
    lines = [f"Environment: {json.dumps(env)}", "",
             "| model | batch | context | measured | estimated | error | peak in | "
             "kv cache (est.) | sdpa prefill / decode | estimate s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        sdpa = r.get("sdpa", {})
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['context']} | {r['measured']:,} | "
            f"{r['estimated']:,} | {r['error_pct']:+.4f}% | {r['peak_phase']} | "
            f"{r['estimated_kv_cache']:,} | {sdpa.get('prefill', '-')} / "
            f"{sdpa.get('decode', '-')} | {r['estimate_seconds']} |")
    (out_dir / "gpu_generate.md").write_text("\n".join(lines) + "\n")


def main() -> int:
    """Parse the options, run every row, write the files."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true",
                        help="2-layer, 128-wide configs at contexts 64 and 256 (a quick check)")
    parser.add_argument("--no-history", action="store_true",
                        help="do not record the allocator's events (CUDA)")
    parser.add_argument("--rows", nargs="*", metavar="'MODEL BATCH CONTEXT'",
                        help="only these rows, e.g. 'gemma3-like 8 16384'")
    parser.add_argument("--measure", nargs=3, metavar=("MODEL", "BATCH", "CONTEXT"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--history", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        name, batch, context = args.measure
        measure_in_child(name, int(batch), int(context), args.history)
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu --tiny", file=sys.stderr)
        return 2
    out_dir = Path(os.environ.get("OUT") or "gpu_out")
    rows = run(args.device, args.tiny, out_dir, history=args.device == "cuda"
               and not args.no_history, only=set(args.rows) if args.rows else None)
    worst = max(abs(r["error_pct"]) for r in rows)
    print(f"wrote {out_dir / 'gpu_generate.json'} and {out_dir / 'gpu_generate.md'}; "
          f"worst error {worst:.4f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
