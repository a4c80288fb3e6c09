"""What ``modelsize estimate MODEL`` traces: a built-in model, a ``config.json`` or a factory.

MODEL is a built-in name (``modelsize estimate --list``), a local Hugging Face
``config.json`` (or its folder), or ``package.module:factory``: a callable returning an
``nn.Module`` or ``(module, inputs)``. The factory form imports the user's own code, which is
the point of it; saved model files are never imported or executed.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modelsize.errors import EstimateError, UsageError, printable
from modelsize.estimation.result import Estimate, FitResult, Source, Suggestion
from modelsize.formats.base import real_path

if TYPE_CHECKING:
    from modelsize.estimation.core import Settings
    from modelsize.estimation.model_source import HubFetch, WeightsPlan
    from modelsize.estimation.parallel import Parallel


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
    dtype: str = "float32"
    """The weights' dtype the model was built in."""
    dtype_source: Source = Source.CLI_DEFAULT
    """Where ``dtype`` came from: ``given`` (``--dtype``), ``config`` (the config.json's),
    ``model`` (a factory's own model), or the CLI's default (float32)."""
    model_class: str = ""
    inferred: bool = False
    """The class was chosen by modelsize (a config.json without ``architectures``)."""
    kind: str = ""
    """``tokens``, ``image``, ``audio`` for built-in and config models; ``""`` for factories."""
    weights: WeightsPlan | None = None
    """MODEL was weights (a model folder, a GGUF file, a Hub repository): the dtype loading
    gives them, where it came from, and tensors held as stored
    (:mod:`modelsize.estimation.model_source`)."""
    fetched: HubFetch | None = None
    """MODEL was a Hub repository: what reading it fetched."""


def resolve(spec: str, dtype: str | None = None, inputs: list[str] | None = None,
            device: str | None = None) -> Target:
    """Turn MODEL (with the weights' ``dtype``, None for the model's own or float32, and a
    factory's input shapes such as ``8x3x224x224``) into a :class:`Target`; ``device``: the
    device a quantized checkpoint is loaded for (what loading builds can differ by device;
    None: unknown)."""
    import torch

    from modelsize.estimation import zoo
    from modelsize.estimation.model_source import kind_of

    path = Path(spec)
    entry: zoo.ZooModel | None = zoo.MODELS.get(spec.lower())
    kind = kind_of(spec) if entry is None else None
    if kind is not None:
        if inputs:
            raise UsageError("--input sets the input shapes of a module:factory model; "
                             f"{printable(spec)} makes its own (--batch, --seq)")
        return _weights_target(spec, kind, dtype, device)
    is_config = path.suffix == ".json" or (path.is_dir() and (path / "config.json").exists())
    if entry is None and is_config:
        entry = zoo.from_config_json(path)
    if entry is not None:
        if inputs:
            raise UsageError(f"--input sets the input shapes of a module:factory model; "
                             f"{printable(entry.name)} makes its own (--batch"
                             + (", --seq)" if entry.seq else ")"))
        name, source = ((dtype, Source.GIVEN) if dtype else
                        (entry.dtype, Source.CONFIG) if entry.dtype else
                        ("float32", Source.CLI_DEFAULT))
        weights_dtype = getattr(torch, name)
        model = zoo.build(entry, weights_dtype)
        accepted = _accepted_kwargs(model)
        chosen = entry

        def make(batch: int, seq: int, train: bool) -> Any:
            inputs = zoo.make_inputs(chosen, batch, seq, train, weights_dtype)
            if isinstance(inputs, dict) and accepted is not None:
                inputs = {k: v for k, v in inputs.items() if k in accepted}
            return inputs

        return Target(entry.name, entry.description, model, make, entry.batch, entry.seq,
                      entry.repeated_block or _repeated_block(model),
                      weights_dtype == torch.float32, name, source,
                      entry.model_class or type(model).__name__, entry.inferred,
                      str(entry.kind))
    if ":" in spec and not path.exists():
        return _factory_target(spec, inputs, dtype)
    if path.suffix == ".json" or path.exists():
        raise UsageError(f"{printable(spec)}: expected a Hugging Face config.json or its folder")
    known = ", ".join(zoo.names())
    raise UsageError(f"unknown model {printable(spec)!r}: expected a built-in name ({known}), "
                     "a config.json, a model folder (config.json and weights), a .gguf file, "
                     "hf://ORG/REPO, or package.module:factory")


def _weights_target(spec: str, kind: Any, dtype: str | None, device: str | None = None) -> Target:
    """A model folder, a GGUF file or a Hub repository: the model built from its config as
    ``from_pretrained`` would build it (:mod:`modelsize.estimation.model_source`)."""
    from modelsize.estimation import model_source as ms
    from modelsize.estimation import zoo

    if kind is ms.SourceKind.HUB:
        with ms.hub_folder(spec) as (folder, fetched, url):
            name = url.removeprefix("hf://").split("@")[0].split("/")[-1]
            target = _folder_target(folder, dtype, kind, url, name, device)
        return replace(target, fetched=fetched)
    if kind is ms.SourceKind.GGUF:
        gguf = ms.read_gguf(Path(spec))
        entry = zoo.from_config_dict(gguf.config, Path(spec).stem, spec)
        main = dtype or "float16"
        why = "--dtype" if dtype else ("modelsize's default for GGUF: float16, llama.cpp's "
                                       "default KV cache type (--dtype to change)")
        model = ms.build_pretrained(entry, main)
        plan = ms.gguf_plan(model, gguf, main, why)
        return _built(entry, model, main, Source.GIVEN if dtype else Source.CLI_DEFAULT, plan,
                      f"{entry.model_class} from the GGUF file {spec} (general.architecture "
                      f"{gguf.architecture})")
    folder = Path(spec)
    return _folder_target(folder, dtype, kind, str(folder), real_path(folder).name,
                          device)


def _folder_target(folder: Path, dtype: str | None, kind: Any, origin: str,
                   name: str, device: str | None = None) -> Target:
    from modelsize.estimation import model_source as ms
    from modelsize.estimation import zoo

    raw = ms._config(folder)
    ckpt = ms.read_checkpoint(folder)
    entry = zoo.from_config_dict(raw, name, origin)
    if dtype:
        main, why, source = dtype, "--dtype", Source.GIVEN
    else:
        main, why = ms.pretrained_dtype(raw, ckpt)
        source = Source.CONFIG if why.startswith("config.json") else Source.MODEL
    model = ms.build_pretrained(entry, main)
    plan = ms.plan_folder(model, raw, ckpt, main, why, kind, device)
    files = ", ".join(ckpt.files) if len(ckpt.files) <= 2 else (
        f"{len(ckpt.files)} {Path(ckpt.files[0]).suffix.lstrip('.')} files")
    return _built(entry, model, main, source, plan,
                  f"{entry.model_class} from {origin} ({files})")


def _built(entry: Any, model: Any, dtype: str, source: Source, plan: WeightsPlan,
           description: str) -> Target:
    import torch

    from modelsize.estimation import zoo

    weights_dtype = getattr(torch, dtype)
    accepted = _accepted_kwargs(model)

    def make(batch: int, seq: int, train: bool) -> Any:
        inputs = zoo.make_inputs(entry, batch, seq, train, weights_dtype)
        if isinstance(inputs, dict) and accepted is not None:
            inputs = {k: v for k, v in inputs.items() if k in accepted}
        return inputs

    return Target(entry.name, description, model, make, entry.batch, entry.seq,
                  entry.repeated_block or _repeated_block(model), dtype == "float32", dtype,
                  source, entry.model_class or type(model).__name__, entry.inferred,
                  str(entry.kind), weights=plan)


def _accepted_kwargs(model: Any) -> set[str] | None:
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    return set(params)


def _factory_target(spec: str, inputs: list[str] | None, dtype: str | None = None) -> Target:
    import torch
    from torch import nn

    from modelsize.estimation.core import weights_dtype

    module_name, _, attr = spec.partition(":")
    # As ``python -m`` does: the current folder first, so a module beside the user is found
    # without PYTHONPATH=.
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, "")
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
    shapes = [parse_input(s) for s in inputs] if inputs else None
    if shapes is None and given_inputs is None:
        raise UsageError(f"{printable(spec)}: give the input shape with --input, e.g. "
                         "--input 8x3x224x224, or return (model, inputs) from the factory")

    def make(batch: int, seq: int, train: bool) -> Any:
        if shapes is not None:
            return tuple(_meta(dt, _resized(shape, batch, seq)) for dt, shape in shapes)
        return _resize_inputs(given_inputs, batch, seq)

    if dtype:
        made = made.to(getattr(torch, dtype))  # floating inputs follow, in make() below
    first = shapes[0][1] if shapes else _first_shape(given_inputs)
    batch = first[0] if first else 1
    # Only token ids have a sequence dimension we can name; 8x3x32x32 is a batch of images.
    tokens = _first_dtype(shapes, given_inputs) in _INTEGER
    seq = first[1] if len(first) > 1 and tokens else 0
    is_fp32 = all(p.dtype == torch.float32 for p in made.parameters())
    own = weights_dtype(made)
    make_in = make if not dtype else _cast_floats(make, getattr(torch, dtype))
    return Target(spec, f"{type(made).__name__} from {spec}", made, make_in, batch, seq,
                  _repeated_block(made), is_fp32, dtype or own,
                  Source.GIVEN if dtype else Source.MODEL, type(made).__name__)


def _cast_floats(make: Callable[[int, int, bool], Any], dtype: Any
                 ) -> Callable[[int, int, bool], Any]:
    """``make`` with its floating-point inputs in ``dtype`` (the factory model was cast)."""
    import torch

    def cast(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v.to(dtype)
        return v

    def made(batch: int, seq: int, train: bool) -> Any:
        inputs = make(batch, seq, train)
        if isinstance(inputs, dict):
            return {k: cast(v) for k, v in inputs.items()}
        if isinstance(inputs, tuple):
            return tuple(cast(v) for v in inputs)
        return cast(inputs)

    return made


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


_INTEGER = ("int64", "int32", "int16", "int8", "uint8")


def _first_dtype(shapes: list[tuple[str, tuple[int, ...]]] | None, inputs: Any) -> str:
    import torch

    if shapes:
        return shapes[0][0]
    values = inputs.values() if isinstance(inputs, dict) else inputs
    if isinstance(values, torch.Tensor):
        values = (values,)
    first = next((v for v in values if isinstance(v, torch.Tensor)), None)
    return str(first.dtype).replace("torch.", "") if first is not None else ""


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
        if tuple(shape) == tuple(v.shape):
            return v  # the factory's own tensors, values and all (the trace may read them)
        if not v.is_meta and all(n <= m for n, m in zip(shape, v.shape, strict=True)):
            return v[tuple(slice(0, n) for n in shape)].clone()
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




@dataclass(frozen=True)
class Options:
    """The estimate options the CLI passes to :func:`modelsize.estimation.estimate`."""

    mode: str
    optimizer: str
    implementation: str
    amp: str | None
    device: str
    accumulate: int
    checkpoint: tuple[str, ...]
    optimize_frozen: bool = False
    sources: tuple[tuple[str, Source], ...] = ()
    """Where ``device`` and ``optimizer`` came from (the CLI's defaults differ from the API's)."""
    gradient_checkpointing: dict[str, Any] | None = None
    """transformers' checkpointing arguments (``--gradient-checkpointing``), or None."""

    def settings(self) -> Settings:
        """The same options as :func:`modelsize.estimation.estimate` takes them."""
        from modelsize.estimation.core import Settings

        return Settings(mode=self.mode, optimizer=self.optimizer, loss=None, amp=self.amp,
                        device=self.device, implementation=self.implementation,
                        accumulate=self.accumulate, checkpoint=self.checkpoint, steps=None,
                        optimize_frozen=self.optimize_frozen,
                        gradient_checkpointing=self.gradient_checkpointing)


def trace_target(target: Target, batch: int, seq: int, options: Options,
                 progress: Callable[[str, int], None] | None = None,
                 parallel: Parallel | None = None) -> Estimate:
    """Estimate ``target`` at ``batch`` x ``seq`` (per rank of ``parallel`` when given)."""
    from modelsize.estimation import estimate

    train = options.mode == "train"
    check_stored_weights(target, "train" if train else "", parallel is not None)
    inputs = target.make_inputs(batch, seq, train)
    est = estimate(target.model, inputs, **options.settings().kwargs(), name=target.name,
                   progress=progress, parallel=parallel)
    if target.weights is not None:
        from modelsize.estimation.model_source import with_weights

        est = with_weights(est, target.weights)
    if options.sources:
        est = replace(est, setup=replace(est.setup, sources=dict(options.sources)))
    return est


def check_stored_weights(target: Target, what: str = "", parallel: bool = False,
                         verify: bool = False) -> None:
    """Refuse what quantized or GGUF weights held as stored cannot answer: a training step,
    a parallel layout, or a ``--verify`` run (which would run the float model)."""
    plan = target.weights
    if plan is None or not plan.stored:
        return
    kind = "GGUF" if plan.quant_method == "gguf" else "quantized"
    if what == "train":
        raise UsageError(f"{printable(target.name)}: {kind} weights are held as stored, not "
                         "trained: estimate --infer or --generate")
    if parallel:
        raise UsageError(f"{printable(target.name)}: {kind} weights on several GPUs are not "
                         "estimated; estimate one device")
    if verify:
        raise UsageError(f"{printable(target.name)}: --verify runs the float model, whose "
                         f"parameters are not the {kind} tensors this estimate counts")


def verify_target(target: Target, est: Estimate, batch: int, seq: int, options: Options,
                  budget: int | None = None) -> Estimate:
    """``est`` with the program run for real on CPU (at a smaller batch if it must be)."""
    from modelsize.estimation.core import verification

    check_stored_weights(target, verify=True)
    train = options.mode == "train"
    done = verification(target.model, target.make_inputs(batch, seq, train), options.settings(),
                        batch=batch, resize=lambda n: target.make_inputs(n, seq, train),
                        budget=budget)
    return replace(est, verification=done)




def suggestions_for(target: Target, base: Estimate, batch: int, seq: int, options: Options,
                    progress: Callable[[str, int], None] | None = None) -> list[Suggestion]:
    """Re-trace ``target`` with each change that could shrink ``base``'s peak."""
    from modelsize.estimation.advice import suggest

    def retrace(**overrides: Any) -> Estimate:
        b = overrides.pop("batch", batch)
        return trace_target(target, b, seq, replace(options, **overrides), progress)

    try:
        return suggest(retrace, base, batch=batch, repeated_block=target.repeated_block,
                       float32_model=target.float32)
    except EstimateError:
        return []


def fit_target(target: Target, batch: int, seq: int, options: Options, budget: int,
               dimension: str = "batch",
               progress: Callable[[str, int], None] | None = None,
               parallel: Parallel | None = None, gpu_limit: int = 4096) -> FitResult:
    """The largest batch (or sequence length) of ``target`` whose estimate fits ``budget``
    (per rank of ``parallel`` when given), or with ``dimension="gpus"`` the fewest GPUs of
    ``parallel``'s strategy whose worst rank fits it at ``batch`` per rank."""
    from modelsize.estimation.fit import fewest, fit

    if dimension == "seq" and not seq:
        raise UsageError("--fit-dim seq: this model has no sequence dimension")
    name = ("per-rank " if parallel is not None else "") + (
        "device total" if options.device == "cuda" else "peak")
    if dimension == "gpus":
        from modelsize.estimation.parallel import Parallel as ParallelOf

        layout = parallel if parallel is not None else ParallelOf(1)

        def on(world: int) -> int:
            est = trace_target(target, batch, seq, options, progress,
                               on_world(layout, world))
            return est.device_estimate.total_bytes

        return fewest(on, budget, limit=gpu_limit, measure_name=name,
                      allowed=lambda n: world_allowed(target.model, layout, n))

    def measure(n: int) -> int:
        b, s = (n, seq) if dimension == "batch" else (batch, n)
        est = trace_target(target, b, s, options, progress, parallel)
        return est.device_estimate.total_bytes

    return fit(measure, budget, dimension=dimension, measure_name=name,
               limit=1 << 16 if dimension == "batch" else 1 << 22)


def fit_both(target: Target, batch: int, seq: int, options: Options, budget: int,
             dimension: str = "batch", progress: Callable[[str, int], None] | None = None,
             parallel: Parallel | None = None) -> list[FitResult]:
    """:func:`fit_target` as asked and, for a training step without checkpointing on a model
    with a repeated block, again with every block checkpointed (labelled)."""
    results = [fit_target(target, batch, seq, options, budget, dimension, progress, parallel)]
    if options.mode == "train" and not options.checkpoint and target.repeated_block:
        with_ckpt = replace(options, checkpoint=(target.repeated_block,))
        other = fit_target(target, batch, seq, with_ckpt, budget, dimension, progress, parallel)
        results.append(replace(other, label=f"with checkpointing on every "
                                            f"{target.repeated_block}"))
    return results


def world_allowed(model: Any, parallel: Parallel, world: int) -> bool:
    """Whether ``parallel``'s strategy can run on ``world`` GPUs: tensor parallelism splits
    attention heads (its degree must divide them: ``world`` for ``tp``, ``parallel.tp`` for
    ``fsdp+tp``, whose world must then be a multiple of it)."""
    strategy = str(parallel.strategy)
    if "tp" not in strategy:
        return True
    degree = world
    if strategy != "tp":
        degree = int(getattr(parallel, "tp", 0) or 1)
        if world % degree:
            return False
    from modelsize.estimation.parallel import unsplit_heads

    return unsplit_heads(model, degree) is None


def on_world(parallel: Parallel, world: int) -> Parallel:
    """``parallel`` on ``world`` GPUs (plain tensor parallelism spans them all)."""
    from dataclasses import fields

    changes: dict[str, Any] = {"world": world, "ranks": None}
    if str(parallel.strategy) == "tp" and any(f.name == "tp" for f in fields(parallel)):
        changes["tp"] = world
    return replace(parallel, **changes)
