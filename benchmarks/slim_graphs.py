"""Graph slimming side by side: modelsize's graph passes vs onnxslim, onnxsim, quantize_dynamic.

    .venv/bin/python benchmarks/slim_graphs.py [--repeats N] [--image 224] [--only resnet]

ResNet-50 (random weights, BatchNorm statistics drawn at random so folding matters; built in
code below, the torchvision architecture, so no weights are downloaded) is exported twice: by
the TorchScript exporter with its own folding off (BatchNormalization nodes in the file, as a
training-friendly export leaves them) and by the default dynamo exporter; a BERT-base-shaped
encoder (transformers ``BertModel``, 12 layers, hidden 768, 12 heads, intermediate 3072, vocab
30522, random init) is exported by the dynamo exporter at sequence length 128. Each tool slims
each export in a fresh process; reported: size before/after (all files), node count (subgraphs
included), wall time (median of ``--repeats``), peak RSS of that process, and the largest
absolute and relative difference of the output from the original's on the same seeded input
(onnxruntime). modelsize's time includes its own verification (both models run once). A peer
that is not installed is skipped (``pip install onnxslim onnxsim``). ``ort_dynamic`` is
onnxruntime's ``quantize_dynamic`` with its defaults, the peer of ``modelsize:int8``;
``modelsize`` is held against onnxslim and onnxsim (``target met``: at least as small as the
smallest peer, output at least as close as the closest, never larger than the input). Results
go to benchmarks/RESULTS.md (section ``slim_graphs_onnx``); other frameworks add their own
``*_cases`` and section.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write_section

PY = sys.executable
REPO = Path(__file__).resolve().parents[1]

# One process per run: the tool's work, then its peak RSS on the last line.
_RUNNER = r"""
import json, sys, time
tool, src, dst = sys.argv[1:4]
t0 = time.perf_counter()
if tool.startswith("modelsize"):
    from modelsize.cli import main
    extra = tool.split(":")[1:]
    args = ["slim", src, "-o", dst, "--force"] + (["--quantize", extra[0]] if extra else [])
    import contextlib, io
    with contextlib.redirect_stdout(io.StringIO()):
        rc = main(args)
    assert rc in (0, None), rc
elif tool == "onnxslim":
    import onnxslim
    onnxslim.slim(src, dst)
elif tool == "ort_dynamic":
    from onnxruntime.quantization import quantize_dynamic
    quantize_dynamic(src, dst)
elif tool == "onnxsim":
    import onnx, onnxsim
    model, ok = onnxsim.simplify(onnx.load(src))
    assert ok
    onnx.save(model, dst)
dt = time.perf_counter() - t0
# VmHWM: this process's peak (ru_maxrss would carry the parent's peak across fork + exec).
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM"))
print(json.dumps({"seconds": dt, "rss": hwm}))
"""


def _bottleneck(torch: Any) -> Any:
    nn = torch.nn

    class Bottleneck(nn.Module):
        def __init__(self, cin: int, width: int, stride: int) -> None:
            super().__init__()
            cout = width * 4
            self.conv1, self.bn1 = nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width)
            self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(width)
            self.conv3, self.bn3 = nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout)
            self.down = None
            if stride != 1 or cin != cout:
                self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                          nn.BatchNorm2d(cout))

        def forward(self, x: Any) -> Any:
            y = torch.relu(self.bn1(self.conv1(x)))
            y = torch.relu(self.bn2(self.conv2(y)))
            y = self.bn3(self.conv3(y))
            return torch.relu(y + (x if self.down is None else self.down(x)))

    return Bottleneck


def resnet50() -> Any:
    """torchvision's ResNet-50 architecture (layers 3-4-6-3, 25.6 M parameters)."""
    import torch

    nn = torch.nn
    block = _bottleneck(torch)
    torch.manual_seed(0)  # before the layers: their initial weights are drawn as they are built
    layers: list[Any] = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                         nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for width, n, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for i in range(n):
            layers.append(block(cin, width, stride if i == 0 else 1))
            cin = width * 4
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2048, 1000)]
    model = nn.Sequential(*layers)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.5, 1.5)
                m.weight.uniform_(0.5, 1.0)
                m.bias.uniform_(-0.1, 0.1)
    return model.eval()


def onnx_cases(tmp: Path, image: int, only: str = "") -> dict[str, Path]:
    """The ONNX inputs: ResNet-50 from both exporters, BERT-base (those whose name contains
    ``only``, case-insensitive, when given)."""
    import warnings

    import torch

    def wanted(case: str) -> bool:
        return only.lower() in case.lower()

    model = resnet50()
    x = torch.randn(1, 3, image, image)
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        case = "ResNet-50, TorchScript exporter, no folding"
        if wanted(case):
            p = tmp / "resnet50_torchscript.onnx"
            torch.onnx.export(model, (x,), str(p), dynamo=False, do_constant_folding=False,
                              input_names=["x"])
            out[case] = p
        case = "ResNet-50, dynamo exporter (default)"
        if wanted(case):
            try:
                import onnxscript  # noqa: F401 (the dynamo exporter needs it)

                p = tmp / "resnet50_dynamo.onnx"
                torch.onnx.export(model, (x,), str(p), dynamo=True, input_names=["x"])
                out[case] = p
            except ImportError:
                pass
        case = "BERT-base encoder, seq 128, dynamo exporter"
        if wanted(case):
            p = tmp / "bert_base.onnx"
            bert, feeds = bert_base()
            torch.onnx.export(bert, feeds, str(p), input_names=["input_ids", "attention_mask"])
            out[case] = p
    return out


def bert_base() -> tuple[Any, tuple[Any, ...]]:
    """A BERT-base-shaped encoder (transformers BertModel, random init) and its inputs."""
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=30522, hidden_size=768, num_hidden_layers=12,
                     num_attention_heads=12, intermediate_size=3072)
    ids = torch.randint(0, 2, (1, 128))
    return BertModel(cfg).eval(), (ids, torch.ones(1, 128, dtype=torch.int64))


def _files_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.parent.iterdir()
               if p.name == path.name or p.name.startswith(path.name + "."))


def _nodes(path: Path) -> int:
    """Nodes in the graph and every subgraph."""
    import onnx

    from modelsize.slimming.graph.onnx_passes import all_graphs

    model = onnx.load(str(path), load_external_data=False)
    return sum(len(g.node) for g in all_graphs(model.graph))


def _max_diff(a: Path, b: Path) -> tuple[float, float]:
    import numpy as np

    from modelsize.slimming.graph.verify_onnx import compare

    cmp = compare(a, b, "exact", tolerance=float("inf"))
    worst = max(cmp.outputs, key=lambda o: o.max_rel)
    return worst.max_abs, worst.max_rel if np.isfinite(worst.max_rel) else float("inf")


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


TOOLS: dict[str, Callable[[], bool]] = {
    "modelsize": lambda: True,
    "modelsize:int8": lambda: True,
    "modelsize:float16": lambda: True,
    "onnxslim": lambda: _installed("onnxslim"),
    "onnxsim": lambda: _installed("onnxsim"),
    "ort_dynamic": lambda: _installed("onnxruntime.quantization"),
}

# Which peers each modelsize row is held against: at least as small as the smallest of them,
# output at least as close as the closest, never larger than the input.
PEERS: dict[str, tuple[str, ...]] = {
    "modelsize": ("onnxslim", "onnxsim"),
    "modelsize:int8": ("ort_dynamic",),
    "modelsize:float16": (),
}


def verdict(tool: str, r: dict[str, Any], results: dict[str, dict[str, Any]],
            before: int) -> str:
    """Whether ``tool``'s row meets the target against the peers that ran."""
    if tool not in PEERS:
        return ""
    why = []
    if r["bytes"] > before:
        why.append("larger than input")
    peers = [results[p] for p in PEERS[tool] if "bytes" in results.get(p, {})]
    if peers:
        best = min(p["bytes"] for p in peers)
        if r["bytes"] > best:
            why.append(f"{r['bytes'] - best:,} B larger than best peer")
        if r["max_rel"] > min(p["max_rel"] for p in peers):
            why.append("output less close than a peer")
    return "yes" if not why else "no: " + "; ".join(why)


def run_tool(tool: str, src: Path, dst: Path, repeats: int) -> dict[str, Any]:
    """Slim ``src`` with ``tool`` ``repeats`` times in fresh processes."""
    times, rss = [], []
    for _ in range(repeats):
        for p in dst.parent.glob(dst.name + "*"):
            p.unlink()
        proc = subprocess.run([PY, "-c", _RUNNER, tool, str(src), str(dst)],
                              capture_output=True, text=True, cwd=REPO,
                              env={**os.environ, "PYTHONPATH": str(REPO / "src")})
        if proc.returncode != 0:
            return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1][:120]}
        doc = json.loads(proc.stdout.strip().splitlines()[-1])
        times.append(doc["seconds"])
        rss.append(doc["rss"] * 1024)
    abs_, rel = _max_diff(src, dst)
    return {"seconds": statistics.median(times), "rss": max(rss), "bytes": _files_bytes(dst),
            "max_abs": abs_, "max_rel": rel}


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def main() -> None:
    """Run every case with every installed tool; write the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--image", type=int, default=224)
    ap.add_argument("--only", default="", metavar="TEXT",
                    help="only the models whose name contains TEXT (e.g. resnet, dynamo); "
                    "the table is printed, RESULTS.md is left alone")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="slim-graphs-") as t:
        tmp = Path(t)
        for case, src in onnx_cases(tmp, args.image, args.only).items():
            before, nodes_before = _files_bytes(src), _nodes(src)
            results: dict[str, dict[str, Any]] = {}
            for tool, available in TOOLS.items():
                if not available():
                    results[tool] = {"error": "not installed"}
                    continue
                out = tmp / "out" / f"{src.stem}.{tool.replace(':', '_')}.onnx"
                out.parent.mkdir(exist_ok=True)
                r = run_tool(tool, src, out, args.repeats)
                if "bytes" in r:
                    r["nodes"] = _nodes(out)
                results[tool] = r
                print(case, tool, r, file=sys.stderr)
            for tool, r in results.items():
                head = f"| {case} | {tool} | {_mb(before)}, {nodes_before} nodes |"
                if "error" in r:
                    rows.append(f"{head} {r['error']} | | | | | |")
                    continue
                rows.append(
                    f"{head} {r['bytes']:,} B ({100 * (r['bytes'] - before) / before:+.2f}%) "
                    f"| {r['nodes']} | {r['seconds']:.2f} s | {r['rss'] / 2**20:.0f} MiB "
                    f"| {r['max_abs']:.2g} / {r['max_rel']:.2g} "
                    f"| {verdict(tool, r, results, before)} |")
    load = os.getloadavg()[0]
    md = "\n".join([
        "## Graph slimming: modelsize vs onnxslim, onnxsim, quantize_dynamic "
        "(`benchmarks/slim_graphs.py`)",
        "",
        f"`{Path(PY).name} benchmarks/slim_graphs.py --repeats {args.repeats} --image "
        f"{args.image}`; time is the median of {args.repeats} runs in fresh processes, RSS the "
        f"peak of that process; load average {load:.2f} on a shared 2-core machine. "
        "Difference: largest |slimmed - original| over the output, and that divided by the "
        "output's largest magnitude, onnxruntime, one seeded input. modelsize's time includes "
        "its verification run; `:int8` and `:float16` are `--quantize int8|float16` "
        "(`--cast float16` runs the same pass on ONNX); `ort_dynamic` is onnxruntime's "
        "`quantize_dynamic` with its defaults. Target met: at least as small as the smallest "
        "peer (onnxslim, onnxsim for `modelsize`; ort_dynamic for `:int8`; none for "
        "`:float16`), output at least as close as the closest, never larger than the input.",
        "",
        "| model | tool | before | after | nodes after | time | peak RSS | max abs / rel diff "
        "| target met |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
        *rows,
    ])
    if not args.only:
        write_section("slim_graphs_onnx", md)
    print(md)


if __name__ == "__main__":
    main()
