"""Per-rank memory across GPUs: Llama-3-8B and -70B under FSDP2, traced on a fake process group.

Run from the repository root: ``python benchmarks/estimate_distributed.py [--quick]
[--only STRATEGY] [--precision policy|autocast] [--resume]``. Writes the
``estimate_distributed`` section of benchmarks/RESULTS.md after each row, replacing rows of
the same settings (``--quick``: the 8-GPU rows only; ``--only tp``: the rows of one
strategy; ``--resume``: skip rows already in the table).

The program: batch 1 x 2048 tokens per rank, fp32 weights with bf16 mixed precision run two
ways: FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` (modelsize's
default, ``policy``) or ``torch.autocast`` around the fp32 FSDP2 model (``autocast``); AdamW
with PyTorch's CUDA default implementation (foreach), two steps, traced with CPU kernels
(``device="cpu"``, the kernels validated against the allocator); FSDP2 ``fully_shard`` on each
``LlamaDecoderLayer`` then the root, resharding after forward, with and without activation
checkpointing of every decoder layer; Llama-3-70B with tensor parallelism over 8 GPUs (its
transformers ``base_model_tp_plan``), and with FSDP2 over 8 x tensor parallelism over 8
(``fsdp+tp``, 64 GPUs). Each row runs in a
fresh Python process: wall time includes building the model on the meta device, RSS is the
process's ``ru_maxrss``. Beside the traced worst rank: the ZeRO paper's stage-3 formula
(mixed-precision Adam, 16 bytes a parameter over the GPUs) and DeepSpeed's
``estimate_zero3_model_states_mem_needs`` (no offload), which count model states only.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time

from _results import write_section

#: (model, GPUs, checkpointing, strategy); ordered so that an interrupted run has the most
#: telling rows first. Each runs with each mixed precision of ``PRECISIONS``.
ROWS = [("llama-3-8b", 8, False, "fsdp"), ("llama-3-8b", 8, True, "fsdp"),
        ("llama-3-70b", 64, True, "fsdp"), ("llama-3-70b", 8, False, "tp"),
        ("llama-3-70b", 64, True, "fsdp+tp"), ("llama-3-70b", 64, False, "fsdp+tp"),
        ("llama-3-8b", 1024, False, "fsdp"), ("llama-3-70b", 1024, True, "fsdp"),
        ("llama-3-8b", 64, False, "fsdp"), ("llama-3-8b", 64, True, "fsdp"),
        ("llama-3-8b", 1024, True, "fsdp"), ("llama-3-70b", 8, True, "fsdp"),
        ("llama-3-70b", 64, False, "fsdp"), ("llama-3-70b", 1024, False, "fsdp"),
        ("llama-3-70b", 8, False, "fsdp")]
PRECISIONS = ("policy", "autocast")
TP = 8  # the tensor-parallel degree of the fsdp+tp rows


def _child(name: str, gpus: int, ckpt: bool, strategy: str, precision: str) -> None:
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    from modelsize.estimation import Parallel, estimate, zoo

    start = time.perf_counter()
    model = zoo.build(zoo.MODELS[name])
    ids = torch.empty(1, 2048, dtype=torch.long, device="meta")
    # foreach cannot mix the DTensor and plain parameters of tensor parallelism (PyTorch
    # raises "mixed torch.Tensor and DTensor"): that row uses the for-loop implementation
    est = estimate(model, {"input_ids": ids, "labels": ids}, optimizer="adamw", amp="bf16",
                   device="cpu", implementation="for-loop" if strategy == "tp" else "foreach",
                   checkpoint=("LlamaDecoderLayer",) if ckpt else (),
                   parallel=Parallel(gpus, strategy, tp=TP if strategy == "fsdp+tp" else None,
                                     mixed_precision=precision))
    seconds = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert est.parallel is not None
    comparisons = {c.name: c.nbytes for c in est.parallel.comparisons}
    print(json.dumps({
        "seconds": seconds, "cpu_seconds": time.process_time(), "rss": rss,
        "peak": est.peak_bytes,
        "phase": f"{est.phase.name} {est.phase.step}", "rank": est.parallel.worst_rank,
        "ops": est.op_count,
        "categories": {str(k): v for k, v in est.categories.items()},
        "zero3": comparisons["ZeRO formula, stage 3"],
        "deepspeed": comparisons["DeepSpeed estimate_zero3 (no offload)"],
    }))


def _gib(n: int) -> str:
    return f"{n / 2**30:,.2f}"


HEADER = ["model", "GPUs", "strategy", "checkpointing", "mixed precision",
          "per-rank peak GiB", "phase", "communication GiB", "activations GiB",
          "ZeRO-3 formula GiB", "DeepSpeed zero3 GiB", "wall s", "CPU s", "RSS MiB"]
KEY = 5  # the cells that name a row


def main(quick: bool, only: str | None, resume: bool, precisions: tuple[str, ...]) -> None:
    """Run every row in its own process and write the RESULTS.md section after each."""
    rows: list[list[str]] = []
    header = HEADER
    done = {tuple(r[:KEY]) for r in _merged([]) if not r[KEY].startswith("failed")}
    for (name, gpus, ckpt, strategy), precision in ((r, p) for r in ROWS for p in precisions):
        if (quick and gpus != 8) or (only and strategy != only):
            continue
        if strategy == "tp" and precision != "autocast":
            continue  # no FSDP2: --amp is autocast
        shown = f"fsdp+tp (tp {TP})" if strategy == "fsdp+tp" else strategy
        label = [name, str(gpus), shown, "every layer" if ckpt else "none",
                 "autocast" if strategy == "tp" else precision]
        if resume and tuple(label) in done:
            continue
        t0 = time.time()
        proc = subprocess.run([sys.executable, __file__, "--child", name, str(gpus),
                               str(int(ckpt)), strategy, precision],
                              capture_output=True, text=True, timeout=3600)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode != 0 or not lines:
            tail = (proc.stderr.strip().splitlines() or ["?"])[-1][:120]
            rows.append([*label, "failed: " + tail, *("-" * (len(header) - KEY - 1))])
            print(name, gpus, ckpt, strategy, "failed:", tail, flush=True)
            _write(header, rows, done=False)
            continue
        r = json.loads(lines[-1])
        cats = r["categories"]
        rows.append([*label, _gib(r["peak"]), r["phase"],
                     _gib(cats["communication"]), _gib(cats["activations"]), _gib(r["zero3"]),
                     _gib(r["deepspeed"]), f"{r['seconds']:.1f}", f"{r['cpu_seconds']:.1f}",
                     f"{r['rss'] / 2**20:,.0f}"])
        print(name, gpus, ckpt, strategy, r, f"({time.time() - t0:.0f} s with startup)",
              flush=True)
        _write(header, rows, done=False)
    _write(header, rows, done=True)


def _merged(rows: list[list[str]]) -> list[list[str]]:
    """``rows`` over the table already in RESULTS.md: a row replaces the one of the same model,
    GPUs, strategy and checkpointing (``--only`` reruns a subset)."""
    from _results import RESULTS

    text = RESULTS.read_text() if RESULTS.exists() else ""
    start = text.find("<!-- BEGIN estimate_distributed -->")
    end = text.find("<!-- END estimate_distributed -->")
    old = []
    if start >= 0 and end > start:
        for line in text[start:end].splitlines()[1:]:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if line.startswith("| llama") and len(cells) == len(HEADER):
                old.append(cells)
            elif line.startswith("| llama") and len(cells) == len(HEADER) - 2:
                # a row of the table before the mixed precision and CPU columns: autocast
                old.append([*cells[:4], "autocast", *cells[4:-1], "-", cells[-1]])
    new = {tuple(r[:KEY]): r for r in rows}
    out = [new.pop(tuple(r[:KEY]), r) for r in old]
    return out + list(new.values())


def _goal(rows: list[list[str]]) -> list[str]:
    """Issue 22's goal for this table: every row under 60 s wall."""
    walls = [(float(r[-3]), r) for r in rows if r[-3] not in ("-", "")]
    if not walls:
        return []
    slow = [f"{r[0]} {r[1]} GPUs {r[2]} {r[3]} {r[4]}: {w:.1f} s" for w, r in walls if w >= 60]
    worst = max(w for w, _ in walls)
    return [f"Goal (issue 22): every row under 60 s wall: {'met' if not slow else 'missed'} "
            f"(slowest {worst:.1f} s{'; over: ' + '; '.join(slow) if slow else ''})."]


def _write(header: list[str], rows: list[list[str]], done: bool) -> None:
    import torch

    rows = _merged(rows)
    load = os.getloadavg()
    text = "\n".join([
        "## estimate_distributed",
        "",
        "Command: `python benchmarks/estimate_distributed.py`. One rank of FSDP2 (`fully_shard` "
        "on each LlamaDecoderLayer, then the root) or of tensor parallelism (the model's "
        "transformers plan) traced on torch.distributed's fake process group: batch 1 x 2048 "
        "tokens per rank, fp32 weights, bf16 mixed precision as FSDP2's MixedPrecisionPolicy "
        "(`policy`, modelsize's default) or torch.autocast around the fp32 FSDP2 model "
        "(`autocast`, whose cache holds a bf16 copy of each gathered weight until the "
        "forward ends); fsdp+tp: FSDP2 over 8 x the tensor-parallel plan over 8; AdamW "
        "(foreach; for-loop for tensor parallelism, where PyTorch's foreach refuses to mix "
        "DTensor and plain parameters), two steps, CPU kernels (the peak of live tensors of "
        "one rank). The worst rank is rank 0 in every row. The formulas count model states "
        "only (ZeRO paper: 16 bytes a parameter over the GPUs; DeepSpeed: 18 bytes a "
        "parameter over the GPUs plus the largest layer in fp32). Each row is a fresh process. "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; load average at the "
        f"end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} on a machine shared with other "
        "jobs, so wall times are upper bounds."
        + ("" if done else " (Run interrupted: the rows below are those finished.)"),
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
        *("| " + " | ".join(r) + " |" for r in rows),
        "",
        *_goal(rows),
    ])
    write_section("estimate_distributed", text)
    if done:
        print(text)


if __name__ == "__main__":
    if len(sys.argv) == 7 and sys.argv[1] == "--child":
        _child(sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1", sys.argv[5], sys.argv[6])
    else:
        main("--quick" in sys.argv,
             sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else None,
             "--resume" in sys.argv,
             (sys.argv[sys.argv.index("--precision") + 1],) if "--precision" in sys.argv
             else PRECISIONS)
