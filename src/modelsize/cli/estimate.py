"""``modelsize estimate MODEL``: arguments, then :mod:`modelsize.estimation`, then the renderer."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from modelsize.errors import UsageError
from modelsize.estimation.optimizers import Implementation, OptimizerName
from modelsize.estimation.parallel import SHARDED, FsdpPrecision, Strategy

_DTYPES = ("float32", "bfloat16", "float16")
#: The command estimates for a GPU by default (users ask about GPUs); ``modelsize.estimate``
#: defaults to the CPU, where estimates are validated. The report says which one was used.
DEFAULT_DEVICE = "cuda"
DEFAULT_OPTIMIZER = "adamw"
#: ``--gradient-checkpointing`` values: the arguments given to transformers.
_HF_CHECKPOINTING: dict[str, dict[str, Any]] = {
    "default": {}, "reentrant": {"use_reentrant": True},
    "non-reentrant": {"use_reentrant": False}}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Define the ``estimate`` sub-command's arguments on ``parser``."""
    parser.add_argument("model", nargs="?", metavar="MODEL",
                        help="built-in name (see --list), a config.json, a model folder "
                        "(config.json and weights), a .gguf file, hf://ORG/REPO[@REV], or "
                        "module:factory")
    parser.add_argument("--list", action="store_true",
                        help="list the built-in models and exit (with --json: as JSON)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--train", dest="mode", action="store_const", const="train",
                      help="a training step: forward, loss, backward, optimizer (default)")
    mode.add_argument("--infer", dest="mode", action="store_const", const="infer",
                      help="one forward pass in eval mode under no_grad")
    mode.add_argument("--generate", type=_positive, default=None, metavar="N",
                      help="generate() of N new tokens (greedy, eval, no_grad) with the "
                      "model's own cache; --seq is the prompt length")
    parser.set_defaults(mode="train")
    parser.add_argument("--batch", type=_positive, default=None, help="batch size")
    parser.add_argument("--seq", type=_positive, default=None, help="sequence length (tokens)")
    parser.add_argument("--input", action="append", default=None, metavar="SHAPE",
                        help="input shape for a factory model, e.g. 8x3x224x224 or "
                        "int64:8x128; repeat for several positional inputs")
    parser.add_argument("--optimizer", default=None,
                        help=f"one of {', '.join(o.value for o in OptimizerName)} "
                        f"(default {DEFAULT_OPTIMIZER})")
    parser.add_argument("--optimize-frozen", action="store_true",
                        help="build the optimizer on every parameter, frozen ones included "
                        "(default: only those that require grad, as fine-tuning code does)")
    parser.add_argument("--impl", default="default",
                        choices=[i.value for i in Implementation],
                        help="optimizer implementation (default: PyTorch's for the device)")
    parser.add_argument("--foreach", dest="impl", action="store_const", const="foreach",
                        help="same as --impl foreach")
    parser.add_argument("--fused", dest="impl", action="store_const", const="fused",
                        help="same as --impl fused")
    parser.add_argument("--amp", choices=["bf16", "fp16"], default=None,
                        help="autocast the forward and the loss to this dtype")
    parser.add_argument("--dtype", choices=_DTYPES, default=None,
                        help="dtype of the model's weights (default: a config.json's own "
                        "dtype, else float32; a factory's model keeps its own); the report "
                        "names the one used and where it came from")
    parser.add_argument("--quantize", choices=["int8", "int4", "fp8", "nf4"], default=None,
                        help="quantize the nn.Linear weights first (weight-only): torchao for "
                        "int8/int4/fp8, bitsandbytes for nf4; the report names the library")
    parser.add_argument("--accumulate", type=_positive, default=1, metavar="N",
                        help="micro-batches per optimizer step (gradient accumulation)")
    parser.add_argument("--checkpoint", action="append", default=None, metavar="MODULES",
                        help="activation checkpointing on these modules: a class name or a "
                        "glob over module names (comma-separated, repeatable)")
    parser.add_argument("--gradient-checkpointing", nargs="?", const="default", default=None,
                        choices=list(_HF_CHECKPOINTING),
                        help="activation checkpointing as transformers switches it on "
                        "(activation_checkpointing_enable) on a transformers model: "
                        "transformers' default arguments, or use_reentrant=True (reentrant) or "
                        "False (non-reentrant)")
    parser.add_argument("--lora", default=None, metavar="SPEC",
                        help="train LoRA adapters made by peft's get_peft_model: "
                        "r=16,alpha=32,targets=q_proj,v_proj (or targets=all-linear; "
                        "dropout=0.05 optional, 0 by default as in peft); the base is frozen")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None,
                        help=f"the device to estimate for (default {DEFAULT_DEVICE}: checked on an "
                        "H100 and an H200 within 0.07%% of max_memory_allocated; cpu: exact to the "
                        "byte against the CPU allocator)")
    parser.add_argument("--verify", action="store_true",
                        help="also run the program for real on CPU under the allocator's "
                        "profiler and print the measured peak beside the estimate (at a "
                        "smaller batch when the full one does not fit --verify-budget)")
    parser.add_argument("--verify-budget", default=None, metavar="SIZE",
                        help="memory the --verify run may use, e.g. 8GiB (default: half of "
                        "the available memory)")
    parser.add_argument("--fit", default=None, metavar="BUDGET",
                        help="find the largest batch that fits, e.g. 80GiB (per rank with "
                        "--gpus N; with --fit-dim gpus the fewest GPUs of that memory); a "
                        "training step without --checkpoint is fitted again with every "
                        "repeated block checkpointed")
    parser.add_argument("--fit-dim", choices=["batch", "seq", "gpus", "context"],
                        default="batch", help="what --fit searches (default batch; context: "
                        "prompt + new tokens, with --generate)")
    par = parser.add_argument_group("across GPUs (per-rank memory)")
    par.add_argument("--gpus", type=_positive, default=None, metavar="N",
                     help="estimate one rank of a data-parallel program on N GPUs")
    par.add_argument("--strategy", default=None, choices=[s.value for s in Strategy],
                     help="fsdp/zero3: FSDP2 traced on a fake process group (default); tp: "
                     "the model's tensor-parallel plan over all N GPUs; fsdp+tp: a 2D mesh "
                     "(N / --tp, --tp), traced; ddp, zero1, zero2: accounted from the "
                     "single-GPU trace")
    par.add_argument("--tp", type=_positive, default=None, metavar="N",
                     help="tensor-parallel degree of fsdp+tp (implies it): the model's plan on "
                     "N GPUs, FSDP2 over the --gpus / N groups")
    par.add_argument("--fsdp-mp", default=None, choices=[p.value for p in FsdpPrecision],
                     help="with --amp and FSDP2: policy (MixedPrecisionPolicy: parameters "
                     "gathered in the amp dtype, gradients reduced in float32; the default) "
                     "or autocast (torch.autocast around float32 FSDP2)")
    par.add_argument("--cpu-offload", action="store_true",
                     help="FSDP2's CPUOffloadPolicy: sharded parameters, gradients and the "
                     "optimizer step on the host; the estimate is of each GPU")
    par.add_argument("--reshard-after-forward", dest="reshard", action="store_true",
                     default=True, help="FSDP2 frees each block's gathered parameters after "
                     "its forward (default)")
    par.add_argument("--no-reshard-after-forward", dest="reshard", action="store_false",
                     help="FSDP2 keeps gathered parameters from the forward to the backward")
    par.add_argument("--shard", action="append", default=None, metavar="MODULES",
                     help="modules to fully_shard before the root: class names or globs "
                     "(default: each repeated block)")
    sug = parser.add_mutually_exclusive_group()
    sug.add_argument("--suggest", dest="suggest", action="store_true", default=None,
                     help="re-trace what would shrink the peak (default: on for text output)")
    sug.add_argument("--no-suggest", dest="suggest", action="store_false")
    from modelsize.cli import estimate_generate

    estimate_generate.add_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--html", metavar="FILE", default=None,
                        help="also write a self-contained HTML report: the memory timeline, "
                        "categories at the peak, activations by module (works offline)")


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, not {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, not {n}")
    return n




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


def run(args: argparse.Namespace) -> int:
    """Execute ``modelsize estimate`` (prints the report or JSON; returns the exit code)."""
    if getattr(args, "list", False):
        return _print_list(getattr(args, "json", False))
    from modelsize.estimation import require_torch
    from modelsize.report.files import check_output_file

    check_output_file(getattr(args, "html", None))
    if not args.model:
        raise UsageError("estimate needs a MODEL (a built-in name, a config.json, or "
                         "module:factory); see modelsize estimate --list")
    require_torch()
    from modelsize.cli import quiet_library_logs

    quiet_library_logs()
    lora = getattr(args, "lora", None)
    hf_ckpt = getattr(args, "gradient_checkpointing", None)
    if args.generate is not None or getattr(args, "engine", "hf") != "hf":
        if lora or hf_ckpt:
            raise UsageError("--lora and --gradient-checkpointing are for a training step "
                             "(or --infer), not --generate")
        from modelsize.cli import estimate_generate

        return estimate_generate.run(args, DEFAULT_DEVICE)
    from modelsize.estimation.optimizers import parse_name
    from modelsize.estimation.result import Source
    from modelsize.estimation.targets import (
        Options,
        fit_both,
        resolve,
        suggestions_for,
        trace_target,
        verify_target,
    )

    optimizer = args.optimizer or DEFAULT_OPTIMIZER
    device = args.device or DEFAULT_DEVICE
    parse_name(optimizer)
    verify_budget = _size(args.verify_budget, "--verify-budget") if args.verify_budget else None
    spec = None
    if lora:
        from modelsize.estimation.lora import parse_lora

        spec = parse_lora(lora)
    target = resolve(args.model, args.dtype, args.input, device)
    if args.quantize:
        from modelsize.estimation.quantized import quantize_target

        target = quantize_target(target, args.quantize)
    if spec is not None:  # after any quantization of target.model: QLoRA is both
        from dataclasses import replace

        from modelsize.estimation.lora import apply_lora

        target = replace(target, model=apply_lora(target.model, spec))
    if args.seq is not None and not target.seq:
        raise UsageError(f"--seq: {target.name} has no sequence dimension ("
                         + (f"it takes {target.kind}" if target.kind else
                            "its first input is not token ids") + "); --batch sets the batch")
    batch = args.batch or target.batch
    seq = args.seq or target.seq
    checkpoint = tuple(p.strip() for group in (args.checkpoint or ()) for p in group.split(",")
                       if p.strip())
    sources = (("device", Source.GIVEN if args.device else Source.CLI_DEFAULT),
               ("optimizer", Source.GIVEN if args.optimizer else Source.CLI_DEFAULT),
               ("dtype", target.dtype_source))
    options = Options(args.mode, optimizer, args.impl, args.amp, device, args.accumulate,
                      checkpoint, args.optimize_frozen, sources,
                      None if hf_ckpt is None else _HF_CHECKPOINTING[hf_ckpt])
    progress = Progress(target.name, sys.stderr.isatty())
    if (args.gpus is not None or args.strategy is not None or args.shard or args.tp
            or args.fsdp_mp or args.cpu_offload or args.fit_dim == "gpus"):
        return _run_parallel(args, target, batch, seq, options, progress)
    try:
        est = trace_target(target, batch, seq, options, progress)
        if spec is not None:
            from modelsize.estimation.lora import lora_note

            est = lora_note(est, target.model, spec)
        if args.verify:
            est = verify_target(target, est, batch, seq, options, verify_budget)
        fits = []
        if args.fit:
            fits = fit_both(target, batch, seq, options, _size(args.fit, "--fit"),
                            args.fit_dim, progress)
        want = args.suggest if args.suggest is not None else not args.json
        suggestions = suggestions_for(target, est, batch, seq, options, progress) if want else []
    finally:
        progress.done()
    if args.json:
        data = est.to_dict()
        data.update(_target_json(target))
        data["batch"], data["seq"] = batch, seq
        data["suggestions"] = [s.to_dict() for s in suggestions]
        data.update(_fit_json(fits))
        data.update(_weights_json(target))
        print(json.dumps(data))
    else:
        from modelsize.report.estimate_text import render_estimate

        sys.stdout.write(render_estimate(est, description=target.description, batch=batch,
                                         seq=seq, suggestions=suggestions, fit=fits)
                         + _weights_text(target))
    _html(args, est, description=target.description, batch=batch, seq=seq,
          suggestions=suggestions, fit=fits)
    return 0


def _weights_json(target: Any) -> dict[str, Any]:
    """MODEL given as weights: their dtypes and what reading them fetched (else nulls)."""
    from modelsize.cli.estimate_generate import _source_json

    return _source_json(target)


def _weights_text(target: Any) -> str:
    if getattr(target, "weights", None) is None:
        return ""
    from modelsize.report.generate_text import render_weights

    return "\n" + render_weights(target.weights, target.fetched)


def _target_json(target: Any) -> dict[str, Any]:
    """What was built: the description, the class (and whether modelsize chose it)."""
    return {"description": target.description, "model_class": target.model_class or None,
            "model_class_inferred": target.inferred}


def _html(args: argparse.Namespace, est: Any, **report: Any) -> None:
    """``--html FILE``: the same report as the text one (see :mod:`modelsize.report.html`)."""
    if getattr(args, "html", None):
        from modelsize.report import html

        html.write(args.html, html.render_estimate(est, **report))


def _run_parallel(args: argparse.Namespace, target: Any, batch: int, seq: int,
                  options: Any, progress: Progress) -> int:
    """``--gpus N``: the worst rank of the data-parallel program, and the formulas beside."""
    from dataclasses import replace

    from modelsize.estimation import estimate
    from modelsize.estimation.parallel import Parallel
    from modelsize.estimation.targets import check_stored_weights, fit_both, on_world

    check_stored_weights(target, parallel=True)
    units = tuple(p.strip() for group in (args.shard or ()) for p in group.split(",")
                  if p.strip())
    strategy = args.strategy or (Strategy.FSDP_TP if args.tp else Strategy.FSDP)
    if args.fsdp_mp and not args.amp:
        raise UsageError("--fsdp-mp chooses how FSDP2 runs --amp: give --amp bf16 or fp16")
    if args.fsdp_mp and Strategy(strategy) not in SHARDED:
        raise UsageError(f"--fsdp-mp chooses how FSDP2 runs --amp; strategy {strategy} runs "
                         "no FSDP2 (its --amp is torch.autocast)")
    if args.fit_dim == "gpus" and args.gpus:
        raise UsageError("--fit-dim gpus searches the number of GPUs: leave out --gpus (or "
                         "fit the batch per rank on --gpus N with --fit-dim batch)")
    if args.fit_dim == "gpus" and not args.fit:
        raise UsageError("--fit-dim gpus needs --fit BUDGET, the memory of one GPU")
    world = args.gpus or (args.tp if args.tp else 1)
    parallel = Parallel(world, strategy, reshard_after_forward=args.reshard,
                        units=units, tp=args.tp,
                        mixed_precision=args.fsdp_mp or FsdpPrecision.POLICY,
                        cpu_offload=args.cpu_offload)
    if args.verify:
        from modelsize.estimation.parallel_trace import check_verifiable

        check_verifiable(parallel)
    inputs = target.make_inputs(batch, seq, options.mode == "train")
    fits: list[Any] = []
    try:
        if args.fit and args.fit_dim == "gpus":
            fits = fit_both(target, batch, seq, options, _size(args.fit, "--fit"), "gpus",
                            progress, parallel)
            if fits[0].best:  # the report below describes the answer
                parallel = on_world(parallel, fits[0].best)
        est = estimate(target.model, inputs, **options.settings().kwargs(), name=target.name,
                       progress=progress, parallel=parallel)
        if args.fit and args.fit_dim != "gpus":
            fits = fit_both(target, batch, seq, options, _size(args.fit, "--fit"),
                            args.fit_dim, progress, parallel)
        if args.verify:
            from modelsize.estimation.parallel_trace import verify_rank

            budget = _size(args.verify_budget, "--verify-budget") if args.verify_budget else None
            est = replace(est, verification=verify_rank(target.model, inputs,
                                                        options.settings(), parallel, est,
                                                        budget))
    finally:
        progress.done()
    est = replace(est, setup=replace(est.setup, sources=dict(options.sources)))
    if args.json:
        data = est.to_dict()
        data.update(_target_json(target))
        data["batch"], data["seq"] = batch, seq
        data.update(_fit_json(fits))
        print(json.dumps(data))
    else:
        from modelsize.report.estimate_text import render_estimate

        sys.stdout.write(render_estimate(est, description=target.description, batch=batch,
                                         seq=seq, fit=fits))
    _html(args, est, description=target.description, batch=batch, seq=seq, fit=fits)
    return 0


def _fit_json(fits: list[Any]) -> dict[str, Any]:
    """``fit``: as asked; ``fit_checkpointed``: the same search with every block checkpointed."""
    return {"fit": fits[0].to_dict() if fits else None,
            "fit_checkpointed": fits[1].to_dict() if len(fits) > 1 else None}


def _size(text: str, option: str) -> int:
    from modelsize.report.units import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise UsageError(f"{option}: {exc}") from None


def _print_list(as_json: bool = False) -> int:
    """The built-in models (needs neither torch nor transformers)."""
    from modelsize.estimation import zoo

    if as_json:
        print(json.dumps({"models": [m.to_dict() for m in zoo.MODELS.values()]}))
        return 0
    for m in zoo.MODELS.values():
        shape = f"batch {m.batch}" + (f" x seq {m.seq}" if m.seq else f", {m.image}px images")
        print(f"  {m.name:12s} {m.description} (default {shape})")
    return 0
