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
    """The options of ``--generate`` (``--generate`` itself is one of the estimate modes) and
    of ``--engine vllm``."""
    from modelsize.estimation import engine_vllm
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
    eng = parser.add_argument_group("serving engine (--engine vllm)")
    eng.add_argument("--engine", choices=["hf", "vllm"], default="hf",
                     help="hf: transformers' generate() (default); vllm: the memory plan vLLM "
                     f"{engine_vllm.VERSION} makes at start-up (KV cache blocks, tokens, maximum "
                     "concurrency), from its rules and the traced model")
    eng.add_argument("--gpu-memory", default=None, metavar="SIZE|GPU",
                     help="the GPU's total memory for --engine vllm: a size (79.2GiB) or a "
                     f"GPU name ({', '.join(k.upper() for k in engine_vllm.GPUS)}; default "
                     "H100)")
    eng.add_argument("--gpu-memory-utilization", type=_fraction, default=None, metavar="F",
                     help="vLLM's gpu_memory_utilization (default 0.92)")
    eng.add_argument("--max-model-len", type=_positive, default=None, metavar="N",
                     help="vLLM's max_model_len (default: the config's "
                     "max_position_embeddings)")
    eng.add_argument("--max-num-seqs", type=_positive, default=None, metavar="N",
                     help="vLLM's max_num_seqs (default: vllm serve's for the GPU)")
    eng.add_argument("--max-num-batched-tokens", type=_positive, default=None, metavar="N",
                     help="vLLM's max_num_batched_tokens: the profiling run's tokens "
                     "(default: vllm serve's for the GPU)")
    eng.add_argument("--block-size", type=_positive, default=None, metavar="N",
                     help="vLLM's block_size in tokens (default 16, FLASH_ATTN's on Hopper)")
    eng.add_argument("--enforce-eager", action="store_true",
                     help="vLLM without CUDA graphs (their memory term is then 0)")
    eng.add_argument("--non-torch", default=None, metavar="SIZE",
                     help="memory vLLM's process takes outside PyTorch during start-up (not "
                     "traced; default 0)")


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], not {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], not {value}")
    return value


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
    """``modelsize estimate MODEL --generate N ...`` (or ``--engine vllm``): print the report
    or JSON."""
    from dataclasses import replace

    import torch

    from modelsize.cli.estimate import Progress, _html, _size
    from modelsize.estimation import estimate
    from modelsize.estimation.core import weights_dtype
    from modelsize.estimation.generate import generation_inputs
    from modelsize.estimation.generate_fit import fit_generation
    from modelsize.estimation.model_source import with_weights
    from modelsize.estimation.result import Source
    from modelsize.estimation.targets import check_stored_weights, resolve

    _refuse_training_options(args)
    if args.engine == "vllm":
        if getattr(args, "quantize", None):
            raise UsageError("--quantize: the hf engine's layers (torchao, bitsandbytes); "
                             "--engine vllm reads a quantized checkpoint's own layout")
        return run_vllm(args)
    _refuse_engine_options(args)
    if args.generate is None:
        raise UsageError("--engine hf estimates generate(): give --generate N")
    target = resolve(args.model, args.dtype, None, args.device or default_device)
    if getattr(args, "quantize", None):
        from modelsize.estimation.quantized import quantize_target

        target = quantize_target(target, args.quantize)
    check_stored_weights(target, verify=args.verify)
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
        est = estimate(model, inputs, mode="generate", new_tokens=args.generate,
                       generation=generation, device=device, amp=args.amp, verify=verify,
                       verify_budget=budget, name=target.name, progress=progress)
        return with_weights(est, target.weights) if target.weights is not None else est

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
    est = replace(est, setup=replace(est.setup, sources=sources,
                                     dtype=est.setup.dtype or weights_dtype(model)))
    if args.json:
        data = est.to_dict()
        data["description"] = target.description
        data["batch"], data["seq"] = batch, prompt
        data["fit"] = fitted.to_dict() if fitted is not None else None
        data.update(_source_json(target))
        print(json.dumps(data))
    else:
        from modelsize.report.estimate_text import render_estimate
        from modelsize.report.generate_text import render_generation_fit, render_weights

        text = render_estimate(est, description=target.description, batch=batch, seq=prompt)
        if fitted is not None:
            text += "\n" + render_generation_fit(fitted)
        if target.weights is not None:
            text += "\n" + render_weights(target.weights, target.fetched)
        sys.stdout.write(text)
    _html(args, est, description=target.description, batch=batch, seq=prompt,
          fit=fitted.fit if fitted is not None else None)
    return 0


def _source_json(target: Any) -> dict[str, Any]:
    """``weights`` (where the dtypes came from, tensors held as stored) and ``remote`` (what
    reading a Hub repository fetched), for MODEL given as weights."""
    return {"weights": target.weights.to_dict() if target.weights is not None else None,
            "remote": target.fetched.to_dict() if target.fetched is not None else None}


_ENGINE_OPTIONS = (("--gpu-memory", "gpu_memory", None),
                   ("--gpu-memory-utilization", "gpu_memory_utilization", None),
                   ("--max-model-len", "max_model_len", None),
                   ("--max-num-seqs", "max_num_seqs", None),
                   ("--max-num-batched-tokens", "max_num_batched_tokens", None),
                   ("--block-size", "block_size", None), ("--enforce-eager", "enforce_eager",
                                                          False),
                   ("--non-torch", "non_torch", None))


def _refuse_engine_options(args: argparse.Namespace) -> None:
    given = [flag for flag, name, default in _ENGINE_OPTIONS
             if getattr(args, name, default) != default]
    if given:
        raise UsageError(f"{', '.join(given)}: vLLM's engine arguments, for --engine vllm")


def run_vllm(args: argparse.Namespace) -> int:
    """``--engine vllm``: vLLM's start-up memory plan (:mod:`modelsize.estimation.engine_vllm`)."""
    from dataclasses import replace

    import torch

    from modelsize.cli.estimate import Progress, _size
    from modelsize.estimation import engine_vllm as ev
    from modelsize.estimation.targets import resolve

    given = [flag for flag, on in (
        ("--cache", args.cache is not None), ("--beams", args.beams != 1),
        ("--prefill-chunk", args.prefill_chunk is not None), ("--left-pad", bool(args.left_pad)),
        ("--verify", args.verify), ("--fit", args.fit is not None), ("--amp", args.amp is not None),
        ("--html", getattr(args, "html", None) is not None),
        ("--device cpu", args.device == "cpu")) if on]
    if given:
        raise UsageError(f"--engine vllm plans vLLM's start-up on a GPU: {', '.join(given)} "
                         "do(es) not apply")
    kv = args.kv_dtype or "auto"
    if kv not in ("auto", "fp8"):
        raise UsageError(f"--kv-dtype {kv}: vLLM's kv_cache_dtype here is auto or fp8")
    gpu = ev.Gpu.parse(args.gpu_memory or "H100")
    if args.gpu_memory is None:
        gpu = replace(gpu, source="modelsize's default GPU (--gpu-memory to change); "
                         + gpu.source)
    target = resolve(args.model, args.dtype, None)
    model = target.model
    dtype = args.dtype or ev.vllm_dtype(target.dtype)
    model = model.to(getattr(torch, dtype))
    settings = ev.VllmSettings(
        gpu, args.gpu_memory_utilization or ev.DEFAULT_UTILIZATION, args.max_model_len,
        args.max_num_seqs, args.max_num_batched_tokens, args.block_size, kv,
        args.enforce_eager, _size(args.non_torch, "--non-torch") if args.non_torch else 0,
        dtype)
    request = (args.seq or 0) + (args.generate or 0) or None
    progress = Progress(target.name, sys.stderr.isatty())
    traced: dict[tuple[int, int, bool], tuple[int, int]] = {}

    def trace(tokens: int, requests: int, sampler: bool) -> tuple[int, int]:
        key = (tokens, requests, sampler)
        if key not in traced:
            traced[key] = ev.trace_profile(model, tokens, requests, sampler, sms=gpu.sms)
        return traced[key]

    try:
        found = ev.plan(model, target.weights, settings, trace, request)
    finally:
        progress.done()
    if args.json:
        data = {"description": target.description, "model": target.name,
                "plan": found.to_dict()}
        data.update(_source_json(target))
        print(json.dumps(data))
    else:
        from modelsize.report.generate_text import render_vllm_plan, render_weights

        text = render_vllm_plan(found, f"{target.name}: {target.description}")
        if target.weights is not None:
            text += "\n" + render_weights(target.weights, target.fetched)
        sys.stdout.write(text)
    return 0
