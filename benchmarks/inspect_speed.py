"""Inspect speed and memory: modelsize inspect vs torch.load on a >= 2 GB training checkpoint.

Builds GPT-2 medium's parameter set from real layers (24 blocks, d=1024, vocab 50257, 355 M
parameters), takes one real AdamW step on 4 x 256 tokens (in a subprocess, so its memory does
not leak into the measurements: Linux keeps ru_maxrss across exec), saves
``{"model": ..., "optimizer": ..., "step": 1}`` with torch.save (>= 2 GB), then
measures, each in a fresh subprocess: wall time of the operation, wall time of the whole process
(interpreter start and imports included) and peak RSS (ru_maxrss), for

* ``modelsize inspect --json``          (no torch imported at all)
* the same with ``MODELSIZE_PURE_PYTHON=1`` (no compiled code: the pickle parsed by the Python
  loop alone, not ``modelsize._pickleops``; zip and safetensors headers read by Python, not
  ``modelsize._headers``)
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
if which.startswith("modelsize"):
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

PURE = "modelsize (pure Python)"
WAYS = ("modelsize", PURE, "torch.load(weights_only=True)", "torch.load(mmap=True)")

#: In-process listing (names, dtypes, shapes) of one file, best of 5 after a warm-up, in a
#: fresh process per way: modelsize's API, or the format's own reader.
_LISTING = r"""
import json, resource, sys, time
which, path = sys.argv[1], sys.argv[2]
if which.startswith("modelsize"):
    import modelsize
    def run():
        rep = modelsize.inspect(path)
        return len(rep.inventory.tensors)
elif which == "safe_open":
    from safetensors import safe_open
    def run():
        n = 0
        with safe_open(path, framework="pt") as f:
            for k in f.keys():
                sl = f.get_slice(k)
                sl.get_shape(), sl.get_dtype()
                n += 1
        return n
else:
    import torch
    def run():
        obj = torch.load(path, weights_only=True, mmap=True)
        return sum(1 for _ in obj.values())
n = run()
times = []
for _ in range(5):
    t = time.perf_counter()
    assert run() == n
    times.append(time.perf_counter() - t)
print(json.dumps({"s": min(times), "tensors": n,
                  "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""

#: ``modelsize inspect --json`` as a whole process, its peak RSS.
_CLI_JSON = r"""
import json, resource, sys, time, os
from modelsize.cli import main
t = time.perf_counter()
with open(os.devnull, "w") as null:
    fd = os.dup(1); os.dup2(null.fileno(), 1)
    try:
        rc = main(["inspect", sys.argv[1], "--json"])
    finally:
        sys.stdout.flush(); os.dup2(fd, 1)
assert rc == 0
print(json.dumps({"s": time.perf_counter() - t,
                  "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


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
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              str(path.with_name("weights.safetensors")))
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


def build_small(folder: Path, n: int = 100_000) -> None:
    """``n`` tensors of 4 float32 each, as safetensors and as a torch.save'd dict."""
    import torch
    from safetensors.torch import save_file

    tensors = {f"layer.{i}.weight": torch.full((4,), float(i)) for i in range(n)}
    save_file(tensors, str(folder / "small.safetensors"))
    torch.save(tensors, folder / "small.pt")


def listing(which: str, path: Path) -> dict[str, float]:
    proc = subprocess.run([sys.executable, "-c", _LISTING, which, str(path)],
                          capture_output=True, text=True, check=True, env=_env(which))
    return json.loads(proc.stdout)


def cli_json(path: Path) -> dict[str, float]:
    proc = subprocess.run([sys.executable, "-c", _CLI_JSON, str(path)],
                          capture_output=True, text=True, check=True, env=_env())
    return json.loads(proc.stdout)


def _env(which: str = "") -> dict[str, str]:
    # Measured as installed packages run: with byte-compiled modules (some machines set
    # PYTHONDONTWRITEBYTECODE, which would recompile modelsize on every run).
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.pop("MODELSIZE_PURE_PYTHON", None)
    if which == PURE:
        env["MODELSIZE_PURE_PYTHON"] = "1"
    return env


def measure(which: str, path: Path) -> dict[str, float]:
    """One fresh process: op time, process wall time, peak RSS."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _MEASURE, which, str(path)],
                          capture_output=True, text=True, check=True, env=_env(which))
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
    ap.add_argument("--small-only", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.build_only:
        print(json.dumps(build_checkpoint(Path(args.build_only))))
        return
    if args.small_only:
        build_small(Path(args.small_only))
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
    weights_st = path.with_name("weights.safetensors")
    small_tmp = tempfile.TemporaryDirectory(dir=args.dir)
    small_dir = Path(small_tmp.name)
    subprocess.run([sys.executable, __file__, "--small-only", str(small_dir)], check=True)
    lists: dict[tuple[str, str], dict[str, float]] = {}
    for label, file, ways in (
            ("weights.safetensors (1.42 GB)", weights_st, ("modelsize", "safe_open")),
            ("100,000 tensors, safetensors", small_dir / "small.safetensors",
             ("modelsize", PURE, "safe_open")),
            ("100,000 tensors, torch.save", small_dir / "small.pt",
             ("modelsize", PURE, "torch.load(mmap=True)"))):
        if not file.exists():
            continue
        for way in ways:
            lists[(label, way)] = listing(way, file)
            print(label, way, lists[(label, way)], flush=True)
        cli = [cli_json(file) for _ in range(args.repeat)]
        lists[(label, "cli")] = {"s": statistics.median(c["s"] for c in cli),
                                 "rss_mb": max(c["rss_mb"] for c in cli)}
        print(label, "cli --json", lists[(label, "cli")], flush=True)
    small_tmp.cleanup()
    load_after = os.getloadavg()
    ms = rows["modelsize"]
    cats = ms["detail"]["categories"]
    assert cats["weights"] == known["weights"], (cats["weights"], known["weights"])
    assert sum(cats.values()) == size
    pure = rows[PURE]
    assert pure["detail"] == ms["detail"], (pure["detail"], ms["detail"])
    full = rows["torch.load(weights_only=True)"]
    mm = rows["torch.load(mmap=True)"]
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
        f"Against `torch.load(mmap=True)`: {mm['op_s'] / ms['op_s']:.1f}x on the operation, "
        f"{mm['process_s'] / ms['process_s']:.1f}x on whole processes.",
        "",
        f"`{PURE}` is modelsize with `MODELSIZE_PURE_PYTHON=1`: no compiled code where it is "
        "built (the pickle parsed by the Python loop alone, not `modelsize._pickleops`; the "
        "zip directory, local headers and safetensors headers read by Python, not "
        "`modelsize._headers`). The compiled loops make the operation "
        f"{pure['op_s'] / ms['op_s']:.2f}x faster here "
        f"({pure['process_s'] / ms['process_s']:.2f}x the whole process); the same bytes.",
        "",
        "Listings in-process (names, dtypes, shapes; best of 5 after a warm-up, fresh process "
        "per way: `modelsize.inspect(path)`, `safe_open(framework=\"pt\")` with each key's "
        "`get_slice` shape and dtype, `torch.load(mmap=True, weights_only=True)`), and "
        f"`modelsize inspect --json` as a whole process (median of {args.repeat}, its peak RSS):",
        "",
        "| file | way | in-process (s) | peak RSS (MB) |",
        "|---|---|---:|---:|",
    ]
    for (label, way), r in lists.items():
        shown = "`modelsize inspect --json` (whole process)" if way == "cli" else f"`{way}`"
        lines.append(f"| {label} | {shown} | {r['s']:.3f} | {r['rss_mb']:.0f} |")
    full_x = full["process_s"] / ms["process_s"]
    mmap_x = mm["process_s"] / ms["process_s"]
    goals = [("inspect >= 50x `torch.load(weights_only=True)`, whole process", full_x >= 50,
              f"{full_x:.0f}x"),
             ("inspect >= 5x `torch.load(mmap=True)`, whole process", mmap_x >= 5,
              f"{mmap_x:.1f}x")]
    st = lists.get(("weights.safetensors (1.42 GB)", "modelsize"))
    so = lists.get(("weights.safetensors (1.42 GB)", "safe_open"))
    if st and so:
        goals.append(("in-process safetensors listing within 2x `safe_open`",
                      st["s"] <= 2 * so["s"], f"{st['s'] / so['s']:.1f}x"))
    for label, limit in (("100,000 tensors, safetensors", 1.0),
                         ("100,000 tensors, torch.save", 3.0)):
        r = lists.get((label, "modelsize"))
        if r:
            goals.append((f"{label} in-process under {limit:.0f} s", r["s"] < limit,
                          f"{r['s']:.2f} s"))
        c = lists.get((label, "cli"))
        if c:
            goals.append((f"{label}, `inspect --json` whole process under 150 MB",
                          c["rss_mb"] < 150, f"{c['rss_mb']:.0f} MB"))
    for label in ("100,000 tensors, safetensors", "100,000 tensors, torch.save"):
        fast, slow = lists.get((label, "modelsize")), lists.get((label, PURE))
        if fast and slow:
            lines += ["", f"{label}: the compiled loops make the listing "
                      f"{slow['s'] / fast['s']:.2f}x faster ({slow['s']:.2f} s -> "
                      f"{fast['s']:.2f} s)."]
    lines += ["", "Goals (issue 22):"]
    lines += [f"- {g}: {'met' if ok else 'missed'} ({fig})." for g, ok, fig in goals]
    lines += [
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
