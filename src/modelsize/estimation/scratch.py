"""Kernel scratch: memory the allocator hands out during an op that no output tensor owns.

Fake tensors see an op's inputs and outputs, not what the real kernel allocates while it
runs. Two kinds of models fill the gap on CPU:

* **analytic**, where the rule is simple and device-independent: the CPU BLAS path of ``mm``,
  ``addmm``, ``bmm`` and ``baddbmm`` clones an operand whose strides BLAS cannot take (an
  expanded or sliced gradient, say) into a contiguous temporary; the CTC loss backward keeps a
  ``log_beta`` table the size of the forward's ``log_alpha``; a sparse COO ``_coalesce``
  sorts its indices (three ``nnz``-long int64 buffers), ``sparse_mask`` gathers the dense rows
  it keeps (see :mod:`modelsize.estimation.fake_rules` for their outputs);
* **probed**, where the kernel's buffers depend on the instruction set, the shapes, the layout
  and the thread count. For those ops the tracker runs the real kernel once per distinct
  signature on zero-filled inputs under the CPU profiler and reads the allocator's own
  events. Signatures too large to run are scaled down along the batch dimension and
  extrapolated linearly, event by event (checked on a third size; when that check fails, or
  when even the smallest batch would need more than :data:`PROBE_LIMIT` bytes, the op is left
  unmodelled and named in the estimate's notes with a bound on what is missing).

The probed kernels, each found by comparing a real run with its fake twin, allocation by
allocation, on common models (transformers' BERT, GPT-2, Llama, T5, ViT, Whisper, Wav2Vec2,
SegFormer, ResNet; ``torch.nn`` transformers, recurrent nets and U-Net parts):

* oneDNN convolutions and LSTMs: reordered inputs and weights, primitive scratch pads, the LSTM
  workspace that PyTorch's meta kernel reports as 0 bytes;
* bfloat16 and float16 ``mm``, ``addmm``, ``bmm`` and ``baddbmm`` on a CPU where PyTorch runs
  them through oneDNN (``use_mkldnn_matmul``: AVX512-BF16 or AMX for bfloat16, AVX512-FP16 or
  AMX-FP16 for float16; float32 too under a reduced ``fp32_precision``): the primitive's
  scratch pad and packed operands, 0.2 to 3 times the operands' size and not linear in any
  dimension, so each signature runs at its full size (up to :data:`PROBE_LIMIT`). Elsewhere
  those calls take the BLAS path above. Which path runs depends on this CPU, so the
  estimate's notes say so when a oneDNN matmul's scratch was counted;
* the fused inference fast paths of ``nn.TransformerEncoderLayer`` and
  ``nn.MultiheadAttention`` (``_transformer_encoder_layer_fwd``,
  ``_native_multi_head_attention``): their meta kernels return the output alone, while the
  CPU kernels run the whole layer inside (QKV projection, the attention matrix, the
  feed-forward activations): 10x the output at 4 x 128 tokens;
* ``_safe_softmax``, the softmax of SDPA's math path (a boolean mask as large as the scores),
  and, on AMX-FP16 CPUs only, the CPU flash attention (elsewhere computed by
  :mod:`modelsize.estimation.flash`: per-thread blocks, and a copy of ``grad_out`` in the
  backward);
* ``native_batch_norm_backward`` (a temporary the size of the input);
  ``native_layer_norm_backward`` (per-thread partial sums);
* 2-d nearest/bilinear upsampling, whose vectorized kernel converts the input and the output
  to channels-last and back when the output is small;
* kernels that copy an input they cannot read in place, probed only when an input is not
  contiguous: softmax and log-softmax (forward and backward), layer norm, ``gelu_backward``,
  ``embedding`` and ``embedding_dense_backward``, upsampling backward;
* pointwise ops whose tensor arguments differ in dtype (``Tag.pointwise``, probed then): the
  CPU TensorIterator promotes each input of another dtype than the computation's to a
  temporary copy in that dtype (``op.tensor().to(common_dtype)`` in ``compute_types``), and
  an in-place or ``out=`` result of another dtype to a temporary it copies back. Under
  autocast that is a float32 copy of a half activation added to a float32 buffer (BART's and
  Pegasus's ``final_logits_bias``: a copy of the logits), a size the meta kernel never
  allocates. CUDA kernels cast as they load: no copy.

Each model returns the bytes the kernel holds beyond its outputs at its high-water mark; a
probed op can also correct the size of an output the meta kernel gets wrong.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from modelsize.estimation import flash, probe_cache

#: Probes run real kernels; above this many bytes of real memory they scale the batch down.
PROBE_BUDGET = 64 * 2**20
#: ... and above this many, even at the smallest batch they can run, they do not run at all.
PROBE_LIMIT = 1024 * 2**20


@dataclass
class KernelCost:
    """What a real kernel costs beyond what its fake twin shows."""

    scratch: int = 0
    output_nbytes: tuple[int | None, ...] = ()
    order: tuple[int, ...] = ()
    """The order in which the kernel allocates its outputs (indices into them), when it is
    not the order they are returned in."""
    parts: tuple[int, ...] = ()
    """The separate allocations ``scratch`` is made of, in the order the kernel makes them
    (freed in reverse), where it makes more than one."""


Key = int | str  # a positional argument's index, or a keyword argument's name
BatchDims = Callable[[Sequence[Any], dict[str, Any]], dict[Key, int]]
Bound = Callable[[Sequence[Any], dict[str, Any]], int]
Prepare = Callable[[list[Any]], None]


@dataclass
class Probe:
    """How to run one op for real.

    ``batch_dims`` says which dimension of which argument is the batch (for an int-list
    argument, which element; for an int argument, 0), ``prepare`` sets up real inputs the
    zero-filled ones cannot stand for, ``when`` limits probing to the calls that can allocate
    (the others cost nothing), and ``bound`` is an upper bound of the scratch (checked against
    the probes in the tests), used to decide whether a real run fits and, when none does, for
    the note that says how much may be missing. ``reads_values`` marks the calls whose
    allocations depend on tensor values, which zero-filled inputs cannot stand for: those are
    not run, only noted.
    """

    batch_dims: BatchDims
    prepare: Prepare | None = None
    when: Callable[[Sequence[Any], dict[str, Any]], bool] | None = None
    bound: Bound | None = None
    reads_values: Callable[[Sequence[Any], dict[str, Any]], bool] | None = None
    scalable: bool = True
    """False: the scratch is not linear in the batch, so a call runs at its full size (up to
    :data:`PROBE_LIMIT`) or not at all."""
    note: str = ""
    """Added to the estimate's notes once a call of this op had scratch (``{dtype}``: the
    first tensor argument's dtype)."""


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
    promotion: Probe | None = None
    """The probe of a pointwise op whose tensor arguments differ in dtype (any pointwise op
    not otherwise modelled), or None."""
    onednn_matmul: frozenset[torch.dtype] = frozenset()
    """The dtypes whose CPU matmuls run through oneDNN on this machine (:func:`onednn_matmul`)."""
    _said: list[str] | None = None
    """The notes the probe now running gave (kept with its answer)."""
    costs: dict[Any, Callable[[Sequence[Any]], KernelCost | None]] = field(default_factory=dict)
    """Analytic models that also correct outputs (CUDA kernels: their workspaces, the
    outputs a meta kernel sizes differently)."""
    libraries: dict[Any, Callable[[Sequence[Any]], str | None]] = field(default_factory=dict)
    """The library whose handle a call uses (``"cublas"``, ``"cublaslt"``), which allocates
    its workspace on the first call of each thread (:mod:`modelsize.estimation.device`)."""
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

    def covers(self, func: Any) -> bool:
        """Whether some call of ``func`` may have scratch here (asked once per op)."""
        return (func in self.analytic or func in self.probed or func in self.outputs
                or func in self.costs or func in self.libraries
                or (self.promotion is not None and _promotes(func)))

    def cost(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any],
             out: Any) -> KernelCost | None:
        """The scratch (and output corrections) of one op call, or None when it has none.

        An op both analytic and probed is modelled analytically, unless its probe has a
        ``when`` that holds for the call (a matmul on the oneDNN path; elsewhere BLAS).
        """
        model = self.costs.get(func)
        if model is not None:
            return model(args)
        probe = self.probed.get(func)
        if probe is not None and probe.when is not None and not probe.when(args, kwargs):
            probe = None
        fn = self.analytic.get(func)
        if fn is not None and (probe is None or probe.when is None):
            n = fn(args)
            return KernelCost(n) if n else None
        fix = self.outputs.get(func)
        if fix is not None:
            return KernelCost(0, fix(args))
        if probe is None and fn is None and self.promotion is not None and _promotes(func):
            promotion = self.promotion
            if promotion.when is None or promotion.when(args, kwargs):
                probe = promotion
        if probe is None:
            return None
        key = (func, torch.is_grad_enabled(), _aliasing(args, kwargs),
               *(_signature(a) for a in args),
               *sorted((k, _signature(v)) for k, v in kwargs.items()))
        if key not in self.cache:
            self.cache[key] = self._shared_probe(key, func, args, kwargs, out, probe)
        cost = self.cache[key]
        if cost is not None and cost.scratch and probe.note:
            first = next((a for a in _flat(args, kwargs) if isinstance(a, torch.Tensor)), None)
            dtype = str(first.dtype).replace("torch.", "") if first is not None else "?"
            _note(self.notes, probe.note.format(dtype=dtype))
        return cost

    def _shared_probe(self, key: tuple[Any, ...], func: Any, args: Sequence[Any],
                      kwargs: dict[str, Any], out: Any, probe: Probe) -> KernelCost | None:
        """:meth:`_probe`, answered from an earlier probe of the same call under the same
        settings where there is one, in this process or on this machine
        (:mod:`modelsize.estimation.probe_cache`); the notes it gave are given again."""
        text = probe_cache.key((self.device_type, sorted(map(str, self.onednn_matmul)),
                                torch.get_num_threads(), torch.backends.mkldnn.is_available()
                                and torch.backends.mkldnn.enabled, PROBE_BUDGET, PROBE_LIMIT,
                                key))
        known = probe_cache.lookup(text) if text is not None else None
        if known is None:
            runs, self._said = self.probes_run, []
            try:
                cost = self._probe(func, args, kwargs, out, probe)
                known = (None if cost is None else [
                    cost.scratch, list(cost.output_nbytes), list(cost.order), list(cost.parts)],
                    tuple(self._said), self.probes_run - runs)
            finally:
                self._said = None
            if text is not None and not torch.autograd.profiler._is_profiler_enabled:
                probe_cache.store(text, known)  # (under a running profiler nothing ran)
            return cost
        fields, said, runs = known
        self.probes_run += runs
        for note in said:
            _note(self.notes, note)
        if fields is None:
            return None
        scratch, nbytes, order, parts = fields
        return KernelCost(scratch, tuple(nbytes), tuple(order), tuple(parts))

    def _probe(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any,
               probe: Probe) -> KernelCost | None:
        bound = probe.bound(args, kwargs) if probe.bound is not None else None
        if torch.autograd.profiler._is_profiler_enabled:
            self._missing(func, "a profiler is already running", bound)
            return None
        if probe.reads_values is not None and probe.reads_values(args, kwargs):
            self._missing(func, "its allocations depend on tensor values", bound)
            return None
        nbytes = sum(_span(t) for t in _distinct(args, kwargs))
        nbytes += sum(_span(t) for t in _out_tensors(out)) + (bound or 0)
        dims = probe.batch_dims(args, kwargs)
        batches = {_size_at(_arg(args, kwargs, k), d) for k, d in dims.items()}
        batch = batches.pop() if len(batches) == 1 else None
        try:
            if nbytes <= PROBE_BUDGET or (
                batch is not None and batch <= 3 and nbytes <= PROBE_LIMIT
            ) or (not probe.scalable and nbytes <= PROBE_LIMIT):
                self.probes_run += 1
                events, sizes = _run(func, args, kwargs, {}, probe.prepare)
                return _cost(events, sizes, out)
            if batch is None or not probe.scalable:
                self._missing(func, f"a real run needs {nbytes} bytes" if not probe.scalable
                              else "too large to run, no batch dim", bound)
                return None
            if batch <= 3 or nbytes * 3 // batch > PROBE_LIMIT:
                self._missing(func, f"a real run needs {nbytes * min(batch, 3) // batch} bytes",
                              bound)
                return None
            self.probes_run += 3
            runs = [_run(func, args, kwargs, {k: (d, n) for k, d in dims.items()}, probe.prepare)
                    for n in (1, 2, 3)]
        except (RuntimeError, ValueError, IndexError) as exc:
            self._missing(func, f"probe failed: {str(exc).splitlines()[0][:120]}", bound)
            return None
        cost = _extrapolate(runs, batch, out)
        if isinstance(cost, str):
            self._missing(func, cost, bound, verb="modelled")
            return None
        return cost

    def _missing(self, func: Any, why: str, bound: int | None, verb: str = "probed") -> None:
        """Name an op whose scratch is not counted, with a bound on it when there is one."""
        tail = f"; up to {bound} bytes of it are not counted" if bound else ""
        text = f"{func}: scratch not {verb} ({why}){tail}"
        _note(self.notes, text)
        if self._said is not None:
            self._said.append(text)


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
    """A zero-filled real CPU tensor with ``a``'s layout (``resize``: (dim, new size)).

    An int list or an int that stands for a size gets the new size at the ``resize`` element.
    """
    if isinstance(a, torch.Tensor):
        shape, stride, offset = list(a.shape), list(a.stride()), a.storage_offset()
        if resize is not None:
            shape[resize[0]] = resize[1]
            stride, offset = _strides_like(shape, stride), 0
        span = 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True)) if all(shape) else 0
        base = torch.zeros(span + offset, dtype=a.dtype, device="cpu")
        return base.as_strided(shape, stride, offset)
    if resize is not None and isinstance(a, int):
        return resize[1]
    if resize is not None and isinstance(a, (list, tuple)):
        items = list(a)
        items[resize[0]] = resize[1]
        return type(a)(items)
    if isinstance(a, (list, tuple)):
        return type(a)(_real(x) for x in a)
    return a


def _arg(args: Sequence[Any], kwargs: dict[str, Any], key: Key) -> Any:
    if isinstance(key, str):
        return kwargs.get(key)
    return args[key] if key < len(args) else None


def _size_at(a: Any, d: int) -> int:
    if isinstance(a, torch.Tensor):
        return int(a.shape[d])
    if isinstance(a, (list, tuple)):
        return int(a[d])
    return int(a)


def _flat(args: Sequence[Any], kwargs: dict[str, Any]) -> list[Any]:
    out: list[Any] = []
    for a in (*args, *(kwargs[k] for k in sorted(kwargs))):
        out.extend(a if isinstance(a, (list, tuple)) else (a,))
    return out


def _distinct(args: Sequence[Any], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for t in _flat(args, kwargs):
        if isinstance(t, torch.Tensor):
            seen.setdefault(id(t), t)
    return list(seen.values())


def _aliasing(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[int, ...]:
    """Which tensor arguments are the same tensor: kernels branch on it (MHA's ``q is k``)."""
    first: dict[int, int] = {}
    return tuple(first.setdefault(id(t), i) for i, t in enumerate(_flat(args, kwargs))
                 if isinstance(t, torch.Tensor))


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Silence the profiler library's own start/stop lines, written straight to fd 2 (also
    around :mod:`modelsize.estimation.verify`'s real runs)."""
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
    resize: dict[Key, tuple[int, int]], prepare: Prepare | None,
) -> tuple[list[int], list[int]]:
    """Run ``func`` for real; return the allocator's events and the real outputs' sizes."""
    from torch.profiler import ProfilerActivity, profile

    made: dict[tuple[int, Any], Any] = {}  # one real tensor per fake one: kernels test q is k

    def real(a: Any, size: tuple[int, int] | None) -> Any:
        if isinstance(a, torch.Tensor):
            if (id(a), size) not in made:
                made[id(a), size] = _real(a, size)
            return made[id(a), size]
        if isinstance(a, (list, tuple)) and size is None:
            return type(a)(real(x, None) for x in a)
        return _real(a, size)

    real_args = [real(a, resize.get(i)) for i, a in enumerate(args)]
    real_kwargs = {k: real(v, resize.get(k)) for k, v in kwargs.items()}
    # Grad mode stays the caller's: some kernels (the oneDNN LSTM) only keep a workspace when
    # it is on. The real arguments do not require grad, so no graph is recorded.
    if prepare is not None:
        prepare(real_args)
    with quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
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


def _extrapolate(runs: list[tuple[list[int], list[int]]], batch: int,
                 out: Any) -> KernelCost | str | None:
    """The cost at ``batch`` from runs at batch 1, 2 and 3, or why there is none."""
    (e1, s1), (e2, s2), (e3, s3) = runs
    if not (len(e1) == len(e2) == len(e3) and len(s1) == len(s2) == len(s3)):
        return "its allocations change with the batch size"
    for a, b, c in (*zip(e1, e2, e3, strict=True), *zip(s1, s2, s3, strict=True)):
        if c - b != b - a:
            return "not linear in the batch size"
    events = [a + (b - a) * (batch - 1) for a, b in zip(e1, e2, strict=True)]
    sizes = [a + (b - a) * (batch - 1) for a, b in zip(s1, s2, strict=True)]
    return _cost(events, sizes, out)


# -- probed ops -------------------------------------------------------------------------------


def _conv_dims(args: Sequence[Any], kwargs: dict[str, Any]) -> dict[Key, int]:
    return {0: 0}


def _conv_backward_dims(args: Sequence[Any], kwargs: dict[str, Any]) -> dict[Key, int]:
    return {0: 0, 1: 0}


def _rnn_dims(args: Sequence[Any], kwargs: dict[str, Any]) -> dict[Key, int]:
    seq_dim = 0 if args[14] else 1  # batch_first
    return {0: seq_dim, 5: 0, 6: 0}


def _rnn_backward_dims(args: Sequence[Any], kwargs: dict[str, Any]) -> dict[Key, int]:
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


def _leading(*keys: Key) -> BatchDims:
    """Dimension 0 of the listed tensor arguments that have one of the first one's size.

    A mask that broadcasts over the batch (size 1) is left as it is.
    """

    def dims(args: Sequence[Any], kwargs: dict[str, Any]) -> dict[Key, int]:
        out: dict[Key, int] = {}
        size = None
        for k in keys:
            t = _arg(args, kwargs, k)
            if isinstance(t, torch.Tensor) and t.dim() > 0:
                size = t.shape[0] if size is None else size
                if t.shape[0] == size:
                    out[k] = 0
        return out

    return dims


def _attention_dims(mask_at: int, type_at: int, *keys: Key) -> BatchDims:
    """The fused MHA kernels: the inputs, and the mask when it has a batch dimension.

    ``mask_type`` 1 is a key padding mask ``(B, S)``, 2 a merged ``(B, H, L, S)`` one; 0 (an
    ``(L, S)`` attention mask) has none.
    """
    inputs = _leading(*keys)

    def dims(args: Sequence[Any], kwargs: dict[str, Any]) -> dict[Key, int]:
        out = inputs(args, kwargs)
        if _arg(args, kwargs, type_at) in (1, 2) and isinstance(_arg(args, kwargs, mask_at),
                                                                torch.Tensor):
            out[mask_at] = 0
        return out

    return dims


def _sdpa_dims(*keys: Key) -> BatchDims:
    """Flash attention: ``(B, H, L, D)`` inputs, and a 4-d mask with the batch's size."""
    inputs = _leading(*keys)

    def dims(args: Sequence[Any], kwargs: dict[str, Any]) -> dict[Key, int]:
        out = inputs(args, kwargs)
        mask, first = kwargs.get("attn_mask"), _arg(args, kwargs, keys[0])
        if (isinstance(mask, torch.Tensor) and mask.dim() == 4
                and mask.shape[0] == first.shape[0]):
            out["attn_mask"] = 0
        return out

    return dims


def _all_leading(args: Sequence[Any], kwargs: dict[str, Any]) -> dict[Key, int]:
    """Dimension 0 of every tensor argument with the first one's size (ops on activations)."""
    keys: list[Key] = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    keys += [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    return _leading(*keys)(args, kwargs)


def _any_non_contiguous(args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    return any(isinstance(t, torch.Tensor) and not t.is_contiguous() for t in _flat(args, kwargs))


def _non_contiguous(*keys: Key) -> Callable[[Sequence[Any], dict[str, Any]], bool]:
    """Probe only when one of these arguments is not contiguous (the kernel copies it)."""

    def when(args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
        return any(isinstance(t, torch.Tensor) and not t.is_contiguous()
                   for t in (_arg(args, kwargs, k) for k in keys))

    return when


@functools.cache
def _promotes(func: Any) -> bool:
    """A pointwise op (TensorIterator) that draws no random numbers: one a probe may run."""
    tags = getattr(func, "tags", ())
    return torch.Tag.pointwise in tags and torch.Tag.nondeterministic_seeded not in tags


def _mixed_dtypes(args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Tensor arguments of more than one dtype (the kernel may promote some of them)."""
    dtypes = {t.dtype for t in _flat(args, kwargs) if isinstance(t, torch.Tensor)}
    return len(dtypes) > 1


def _promotion_bound(args: Sequence[Any], kwargs: dict[str, Any]) -> int:
    """Every tensor argument copied to an 8-byte dtype, and the result once more."""
    largest = max((t.numel() for t in _flat(args, kwargs) if isinstance(t, torch.Tensor)),
                  default=0)
    return 8 * (sum(t.numel() for t in _flat(args, kwargs) if isinstance(t, torch.Tensor))
                + largest) + 64


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _mha_bound(args: Sequence[Any], kwargs: dict[str, Any]) -> int:
    """Projections, the per-head copies, the scores and the weights, twice over."""
    q, k = args[0], args[1]
    (b, n, _), s, e, h = q.shape, k.shape[1], int(args[3]), int(args[4])
    return q.element_size() * (2 * b * h * n * s + 12 * b * max(n, s) * e)


def _encoder_bound(args: Sequence[Any], kwargs: dict[str, Any]) -> int:
    """The attention block's bound plus the feed-forward activations, twice over."""
    x, e, h, hidden = args[0], int(args[1]), int(args[2]), int(args[14].shape[0])
    b, n = x.shape[0], x.shape[1]
    return x.element_size() * (2 * b * h * n * n + 12 * b * n * e + 2 * b * n * hidden)


def _flash_blocks(d: int) -> int:
    """Twice the float32 blocks each thread works on (at most 256 queries x 512 keys)."""
    return 8 * torch.get_num_threads() * (256 * 512 + 256 * (d + 2)) * 2


def _flash_bound(args: Sequence[Any], kwargs: dict[str, Any]) -> int:
    q = args[0]
    return _flash_blocks(q.shape[-1]) + 4 * q.numel()


def _flash_backward_bound(args: Sequence[Any], kwargs: dict[str, Any]) -> int:
    q, k = args[1], args[2]
    return _flash_blocks(q.shape[-1]) + 4 * (q.numel() + 2 * k.numel())


def _safe_softmax_bound(args: Sequence[Any], kwargs: dict[str, Any]) -> int:
    x = args[0]
    return x.numel() * (x.element_size() + 2) + 64


def _loss_bound(args: Sequence[Any], kwargs: dict[str, Any]) -> int:
    """An elementwise loss buffer, a second one for the reduction, and a few scalars."""
    return 3 * _nbytes(args[0]) + 64


def _twice_first(args: Sequence[Any], kwargs: dict[str, Any]) -> int:
    return 2 * _nbytes(args[0]) + 4096 * torch.get_num_threads()


def _twice_all(args: Sequence[Any], kwargs: dict[str, Any]) -> int:
    return 2 * sum(_nbytes(t) for t in _flat(args, kwargs)) + 4096 * torch.get_num_threads()


def _upsample_bound(args: Sequence[Any], kwargs: dict[str, Any]) -> int:
    """The channels-last input and output, and per-thread index and weight tables."""
    x, size = args[0], [int(n) for n in args[1]]
    out = x.shape[0] * x.shape[1] * math.prod(size) * x.element_size()
    return _nbytes(x) + out + 64 * sum(size) * torch.get_num_threads()


def _upsample_backward_dims(args: Sequence[Any], kwargs: dict[str, Any]) -> dict[Key, int]:
    return {0: 0, 2: 0}  # the gradient, and the batch in ``input_size``


def _no_batch(args: Sequence[Any], kwargs: dict[str, Any]) -> dict[Key, int]:
    return {}  # flattened indices: scaling the bags down is not a resize of one dimension


def _embedding_bag_bound(args: Sequence[Any], kwargs: dict[str, Any]) -> int:
    """Two ``offset2bag`` tables (one entry per index, plus one) and per-bag counts."""
    return 16 * (args[1].numel() + 1) + 16 * args[2].numel() + 4096


def _embedding_bag_backward_bound(args: Sequence[Any], kwargs: dict[str, Any]) -> int:
    """Sorted indices, their order and counts; for ``max``, copies of the gradient."""
    return 64 * (args[1].numel() + 1) + 4 * _nbytes(args[0])


def _weight_norm_bound(args: Sequence[Any], kwargs: dict[str, Any]) -> int:
    """Per-thread float64 partial norms along the kept dimension (forward and backward)."""
    backward = len(args) >= 4
    v = args[1] if backward else args[0]
    dim = int(_arg(args, kwargs, 4 if backward else 2) or kwargs.get("dim", 0))
    return 32 * (torch.get_num_threads() + 1) * int(v.shape[dim]) + 64


def _euclidean_bound(args: Sequence[Any], kwargs: dict[str, Any]) -> int:
    """Both inputs widened by two columns (norms and ones), their norms, twice over."""
    return 2 * sum(_nbytes(t) * (t.shape[-1] + 3) // max(t.shape[-1], 1) for t in args[:2])


def _batch_norm_bound(args: Sequence[Any], kwargs: dict[str, Any]) -> int:
    """Per-channel statistics in float64, per thread."""
    x = args[0]
    return 16 * (x.shape[1] if x.dim() > 1 else 1) * (torch.get_num_threads() + 2)


def _group_norm_backward_dims(args: Sequence[Any], kwargs: dict[str, Any]) -> dict[Key, int]:
    return {0: 0, 1: 0, 2: 0, 3: 0, 5: 0}  # the int ``N`` is the batch too


def _group_norm_backward_bound(args: Sequence[Any], kwargs: dict[str, Any]) -> int:
    """Per-sample, per-channel float64 partial sums, twice."""
    return 32 * int(args[5]) * int(args[6]) + 4096 * torch.get_num_threads()


def _layer_norm_backward_bound(args: Sequence[Any], kwargs: dict[str, Any]) -> int:
    """Copies of both inputs, and per-thread float64 partial sums of the weight grads."""
    width = math.prod(int(n) for n in args[2])
    return 2 * (_nbytes(args[0]) + _nbytes(args[1])) + 32 * width * torch.get_num_threads()


def _embedding_backward_bound(args: Sequence[Any], kwargs: dict[str, Any]) -> int:
    """A copy of the gradient, sorted indices and their order, per-row counts."""
    return _nbytes(args[0]) + 4 * _nbytes(args[1]) + 8 * int(args[2])


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


def onednn_matmul() -> frozenset[torch.dtype]:
    """The dtypes whose CPU ``mm``/``addmm``/``bmm``/``baddbmm`` PyTorch runs through oneDNN
    on this machine (``use_mkldnn_matmul`` in ATen's ``mkldnn/Matmul.cpp``): bfloat16 where
    oneDNN supports it here, float16 likewise, float32 under a reduced ``fp32_precision``."""
    mkldnn = torch.backends.mkldnn
    if not (mkldnn.is_available() and mkldnn.enabled):
        return frozenset()
    out = set()
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        out.add(torch.bfloat16)
    if torch.ops.mkldnn._is_mkldnn_fp16_supported():
        out.add(torch.float16)
    matmul = getattr(mkldnn, "matmul", None)
    if (getattr(matmul, "fp32_precision", "none") in ("bf16", "tf32")
            or torch.get_float32_matmul_precision() != "highest"):
        out.add(torch.float32)
    return frozenset(out)


def cpu_description() -> str:
    """This CPU's vector extensions as PyTorch sees them: ``AVX512, AMX-BF16, AVX512-FP16``."""
    caps: dict[str, Any] = getattr(torch.cpu, "get_capabilities", dict)()
    named = [torch.backends.cpu.get_cpu_capability()]
    for key, name in (("amx_bf16", "AMX-BF16"), ("amx_fp16", "AMX-FP16"),
                      ("avx512_bf16", "AVX512-BF16"), ("avx512_fp16", "AVX512-FP16")):
        if caps.get(key):
            named.append(name)
    return ", ".join(named)


def _matmul_operands(args: Sequence[Any], at: int) -> tuple[Any, Any]:
    return args[at], args[at + 1]


def _onednn_when(at: int, dtypes: frozenset[torch.dtype]
                 ) -> Callable[[Sequence[Any], dict[str, Any]], bool]:
    """A matmul whose operands (at ``at`` and ``at + 1``) take the oneDNN path here."""

    def when(args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
        a, b = _matmul_operands(args, at)
        return a.dtype in dtypes and b.dtype == a.dtype and a.numel() > 0 and b.numel() > 0

    return when


def _matmul_bound(at: int) -> Bound:
    """Twice the operands and the result in float32, and 32 KiB per thread (the largest
    measured: 3x the operands for small problems, 0.03-0.7x for large ones)."""

    def bound(args: Sequence[Any], kwargs: dict[str, Any]) -> int:
        a, b = _matmul_operands(args, at)
        rows, inner, cols = a.shape[-2], a.shape[-1], b.shape[-1]
        batch = a.shape[0] if a.dim() == 3 else 1
        return 8 * batch * (rows * inner + inner * cols + rows * cols) + (
            32768 * (torch.get_num_threads() + 1))

    return bound


def _dtype_of(at: int, dtypes: set[torch.dtype] | frozenset[torch.dtype]
              ) -> Callable[[Sequence[Any], dict[str, Any]], bool]:
    """The tensor argument at ``at`` has one of ``dtypes``."""

    def when(args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
        return isinstance(args[at], torch.Tensor) and args[at].dtype in dtypes

    return when


def _grouped_mm_bound(args: Sequence[Any], kwargs: dict[str, Any]) -> int:
    """The largest group's GEMM can be no larger than the whole problem's."""
    a, b = args[0], args[1]
    threads = torch.get_num_threads()
    return 8 * (a.numel() + b.numel() + a.shape[-2] * b.shape[-1]) + 32768 * (threads + 1)


def _ctc_backward(args: Sequence[Any]) -> int:
    """``log_beta``, shaped like the forward's ``log_alpha`` (measured: exactly its size)."""
    return _nbytes(args[6])


def _sparse_parts(t: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A sparse COO tensor's indices and values, read without dispatch."""
    with torch._C._DisableTorchDispatch():
        return t._indices(), t._values()


def _coalesce(args: Sequence[Any]) -> int:
    """``_coalesce``: sort's values and order and an ``arange`` (``nnz`` int64s each), and the
    flattened indices with more than one sparse dimension (measured)."""
    indices, _ = _sparse_parts(args[0])
    nnz = int(indices.shape[1])
    return 8 * nnz * (4 if indices.shape[0] > 1 else 3)


def _sparse_mask(args: Sequence[Any]) -> int:
    """``dense.sparse_mask(mask)``: a one-element ones and the dense rows gathered at the
    mask's indices (measured)."""
    dense, mask = args[0], args[1]
    if mask.layout is not torch.sparse_coo or dense.layout is not torch.strided:
        return 0
    indices, _ = _sparse_parts(mask)
    row = math.prod(dense.shape[indices.shape[0]:])
    return dense.element_size() * (1 + int(indices.shape[1]) * row)


def table(device_type: str) -> ScratchModels:
    """The scratch models for kernels of ``device_type``."""
    aten = torch.ops.aten
    models = ScratchModels(device_type)
    if device_type == "cuda":
        from modelsize.estimation.cuda_kernels import cuda_models

        cuda_models(models)
        return models
    if device_type != "cpu":
        return models
    models.wrap_numbers = True
    models.analytic = {
        aten.mm.default: _mm,
        aten.addmm.default: _addmm,
        aten.bmm.default: _bmm,
        aten.baddbmm.default: _baddbmm,
        aten._ctc_loss_backward.default: _ctc_backward,
        aten._ctc_loss_backward.Tensor: _ctc_backward,
        aten._coalesce.default: _coalesce,
        aten.sparse_mask.default: _sparse_mask,
    }
    models.analytic[aten._scaled_dot_product_flash_attention_for_cpu.default] = (
        flash.forward_scratch)
    models.analytic[aten._scaled_dot_product_flash_attention_for_cpu_backward.default] = (
        flash.backward_scratch)
    models.onednn_matmul = onednn_matmul()
    # Flash attention in a dtype whose GEMMs oneDNN runs here (its scratch pads), or in the
    # packed float16 path of AMX-FP16 CPUs, is probed; the analytic model covers the rest.
    probed_flash = models.onednn_matmul | ({torch.float16} if flash.packs_half() else set())
    note = ("cpu: {dtype} matmuls run through oneDNN on this CPU ("
            + cpu_description().replace("{", "").replace("}", "")
            + "); their scratch, counted, is this CPU's (a CPU without oneDNN support "
            "for {dtype} runs them through BLAS, without it)")
    models.probed = {
        aten.convolution.default: Probe(_conv_dims),
        aten.convolution_backward.default: Probe(_conv_backward_dims),
        aten.mkldnn_rnn_layer.default: Probe(_rnn_dims),
        aten.mkldnn_rnn_layer_backward.default: Probe(_rnn_backward_dims, _rnn_backward_prepare),
        aten._transformer_encoder_layer_fwd.default: Probe(
            _attention_dims(18, 19, 0), bound=_encoder_bound),
        aten._native_multi_head_attention.default: Probe(
            _attention_dims(9, 12, 0, 1, 2), bound=_mha_bound),
        aten._scaled_dot_product_flash_attention_for_cpu.default: Probe(
            _sdpa_dims(0, 1, 2), when=_dtype_of(0, probed_flash), bound=_flash_bound,
            note=note),
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default: Probe(
            _sdpa_dims(0, 1, 2, 3, 4, 5), when=_dtype_of(1, probed_flash),
            bound=_flash_backward_bound, note=note),
        aten._safe_softmax.default: Probe(_leading(0), bound=_safe_softmax_bound),
        aten.native_batch_norm.default: Probe(_leading(0), bound=_batch_norm_bound),
        aten.native_batch_norm_backward.default: Probe(_leading(0, 1), bound=_twice_all),
        aten.native_group_norm_backward.default: Probe(
            _group_norm_backward_dims, bound=_group_norm_backward_bound),
        aten.native_layer_norm_backward.default: Probe(
            _leading(0, 1, 3, 4), bound=_layer_norm_backward_bound),
        aten.native_layer_norm.default: Probe(
            _leading(0), when=_non_contiguous(0), bound=_twice_first),
        aten.gelu_backward.default: Probe(
            _leading(0, 1), when=_non_contiguous(0, 1), bound=_twice_all),
        aten.embedding.default: Probe(_leading(1), when=_non_contiguous(1), bound=_twice_all),
        aten.embedding_dense_backward.default: Probe(
            _leading(0, 1), when=lambda a, k: _non_contiguous(0, 1)(a, k) or bool(a[4]),
            bound=_embedding_backward_bound),
    }
    models.promotion = Probe(_all_leading, when=_mixed_dtypes, bound=_promotion_bound)
    if models.onednn_matmul:
        for matmul, at in ((aten.mm.default, 0), (aten.addmm.default, 1), (aten.bmm.default, 0),
                       (aten.baddbmm.default, 1)):
            models.probed[matmul] = Probe(_no_batch, when=_onednn_when(at, models.onednn_matmul),
                                      bound=_matmul_bound(at), scalable=False, note=note)
        # one oneDNN GEMM per group: its scratch follows the group sizes, the offsets' values
        models.probed[aten._grouped_mm.default] = Probe(
            _no_batch, when=_onednn_when(0, models.onednn_matmul), bound=_grouped_mm_bound,
            reads_values=lambda a, k: True)
    models.probed[aten._weight_norm_interface.default] = Probe(
        _no_batch, bound=_weight_norm_bound)
    models.probed[aten._weight_norm_interface_backward.default] = Probe(
        _no_batch, bound=_weight_norm_bound)
    models.probed[aten._euclidean_dist.default] = Probe(_leading(0, 1), bound=_euclidean_bound)
    for op in (aten._embedding_bag, aten._embedding_bag_forward_only):
        models.probed[op.default] = Probe(_no_batch, bound=_embedding_bag_bound)
    models.probed[aten._embedding_bag_backward.default] = Probe(
        _no_batch, bound=_embedding_bag_backward_bound,
        reads_values=lambda a, k: a[8] == 2)  # max: the scratch follows ``maximum_indices``
    # Reduced losses return a 0-dim tensor on the storage of the elementwise loss (an
    # input-sized output the meta kernel reports as one element), some after a second buffer.
    for op in (aten.mse_loss, aten.smooth_l1_loss, aten.huber_loss, aten.binary_cross_entropy,
               aten.binary_cross_entropy_with_logits, aten.soft_margin_loss):
        models.probed[op.default] = Probe(_all_leading, bound=_loss_bound)
    # Kernels that copy a non-contiguous input (a transposed view, an expanded gradient).
    for op in (aten.max_pool2d_with_indices, aten.max_pool3d_with_indices, aten.avg_pool2d,
               aten.avg_pool3d, aten._adaptive_avg_pool2d, aten._adaptive_avg_pool3d,
               aten.adaptive_max_pool2d, aten.adaptive_max_pool3d,
               aten.max_pool2d_with_indices_backward, aten.max_pool3d_with_indices_backward,
               aten.avg_pool2d_backward, aten.avg_pool3d_backward,
               aten._adaptive_avg_pool2d_backward, aten._adaptive_avg_pool3d_backward,
               aten.adaptive_max_pool2d_backward, aten.adaptive_max_pool3d_backward,
               aten.pixel_shuffle, aten.pixel_unshuffle):
        models.probed[op.default] = Probe(_all_leading, when=_any_non_contiguous,
                                          bound=_twice_all)
    for op in (aten._softmax, aten._log_softmax):
        models.probed[op.default] = Probe(
            _leading(0), when=_non_contiguous(0), bound=_twice_first)
    for op in (aten._softmax_backward_data, aten._log_softmax_backward_data):
        models.probed[op.default] = Probe(
            _leading(0, 1), when=_non_contiguous(0, 1), bound=_twice_all)
    for op in (aten.upsample_nearest2d, aten._upsample_nearest_exact2d,
               aten.upsample_bilinear2d, aten.upsample_bicubic2d):
        models.probed[op.default] = Probe(_leading(0), bound=_upsample_bound)
    for op in (aten.upsample_nearest2d_backward, aten._upsample_nearest_exact2d_backward,
               aten.upsample_bilinear2d_backward, aten.upsample_bicubic2d_backward):
        models.probed[op.default] = Probe(
            _upsample_backward_dims, when=_non_contiguous(0), bound=_twice_first)
    return models

