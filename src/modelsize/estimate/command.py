"""``modelsize estimate``: arguments, model resolution, and the call into the library.

MODEL is a built-in name (``modelsize estimate --list``), a local Hugging Face
``config.json`` (or its folder), or ``package.module:factory``: a callable returning an
``nn.Module`` or ``(module, inputs)``. The factory form imports the user's own code, which is
the point of it; saved model files are never imported or executed.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from modelsize.errors import EstimateError, UsageError, printable
from modelsize.estimate.optimizers import Implementation, OptimizerName
from modelsize.estimate.result import Estimate, FitResult, Suggestion

_DTYPES = ("float32", "bfloat16", "float16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Define the ``estimate`` sub-command's arguments on ``parser``."""
    parser.add_argument("model", nargs="?", metavar="MODEL",
                        help="built-in name (see --list), a config.json, or module:factory")
    parser.add_argument("--list", action="store_true", help="list the built-in models and exit")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--train", dest="mode", action="store_const", const="train",
                      help="a training step: forward, loss, backward, optimizer (default)")
    mode.add_argument("--infer", dest="mode", action="store_const", const="infer",
                      help="one forward pass in eval mode under no_grad")
    parser.set_defaults(mode="train")
    parser.add_argument("--batch", type=_positive, default=None, help="batch size")
    parser.add_argument("--seq", type=_positive, default=None, help="sequence length (tokens)")
    parser.add_argument("--input", action="append", default=None, metavar="SHAPE",
                        help="input shape for a factory model, e.g. 8x3x224x224 or "
                        "int64:8x128; repeat for several positional inputs")
    parser.add_argument("--optimizer", default="adamw",
                        help=f"one of {', '.join(o.value for o in OptimizerName)} "
                        "(default adamw)")
    parser.add_argument("--impl", default="default",
                        choices=[i.value for i in Implementation],
                        help="optimizer implementation (default: PyTorch's for the device)")
    parser.add_argument("--foreach", dest="impl", action="store_const", const="foreach",
                        help="same as --impl foreach")
    parser.add_argument("--fused", dest="impl", action="store_const", const="fused",
                        help="same as --impl fused")
    parser.add_argument("--amp", choices=["bf16", "fp16"], default=None,
                        help="autocast the forward and the loss to this dtype")
    parser.add_argument("--dtype", choices=_DTYPES, default="float32",
                        help="dtype of a built-in model's weights (default float32)")
    parser.add_argument("--accumulate", type=_positive, default=1, metavar="N",
                        help="micro-batches per optimizer step (gradient accumulation)")
    parser.add_argument("--checkpoint", action="append", default=None, metavar="MODULES",
                        help="activation checkpointing on these modules: a class name or a "
                        "glob over module names (comma-separated, repeatable)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda",
                        help="the device to estimate for (default cuda; cpu is validated "
                        "to the byte against the CPU profiler)")
    parser.add_argument("--fit", default=None, metavar="BUDGET",
                        help="find the largest batch that fits, e.g. 80GiB")
    parser.add_argument("--fit-dim", choices=["batch", "seq"], default="batch",
                        help="what --fit searches (default batch)")
    sug = parser.add_mutually_exclusive_group()
    sug.add_argument("--suggest", dest="suggest", action="store_true", default=None,
                     help="re-trace what would shrink the peak (default: on for text output)")
    sug.add_argument("--no-suggest", dest="suggest", action="store_false")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, not {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, not {n}")
    return n


@dataclass
class Target:
    """A model to trace and how to make its inputs for a given batch and sequence length."""

    name: str
    description: str
    model: Any
    make_inputs: Callable[[int, int, bool], Any]
    batch: int
    seq: int
    repeated_block: str = ""
    float32: bool = True


def resolve(spec: str, args: argparse.Namespace) -> Target:
    """Turn MODEL (and --input/--dtype) into a :class:`Target`."""
    import torch

    from modelsize.estimate import zoo

    dtype = getattr(torch, args.dtype)
    path = Path(spec)
    entry: zoo.ZooModel | None = zoo.MODELS.get(spec.lower())
    is_config = path.suffix == ".json" or (path.is_dir() and (path / "config.json").exists())
    if entry is None and is_config:
        entry = zoo.from_config_json(path)
    if entry is not None:
        model = zoo.build(entry, dtype)
        accepted = _accepted_kwargs(model)
        chosen = entry

        def make(batch: int, seq: int, train: bool) -> Any:
            inputs = zoo.make_inputs(chosen, batch, seq, train, dtype)
            if isinstance(inputs, dict) and accepted is not None:
                inputs = {k: v for k, v in inputs.items() if k in accepted}
            return inputs

        return Target(entry.name, entry.description, model, make, entry.batch, entry.seq,
                      entry.repeated_block or _repeated_block(model), dtype == torch.float32)
    if ":" in spec and not path.exists():
        return _factory_target(spec, args)
    if path.suffix == ".json" or path.exists():
        raise UsageError(f"{printable(spec)}: expected a Hugging Face config.json or its folder")
    known = ", ".join(zoo.names())
    raise UsageError(f"unknown model {printable(spec)!r}: expected a built-in name ({known}), "
                     "a config.json, or package.module:factory")


def _accepted_kwargs(model: Any) -> set[str] | None:
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    return set(params)


def _factory_target(spec: str, args: argparse.Namespace) -> Target:
    import torch
    from torch import nn

    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UsageError(f"cannot import {printable(module_name)!r}: {exc}") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise UsageError(f"{printable(module_name)} has no callable {printable(attr)!r}")
    made = factory()
    given_inputs = None
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module):
        made, given_inputs = made
    if not isinstance(made, nn.Module):
        raise UsageError(f"{printable(spec)} returned {type(made).__name__}, not an nn.Module")
    shapes = [parse_input(s) for s in args.input] if args.input else None
    if shapes is None and given_inputs is None:
        raise UsageError(f"{printable(spec)}: give the input shape with --input, e.g. "
                         "--input 8x3x224x224, or return (model, inputs) from the factory")

    def make(batch: int, seq: int, train: bool) -> Any:
        if shapes is not None:
            return tuple(_meta(dt, _resized(shape, batch, seq)) for dt, shape in shapes)
        return _resize_inputs(given_inputs, batch, seq)

    first = shapes[0][1] if shapes else _first_shape(given_inputs)
    batch = first[0] if first else 1
    seq = first[1] if len(first) > 1 else 0
    is_fp32 = all(p.dtype == torch.float32 for p in made.parameters())
    return Target(spec, f"{type(made).__name__} from {spec}", made, make, batch, seq,
                  _repeated_block(made), is_fp32)


def parse_input(text: str) -> tuple[str, tuple[int, ...]]:
    """``int64:8x128`` -> ("int64", (8, 128)); the dtype defaults to float32."""
    dtype, _, shape = text.rpartition(":")
    dtype = dtype or "float32"
    try:
        dims = tuple(int(d) for d in shape.lower().split("x"))
    except ValueError:
        raise UsageError(f"--input {printable(text)}: expected a shape like 8x3x224x224") from None
    if not dims or any(d < 0 for d in dims):
        raise UsageError(f"--input {printable(text)}: expected a shape like 8x3x224x224")
    import torch

    if not isinstance(getattr(torch, dtype, None), torch.dtype):
        raise UsageError(f"--input {printable(text)}: unknown dtype {printable(dtype)!r}")
    return dtype, dims


def _meta(dtype: str, shape: tuple[int, ...]) -> Any:
    import torch

    return torch.empty(shape, dtype=getattr(torch, dtype), device="meta")


def _resized(shape: tuple[int, ...], batch: int, seq: int) -> tuple[int, ...]:
    out = list(shape)
    if out:
        out[0] = batch
    if len(out) > 1 and seq:
        out[1] = seq
    return tuple(out)


def _first_shape(inputs: Any) -> tuple[int, ...]:
    import torch

    values = inputs.values() if isinstance(inputs, dict) else inputs
    if isinstance(values, torch.Tensor):
        return tuple(values.shape)
    for v in values:
        if isinstance(v, torch.Tensor):
            return tuple(v.shape)
    return ()


def _resize_inputs(inputs: Any, batch: int, seq: int) -> Any:
    import torch

    first = _first_shape(inputs)

    def conv(v: Any) -> Any:
        if not isinstance(v, torch.Tensor) or not v.dim():
            return v
        shape = list(v.shape)
        if shape[0] == first[0]:
            shape[0] = batch
        if len(shape) > 1 and len(first) > 1 and shape[1] == first[1] and seq:
            shape[1] = seq
        return torch.empty(shape, dtype=v.dtype, device="meta")

    if isinstance(inputs, dict):
        return {k: conv(v) for k, v in inputs.items()}
    if isinstance(inputs, torch.Tensor):
        return (conv(inputs),)
    return tuple(conv(v) for v in inputs)


def _repeated_block(model: Any) -> str:
    """The class that repeats most among modules holding parameters (a transformer layer)."""
    from torch import nn

    counts: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, (nn.ModuleList, nn.Sequential)):
            for child in m.children():
                if any(True for _ in child.parameters()):
                    name = type(child).__name__
                    counts[name] = counts.get(name, 0) + 1
    best = max(counts.items(), key=lambda kv: kv[1], default=("", 0))
    return best[0] if best[1] >= 2 else ""


# -- running ---------------------------------------------------------------------------------


class Progress:
    """A one-line progress display on a terminal's stderr, for traces longer than a second."""

    def __init__(self, label: str, enabled: bool) -> None:
        self.label = label
        self.enabled = enabled
        self.start = time.monotonic()
        self.shown = False

    def __call__(self, phase: str, ops: int) -> None:
        """Update the line (called by the tracker every 1024 ops)."""
        elapsed = time.monotonic() - self.start
        if not self.enabled or elapsed < 1.0:
            return
        sys.stderr.write(f"\r  tracing {self.label}: {phase}, {ops:,} ops, {elapsed:.1f} s ")
        sys.stderr.flush()
        self.shown = True

    def done(self) -> None:
        """Clear the line."""
        if self.shown:
            sys.stderr.write("\r" + " " * 78 + "\r")
            sys.stderr.flush()
        self.shown = False


@dataclass(frozen=True)
class Options:
    """The estimate options the CLI passes to :func:`modelsize.estimate.estimate`."""

    mode: str
    optimizer: str
    implementation: str
    amp: str | None
    device: str
    accumulate: int
    checkpoint: tuple[str, ...]


def trace_target(target: Target, batch: int, seq: int, options: Options,
                 progress: Callable[[str, int], None] | None = None) -> Estimate:
    """Estimate ``target`` at ``batch`` x ``seq``."""
    from modelsize.estimate import estimate

    train = options.mode == "train"
    inputs = target.make_inputs(batch, seq, train)
    return estimate(
        target.model, inputs, mode=options.mode, optimizer=options.optimizer,
        implementation=options.implementation, amp=options.amp, device=options.device,
        accumulate=options.accumulate, checkpoint=options.checkpoint, name=target.name,
        progress=progress,
    )


def run(args: argparse.Namespace) -> int:
    """Execute ``modelsize estimate`` (prints the report or JSON; returns the exit code)."""
    from modelsize.estimate import require_torch

    if getattr(args, "list", False):
        return _print_list()
    if not args.model:
        raise UsageError("estimate needs a MODEL (a built-in name, a config.json, or "
                         "module:factory); see modelsize estimate --list")
    require_torch()
    from modelsize.estimate.optimizers import parse_name

    parse_name(args.optimizer)
    target = resolve(args.model, args)
    batch = args.batch or target.batch
    seq = args.seq or target.seq
    checkpoint = tuple(p.strip() for group in (args.checkpoint or ()) for p in group.split(",")
                       if p.strip())
    options = Options(args.mode, args.optimizer, args.impl, args.amp, args.device,
                      args.accumulate, checkpoint)
    progress = Progress(target.name, sys.stderr.isatty())
    try:
        est = trace_target(target, batch, seq, options, progress)
        fit_result = _run_fit(args, target, batch, seq, options, progress) if args.fit else None
        want = args.suggest if args.suggest is not None else not args.json
        suggestions = _suggestions(target, est, batch, seq, options, progress) if want else []
    finally:
        progress.done()
    if args.json:
        data = est.to_dict()
        data["description"] = target.description
        data["batch"], data["seq"] = batch, seq
        data["suggestions"] = [s.to_dict() for s in suggestions]
        data["fit"] = fit_result.to_dict() if fit_result else None
        print(json.dumps(data))
    else:
        from modelsize.report.estimate_text import render_estimate

        sys.stdout.write(render_estimate(est, description=target.description, batch=batch,
                                         seq=seq, suggestions=suggestions, fit=fit_result))
    return 0


def _run_fit(args: argparse.Namespace, target: Target, batch: int, seq: int, options: Options,
             progress: Progress) -> FitResult:
    from modelsize.estimate.fit import fit
    from modelsize.report.units import parse_size

    try:
        budget = parse_size(args.fit)
    except ValueError as exc:
        raise UsageError(f"--fit: {exc}") from None
    if args.fit_dim == "seq" and not seq:
        raise UsageError("--fit-dim seq: this model has no sequence dimension")

    def measure(n: int) -> int:
        b, s = (n, seq) if args.fit_dim == "batch" else (batch, n)
        est = trace_target(target, b, s, options, progress)
        return est.device_estimate.total_bytes

    name = "device total" if options.device == "cuda" else "peak"
    return fit(measure, budget, dimension=args.fit_dim, measure_name=name,
               limit=1 << 16 if args.fit_dim == "batch" else 1 << 22)


def _suggestions(target: Target, base: Estimate, batch: int, seq: int, options: Options,
                 progress: Progress) -> list[Suggestion]:
    from modelsize.estimate.advice import suggest

    def retrace(**overrides: Any) -> Estimate:
        b = overrides.pop("batch", batch)
        return trace_target(target, b, seq, replace(options, **overrides), progress)

    try:
        return suggest(retrace, base, batch=batch, repeated_block=target.repeated_block,
                       float32_model=target.float32)
    except EstimateError:
        return []


def _print_list() -> int:
    from modelsize.estimate import zoo

    for m in zoo.MODELS.values():
        shape = f"batch {m.batch}" + (f" x seq {m.seq}" if m.seq else f", {m.image}px images")
        print(f"  {m.name:12s} {m.description} (default {shape})")
    return 0


# -- demo ------------------------------------------------------------------------------------


def demo_section() -> str:
    """The estimate part of ``modelsize demo``: a CNN, GPT-2 and Llama-3-8B (about 20 s)."""
    from modelsize.estimate import require_torch

    require_torch("the estimate demo")
    from modelsize.report.estimate_text import render_estimate, render_fit

    parts = []
    ns = argparse.Namespace(dtype="float32", input=None)
    cnn = resolve("seed-cnn", ns)
    adam = Options("train", "adam", "default", None, "cpu", 1, ())
    est = trace_target(cnn, 64, 0, adam)
    sugg = _suggestions(cnn, est, 64, 0, adam, Progress("", False))
    parts.append("$ modelsize estimate seed-cnn --batch 64 --optimizer adam --device cpu\n")
    parts.append(render_estimate(est, description=cnn.description, batch=64, seq=0,
                                 suggestions=sugg, modules=4))
    gpt2 = resolve("gpt2", ns)
    adamw = Options("train", "adamw", "default", None, "cuda", 1, ())
    est = trace_target(gpt2, 8, 1024, adamw)
    parts.append("\n$ modelsize estimate gpt2 --batch 8 --seq 1024 --no-suggest\n")
    parts.append(render_estimate(est, description=gpt2.description, batch=8, seq=1024,
                                 modules=4))
    llama = resolve("llama-3-8b", argparse.Namespace(dtype="bfloat16", input=None))
    infer = Options("infer", "adamw", "default", None, "cuda", 1, ())
    from modelsize.estimate.fit import fit

    budget = 80 * 2**30

    def measure(n: int) -> int:
        return trace_target(llama, n, 2048, infer).device_estimate.total_bytes

    result = fit(measure, budget, measure_name="device total", limit=1 << 16)
    parts.append("\n$ modelsize estimate llama-3-8b --infer --dtype bfloat16 --seq 2048 "
                 "--fit 80GiB\n")
    parts.append(render_fit(result, description=llama.description))
    return "".join(parts)
