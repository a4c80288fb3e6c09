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
import statistics
import subprocess
import sys
import tempfile
import time

from _results import write_section

MODELS = ("llama-3-8b", "llama-3-70b")
#: (tool, steps, probe cache): "cold" runs with an empty kernel-probe cache
#: (``MODELSIZE_CACHE_DIR``, :mod:`modelsize.estimation.probe_cache`), as on a machine's first
#: estimate; "warm" with the one the cold 2-step run of the same model left.
RUNS = (("modelsize", 1, "cold"), ("modelsize", 2, "cold"), ("modelsize", 2, "warm"),
        ("MemTracker", 1, ""))
#: modelsize rows are the median of this many fresh processes (MemTracker's: one run).
REPEATS = 3


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
    results: dict[tuple[str, int, str], dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in MODELS:
            warm = os.path.join(tmp, f"{name}-warm")
            for tool, steps, cache in RUNS:
                label = f"{tool} ({cache} probe cache)" if cache else tool
                runs = []
                for i in range(REPEATS if tool == "modelsize" else 1):
                    env = dict(os.environ)
                    if cache == "cold":  # an empty folder each run; the 2-step's last is kept
                        env["MODELSIZE_CACHE_DIR"] = (warm if steps == 2 and i == REPEATS - 1
                                                      else os.path.join(tmp, f"{name}-{steps}-{i}"))
                    elif cache == "warm":
                        env["MODELSIZE_CACHE_DIR"] = warm
                    proc = subprocess.run(
                        [sys.executable, __file__, "--child", tool, name, str(steps)],
                        capture_output=True, text=True, timeout=3600, env=env,
                    )
                    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
                    if proc.returncode != 0 or not lines:
                        tail = (proc.stderr.strip().splitlines() or ["?"])[-1][:120]
                        print(name, label, steps, "failed:", tail, flush=True)
                        runs = []
                        break
                    runs.append(json.loads(lines[-1]))
                    print(name, label, steps, runs[-1], flush=True)
                if not runs:
                    rows.append([name, label, str(steps), "failed", "-", "-", "-", ""])
                    continue
                r = {k: statistics.median(x[k] for x in runs) for k in ("seconds", "cpu")}
                r["rss"] = max(x["rss"] for x in runs)
                results[(name, steps, cache)] = r
                peaks[(name, tool, steps)] = runs[0]["peak"]
                spread = (f"{len(runs)} runs, wall {min(x['seconds'] for x in runs):.1f}-"
                          f"{max(x['seconds'] for x in runs):.1f} s" if len(runs) > 1 else "")
                rows.append([name, label, str(steps), f"{r['seconds']:.1f}", f"{r['cpu']:.1f}",
                             f"{r['rss'] / 2**20:,.0f}", f"{runs[0]['peak'] / 2**30:,.2f}",
                             spread])
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
    notes.append("Goal (issue 22): Llama-3-70B 2-step training under 10 s wall, RSS under "
                 "1 GB:")
    for cache in ("cold", "warm"):
        r = results.get(("llama-3-70b", 2, cache))
        if r is not None:
            met = r["seconds"] < 10 and r["rss"] < 2**30
            notes.append(f"- {cache} probe cache: {'met' if met else 'missed'} "
                         f"({r['seconds']:.1f} s median wall, {r['cpu']:.1f} CPU s, RSS "
                         f"{r['rss'] / 2**20:,.0f} MiB).")
    text = "\n".join([
        "## estimate_scale",
        "",
        "Command: `python benchmarks/estimate_scale.py`. Llama-3 training step, batch 1 x 2048 "
        "tokens, bf16 CPU autocast, AdamW for-loop, fp32 master weights. Each row is a fresh "
        "process: wall time includes building the model (meta device for modelsize, fake "
        "tensors for MemTracker), CPU s the process's user + system time (whole process, "
        "imports included: steadier than the wall time on a shared machine), RSS its "
        f"`ru_maxrss`; modelsize's rows are the median of {REPEATS} processes (RSS: the "
        "largest), MemTracker's one run. A cold probe cache is a machine's first estimate: "
        "the CPU kernels whose scratch is measured (oneDNN bf16 matmuls, flash attention) "
        "run for real once per shape; warm, their answers come from the cache that run "
        "left. "
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
