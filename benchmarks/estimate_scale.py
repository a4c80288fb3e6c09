"""Tracing cost at scale: Llama-3-8B and -70B training steps, modelsize vs PyTorch's MemTracker.

Run from the repository root: ``python benchmarks/estimate_scale.py`` (several minutes: the
MemTracker rows dominate). Writes the ``estimate_scale`` section of benchmarks/RESULTS.md.

The program is the same for both tools: batch 1 x 2048 tokens, bf16 CPU autocast, AdamW
(for-loop), one training step (forward, loss, backward, ``optimizer.step()``,
``zero_grad``); modelsize is also timed on its default two steps. Each measurement runs in a
fresh Python process and reports its wall time (model construction included), its CPU time
and its peak resident memory (``ru_maxrss``), so nothing is shared between rows.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time

from _results import write_section

MODELS = ("llama-3-8b", "llama-3-70b")
RUNS = (("modelsize", 1), ("modelsize", 2), ("MemTracker", 1))


def _child(tool: str, name: str, steps: int) -> None:
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    from modelsize.estimation import zoo

    entry = zoo.MODELS[name]
    start = time.perf_counter()
    if tool == "modelsize":
        from modelsize.estimation import estimate

        model = zoo.build(entry)
        ids = torch.empty(1, 2048, dtype=torch.long, device="meta")
        est = estimate(model, {"input_ids": ids, "labels": ids}, optimizer="adamw",
                       implementation="for-loop", amp="bf16", device="cpu", steps=steps)
        peak = est.peak_bytes
    else:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.distributed._tools.mem_tracker import MemTracker

        with FakeTensorMode():
            model = entry.build()
            ids = torch.zeros(1, 2048, dtype=torch.long)
            opt = torch.optim.AdamW(model.parameters(), foreach=False)
            tracker = MemTracker()
            tracker.track_external(model, opt)
            with tracker:
                for _ in range(steps):
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        loss = model(input_ids=ids, labels=ids).loss
                    loss.backward()
                    del loss
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    tracker.reset_mod_stats()  # else it refuses a second iteration
        peak = int(sum(d["Total"] for d in tracker.get_tracker_snapshot("peak").values()))
    seconds = time.perf_counter() - start
    usage = resource.getrusage(resource.RUSAGE_SELF)
    rss, cpu = usage.ru_maxrss * 1024, usage.ru_utime + usage.ru_stime
    print(json.dumps({"seconds": seconds, "cpu": cpu, "rss": rss, "peak": peak}))


def main() -> None:
    """Run every (model, tool) pair in its own process and write the RESULTS.md section."""
    import torch

    load_before = os.getloadavg()[0]
    rows = []
    peaks: dict[tuple[str, str, int], int] = {}
    for name in MODELS:
        for tool, steps in RUNS:
            t0 = time.time()
            proc = subprocess.run(
                [sys.executable, __file__, "--child", tool, name, str(steps)],
                capture_output=True, text=True, timeout=3600,
            )
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            if proc.returncode != 0 or not lines:
                tail = (proc.stderr.strip().splitlines() or ["?"])[-1][:120]
                rows.append([name, tool, str(steps), "failed", "-", "-", "-", tail])
                print(name, tool, steps, "failed:", tail, flush=True)
                continue
            r = json.loads(lines[-1])
            peaks[(name, tool, steps)] = r["peak"]
            rows.append([name, tool, str(steps), f"{r['seconds']:.1f}", f"{r['cpu']:.1f}",
                         f"{r['rss'] / 2**20:,.0f}", f"{r['peak'] / 2**30:,.2f}", ""])
            print(name, tool, steps, r, f"({time.time() - t0:.0f} s with startup)", flush=True)
    header = ["model", "tool", "steps", "wall s", "CPU s", "peak RSS MiB", "traced peak GiB",
              "note"]
    notes = []
    for name in MODELS:
        ours = peaks.get((name, "modelsize", 1))
        theirs = peaks.get((name, "MemTracker", 1))
        if ours is not None and theirs is not None:
            notes.append(f"{name}: modelsize's peak minus MemTracker's = {ours - theirs:+,} bytes "
                         "(CPU kernel scratch and wrapped Python scalars, which modelsize adds "
                         "and fake tensors alone do not show).")
    seventy = next((r for r in rows if r[:3] == ["llama-3-70b", "modelsize", "2"]), None)
    if seventy is not None and seventy[3] != "failed":
        wall = float(seventy[3])
        notes.append(f"Goal (issue 22): Llama-3-70B 2-step training under 10 s wall: "
                     f"{'met' if wall < 10 else 'missed'} ({wall:.1f} s, {seventy[4]} CPU s, "
                     f"RSS {seventy[5]} MiB against a goal of 1 GB).")
    text = "\n".join([
        "## estimate_scale",
        "",
        "Command: `python benchmarks/estimate_scale.py`. Llama-3 training step, batch 1 x 2048 "
        "tokens, bf16 CPU autocast, AdamW for-loop, fp32 master weights. Each row is a fresh "
        "process: wall time includes building the model (meta device for modelsize, fake "
        "tensors for MemTracker), CPU s the process's user + system time (whole process, "
        "imports included: steadier than the wall time on a shared machine), RSS its "
        "`ru_maxrss`. "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; 1-minute load "
        f"average {load_before:.1f} before the runs and {os.getloadavg()[0]:.1f} after "
        f"({os.cpu_count()} cores).",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
        *("| " + " | ".join(r) + " |" for r in rows),
        "",
        *notes,
    ])
    write_section("estimate_scale", text)
    print(text)


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        _child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        main()
