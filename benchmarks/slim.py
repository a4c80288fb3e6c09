"""Slim speed and memory: modelsize slim vs the usual scripts, on a >= 2 GB training checkpoint.

The checkpoint is the one ``inspect_speed.py`` builds (GPT-2 medium's parameter set after one
real AdamW step, ``torch.save({"model", "optimizer", "step"})``, >= 2 GB), plus the same
tensors as one safetensors file (model and optimizer moments, as some trainers save them).
Each contender runs in a fresh process (peak RSS is that process's ``ru_maxrss``; the wall time
is the whole process, interpreter start and imports included), page cache warm:

* weights only, torch file: ``modelsize slim train.pt -o out.pt`` vs the naive
  ``torch.load`` + keep ``["model"]`` + ``torch.save``;
* weights only in bfloat16: ``modelsize slim train.pt --drop optimizer_state --cast bfloat16``
  vs the same script with ``.to(torch.bfloat16)``;
* safetensors: ``modelsize slim train.safetensors`` vs safetensors' own ``load_file`` + drop
  the optimizer entries + ``save_file``;
* ``cp`` of the output's bytes (the floor for writing that many bytes), and ``cp`` followed by
  ``sync`` of the copy (modelsize fsyncs its output before renaming it into place).

Each output is checked: same tensors as the reference script writes (names, dtypes, values).

    python benchmarks/slim.py [--dir DIR] [--repeat 3] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _results import write_section

_NAIVE = r"""
import sys, torch
src, out, how = sys.argv[1], sys.argv[2], sys.argv[3]
if how == "safetensors":
    from safetensors.torch import load_file, save_file
    t = load_file(src)
    save_file({k: v for k, v in t.items() if k.startswith("model.")}, out)
else:
    ck = torch.load(src, weights_only=True)
    sd = ck["model"]
    if how == "bf16":
        sd = {k: v.to(torch.bfloat16) for k, v in sd.items()}
    torch.save(sd, out)
"""

_TO_SAFETENSORS = r"""
import sys, torch
from safetensors.torch import save_file
ck = torch.load(sys.argv[1], weights_only=True)
t = {f"model.{k}": v for k, v in ck["model"].items()}
for i, s in ck["optimizer"]["state"].items():
    for k, v in s.items():
        if v.dim():
            t[f"optimizer.state.{i}.{k}"] = v
save_file(t, sys.argv[2])
"""

_CHECK = r"""
import sys, torch
a, b = sys.argv[1], sys.argv[2]
if a.endswith(".safetensors"):
    from safetensors.torch import load_file
    x, y = load_file(a), load_file(b)
else:
    x, y = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
assert list(x) == list(y), (list(x)[:3], list(y)[:3])
assert all(x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]) for k in x)
print(len(x))
"""


def run(cmd: list[str]) -> dict[str, float]:
    """Wall time and peak RSS of one fresh process (rusage of that child alone)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    err = proc.stderr.read().decode() if proc.stderr else ""
    if proc.stderr:
        proc.stderr.close()
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{cmd} failed: {err}")
    return {"wall_s": wall, "rss_mb": usage.ru_maxrss / 1024}


def median_of(cmd: list[str], repeat: int, before: object = None) -> dict[str, float]:
    runs = []
    for _ in range(repeat):
        if callable(before):
            before()
        runs.append(run(cmd))
    return {"wall_s": statistics.median(r["wall_s"] for r in runs),
            "rss_mb": max(r["rss_mb"] for r in runs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    py = sys.executable
    here = Path(__file__).parent
    tmp = tempfile.TemporaryDirectory(dir=args.dir)
    d = Path(tmp.name)
    train = d / "train.pt"
    subprocess.run([py, str(here / "inspect_speed.py"), "--build-only", str(train)],
                   check=True, capture_output=True)
    train_st = d / "train.safetensors"
    subprocess.run([py, "-c", _TO_SAFETENSORS, str(train), str(train_st)], check=True)
    for p in (train, train_st):
        with open(p, "rb") as fh:
            while fh.read(1 << 24):
                pass
    modelsize = [py, "-m", "modelsize", "slim"]
    cases = [
        ("weights only (torch)", train, [], "plain", "ms.pt", "naive.pt"),
        ("weights only, bfloat16 (torch)", train, ["--drop", "optimizer_state", "--cast",
                                                  "bfloat16"], "bf16", "ms_bf16.pt",
         "naive_bf16.pt"),
        ("weights only (safetensors)", train_st, [], "safetensors", "ms.safetensors",
         "naive.safetensors"),
    ]
    rows = []
    for title, src, flags, how, ms_name, naive_name in cases:
        ms_out, naive_out = d / ms_name, d / naive_name

        def clean(p: Path = ms_out) -> None:
            p.unlink(missing_ok=True)

        ms = median_of([*modelsize, str(src), *flags, "-o", str(ms_out)], args.repeat, clean)
        naive = median_of([py, "-c", _NAIVE, str(src), str(naive_out), how], args.repeat)
        copy = d / "copy.bin"

        def drop_copy(p: Path = copy) -> None:
            p.unlink(missing_ok=True)

        cp = median_of(["cp", str(ms_out), str(copy)], args.repeat, drop_copy)
        cp_sync = median_of(["sh", "-c", f"cp '{ms_out}' '{copy}' && sync '{copy}'"],
                            args.repeat, drop_copy)
        check = subprocess.run([py, "-c", _CHECK, str(ms_out), str(naive_out)], check=True,
                               capture_output=True, text=True)
        rows.append({
            "case": title, "input_bytes": src.stat().st_size, "tensors": int(check.stdout),
            "modelsize": ms, "naive": naive, "cp": cp, "cp_sync": cp_sync,
            "ms_bytes": ms_out.stat().st_size, "naive_bytes": naive_out.stat().st_size,
        })
        print(json.dumps(rows[-1]), flush=True)
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    lines = [
        "## slim: modelsize slim vs load-delete-save scripts and cp",
        "",
        f"Input: GPT-2 medium's parameter set after one AdamW step, "
        f"`torch.save({{model, optimizer, step}})`: {train.stat().st_size:,} bytes; the same "
        f"tensors as one safetensors file: {train_st.stat().st_size:,} bytes. Fresh process per "
        f"run, warm page cache, median wall of {args.repeat} (whole process: interpreter, "
        "imports, read, write; modelsize also fsyncs and re-reads its output to verify it), peak "
        "RSS the max of the runs. The naive script is `torch.load(weights_only=True)`, keep "
        "`['model']` (cast with `.to(torch.bfloat16)`), `torch.save`; for safetensors "
        "`load_file`, drop the optimizer entries, `save_file`. Outputs compared tensor by tensor "
        "(names, dtypes, values equal). 2-core machine.",
        "",
        "| case | way | wall (s) | peak RSS (MB) | output bytes |",
        "|---|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['case']} | `modelsize slim` | {r['modelsize']['wall_s']:.2f} | "
                     f"{r['modelsize']['rss_mb']:.0f} | {r['ms_bytes']:,} |")
        lines.append(f"| | naive script | {r['naive']['wall_s']:.2f} | "
                     f"{r['naive']['rss_mb']:.0f} | {r['naive_bytes']:,} |")
        lines.append(f"| | `cp` of the output | {r['cp']['wall_s']:.2f} | "
                     f"{r['cp']['rss_mb']:.0f} | |")
        lines.append(f"| | `cp` + `sync` | {r['cp_sync']['wall_s']:.2f} | | |")
    lines.append("")
    for r in rows:
        ms, naive, cp, cps = r["modelsize"], r["naive"], r["cp"], r["cp_sync"]
        lines.append(
            f"- {r['case']}: peak RSS {100 * ms['rss_mb'] / naive['rss_mb']:.1f}% of the naive "
            f"script's ({ms['rss_mb']:.0f} vs {naive['rss_mb']:.0f} MB); wall "
            f"{ms['wall_s'] / naive['wall_s']:.2f}x the naive script's, "
            f"{ms['wall_s'] / cp['wall_s']:.2f}x `cp`'s and {ms['wall_s'] / cps['wall_s']:.2f}x "
            "`cp` + `sync`'s.")
    lines += ["", "Reproduce: `.venv/bin/python benchmarks/slim.py`"]
    write_section("slim", "\n".join(lines))
    print("\n".join(lines))
    print(f"(benchmark driver peak RSS {own / 1024:.0f} MB)")
    if args.keep:
        print(f"kept {d}")
    else:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
