"""Inspect speed and memory: modelsize inspect vs torch.load on a >= 2 GB training checkpoint.

Builds GPT-2 medium's parameter set from real layers (24 blocks, d=1024, vocab 50257, 355 M
parameters), takes one real AdamW step on 4 x 256 tokens (in a subprocess, so its memory does
not leak into the measurements: Linux keeps ru_maxrss across exec), saves
``{"model": ..., "optimizer": ..., "step": 1}`` with torch.save (>= 2 GB), then
measures, each in a fresh subprocess: wall time of the operation, wall time of the whole process
(interpreter start and imports included) and peak RSS (ru_maxrss), for

* ``modelsize inspect --json``          (no torch imported at all)
* ``torch.load(weights_only=True)``     (the safe full load)
* ``torch.load(mmap=True, weights_only=True)``

Page cache is warm for every run (the file was just written and is read once before timing).

    python benchmarks/inspect_speed.py [--dir DIR] [--keep] [--repeat 3]
    python benchmarks/inspect_speed.py --checkpoint DIR/train.pt   # one kept by --keep

``--checkpoint`` measures a checkpoint this script wrote before (building one takes minutes);
the byte counts it is checked against are then read back with ``torch.load(mmap=True)``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _results import write_section

_MEASURE = r"""
import json, resource, sys, time, io, contextlib
t0 = time.perf_counter()
which, path = sys.argv[1], sys.argv[2]
if which == "modelsize":
    from modelsize.cli import main
    t1 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()) as out:
        rc = main(["inspect", path, "--json"])
    assert rc == 0
    result = json.loads(out.getvalue())
    detail = {"tensors": result["tensor_count"], "categories": result["bytes_by_category"]}
else:
    import torch
    t1 = time.perf_counter()
    obj = torch.load(path, weights_only=True, mmap=(which == "torch.load(mmap=True)"))
    n = sum(1 for k in obj["model"]) + sum(len(v) for v in obj["optimizer"]["state"].values())
    detail = {"tensors": n}
t2 = time.perf_counter()
print(json.dumps({"op_s": t2 - t1, "import_s": t1 - t0,
                  "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "detail": detail}))
"""

WAYS = ("modelsize", "torch.load(weights_only=True)", "torch.load(mmap=True)")


def build_checkpoint(path: Path) -> dict[str, int]:
    """Write the checkpoint; return the byte counts we know independently."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    d, layers, vocab = 1024, 24, 50257
    blocks = nn.ModuleList()
    for _ in range(layers):
        blocks.append(nn.ModuleDict({
            "ln_1": nn.LayerNorm(d), "qkv": nn.Linear(d, 3 * d), "proj": nn.Linear(d, d),
            "ln_2": nn.LayerNorm(d), "fc": nn.Linear(d, 4 * d), "fc2": nn.Linear(4 * d, d),
        }))
    model = nn.ModuleDict({"wte": nn.Embedding(vocab, d), "wpe": nn.Embedding(1024, d),
                           "h": blocks, "ln_f": nn.LayerNorm(d)})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    # One step on a batch of 4 x 256 tokens, as a language model trains (a toy 8-token step
    # would leave the embedding's Adam moments almost all zero, which no real checkpoint has).
    ids = torch.randint(0, vocab, (4, 256))
    x = model["wte"](ids) + model["wpe"](torch.arange(256))
    for blk in blocks:
        h = blk["qkv"](blk["ln_1"](x))[..., :d]
        x = x + blk["proj"](h)
        x = x + blk["fc2"](torch.relu(blk["fc"](blk["ln_2"](x))))
    loss = (model["ln_f"](x) @ model["wte"].weight.T).logsumexp(-1).mean()
    loss.backward()
    opt.step()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 1}, path)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"weights": weights, "params": sum(p.numel() for p in model.parameters())}


def known_counts(path: Path) -> dict[str, int]:
    """The byte counts of ``build_checkpoint`` for a checkpoint it wrote, read back by torch.

    Tied weights (``lm_head.weight`` saved as the embedding's storage) are one set of bytes in
    the file and one set of parameters: each storage counts once, as ``model.parameters()``
    counts a shared parameter once.
    """
    import torch

    obj = torch.load(path, weights_only=True, mmap=True)
    storages: dict[int, tuple[int, int]] = {}
    for t in obj["model"].values():
        s = t.untyped_storage()
        storages[s.data_ptr()] = (s.nbytes(), s.nbytes() // t.element_size())
    return {"weights": sum(n for n, _ in storages.values()),
            "params": sum(p for _, p in storages.values())}


def _env() -> dict[str, str]:
    # Measured as installed packages run: with byte-compiled modules (some machines set
    # PYTHONDONTWRITEBYTECODE, which would recompile modelsize on every run).
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def measure(which: str, path: Path) -> dict[str, float]:
    """One fresh process: op time, process wall time, peak RSS."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _MEASURE, which, str(path)],
                          capture_output=True, text=True, check=True, env=_env())
    wall = time.perf_counter() - t0
    out = json.loads(proc.stdout)
    out["process_s"] = wall
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--checkpoint", default=None,
                    help="measure this checkpoint (written by an earlier --keep run)")
    ap.add_argument("--build-only", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--known-only", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.build_only:
        print(json.dumps(build_checkpoint(Path(args.build_only))))
        return
    if args.known_only:
        print(json.dumps(known_counts(Path(args.known_only))))
        return
    tmp = None
    if args.checkpoint:
        path = Path(args.checkpoint)
        step = ["--known-only", str(path)]  # in a subprocess: torch's memory stays there
    else:
        tmp = tempfile.TemporaryDirectory(dir=args.dir)
        path = Path(tmp.name) / "train.pt"
        step = ["--build-only", str(path)]
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, __file__, *step], capture_output=True, text=True, check=True,
    )
    known = json.loads(proc.stdout)
    size = path.stat().st_size
    verb = "read back" if args.checkpoint else "built"
    print(f"{verb} {path} ({size / 1e9:.2f} GB) in {time.perf_counter() - t0:.0f} s", flush=True)
    with open(path, "rb") as fh:  # warm the page cache for every contender alike
        while fh.read(1 << 24):
            pass
    load_before = os.getloadavg()
    rows = {}
    for which in WAYS:
        measure(which, path)  # unmeasured: byte-compiles modules, like a first run after install
        runs = [measure(which, path) for _ in range(args.repeat)]
        rows[which] = {
            "op_s": statistics.median(r["op_s"] for r in runs),
            "process_s": statistics.median(r["process_s"] for r in runs),
            "rss_mb": max(r["rss_mb"] for r in runs),
            "detail": runs[0]["detail"],
        }
        print(which, json.dumps(rows[which]), flush=True)
    load_after = os.getloadavg()
    ms = rows["modelsize"]
    cats = ms["detail"]["categories"]
    assert cats["weights"] == known["weights"], (cats["weights"], known["weights"])
    assert sum(cats.values()) == size
    full = rows["torch.load(weights_only=True)"]
    lines = [
        "## inspect speed: modelsize inspect vs torch.load",
        "",
        f"Checkpoint: GPT-2 medium's parameter set ({known['params']:,} parameters) after one "
        "AdamW "
        "step on 4 x 256 tokens, "
        f"`torch.save({{model, optimizer, step}})`: {size:,} bytes ({size / 1e9:.2f} GB), "
        f"{ms['detail']['tensors']} tensors. Warm page cache; median of {args.repeat} fresh "
        "processes "
        "after one unmeasured warm-up each; peak RSS is the max. "
        f"{os.cpu_count()}-core machine, shared with other work while measured: 1-minute load "
        f"average {load_before[0]:.1f} before, {load_after[0]:.1f} after (timings carry that "
        "noise).",
        "",
        "| way | operation (s) | whole process (s) | peak RSS (MB) |",
        "|---|---:|---:|---:|",
    ]
    for which in WAYS:
        r = rows[which]
        lines.append(f"| `{which}` | {r['op_s']:.3f} | {r['process_s']:.2f} | {r['rss_mb']:.0f} |")
    lines += [
        "",
        f"modelsize is **{full['op_s'] / ms['op_s']:.0f}x** faster than a full `torch.load` on the "
        f"operation ({full['process_s'] / ms['process_s']:.0f}x on whole processes, which include "
        f"torch's import), with {ms['rss_mb']:.0f} MB peak RSS vs {full['rss_mb']:.0f} MB. "
        f"Categories: weights {cats['weights']:,} B, "
        f"optimizer_state {cats['optimizer_state']:,} B, "
        f"metadata {cats['metadata']:,} B (sum = file size).",
        "",
        "Reproduce: `.venv/bin/python benchmarks/inspect_speed.py`",
    ]
    write_section("inspect_speed", "\n".join(lines))
    print("\n".join(lines))
    if tmp is None:
        return
    if args.keep:
        print(f"kept {path}")
    else:
        tmp.cleanup()


if __name__ == "__main__":
    main()
