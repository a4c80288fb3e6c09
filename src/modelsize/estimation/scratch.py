"""Kernel scratch: memory the allocator hands out during an op that no output tensor owns.

Fake tensors see an op's inputs and outputs, not what the real kernel allocates while it
runs. Two kinds of models fill the gap on CPU:

* **analytic**, where the rule is simple and device-independent: the CPU BLAS path of ``mm``,
  ``addmm``, ``bmm`` and ``baddbmm`` clones an operand whose strides BLAS cannot take (an
  expanded or sliced gradient, say) into a contiguous temporary;
* **probed**, where the kernel belongs to oneDNN and its buffers depend on the instruction set,
  the shapes and the thread count (reordered inputs and weights, blocked outputs converted
  back to dense, primitive scratch pads, the LSTM workspace that PyTorch's meta kernel reports
  as 0 bytes). For those ops the tracker runs the real kernel once per distinct signature on
  zero-filled inputs under the CPU profiler and reads the allocator's own events. Signatures
  too large to run are scaled down along the batch dimension and extrapolated linearly, event
  by event (checked on a third size; when that check fails the op is left unmodelled and
  listed in the estimate's notes).

Each model returns the bytes the kernel holds beyond its outputs at its high-water mark; a
probed op can also correct the size of an output the meta kernel gets wrong.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

#: Probes run real kernels; above this many bytes of real memory they scale the batch down.
PROBE_BUDGET = 64 * 2**20


@dataclass
class KernelCost:
    """What a real kernel costs beyond what its fake twin shows."""

    scratch: int = 0
    output_nbytes: tuple[int | None, ...] = ()


BatchDims = Callable[[Sequence[Any]], dict[int, int]]
Prepare = Callable[[list[Any]], None]


@dataclass
class Probe:
    """How to run one op for real: where its batch dimension is, and any setup it needs."""

    batch_dims: BatchDims
    prepare: Prepare | None = None


@dataclass
class ScratchModels:
    """The per-op models for one device, with the probe cache and what could not be modelled."""

    device_type: str
    analytic: dict[Any, Callable[[Sequence[Any]], int]] = field(default_factory=dict)
    outputs: dict[Any, Callable[[Sequence[Any]], tuple[int | None, ...]]] = field(
        default_factory=dict
    )
    probed: dict[Any, Probe] = field(default_factory=dict)
    cache: dict[tuple[Any, ...], KernelCost | None] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    probes_run: int = 0
    wrap_numbers: bool = False
    _tensor_params: dict[Any, tuple[tuple[int, str], ...]] = field(default_factory=dict)

    def wrapped(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> int:
        """Bytes of the CPU tensors PyTorch wraps Python numbers in for the op's duration.

        A number passed where the schema takes a Tensor (``x.mul_(0.9)``) becomes an 8-byte
        0-dim CPU tensor before the kernel runs, and TensorIterator casts it to the result's
        dtype in a temporary when the two differ. Fake tensors never see either.
        """
        params = self._tensor_params.get(func)
        if params is None:
            params = _wrapping_params(func)
            self._tensor_params[func] = params
        if not params:
            return 0
        total = 0
        if func.__name__.startswith("_foreach_"):
            # the CPU slow path loops over the list, wrapping one scalar at a time
            lists = [a for a in args if isinstance(a, (list, tuple)) and a]
            first = lists[0][0] if lists else None
            for i, name in params:
                v = args[i] if i < len(args) else kwargs.get(name)
                v = v[0] if isinstance(v, (list, tuple)) and v else v
                if isinstance(v, (bool, int, float, complex)) and first is not None:
                    total = max(total, _wrap_cost(v, first.dtype, first.element_size()))
            return total
        result = out if isinstance(out, torch.Tensor) else None
        for i, name in params:
            v = args[i] if i < len(args) else kwargs.get(name)
            if isinstance(v, (bool, int, float, complex)):
                total += _wrap_cost(v, result.dtype if result is not None else None,
                                    result.element_size() if result is not None else 0)
        return total

    def cost(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any],
             out: Any) -> KernelCost | None:
        """The scratch (and output corrections) of one op call, or None when it has none."""
        fn = self.analytic.get(func)
        if fn is not None:
            n = fn(args)
            return KernelCost(n) if n else None
        fix = self.outputs.get(func)
        if fix is not None:
            return KernelCost(0, fix(args))
        probe = self.probed.get(func)
        if probe is None:
            return None
        key = (func, torch.is_grad_enabled(), *(_signature(a) for a in args),
               *sorted((k, _signature(v)) for k, v in kwargs.items()))
        if key not in self.cache:
            self.cache[key] = self._probe(func, args, kwargs, out, probe)
        return self.cache[key]

    def _probe(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any,
               probe: Probe) -> KernelCost | None:
        if torch.autograd.profiler._is_profiler_enabled:
            _note(self.notes, f"{func}: scratch not probed (a profiler is already running)")
            return None
        nbytes = sum(_span(a) for a in args if isinstance(a, torch.Tensor))
        nbytes += sum(_span(t) for t in _out_tensors(out))
        dims = probe.batch_dims(args)
        batches = {args[i].shape[d] for i, d in dims.items()}
        batch = batches.pop() if len(batches) == 1 else None
        try:
            if nbytes <= PROBE_BUDGET or (batch is not None and batch <= 3):
                self.probes_run += 1
                events, sizes = _run(func, args, kwargs, {}, probe.prepare)
                return _cost(events, sizes, out)
            if batch is None:
                _note(self.notes, f"{func}: scratch not probed (too large to run, no batch dim)")
                return None
            self.probes_run += 3
            runs = [_run(func, args, kwargs, {i: (d, n) for i, d in dims.items()}, probe.prepare)
                    for n in (1, 2, 3)]
        except (RuntimeError, ValueError, IndexError) as exc:
            _note(self.notes, f"{func}: scratch probe failed ({str(exc).splitlines()[0][:120]})")
            return None
        return _extrapolate(func, runs, batch, out, self.notes)



#: Ops whose ``Scalar`` overloads wrap the number in a tensor inside the kernel (measured).
_WRAPPING_BASES = frozenset({"add", "sub", "mul", "div", "rsub"})


def _wrapping_params(func: Any) -> tuple[tuple[int, str], ...]:
    """Arguments where a Python number gets wrapped in a CPU tensor."""
    base = func.__name__.split(".")[0].removeprefix("_foreach_").rstrip("_")
    wraps_scalars = base in _WRAPPING_BASES or func.__name__ == "_foreach_pow.ScalarAndTensor"
    out = []
    for i, a in enumerate(func._schema.arguments):
        kind = str(a.type)
        if isinstance(a.type, torch.TensorType) or (
            wraps_scalars and kind in ("number", "List[number]") and a.name != "alpha"
        ):
            out.append((i, a.name))
    return tuple(out)


def _wrap_cost(v: bool | int | float | complex, dtype: torch.dtype | None, itemsize: int) -> int:
    wrapped = 16 if isinstance(v, complex) else 8
    return wrapped + (itemsize if dtype is not None and dtype != _wrapped_dtype(v) else 0)


def _wrapped_dtype(v: bool | int | float | complex) -> torch.dtype:
    if isinstance(v, bool):
        return torch.bool
    if isinstance(v, int):
        return torch.int64
    if isinstance(v, float):
        return torch.float64
    return torch.complex128


def _note(notes: list[str], text: str) -> None:
    if text not in notes:
        notes.append(text)


def _signature(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return ("T", tuple(a.shape), tuple(a.stride()), a.storage_offset(), a.dtype)
    if isinstance(a, (list, tuple)):
        return tuple(_signature(x) for x in a)
    return a


def _span(t: torch.Tensor) -> int:
    if t.numel() == 0:
        return 0
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return (1 + last) * t.element_size()


def _out_tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for t in out if isinstance(t, torch.Tensor)]
    return []


def _strides_like(shape: Sequence[int], stride: Sequence[int]) -> list[int]:
    """Dense strides for ``shape`` in the same dimension order as ``stride`` (0 stays 0)."""
    order = sorted(range(len(shape)), key=lambda d: (stride[d], shape[d]))
    out = [0] * len(shape)
    step = 1
    for d in order:
        if stride[d] == 0:
            continue
        out[d] = step
        step *= max(shape[d], 1)
    return out


def _real(a: Any, resize: tuple[int, int] | None = None) -> Any:
    """A zero-filled real CPU tensor with ``a``'s layout (``resize``: (dim, new size))."""
    if isinstance(a, torch.Tensor):
        shape, stride, offset = list(a.shape), list(a.stride()), a.storage_offset()
        if resize is not None:
            shape[resize[0]] = resize[1]
            stride, offset = _strides_like(shape, stride), 0
        span = 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True)) if all(shape) else 0
        base = torch.zeros(span + offset, dtype=a.dtype, device="cpu")
        return base.as_strided(shape, stride, offset)
    if isinstance(a, (list, tuple)):
        return type(a)(_real(x) for x in a)
    return a


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence the profiler library's own start/stop lines, written straight to fd 2."""
    try:
        saved = os.dup(2)
    except OSError:  # no stderr to speak of
        yield
        return
    try:
        sys.stderr.flush()
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _run(
    func: Any, args: Sequence[Any], kwargs: dict[str, Any],
    resize: dict[int, tuple[int, int]], prepare: Prepare | None,
) -> tuple[list[int], list[int]]:
    """Run ``func`` for real; return the allocator's events and the real outputs' sizes."""
    from torch.profiler import ProfilerActivity, profile

    real_args = [_real(a, resize.get(i)) for i, a in enumerate(args)]
    real_kwargs = {k: _real(v) for k, v in kwargs.items()}
    # Grad mode stays the caller's: some kernels (the oneDNN LSTM) only keep a workspace when
    # it is on. The real arguments do not require grad, so no graph is recorded.
    if prepare is not None:
        prepare(real_args)
    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = func(*real_args, **real_kwargs)
    sizes = [t.untyped_storage().nbytes() for t in _out_tensors(result)]
    del result
    events = [e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    return events, sizes


def _cost(events: Sequence[int], sizes: Sequence[int], out: Any) -> KernelCost | None:
    # The outputs are still alive when the profile ends: what remains allocated is theirs.
    cur = high = 0
    for n in events:
        cur += n
        high = max(high, cur)
    fixes: list[int | None] = []
    for fake, real in zip(_out_tensors(out), sizes, strict=False):
        fixes.append(real if real != fake.untyped_storage().nbytes() else None)
    scratch = max(high - cur, 0)
    if not scratch and not any(f is not None for f in fixes):
        return None
    return KernelCost(scratch, tuple(fixes))


def _extrapolate(func: Any, runs: list[tuple[list[int], list[int]]], batch: int, out: Any,
                 notes: list[str]) -> KernelCost | None:
    (e1, s1), (e2, s2), (e3, s3) = runs
    if not (len(e1) == len(e2) == len(e3) and len(s1) == len(s2) == len(s3)):
        _note(notes, f"{func}: scratch not modelled (its allocations change with the batch size)")
        return None
    for a, b, c in (*zip(e1, e2, e3, strict=True), *zip(s1, s2, s3, strict=True)):
        if c - b != b - a:
            _note(notes, f"{func}: scratch not modelled (not linear in the batch size)")
            return None
    events = [a + (b - a) * (batch - 1) for a, b in zip(e1, e2, strict=True)]
    sizes = [a + (b - a) * (batch - 1) for a, b in zip(s1, s2, strict=True)]
    return _cost(events, sizes, out)


# -- probed ops -------------------------------------------------------------------------------


def _conv_dims(args: Sequence[Any]) -> dict[int, int]:
    return {0: 0}


def _conv_backward_dims(args: Sequence[Any]) -> dict[int, int]:
    return {0: 0, 1: 0}


def _rnn_dims(args: Sequence[Any]) -> dict[int, int]:
    seq_dim = 0 if args[14] else 1  # batch_first
    return {0: seq_dim, 5: 0, 6: 0}


def _rnn_backward_dims(args: Sequence[Any]) -> dict[int, int]:
    seq_dim = 0 if args[21] else 1
    dims = {0: seq_dim, 5: 0, 6: 0, 7: seq_dim, 8: 0, 9: 0, 10: seq_dim, 11: 0, 12: 0}
    return {i: d for i, d in dims.items() if isinstance(args[i], torch.Tensor)}


def _rnn_backward_prepare(real: list[Any]) -> None:
    """The workspace comes from a real forward: the meta kernel reports it as empty."""
    with torch.enable_grad():  # without grad mode the kernel keeps no workspace
        fwd = torch.ops.aten.mkldnn_rnn_layer.default(
            real[0], real[1], real[2], real[3], real[4], real[5], real[6], real[13], real[20],
            real[14], real[15], real[16], real[17], real[19], real[21], real[18],
        )
    real[7], real[8], real[9], real[22] = fwd


# -- analytic models ------------------------------------------------------------------------


def _blas_copy(m: Any) -> int:
    """Bytes the CPU BLAS path clones when matrix ``m`` has strides BLAS cannot take."""
    if not isinstance(m, torch.Tensor) or m.dim() != 2:
        return 0
    r, c = m.shape
    s0, s1 = m.stride()
    if (s1 == 1 and s0 >= max(1, c)) or (s0 == 1 and s1 >= max(1, r)):
        return 0
    return m.numel() * m.element_size()


def _mm(args: Sequence[Any]) -> int:
    a, b = args[0], args[1]
    if a.shape[1] == 0:
        return 0
    return _blas_copy(a) + _blas_copy(b)


def _addmm(args: Sequence[Any]) -> int:
    return _mm(args[1:3])


def _bmm(args: Sequence[Any]) -> int:
    a, b = args[0], args[1]
    if a.shape[0] == 0:
        return 0
    if a.shape[2] * a.shape[1] * b.shape[2] < 400:  # small problems take a copy-free loop
        return 0
    return _blas_copy(a[0]) + _blas_copy(b[0])


def _baddbmm(args: Sequence[Any]) -> int:
    return _bmm(args[1:3])


def _batch_norm_outputs(args: Sequence[Any]) -> tuple[int | None, ...]:
    """In eval mode the meta kernel returns empty ``save_mean``/``save_invstd``; the CPU
    kernel returns one accumulator-typed value per channel each (freed by its caller)."""
    x, training = args[0], args[5]
    if training or x.dim() < 2:
        return ()
    acc = 8 if x.dtype == torch.float64 else 4
    return (None, x.shape[1] * acc, x.shape[1] * acc)


def table(device_type: str) -> ScratchModels:
    """The scratch models for kernels of ``device_type``."""
    aten = torch.ops.aten
    models = ScratchModels(device_type)
    if device_type != "cpu":
        return models
    models.wrap_numbers = True
    models.analytic = {
        aten.mm.default: _mm,
        aten.addmm.default: _addmm,
        aten.bmm.default: _bmm,
        aten.baddbmm.default: _baddbmm,
    }
    models.outputs = {aten.native_batch_norm.default: _batch_norm_outputs}
    models.probed = {
        aten.convolution.default: Probe(_conv_dims),
        aten.convolution_backward.default: Probe(_conv_backward_dims),
        aten.mkldnn_rnn_layer.default: Probe(_rnn_dims),
        aten.mkldnn_rnn_layer_backward.default: Probe(_rnn_backward_dims, _rnn_backward_prepare),
    }
    return models

