"""``modelsize demo``: build the seed stories on the spot (nothing downloaded) and explain them.

Each story is a real file written by the real framework, showing one of the ways a saved model
grows far beyond its weights.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from modelsize.errors import MissingDependencyError


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise MissingDependencyError("torch", "modelsize demo", extra="demo") from exc
    return torch


def seed_cnn() -> Any:
    """The small MNIST-style CNN of the PyTorch examples (1.2 M parameters)."""
    torch = _torch()
    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(1, 32, 3), nn.ReLU(), nn.Conv2d(32, 64, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Dropout(0.25), nn.Flatten(), nn.Linear(9216, 128), nn.ReLU(), nn.Dropout(0.5),
        nn.Linear(128, 10),
    )


def _train_checkpoint(out: Path) -> Path:
    torch = _torch()
    torch.manual_seed(0)
    model = seed_cnn()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    images, labels = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
    loss = torch.nn.functional.cross_entropy(model(images), labels)
    loss.backward()
    opt.step()
    path = out / "train.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 1}, path)
    return path


def _slice(out: Path) -> Path:
    torch = _torch()
    table = torch.randn(50_000, 64)  # an embedding table
    path = out / "first_rows.pt"
    torch.save(table[:10], path)  # saves the whole 12.8 MB storage for 2.5 kB of rows
    return path


def _float64(out: Path) -> Path:
    torch = _torch()
    torch.manual_seed(0)
    model = seed_cnn().double()
    path = out / "model_f64.pt"
    torch.save(model.state_dict(), path)
    return path


def _whole_module(out: Path) -> Path:
    torch = _torch()
    torch.manual_seed(0)
    model = seed_cnn()
    def keep(module: Any, inputs: Any, output: Any) -> None:
        module.last_output = output.detach()  # what debugging code often leaves behind

    for layer in model:
        layer.register_forward_hook(keep)
    model(torch.randn(16, 1, 28, 28))
    for layer in model:
        layer._forward_hooks.clear()  # hooks are closures: torch.save cannot pickle them
    path = out / "whole_model.pt"
    torch.save(model, path)
    return path


def _tied_clone(out: Path) -> Path:
    torch = _torch()
    try:
        from safetensors.torch import save_file
    except ImportError as exc:
        raise MissingDependencyError("safetensors", "this demo story", extra="demo") from exc
    torch.manual_seed(0)
    emb = torch.randn(5_000, 128)
    tensors = {
        "wte.weight": emb,
        # Tied weights, cloned because safetensors refuses tensors that share memory.
        "lm_head.weight": emb.clone(),
        "ln_f.weight": torch.ones(128),
        "ln_f.bias": torch.zeros(128),
    }
    path = out / "tied.safetensors"
    save_file(tensors, str(path))
    return path


def _tensorflow(out: Path) -> Path:
    """A real TF1 Saver checkpoint shipped with the package (TensorFlow is never a dependency)."""
    import shutil
    from importlib.resources import as_file, files

    with as_file(files("modelsize") / "demo_data" / "tf1_mlp_adam") as src:
        dest = out / "tf1_mlp_adam"
        shutil.copytree(src, dest, dirs_exist_ok=True)
    return dest / "model.ckpt"


STORIES: tuple[tuple[str, Callable[[Path], Path]], ...] = (
    ("A training checkpoint: a small CNN after one Adam step, saved with its optimizer",
     _train_checkpoint),
    ("A slice of a big tensor saved with torch.save", _slice),
    ("The same CNN's weights saved in float64", _float64),
    ("A model pickled whole, with activations cached in its modules", _whole_module),
    ("Tied embeddings cloned before saving to safetensors", _tied_clone),
    ("TensorFlow: a TF1 Saver checkpoint of an MLP after one Adam step (written by TF 2.21)",
     _tensorflow),
)


#: Names ``--only`` takes for single stories, from the story list: ``train_checkpoint``...
STORY_NAMES: tuple[str, ...] = tuple(make.__name__.lstrip("_") for _, make in STORIES)
#: The demo's sections; ``--only`` takes these and :data:`STORY_NAMES`.
SECTIONS: tuple[str, ...] = ("inspect", "estimate")


def inspect_section(out: Path, only: Sequence[str] | None = None,
                    written: list[Path] | None = None) -> str:
    """Write every story's file (or those named in ``only``) into ``out``, inspect each, run
    the fix it prints, and return the reports. What the fixes wrote is added to ``written``
    (paths relative to ``out``)."""
    from modelsize.findings import fix_command
    from modelsize.inspection import inspect
    from modelsize.report.text import render_inspect

    parts = []
    here = Path.cwd()
    try:
        os.chdir(out)  # reports name the files as a user in that folder would
        for i, (title, make) in enumerate(STORIES, 1):
            if only is not None and make.__name__.lstrip("_") not in only:
                continue
            path = make(Path("."))
            report = inspect(path)
            text = f"== {i}. {title}\n\n$ modelsize inspect {path} --top 5\n"
            text += render_inspect(report, top=5)
            command = fix_command(report.inventory, list(report.findings))
            if command:
                text += "\nThe fix, run exactly as printed:\n\n" + _run_fix(command, written)
            parts.append(text)
    finally:
        os.chdir(here)
    return "\n".join(parts)


def _tree(folder: Path) -> set[Path]:
    return {p.relative_to(folder) for p in folder.rglob("*")}


def _run_fix(command: str, written: list[Path] | None = None) -> str:
    """``$ command`` and what it prints, run in this process through the CLI (in the current
    folder); the paths it created are added to ``written``."""
    import contextlib
    import io
    import shlex

    from modelsize.cli import main

    argv = shlex.split(command)[1:]
    before = _tree(Path("."))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    if written is not None:
        written.extend(sorted(_tree(Path(".")) - before))
    text = f"$ {command}\n{out.getvalue()}{err.getvalue()}"
    if code == 0:
        from modelsize.inspection import inspect

        slimmed = inspect(argv[argv.index("-o") + 1])
        left = ", ".join(f.kind.value for f in slimmed.findings) or "none"
        text += (f"$ modelsize inspect {argv[argv.index('-o') + 1]}: "
                 f"{slimmed.file_bytes:,} bytes, findings left: {left}\n")
    return text


def _folder(directory: str | None) -> Path:
    """The folder the demo writes into: ``--dir`` (made if missing) or a new temporary
    folder, which is kept: the commands the demo prints name files in it."""
    from modelsize.errors import InputError, UsageError, printable

    if directory is None:
        return Path(tempfile.mkdtemp(prefix="modelsize-demo-"))
    out = Path(directory)
    shown = printable(directory)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--dir {shown}: exists and is not a folder; name a folder to write "
                         "the example files into")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"--dir {shown}: cannot create it: {exc.strerror or exc}") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise InputError(f"--dir {shown}: cannot write into it (permission denied)")
    return out


def _remove(out: Path, written: list[Path]) -> None:
    """Remove what the fixes wrote, deepest first, so that each fix runs again as printed."""
    import shutil

    for rel in sorted(written, key=lambda p: len(p.parts), reverse=True):
        path = out / rel
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def run_demo(directory: str | None = None, sections: Sequence[str] | None = None) -> int:
    """Print the demo. Its files go to ``directory`` or to a new temporary folder; either is
    kept, and the fixes' outputs are removed at the end, so that every command the demo
    printed runs as printed in that folder afterwards. ``sections``: ``inspect``,
    ``estimate`` and story names (:data:`STORY_NAMES`); unknown names are a UsageError."""
    from modelsize.errors import UsageError, printable

    names = list(sections or SECTIONS)
    unknown = [n for n in names if n not in SECTIONS + STORY_NAMES]
    if unknown:
        raise UsageError(f"--only: unknown section or story {printable(unknown[0])!r} "
                         f"(one of: {', '.join(SECTIONS + STORY_NAMES)})")
    stories = [n for n in names if n in STORY_NAMES]
    if "inspect" in names or stories:
        out = _folder(directory)
        sys.stdout.write(f"modelsize inspect: why is this file so big? (files in {out})\n\n")
        written: list[Path] = []
        try:
            sys.stdout.write(inspect_section(
                out, None if "inspect" in names else stories, written))
        finally:
            _remove(out, written)
        shown = shlex.quote(str(out))
        sys.stdout.write(
            f"\nThe example files are kept in {out}: `cd {shown}` to run the commands above "
            "(the fixes' outputs were removed, so each fix runs as printed)"
            + (f"; `rm -r {shown}` when done.\n" if directory is None else ".\n"))
        sys.stdout.flush()
    if "estimate" in names:
        sys.stdout.write("\nmodelsize estimate: how much memory will it need?\n\n")
        sys.stdout.write(estimate_section())
    return 0


def estimate_section() -> str:
    """The estimate part of ``modelsize demo``: a CNN, GPT-2 and Llama-3-8B (about 20 s)."""
    from modelsize.estimation import require_torch

    require_torch("the estimate demo")
    from modelsize.estimation.fit import fit
    from modelsize.estimation.targets import Options, resolve, suggestions_for, trace_target
    from modelsize.report.estimate_text import render_estimate, render_fit

    parts = []
    cnn = resolve("seed-cnn")
    adam = Options("train", "adam", "default", None, "cpu", 1, ())
    est = trace_target(cnn, 64, 0, adam)
    sugg = suggestions_for(cnn, est, 64, 0, adam)
    parts.append("$ modelsize estimate seed-cnn --batch 64 --optimizer adam --device cpu\n")
    parts.append(render_estimate(est, description=cnn.description, batch=64, seq=0,
                                 suggestions=sugg, modules=4))
    gpt2 = resolve("gpt2")
    adamw = Options("train", "adamw", "default", None, "cuda", 1, ())
    est = trace_target(gpt2, 8, 1024, adamw)
    parts.append("\n$ modelsize estimate gpt2 --batch 8 --seq 1024 --no-suggest\n")
    parts.append(render_estimate(est, description=gpt2.description, batch=8, seq=1024,
                                 modules=4))
    llama = resolve("llama-3-8b", "bfloat16")
    infer = Options("infer", "adamw", "default", None, "cuda", 1, ())
    budget = 80 * 2**30

    def measure(n: int) -> int:
        return trace_target(llama, n, 2048, infer).device_estimate.total_bytes

    result = fit(measure, budget, measure_name="device total", limit=1 << 16)
    parts.append("\n$ modelsize estimate llama-3-8b --infer --dtype bfloat16 --seq 2048 "
                 "--fit 80GiB\n")
    parts.append(render_fit(result, description=llama.description))
    return "".join(parts)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Define the ``demo`` sub-command's arguments."""
    p.add_argument("--dir", default=None,
                   help="write the example files here (default: a new temporary folder; "
                   "either is kept, and the demo says where)")
    p.add_argument("--only", action="append", default=None, metavar="NAME",
                   help="run only this section (" + ", ".join(SECTIONS) + ") or story ("
                   + ", ".join(STORY_NAMES) + "); repeatable")


def run(args: argparse.Namespace) -> int:
    """Execute ``modelsize demo``."""
    from modelsize.cli import quiet_library_logs

    quiet_library_logs()
    return run_demo(args.dir, sections=args.only)
