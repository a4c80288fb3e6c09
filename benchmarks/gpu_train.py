"""GPU check of ``estimate(..., device="cuda")`` for training steps and forwards against
``torch.cuda.max_memory_allocated()``.

Run from the repository root on a machine with one CUDA GPU (no network: models are built in
code from configs, random weights):

    PYTHONPATH=src:benchmarks python benchmarks/gpu_train.py      # about a minute on an H100
    PYTHONPATH=src:benchmarks python benchmarks/gpu_train.py --device cpu --tiny   # CPU path

Each row is one program: a forward under ``no_grad`` (``infer``), or two training steps
(forward, ``default_loss``, backward, ``AdamW.step()`` with the implementation PyTorch picks
on the device, ``zero_grad(set_to_none=True)``), optionally under bf16 autocast. Each real run
is a fresh process (``--measure``): the model moved to the device, its inputs too, the caching
allocator emptied and its peak statistics reset, then the program; nothing an earlier row
left (cuBLAS workspaces of the main and the autograd thread, cached segments) counts. The
estimate, of the same program with ``device="cuda"`` on a meta copy of the model
(``DeviceEstimate.allocated_bytes``: the trace replayed through the caching allocator's rules,
with the cuBLAS workspaces), runs meanwhile in this process. With ``--history`` (the default
on CUDA) each run also records the allocator's events, addresses included, and its segments
before the run (benchmarks/_cuda_history.py), all rows in ``gpu_train_history.json.gz``. On
CPU the real side is the CPU allocator's peak from the profiler's memory events.

Writes ``gpu_train.json`` and ``gpu_train.md`` to ``$OUT`` (default ``./gpu_out``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import gzip
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn

from modelsize.estimation import estimate
from modelsize.estimation.trace import default_loss


class ConvNet(nn.Module):
    """A small image classifier: three conv blocks with BatchNorm, then a linear head."""

    def __init__(self, width: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        cin = 3
        for cout in (width, 2 * width, 4 * width):
            layers += [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(),
                       nn.MaxPool2d(2)]
            cin = cout
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(cin, 100)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))


def _gpt2(tiny: bool) -> nn.Module:
    cfg = transformers.GPT2Config(n_layer=2 if tiny else 12, n_embd=64 if tiny else 768,
                                  n_head=4 if tiny else 12, vocab_size=1000 if tiny else 50257,
                                  n_positions=1024)
    return transformers.GPT2LMHeadModel(cfg)


def _llama(tiny: bool) -> nn.Module:
    cfg = transformers.LlamaConfig(num_hidden_layers=2 if tiny else 8,
                                   hidden_size=128 if tiny else 2048,
                                   intermediate_size=256 if tiny else 5632,
                                   num_attention_heads=4 if tiny else 32,
                                   num_key_value_heads=2 if tiny else 8,
                                   vocab_size=1000 if tiny else 32000)
    return transformers.LlamaForCausalLM(cfg)


def _tokens(batch: int, seq: int, vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


#: name -> (model factory, inputs factory(tiny), mode, autocast dtype or None)
ROWS: dict[str, tuple[Callable[[bool], nn.Module], Callable[[bool], Any], str,
                      torch.dtype | None]] = {
    "cnn train": (lambda t: ConvNet(8 if t else 64),
                  lambda t: (torch.randn(4 if t else 64, 3, 32 if t else 64, 32 if t else 64),),
                  "train", None),
    "gpt2 train": (_gpt2, lambda t: _tokens(2 if t else 4, 32 if t else 512,
                                            1000 if t else 50257), "train", None),
    "gpt2 infer": (_gpt2, lambda t: _tokens(2 if t else 8, 32 if t else 1024,
                                            1000 if t else 50257), "infer", None),
    "gpt2 train bf16 autocast": (_gpt2, lambda t: _tokens(2 if t else 4, 32 if t else 512,
                                                          1000 if t else 50257),
                                 "train", torch.bfloat16),
    "llama train bf16 autocast": (_llama, lambda t: _tokens(1 if t else 2, 32 if t else 1024,
                                                            1000 if t else 32000),
                                  "train", torch.bfloat16),
}


def _to(inputs: Any, device: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(inputs, dict):
        return (), {k: v.to(device) for k, v in inputs.items()}
    return tuple(v.to(device) for v in inputs), {}


def run_real(model: nn.Module, inputs: Any, mode: str, amp: torch.dtype | None,
             device: str, record: dict[str, Any] | None = None) -> int:
    """The real peak of the program on ``device`` (CUDA: ``max_memory_allocated``); on CUDA,
    ``record`` (when given) receives the allocator's record of the run."""
    args, kwargs = _to(inputs, device)

    def call() -> Any:
        ctx = (torch.autocast(device, dtype=amp) if amp is not None
               else contextlib.nullcontext())
        with ctx:
            return model(*args, **kwargs)

    def program() -> None:
        if mode == "infer":
            model.eval()
            with torch.no_grad():
                out = call()
            del out
            return
        model.train()
        opt = torch.optim.AdamW(model.parameters())
        for _ in range(2):
            loss = default_loss(call())
            loss.backward()
            del loss
            opt.step()
            opt.zero_grad(set_to_none=True)
        del opt

    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        if record is not None:
            import _cuda_history

            record["allocated_before"] = torch.cuda.memory_allocated()
            record.update(_cuda_history.record(program))
        else:
            program()
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated())
    from torch.profiler import ProfilerActivity, profile

    tensors = [*model.parameters(), *model.buffers(), *args, *kwargs.values()]
    before = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                  for t in tensors}.values())
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        program()
    cur = high = 0
    for e in prof.profiler.kineto_results.events():
        if e.name() == "[memory]":
            cur += e.nbytes()
            high = max(high, cur)
    return before + high


def measure_in_child(name: str, history: bool) -> None:
    """``--measure``: one row's real run on the GPU, its numbers printed (JSON)."""
    transformers.logging.set_verbosity_error()
    make_model, make_inputs, mode, amp = ROWS[name]
    torch.manual_seed(0)
    model = make_model(False).to("cuda")
    inputs = make_inputs(False)
    record: dict[str, Any] | None = {} if history else None
    peak = run_real(model, inputs, mode, amp, "cuda", record)
    stats = torch.cuda.memory_stats()
    print(json.dumps({"max_memory_allocated": peak,
                      "max_memory_reserved": torch.cuda.max_memory_reserved(),
                      "requested_peak": int(stats.get("requested_bytes.all.peak", 0)),
                      "num_alloc_retries": int(stats.get("num_alloc_retries", 0)),
                      "history": record}))


def spawn_measure(name: str, history: bool) -> subprocess.Popen[str]:
    """The real run of one row in a fresh process (see :func:`measure_in_child`)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--measure", name]
    return subprocess.Popen(cmd + (["--history"] if history else []), stdout=subprocess.PIPE,
                            text=True)


def run(device: str, tiny: bool, out_dir: Path, history: bool = False,
        only: set[str] | None = None) -> list[dict[str, Any]]:
    """Every row, printed as it goes."""
    transformers.logging.set_verbosity_error()
    rows: list[dict[str, Any]] = []
    records: dict[str, Any] = {}
    started = time.perf_counter()
    for name, (make_model, make_inputs, mode, amp) in ROWS.items():
        if only and name not in only:
            continue
        torch.manual_seed(0)
        inputs = make_inputs(tiny)
        t0 = time.perf_counter()
        child = spawn_measure(name, history) if device == "cuda" else None
        with torch.device("meta"):
            meta = make_model(tiny)
        est = estimate(meta, inputs, mode=mode, amp=amp, device=device)
        est_s = time.perf_counter() - t0
        m: dict[str, Any]
        if child is not None:
            out, _ = child.communicate()
            if child.returncode:
                raise RuntimeError(f"the measuring process of {name!r} failed")
            m = json.loads(out.strip().splitlines()[-1])
            if m.get("history") is not None:
                records[name] = m.pop("history")
        else:
            torch.manual_seed(0)
            model = make_model(tiny)
            m = {"max_memory_allocated": run_real(model, inputs, mode, amp, device)}
        actual = int(m["max_memory_allocated"])
        real_s = time.perf_counter() - t0
        dev = est.device_estimate
        predicted = dev.allocated_bytes
        row = {"row": name, "mode": mode, "amp": str(amp).removeprefix("torch."),
               "measured": actual, "estimated": predicted,
               "error_pct": round(100.0 * (predicted - actual) / actual, 4),
               "error_bytes": predicted - actual,
               "estimated_tensor_peak": est.peak_bytes,
               "terms": {t.name: t.nbytes for t in dev.terms},
               "categories": {str(getattr(c, "value", c)): n for c, n in est.categories.items()},
               "phase": f"{est.phase.name} of step {est.phase.step}",
               "measured_requested_peak": m.get("requested_peak"),
               "max_memory_reserved": m.get("max_memory_reserved"),
               "num_alloc_retries": m.get("num_alloc_retries"),
               "estimate_seconds": round(est_s, 2), "run_seconds": round(real_s, 2)}
        rows.append(row)
        print(f"[{time.perf_counter() - started:6.1f}s] {name}: measured {actual:,} "
              f"estimated {predicted:,} ({row['error_pct']:+.4f}%, {predicted - actual:+,} "
              f"B), tensors {est.peak_bytes:,} in {row['phase']}; estimate {est_s:.1f}s",
              flush=True)
        _write(rows, device, tiny, out_dir)
    if records:
        with gzip.open(out_dir / "gpu_train_history.json.gz", "wt") as f:
            json.dump({"environment": _environment(device), "rows": records}, f)
    return rows


def _environment(device: str) -> dict[str, Any]:
    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "transformers": transformers.__version__, "device": device}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env |= {"gpu": props.name, "sm": f"{props.major}.{props.minor}",
                "cuda": torch.version.cuda}
    return env


def _write(rows: list[dict[str, Any]], device: str, tiny: bool, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    env = _environment(device)
    (out_dir / "gpu_train.json").write_text(json.dumps(
        {"environment": env, "tiny": tiny, "rows": rows}, indent=1))
    lines = [f"Environment: {json.dumps(env)}", "",
             "| program | measured | estimated | error | traced tensor peak | peak in |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['row']} | {r['measured']:,} | {r['estimated']:,} | {r['error_pct']:+.4f}% "
              f"| {r['estimated_tensor_peak']:,} | {r['phase']} |" for r in rows]
    (out_dir / "gpu_train.md").write_text("\n".join(lines) + "\n")


def main() -> int:
    """Parse the options, run every row, write the files."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (a quick check)")
    parser.add_argument("--no-history", action="store_true",
                        help="do not record the allocator's events (CUDA)")
    parser.add_argument("--rows", nargs="*", metavar="ROW", help="only these rows")
    parser.add_argument("--measure", metavar="ROW", help=argparse.SUPPRESS)
    parser.add_argument("--history", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        measure_in_child(args.measure, args.history)
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu --tiny", file=sys.stderr)
        return 2
    out_dir = Path(os.environ.get("OUT") or "gpu_out")
    rows = run(args.device, args.tiny, out_dir, history=args.device == "cuda"
               and not args.no_history, only=set(args.rows) if args.rows else None)
    worst = max(abs(r["error_pct"]) for r in rows)
    print(f"wrote {out_dir / 'gpu_train.json'}; worst error {worst:.4f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
