"""What is alive on the GPU at ``max_memory_allocated``: the caching allocator's own record.

For the rows of ``gpu_generate.py`` and ``gpu_train.py`` whose estimate misses, this runs the
real program once more under ``torch.cuda.memory._record_memory_history`` and writes, per row,
the allocator's events in order (``[action, size, the innermost frames of the Python stack
that asked, address]``; an alloc event carries the *requested* size, not the block's, so
``replayed_peak`` is the peak of requested bytes: ``max_memory_allocated`` counts blocks, see
modelsize.estimation.cuda_allocator) and the blocks alive at the peak, grouped by their stack.
Rows run one after another in this process, so each starts with what the earlier ones left
(workspaces, cached segments); gpu_generate.py and gpu_train.py record every row in a fresh
process (their ``--history``). Needs a GPU:

    PYTHONPATH=src:benchmarks python benchmarks/gpu_diagnose.py [ROW ...]

Writes ``diagnose_<row>.json`` to ``$OUT`` (default ``./gpu_out``).
"""

from __future__ import annotations

import gc
import json
import os
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import transformers

import gpu_generate
import gpu_train
from modelsize.estimation.generate import generation_inputs


def _frames(event: dict[str, Any], depth: int = 6) -> str:
    """The innermost frames outside torch's own Python plumbing, innermost first."""
    out = []
    for f in event.get("frames", []):
        name, path = f.get("name", "?"), f.get("filename", "?")
        if "torch/cuda/memory" in path or path.startswith("<"):
            continue
        out.append(f"{os.path.basename(path)}:{f.get('line', 0)}:{name}")
        if len(out) >= depth:
            break
    return " < ".join(out)


def record(program: Any) -> dict[str, Any]:
    """Run ``program()`` under the allocator's history; the events and the peak's blocks."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                             max_entries=400_000)
    try:
        program()
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    peak = torch.cuda.max_memory_allocated()
    events = [e for trace in snap["device_traces"] for e in trace]
    live: dict[int, tuple[int, str]] = {}
    cur, high, at_peak = base, base, {}
    compact = []
    for e in events:
        action, size, addr = e["action"], int(e.get("size", 0)), int(e.get("addr", 0))
        if action == "alloc":
            where = _frames(e)
            live[addr] = (size, where)
            cur += size
            compact.append(["a", size, where[:160], addr])
            if cur > high:
                high, at_peak = cur, dict(live)
        elif action == "free_requested":  # the statistics drop here, not at free_completed
            size_where = live.pop(addr, None)
            if size_where is not None:
                cur -= size_where[0]
                compact.append(["f", size_where[0], size_where[1], addr])
        elif action in ("segment_alloc", "segment_free"):
            compact.append(["s" if action == "segment_alloc" else "S", size, "", addr])
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, where in at_peak.values():
        groups[where][0] += size
        groups[where][1] += 1
    return {"max_memory_allocated": peak, "allocated_before": base,
            "replayed_peak": high, "events": len(events),
            "alive_at_peak": sorted(([w, n, c] for w, (n, c) in groups.items()),
                                    key=lambda r: -r[1]),
            "trace": compact}


def generate_row(model_name: str, batch: int, context: int) -> dict[str, Any]:
    """A ``gpu_generate`` row, run for real once more under the history."""
    cls, make = gpu_generate.MODELS[model_name]
    config = make(False)
    model = gpu_generate.build(cls, config, "cuda", torch.bfloat16)
    prompt = context - gpu_generate.NEW_TOKENS
    inputs = {k: v.to("cuda") for k, v in generation_inputs(model, batch, prompt).items()}

    def program() -> None:
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=gpu_generate.NEW_TOKENS,
                                 min_new_tokens=gpu_generate.NEW_TOKENS, do_sample=False)
        del out

    return record(program)


def train_row(name: str) -> dict[str, Any]:
    """A ``gpu_train`` row, run for real once more under the history."""
    make_model, make_inputs, mode, amp = gpu_train.ROWS[name]
    torch.manual_seed(0)
    model = make_model(False).to("cuda")
    inputs = make_inputs(False)
    result: dict[str, Any] = {}

    def program() -> None:
        result["peak"] = gpu_train.run_real(model, inputs, mode, amp, "cuda")

    return record(program)


ROWS = {
    "gemma3_b1_16k": lambda: generate_row("gemma3-like", 1, 16384),
    "llama_b1_2k": lambda: generate_row("llama-like", 1, 2048),
    "gpt2_train_bf16": lambda: train_row("gpt2 train bf16 autocast"),
    "cnn_train": lambda: train_row("cnn train"),
    "gpt2_train": lambda: train_row("gpt2 train"),
}


def main() -> int:
    """Run the rows named (all by default), one file each."""
    transformers.logging.set_verbosity_error()
    out_dir = Path(os.environ.get("OUT") or "gpu_out")
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in sys.argv[1:] or list(ROWS):
        data = ROWS[name]()
        (out_dir / f"diagnose_{name}.json").write_text(json.dumps(data))
        print(f"{name}: max_memory_allocated {data['max_memory_allocated']:,}, replayed "
              f"{data['replayed_peak']:,}, {data['events']} events; top at the peak:",
              flush=True)
        for where, n, count in data["alive_at_peak"][:8]:
            print(f"  {n:>14,} B in {count:>4} blocks  {where[:150]}", flush=True)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
