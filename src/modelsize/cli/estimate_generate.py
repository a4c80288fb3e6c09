"""``modelsize estimate MODEL --generate N``: arguments, the traced ``generate()``, its report.

Part of the ``estimate`` verb (:mod:`modelsize.cli.estimate` defines ``--generate`` and hands
over here); torch-free until :func:`run` runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from modelsize.errors import UsageError
from modelsize.estimation.generate_options import CacheChoice, GenerateOptions, KvDtype


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``--generate`` (``--generate`` itself is one of the estimate modes)."""
    gen = parser.add_argument_group("generation (with --generate N)")
    gen.add_argument("--cache", choices=[c.value for c in CacheChoice], default=None,
                     help="the cache generate() builds (default dynamic): static allocates "
                     "prompt + new tokens up front; sliding is transformers' sliding_window "
                     "(a static cache whose sliding layers hold the window); offloaded moves "
                     "layers to the host (CUDA); quantized stores keys and values in --kv-dtype")
    gen.add_argument("--kv-dtype", choices=[k.value for k in KvDtype], default=None,
                     help="element type of the cached keys and values: auto (the model's), "
                     "fp8 (QuantizedCache fp8), int4 / int2 (QuantizedCache quanto)")
    gen.add_argument("--beams", type=_positive, default=1, metavar="K",
                     help="beam search with K beams (num_beams; default 1: greedy)")
    gen.add_argument("--prefill-chunk", type=_positive, default=None, metavar="C",
                     help="process the prompt in chunks of C tokens (prefill_chunk_size)")
    gen.add_argument("--left-pad", type=int, default=0, metavar="P",
                     help="pad every prompt but the first by P positions on the left "
                     "(attention mask 0), as a batch of prompts of different lengths is")


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, not {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, not {n}")
    return n


def _refuse_training_options(args: argparse.Namespace) -> None:
    given = [name for name, on in (
        ("--optimizer", args.optimizer is not None), ("--optimize-frozen", args.optimize_frozen),
        ("--impl/--foreach/--fused", args.impl != "default"),
        ("--accumulate", args.accumulate != 1), ("--checkpoint", bool(args.checkpoint)),
        ("--gpus", args.gpus is not None), ("--strategy", args.strategy is not None),
        ("--tp", args.tp is not None), ("--fsdp-mp", args.fsdp_mp is not None),
        ("--cpu-offload", args.cpu_offload), ("--shard", bool(args.shard)),
        ("--input", bool(args.input))) if on]
    if given:
        raise UsageError(f"--generate runs generate() on one device in eval mode: "
                         f"{', '.join(given)} do(es) not apply")
    if args.fit and args.fit_dim not in ("context", "batch"):
        raise UsageError("--fit with --generate searches --fit-dim context (prompt + new "
                         "tokens) or batch")


def run(args: argparse.Namespace, default_device: str) -> int:
    """``modelsize estimate MODEL --generate N ...``: print the report or JSON."""
    from dataclasses import replace

    import torch

    from modelsize.cli.estimate import Progress, _html, _size
    from modelsize.estimation import estimate
    from modelsize.estimation.generate import generation_inputs
    from modelsize.estimation.generate_fit import fit_generation
    from modelsize.estimation.result import Source
    from modelsize.estimation.targets import resolve

    _refuse_training_options(args)
    target = resolve(args.model, args.dtype, None)
    batch = args.batch or target.batch
    prompt = args.seq or target.seq or 1
    options = GenerateOptions(CacheChoice(args.cache or "dynamic"),
                              KvDtype(args.kv_dtype or "auto"), args.beams, args.prefill_chunk)
    generation = options.generation()
    device = args.device or default_device
    budget = _size(args.verify_budget, "--verify-budget") if args.verify_budget else None
    dtype = getattr(torch, args.dtype) if args.dtype else None  # else the model's own
    model = target.model
    progress = Progress(target.name, sys.stderr.isatty())

    def estimate_at(b: int, p: int, verify: bool = False) -> Any:
        inputs = generation_inputs(model, b, p, min(args.left_pad, p - 1), dtype)
        return estimate(model, inputs, mode="generate", new_tokens=args.generate,
                        generation=generation, device=device, amp=args.amp, verify=verify,
                        verify_budget=budget, name=target.name, progress=progress)

    if args.left_pad and args.left_pad >= prompt:
        raise UsageError(f"--left-pad {args.left_pad} leaves no token of a {prompt}-token "
                         "prompt")
    try:
        est = estimate_at(batch, prompt, args.verify)
        fitted = None
        if args.fit:
            limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
            fitted = fit_generation(estimate_at, _size(args.fit, "--fit"), args.fit_dim,
                                    batch=batch, prompt=prompt, new_tokens=args.generate,
                                    context_limit=limit if isinstance(limit, int) else None)
    finally:
        progress.done()
    sources = {"device": Source.GIVEN if args.device else Source.CLI_DEFAULT,
               "dtype": target.dtype_source}
    est = replace(est, setup=replace(est.setup, sources=sources))
    if args.json:
        data = est.to_dict()
        data["description"] = target.description
        data["batch"], data["seq"] = batch, prompt
        data["fit"] = fitted.to_dict() if fitted is not None else None
        print(json.dumps(data))
    else:
        from modelsize.report.estimate_text import render_estimate
        from modelsize.report.generate_text import render_generation_fit

        text = render_estimate(est, description=target.description, batch=batch, seq=prompt)
        if fitted is not None:
            text += "\n" + render_generation_fit(fitted)
        sys.stdout.write(text)
    _html(args, est, description=target.description, batch=batch, seq=prompt,
          fit=fitted.fit if fitted is not None else None)
    return 0
