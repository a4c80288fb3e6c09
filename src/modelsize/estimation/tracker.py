"""The counter: a fake-tensor mode that keeps the live bytes of every storage the program creates.

Every tensor op runs on fake tensors (metadata only, no data, no real memory). After each op
the tracker registers the storages of its outputs that it has not seen yet and attaches a
weak-reference finalizer to each, so a storage is counted from the op that allocated it until
the moment Python or C++ drops its last reference: views share a storage and count once, and
frees happen exactly where the real allocator would see them. Once the program has ended
(:meth:`CountingFakeMode.end_program`), frees are no longer stamped: what outlives the program
stays unfreed, however soon the garbage collector reaches the trace's own reference cycles.
Bytes that no tensor owns (kernel scratch, see :mod:`modelsize.estimation.scratch`) are added
for the duration of the op.

Where a fake run and a real CPU run part ways, and what bridges them (each one found by
comparing the two, allocation by allocation, against the CPU profiler; see tests/estimate):

* FakeTensorMode runs some ops through Python decompositions that dispatch their parts back
  through the mode: only the outer op is counted (a real kernel allocates its outputs, not the
  decomposition's intermediates), unless a real run on the target device decomposes the op
  too (:func:`modelsize.estimation.kernels.runs_as_kernel`). Those composite ops bypass the
  fake-tensor dispatch cache, which is shared by every fake mode of the process: a cached
  result would skip the parts, so the count would depend on what ran before;
* a dispatch mode makes ATen and autograd take their "tensor subclass" branches, some of
  which allocate more than a real run: the counting mode takes a real run's branch instead
  (:mod:`modelsize.estimation.kernels`: composite kernels while the mode is entered, the
  gradient accumulation of the autograd engine and a few formulas in
  :meth:`CountingFakeMode.__torch_dispatch__`);
* kernels allocate memory no output owns (BLAS operand copies, oneDNN reorders, wrapped Python
  scalars): :mod:`modelsize.estimation.scratch`;
* a few meta kernels report output sizes the CPU kernels do not produce (oneDNN LSTM
  workspace, eval-mode BatchNorm statistics): corrected by the same module;
* a meta kernel may return one tensor as two outputs where the real kernel returns two
  (``mkldnn_rnn_layer_backward``'s two bias gradients), while the fake-tensor dispatch cache
  answers the same call with two: the counting mode makes every such output its own tensor,
  as the cache does, so a trace does not depend on whether the process ran the call before
  (:meth:`CountingFakeMode._unshared`);
* autograd keeps wrapped Python scalars saved for backward: ``trace._SavedScalars``;
* activation checkpointing copies the CPU generator's state (C++, no dispatch):
  :mod:`modelsize.estimation.rng`.

Memory allocated outside PyTorch's allocator (BLAS internals, the Python heap) is invisible
here, as it is to the allocator and its profiler.

What a trace costs is mostly FakeTensorMode's dispatch, op by op. Four shortcuts through it,
each compared with FakeTensorMode's own code in tests/estimation/test_dispatch_shortcuts.py:
the dispatch cache's key made in one pass (:meth:`CountingFakeMode._cache_key`), a cache
hit's output tensor made from a template (:meth:`CountingFakeMode.new_fake`), the fake
constant of ``torch.tensor(x)`` made without the generic conversion (:func:`_lift_fresh`), and
no Dynamo wrapper around the modes' ``__torch_dispatch__`` (nothing is compiled inside a
trace).
"""

from __future__ import annotations

import bisect
import inspect
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from enum import Enum
from types import TracebackType
from typing import Any

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch._subclasses import fake_tensor as _fake_tensor
from torch._subclasses.fake_tensor import (
    FakeTensor,
    FakeTensorConfig,
    FakeTensorMode,
    _DispatchCacheKey,
)
from torch.autograd.function import BackwardCFunction
from torch.utils._mode_utils import no_dispatch

from modelsize.estimation import kernels, quant_kernels, quantized, rng
from modelsize.estimation.fake_rules import RULES
from modelsize.estimation.scratch import ScratchModels

_PROXY = torch._C._TorchDispatchModeKey.PROXY
_KEY_MARK = ("modelsize", "flat key")  # equal to nothing FakeTensorMode puts in a key
#: argument types that go into a key as themselves (FakeTensorMode's key holds them too)
_PLAIN = frozenset({int, float, bool, str, complex, type(None), torch.dtype, torch.device,
                    torch.layout, torch.memory_format})
_STRIDED = torch.strided


def _flat_key(mode: FakeTensorMode, args: Any, key: list[Any]) -> bool:
    """Append ``args`` (a tuple, list or dict) to ``key``, each item after its type; False
    where an item is not a strided fake tensor of ``mode``, a plain value or a container of
    them (``key`` is then of no use)."""
    append = key.append
    if isinstance(args, dict):
        append(dict)
        append(len(args))
        append(tuple(args))
        args = args.values()
    for a in args:
        t = type(a)
        if t is FakeTensor:
            if a.fake_mode is not mode or a.constant is not None or a.layout is not _STRIDED:
                return False
            append(FakeTensor)
            append((a.dtype, a.shape, a.stride(), a.device, a.storage_offset(),
                    a.untyped_storage().nbytes(), a.requires_grad, a.is_conj(), a.is_neg(),
                    a.is_inference(), a.is_quantized))
        elif t in _PLAIN:
            append(t)
            append(a)
        elif t is tuple or t is list or t is torch.Size:
            append(t)
            append(len(a))
            if not _flat_key(mode, a, key):
                return False
        else:
            return False
    return True


class Origin(str, Enum):
    """Where a counted storage came from (the estimator turns this into a category)."""

    PARAMETER = "parameter"
    BUFFER = "buffer"
    INPUT = "input"
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    OTHER = "other"


#: :attr:`Allocation.state` values
STATE_NONE, STATE_FLOAT, STATE_PACKED = 0, 1, 2


def packed_dtype(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` holds quantized weights: integers (packed nibbles, int8 codes) and
    1-byte floats (fp8, fp4 pairs); not bool."""
    if dtype is torch.bool or dtype.is_complex:
        return False
    return not dtype.is_floating_point or dtype.itemsize < 2


@dataclass(slots=True)
class Allocation:
    """One counted storage: its size and lifetime in ticks (one tick per op)."""

    nbytes: int
    origin: Origin
    created: int
    phase: int
    module: str
    freed: int = -1
    is_grad: bool = False
    is_state: bool = False
    saved: bool = False
    recomputed: bool = False
    host: bool = False
    """Host memory in a trace for CUDA (the CPU step counters of a foreach optimizer): not
    on the device, counted as 0 bytes."""
    op: Any = None
    """The op that allocated the storage (an ``OpOverload``), None for one tracked from
    outside an op (parameters, inputs, gradients, optimizer state)."""
    shape: tuple[int, ...] = ()
    """The shape and dtype of the tensor the storage was made for."""
    dtype: Any = None
    state: int = STATE_NONE
    """What its values derive from: :data:`STATE_NONE` (the inputs), :data:`STATE_FLOAT`
    (only parameters, buffers and constants), :data:`STATE_PACKED` (among them a quantized,
    packed weight: an integer or 1-byte float parameter or buffer)."""
    sources: tuple[Allocation, ...] = ()
    """A pointwise op's output: the records of its input-derived arguments (what it could
    be recomputed from)."""
    saved_by: tuple[str, ...] = ()
    """The autograd nodes that keep the storage for the backward, as the graph stood when
    the forward ended (``MmBackward0``; a custom Function's ``ctx`` attribute as
    ``MatMul4BitBackward.tensors``; ``checkpoint`` for a checkpointed region's inputs)."""
    kept_in: tuple[str, ...] = ()
    """The modules whose forward made those nodes."""

    def live_at(self, tick: int) -> bool:
        """Whether this storage held memory right after the op at ``tick`` allocated."""
        return self.created <= tick and (self.freed < 0 or self.freed >= tick)


@dataclass(slots=True)
class Phase:
    """A named stretch of the program (``forward`` of step 1, micro-batch 1, ...)."""

    name: str
    step: int
    micro_batch: int
    start: int
    end: int = -1


def parts(tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors whose storages hold ``tensor``'s bytes: itself when strided; a sparse COO
    tensor's indices and values; a compressed one's index arrays and values (read without
    dispatch: no op is counted)."""
    layout = tensor.layout
    if layout is torch.strided:
        return (tensor,)
    with torch._C._DisableTorchDispatch():
        if layout is torch.sparse_coo:
            return (tensor._indices(), tensor._values())
        if layout in (torch.sparse_csr, torch.sparse_bsr):
            return (tensor.crow_indices(), tensor.col_indices(), tensor.values())
        if layout in (torch.sparse_csc, torch.sparse_bsc):
            return (tensor.ccol_indices(), tensor.row_indices(), tensor.values())
    return ()


class FunctionModesOff:
    """The torch-function modes switched off for a stretch of the trace's own bookkeeping (a
    replayed block): popped on entry, pushed back in their order on exit.

    With a mode on, every torch function and every tensor attribute read calls into the
    mode's Python handler, the bookkeeping's reads of fake tensors included; a replay runs no
    op of the model for any mode to see.
    """

    __slots__ = ("modes",)

    def __enter__(self) -> None:
        pop = torch._C._pop_torch_function_stack
        self.modes = [pop() for _ in range(torch._C._len_torch_function_stack())]

    def __exit__(self, *exc: object) -> None:
        push = torch._C._push_on_torch_function_stack
        for m in reversed(self.modes):
            push(m)
        self.modes = []


_A = torch.ops.aten
#: ops that index a table (argument 0) with integer ids: the position of the ids
_INDEX_ARGS: dict[Any, int] = {
    _A.embedding.default: 1, _A.index.Tensor: 1, _A.index_select.default: 2,
    _A.gather.default: 2, _A.take.default: 1, _A._unsafe_index.Tensor: 1,
}
#: copies that make a pure function of their one argument (beside the pointwise-tagged ops)
_COPIES = frozenset({_A._to_copy.default, _A.clone.default})


def _tensors(out: Any) -> Iterator[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for item in out:
            if isinstance(item, torch.Tensor):
                yield item
            elif isinstance(item, (tuple, list)):
                yield from _tensors(item)


class CountingFakeMode(FakeTensorMode):
    """A :class:`FakeTensorMode` that counts the bytes of live storages after every op.

    ``device_type`` is the device whose kernels the count follows where a composite op runs
    as one kernel on some devices and decomposed on others (default: the scratch table's
    device, else CPU).
    """

    #: Marks fake tensors whose composite kernels take a real run's branches (kernels.py).
    counts_real_kernels = True

    def __init__(self, scratch: ScratchModels | None = None,
                 device_type: str | None = None) -> None:
        super().__init__(allow_non_fake_inputs=True)
        self.scratch = scratch
        self.device_type = device_type or (scratch.device_type if scratch else "cpu")
        self.allocations: list[Allocation] = []
        self.phases: list[Phase] = []
        self.live: dict[int, Allocation] = {}
        self.live_bytes = 0
        self.tick = 0
        self.peak_bytes = 0
        self.peak_tick = 0
        self.peak_scratch = 0
        self.peak_scratch_op = ""
        self.timeline: list[int] = []
        self.ops: list[Any] = []
        self.scratch_at: dict[int, int] = {}
        #: the separate allocations that make up ``scratch_at[tick]``, where a kernel makes
        #: more than one (a CUDA reduction's buffer and semaphores), in order
        self.scratch_parts: dict[int, tuple[int, ...]] = {}
        #: (library, on the backward thread) -> the tick of its first call: where a real run
        #: creates that thread's handle and its workspace (``ScratchModels.libraries``)
        self.first_calls: dict[tuple[str, bool], int] = {}
        self.host_rng_copies = 0  # RNG states a trace for CUDA left uncounted (rng.py)
        self.real_values: Any = None  # the trace's RealValues, for rules that read index values
        self.progress: Callable[[int], None] | None = None
        self.modules: list[str] = []
        self.origin = Origin.OTHER
        self.counting = True
        self.depth = 0
        self._ops: dict[Any, tuple[bool, Any, bool]] = {}
        self._fakes: dict[torch.device, dict[str, Any]] = {}  # new_fake's templates
        # In a trace for CUDA, ``torch.tensor(x)`` in an optimizer step makes a CPU tensor
        # (the step counters of torch.optim's for-loop and foreach paths): not GPU memory.
        self._host_ops = (frozenset({torch.ops.aten.lift_fresh.default,
                                     torch.ops.aten.lift_fresh_copy.default})
                          if self.device_type == "cuda" else frozenset())
        self._node: tuple[int, str] | None = None
        self._node_mark = 0
        self._pointwise_ops: dict[Any, bool] = {}
        #: custom autograd Functions (node names) that keep a packed weight (record_savers)
        self.packed_keepers: set[str] = set()
        #: (the next autograd sequence number, the module) at each change of module
        self.module_seq: list[tuple[int, str]] = []
        #: (tick, sequence number) of each backward node that dispatches, while not None
        #: (block_replay checks that a block's backward ran alone)
        self.node_log: list[tuple[int, int]] | None = None
        self.ended = False

    # -- registration -----------------------------------------------------------------------

    def track(self, tensor: torch.Tensor, origin: Origin) -> Allocation:
        """Count ``tensor``'s storage from now on (no-op if it is already counted); a sparse
        tensor's storages (see :func:`parts`) all, the record of its values returned."""
        if not isinstance(tensor, FakeTensor) and quantized.is_wrapper(tensor):
            return [self.track(t, origin) for t in quantized.inner_tensors(tensor)][-1]
        if tensor.layout is not torch.strided:
            recs = [self.track(t, origin) for t in parts(tensor)]
            return recs[-1] if recs else Allocation(0, origin, self.tick, 0, "")
        st = tensor.untyped_storage()
        key = st._cdata
        rec = self.live.get(key)
        if rec is not None:
            return rec
        rec = Allocation(
            nbytes=st.nbytes(),
            origin=origin,
            created=self.tick,
            phase=len(self.phases) - 1,
            module=self.modules[-1] if self.modules else "",
            recomputed=origin is Origin.BACKWARD and bool(self.modules),
            shape=tuple(tensor.shape),
            dtype=tensor.dtype,
        )
        if origin is Origin.PARAMETER or origin is Origin.BUFFER:
            rec.state = STATE_PACKED if packed_dtype(tensor.dtype) else STATE_FLOAT
        self.live[key] = rec
        self.allocations.append(rec)
        self.live_bytes += rec.nbytes
        weakref.finalize(st, self._free, key)
        return rec

    def track_virtual(self, nbytes: int) -> Allocation:
        """Count ``nbytes`` that no fake storage holds, from the next op until :meth:`release`."""
        rec = Allocation(
            nbytes=nbytes,
            origin=self.origin,
            created=self.tick + 1,
            phase=len(self.phases) - 1,
            module=self.modules[-1] if self.modules else "",
        )
        self.allocations.append(rec)
        self.live_bytes += nbytes
        return rec

    def release(self, rec: Allocation) -> None:
        """End a virtual allocation (idempotent)."""
        if rec.freed < 0:
            rec.freed = self.tick
            self.live_bytes -= rec.nbytes

    def allocation_of(self, tensor: torch.Tensor) -> Allocation | None:
        """The live record of ``tensor``'s storage, if counted (None for a sparse tensor)."""
        if tensor.layout is not torch.strided:
            return None
        return self.live.get(tensor.untyped_storage()._cdata)

    def allocations_of(self, tensor: torch.Tensor) -> list[Allocation]:
        """The live records of the storages that hold ``tensor`` (a sparse one has several)."""
        recs = (self.live.get(t.untyped_storage()._cdata) for t in parts(tensor))
        return [r for r in recs if r is not None]

    def end_program(self) -> None:
        """The traced program has ended: its records are final.

        What is still live now (parameters, inputs, optimizer state) outlives the program,
        so a storage freed from here on, by the trace's own tear-down, keeps its record
        unfreed. Without this the record would read freed at the last tick or never,
        depending on whether the garbage collector happened to reach a reference cycle that
        holds the fake tensors before the trace was read.
        """
        self.ended = True

    def _free(self, key: int) -> None:
        if self.ended:
            return
        rec = self.live.pop(key, None)
        if rec is not None:
            rec.freed = self.tick
            self.live_bytes -= rec.nbytes

    def begin_phase(self, name: str, step: int, micro_batch: int = 0) -> None:
        """Start a named phase; the previous one ends here."""
        if self.phases and self.phases[-1].end < 0:
            self.phases[-1].end = self.tick
        self.phases.append(Phase(name, step, micro_batch, self.tick + 1))

    def end_phase(self) -> None:
        """End the current phase."""
        if self.phases and self.phases[-1].end < 0:
            self.phases[-1].end = self.tick

    def enter_module(self, name: str) -> None:
        """``name``'s forward starts: what it allocates is its own."""
        self.modules.append(name)
        self._module_changed()

    def exit_module(self) -> None:
        """The innermost module's forward ends."""
        self.modules.pop()
        self._module_changed()

    def _module_changed(self) -> None:
        # the autograd nodes made from here on (their sequence numbers) are the module's
        seq = torch._C._autograd._get_sequence_nr()
        name = self.modules[-1] if self.modules else ""
        if self.module_seq and self.module_seq[-1][0] == seq:
            self.module_seq[-1] = (seq, name)
        else:
            self.module_seq.append((seq, name))

    def module_of_node(self, node: Any) -> str:
        """The module whose forward made autograd ``node`` (by its sequence number)."""
        i = bisect.bisect_right(self.module_seq, (node._sequence_nr(), "\uffff")) - 1
        return self.module_seq[i][1] if i >= 0 else ""

    # -- real-run paths ---------------------------------------------------------------------

    def __enter__(self) -> CountingFakeMode:
        kernels.acquire()
        rng.acquire()
        try:
            super().__enter__()
        except BaseException:
            rng.release()
            kernels.release()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc_val: BaseException | None,
                 exc_tb: TracebackType | None) -> None:
        try:
            super().__exit__(exc_type, exc_val, exc_tb)
        finally:
            rng.release()
            kernels.release()

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # No torch.compile runs inside a trace's dispatch: without the wrapper Dynamo puts
        # around every mode's __torch_dispatch__, each op saves two eval-frame switches.
        return False

    def _cached_dispatch_impl(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        if not kernels.runs_as_kernel(func, self.device_type):
            # a cache hit would skip the parts a real run allocates
            return self._dispatch_impl(func, types, args, kwargs)
        return super()._cached_dispatch_impl(func, types, args, kwargs)

    def _get_output_tensor_from_cache_entry(self, state: Any, entry: Any, key: Any,
                                            func: Any, args: Any) -> Any:
        """A cache hit's new output tensor: FakeTensorMode's, without its generic checks
        (no symbolic sizes here) and with :meth:`new_fake`'s constructor."""
        meta = entry.metadata
        if (meta is None or entry.inplace_idx is not None or self.shape_env is not None
                or meta.layout is not _STRIDED or FakeTensorConfig.debug):
            return super()._get_output_tensor_from_cache_entry(state, entry, key, func, args)
        with torch._C._DisableTorchDispatch():  # a meta tensor, its storage: no fake op runs
            empty = torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype,
                                        device="meta", requires_grad=meta.requires_grad)
            if meta.is_conj:
                torch._C._set_conj(empty, True)
            if meta.is_neg:
                torch._C._set_neg(empty, True)
            if isinstance(func, torch._ops.OpOverload) and func.is_view:
                # a view's output shares its input's storage
                empty.set_(args[entry.view_idx].untyped_storage(), meta.storage_offset,
                           meta.shape, meta.stride)
        return self.new_fake(empty, meta.device)

    def new_fake(self, elem: torch.Tensor, device: torch.device) -> FakeTensor:
        """``FakeTensor(self, elem, device)``, five times faster: the attributes the
        constructor sets are copied from one tensor it made for this mode and device (its
        argument checks and device normalisation are what cost). ``FakeTensorConfig.debug``
        takes the constructor (it records where each tensor was made)."""
        if FakeTensorConfig.debug:
            return FakeTensor(self, elem, device)
        template = self._fakes.get(device)
        if template is None:
            made = FakeTensor(self, elem, device)
            self._fakes[device] = dict(vars(made))
            return made
        t = torch.Tensor._make_subclass(FakeTensor, elem, elem.requires_grad,
                                        dispatch_device=True, device_for_backend_keys=device)
        if getattr(self, "_allow_unsafe_data_ptr_access", False):
            torch._C._set_warn_deprecated_on_mutable_data_ptr(t)
        else:
            torch._C._set_throw_on_mutable_data_ptr(t)
        t.__dict__.update(template)
        return t

    def _cache_key(self, state: Any, func: Any, args: Any, kwargs: Any) -> Any:
        """The fake-tensor dispatch cache's key for this call, made in one pass.

        FakeTensorMode's own key flattens a 17-field record per tensor through generic
        recursion: 26% of a profiled generate trace. Where every argument is one of this
        mode's strided fake tensors or a plain value (any trace without symbolic shapes),
        the key is built here from the same facts: the op, the global state FakeTensorMode reads,
        and each tensor's dtype, shape, strides, device, storage offset and size,
        requires_grad and conj/neg/inference bits (its layout is strided and its memory
        format follows from its shape and strides). The marker keeps these keys apart from
        FakeTensorMode's in the cache every fake mode of the process shares. Anything else
        takes FakeTensorMode's key.
        """
        if self.shape_env is None:
            key = [func, torch.get_default_dtype(), torch._C._get_default_device(),
                   torch.is_inference_mode_enabled(),
                   torch._C._get_dispatch_mode(_PROXY) is not None, _KEY_MARK]
            if _flat_key(self, args, key) and (not kwargs or _flat_key(self, kwargs, key)):
                return _DispatchCacheKey(tuple(key))
        return super()._cache_key(state, func, args, kwargs)

    def _real_path(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """The in-place op a real run's backward runs where this one would copy, if any."""
        node = torch._C._current_autograd_node()
        if node is None:
            return None
        key = (node._sequence_nr(), node.name())
        if key != self._node:  # a new node: what it creates from here on is its own
            self._node, self._node_mark = key, self.tick
            if self.node_log is not None:
                self.node_log.append((self.tick, key[0]))
        if torch.is_grad_enabled():
            return None
        inplace = kernels.NODE_INPLACE.get((key[1], func))
        if inplace is not None:
            rec = self.allocation_of(args[0]) if isinstance(args[0], FakeTensor) else None
            return inplace if rec is not None and rec.created > self._node_mark else None
        if func is torch.ops.aten.add.Tensor and self._accumulates_in_place(args, kwargs):
            return torch.ops.aten.add_.Tensor
        return None

    def _accumulates_in_place(self, args: Any, kwargs: dict[str, Any]) -> bool:
        """Whether this ``add`` is the engine accumulating a gradient that a real run adds
        in place (``InputBuffer::accumulate``): the engine holds the only reference to the
        earlier gradient (tensor and storage), which is dense and not a zero tensor.

        The earlier gradient was made before the running node; the new one by the node
        itself, and the engine holds it alone, so its use count is the baseline that the
        dispatch path adds to every argument (one more per mode above this one).
        """
        if len(args) != 2 or kwargs.get("alpha", 1) != 1:
            return False
        old, new = args
        if not (isinstance(old, FakeTensor) and isinstance(new, FakeTensor)) or old is new:
            return False
        if old.layout is not torch.strided or new.layout is not torch.strided:
            return False
        if old.shape != new.shape or old.dtype != new.dtype:
            return False
        rec_old, rec_new = self.allocation_of(old), self.allocation_of(new)
        if rec_old is None or rec_new is None:
            return False
        if rec_old.created > self._node_mark or rec_new.created <= self._node_mark:
            return False
        if old._is_zerotensor() or not is_non_overlapping_and_dense_or_false(old):
            return False
        # Tensor._use_count is undocumented but stable (the C++ TensorImpl's refcount)
        if old._use_count() != new._use_count():  # type: ignore[attr-defined]
            return False
        storage = old.untyped_storage()  # this wrapper holds one more reference
        return bool(torch._C._storage_Use_Count(storage._cdata) == 2)

    # -- what a forward-made storage derives from --------------------------------------------

    def _derive(self, func: Any, args: Any, kwargs: dict[str, Any],
                made: list[Allocation]) -> None:
        """Set :attr:`Allocation.state` (and a pointwise op's ``sources``) of the storages
        ``func`` just made, from its tensor arguments' records.

        An index argument (the ids of an embedding, the codes of a table lookup) carries its
        ``packed`` mark only where it has more elements than the table it indexes: decoding
        codes through a codebook is a dequantization, looking position ids up in an
        embedding is not.
        """
        state = STATE_FLOAT  # no tensor argument: a constant
        sources: list[Allocation] = []
        index = _INDEX_ARGS.get(func)
        table = 0
        live = self.live
        for i, a in enumerate((*args, *kwargs.values())):
            group = a if isinstance(a, (list, tuple)) else (a,)
            for t in group:
                if not isinstance(t, FakeTensor) or t.layout is not torch.strided:
                    continue
                rec = live.get(t.untyped_storage()._cdata)
                if rec is None or rec.state == STATE_NONE:
                    state = STATE_NONE
                    if rec is not None:
                        sources.append(rec)
                    continue
                if index is not None:
                    if i == 0:
                        table = t.numel()
                    elif i == index and rec.state == STATE_PACKED and t.numel() <= table:
                        continue  # an embedding's ids
                if rec.state > state and state != STATE_NONE:
                    state = rec.state
        for rec in made:
            rec.state = state
        if state == STATE_NONE and sources and self._pointwise(func):
            src = tuple(sources)
            for rec in made:
                rec.sources = src

    def _derive_ruled(self, func: Any, args: Any, kwargs: dict[str, Any], out: Any,
                      before: int) -> None:
        """The outputs a rule made op by op (a bitsandbytes kernel written out as the
        ``torch.empty`` it calls) derive from the rule's op's arguments, not from nothing: a
        dequantized weight made by ``dequantize_4bit`` comes from the packed weight."""
        fresh = []
        for whole in _tensors(out):
            if isinstance(whole, FakeTensor):
                for t in parts(whole):
                    rec = self.live.get(t.untyped_storage()._cdata)
                    if rec is not None and rec.created > before:
                        rec.op = func
                        fresh.append(rec)
        if fresh:
            self._derive(func, args, kwargs, fresh)

    def _pointwise(self, func: Any) -> bool:
        flag = self._pointwise_ops.get(func)
        if flag is None:
            tags = getattr(func, "tags", ())
            flag = torch.Tag.pointwise in tags or func in _COPIES
            self._pointwise_ops[func] = flag
        return flag

    # -- dispatch ---------------------------------------------------------------------------

    def _op_info(self, func: Any) -> tuple[bool, Any, bool]:
        """Whether ``func`` runs as one kernel, its fake rule, whether it has scratch (once)."""
        info = (kernels.runs_as_kernel(func, self.device_type),
                RULES.get(func) or SHORTCUTS.get(func)
                or quant_kernels.rule(func, self.device_type),
                self.scratch is not None and self.scratch.covers(func))
        self._ops[func] = info
        return info

    def _unshared(self, out: tuple[Any, ...], args: Any, kwargs: dict[str, Any]
                  ) -> tuple[Any, ...]:
        """``out`` with each tensor it returns twice (not an argument: an in-place or
        ``out=`` result) replaced, after its first place, by a new tensor of the same shape,
        strides and dtype.

        Some meta kernels return one tensor as two outputs (``mkldnn_rnn_layer_backward``:
        ``diff_b, diff_b``) where the real kernel returns two. The fake-tensor dispatch
        cache, shared by the process, builds each output of a cached call anew, so only
        the first such call in a process would share: a shared gradient is cloned by
        autograd's gradient accumulation, one that is not is stolen, and the trace of the
        same model would change with what the process ran before.
        """
        inputs = {id(t) for t in _tensors((*args, *kwargs.values()))}
        seen: set[int] = set()
        items = list(out)
        for i, t in enumerate(items):
            if not isinstance(t, FakeTensor):
                continue
            if id(t) in seen and id(t) not in inputs:
                items[i] = FakeTensorMode.dispatch(
                    self, torch.ops.aten.empty_strided.default, (FakeTensor,),
                    (t.shape, t.stride()), {"dtype": t.dtype, "layout": t.layout,
                                            "device": t.device})
            seen.add(id(t))
        return tuple(items)

    def __torch_dispatch__(  # type: ignore[override]
        self,
        func: Any,
        types: Any,
        args: Any = (),
        kwargs: Any = None,
    ) -> Any:
        query = _META_QUERIES.get(func)
        if query is not None:  # prim.device, size, stride, storage_offset: what C++ code asks
            return query(args)  # of a fake tensor; FakeTensorMode.dispatch answers it first
        # A Python decomposition of an op that has a real kernel: count the op, not its parts.
        info = self._ops.get(func)
        if info is None:
            info = self._op_info(func)
        nested, rule, scratch_op = info
        kwargs = kwargs or {}
        if self.counting and not self.depth and self.origin is Origin.BACKWARD:
            inplace = self._real_path(func, args, kwargs)
            if inplace is not None:
                func = inplace
                _, rule, scratch_op = self._ops.get(func) or self._op_info(func)
        self.depth += nested
        before = self.tick
        try:
            if rule is not None:
                out = rule(self, func, args, kwargs or {})
            else:
                out = FakeTensorMode.dispatch(self, func, types, args, kwargs or {})
                if type(out) is tuple and len({id(x) for x in out}) < len(out):
                    out = self._unshared(out, args, kwargs)
        finally:
            self.depth -= nested
        if not self.counting or self.depth:
            return out
        if rule is not None and self.origin is Origin.FORWARD and self.tick != before:
            self._derive_ruled(func, args, kwargs or {}, out, before)
        kwargs = kwargs or {}
        scratch = self.scratch
        pieces: tuple[int, ...] = ()
        extra = scratch.wrapped(func, args, kwargs, out) if scratch and scratch.wrap_numbers else 0
        counted = False
        made: list[Allocation] = []
        for whole in _tensors(out):
            if not isinstance(whole, FakeTensor):
                continue
            if not counted:
                self.tick += 1
                self.ops.append(func)
                counted = True
            for t in parts(whole):
                st = t.untyped_storage()
                rec = self.live.get(st._cdata)
                if rec is None:
                    rec = self.track(t, self.origin)
                    made.append(rec)
                    if func in self._host_ops and self.origin is Origin.OPTIMIZER:
                        rec.host = True  # a CPU step counter of a foreach optimizer
                        self.live_bytes -= rec.nbytes
                        rec.nbytes = 0
                elif not rec.host and rec.nbytes != st.nbytes():  # resize_ and friends
                    self.live_bytes += st.nbytes() - rec.nbytes
                    rec.nbytes = st.nbytes()
        if made:
            for rec in made:
                rec.op = func
            if self.origin is Origin.FORWARD:
                self._derive(func, args, kwargs, made)
        if scratch is not None and scratch_op:
            library = scratch.libraries.get(func)
            if library is not None:
                name = library(args)
                if name:
                    self.first_calls.setdefault((name, self.origin is Origin.BACKWARD),
                                                self.tick)
            cost = scratch.cost(func, args, kwargs, out)
            if cost is not None:
                extra += cost.scratch
                pieces = cost.parts
                if cost.order and len(made) == len(cost.order):
                    n = len(made)  # the outputs' records are the last ones: reordered
                    if all(a is b for a, b in zip(self.allocations[-n:], made, strict=True)):
                        self.allocations[-n:] = [made[i] for i in cost.order]
                for t, real in zip(_tensors(out), cost.output_nbytes, strict=False):
                    rec = self.allocation_of(t)
                    if real is not None and rec is not None and rec.created == self.tick:
                        self.live_bytes += real - rec.nbytes
                        rec.nbytes = real
        if not counted:
            if not extra:
                return out
            self.tick += 1  # an in-place op whose kernel still allocates
            self.ops.append(func)
        if extra:
            self.scratch_at[self.tick] = extra
            if pieces:
                self.scratch_parts[self.tick] = pieces
        if self.progress is not None and not self.tick & 1023:
            self.progress(self.tick)
        high = self.live_bytes + extra
        self.timeline.append(high)
        if high > self.peak_bytes:
            self.peak_bytes = high
            self.peak_tick = self.tick
            self.peak_scratch = extra
            self.peak_scratch_op = str(func) if extra else ""
        return out


def _lift_fresh(mode: CountingFakeMode, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """``lift_fresh`` of the real tensor ``torch.tensor(x)`` just made, as FakeTensorMode
    makes it: ``torch.tensor`` in a trace three times faster (the 723 step counters of a
    Llama-3-70B estimate's optimizer: 0.68 s, then 0.22 s).

    FakeTensorMode runs the op on the real tensor (it returns its argument), and where that
    may be a constant (at most ``CONSTANT_NUMEL_LIMIT`` elements) converts a private copy with
    its generic converter: a fake over a new meta storage of the copy's size, strides and
    offset, whose ``constant`` is the copy, memoized for the copy (the tensor, and its storage:
    an op FakeTensorMode runs on constants that returns a view of this one gives a view of
    this fake) and registered with the constants whose storage a write invalidates. This
    makes the same fake from a template (:meth:`CountingFakeMode.new_fake`). Anything else (a
    subclass, a tensor that needs grad, is quantized, conjugate or negative, an inference
    tensor, not on the CPU, not strided, more elements, symbolic shapes, a differing storage)
    takes FakeTensorMode's path.
    """
    x = args[0] if len(args) == 1 and not kwargs else None
    if (type(x) is not torch.Tensor or mode.shape_env is not None or FakeTensorConfig.debug
            or x.device.type != "cpu" or x.layout is not _STRIDED or x.requires_grad
            or x.numel() > _fake_tensor.CONSTANT_NUMEL_LIMIT or x.is_quantized or x.is_conj()
            or x.is_neg() or x.is_inference()):
        return FakeTensorMode.dispatch(mode, func, (), tuple(args), kwargs)
    with no_dispatch():
        const = x.clone()
        meta = torch.empty_strided(const.shape, const.stride(), dtype=const.dtype,
                                   device="meta")
    if (meta.untyped_storage().nbytes() != const.untyped_storage().nbytes()
            or const.storage_offset()):
        return FakeTensorMode.dispatch(mode, func, (), tuple(args), kwargs)
    out = mode.new_fake(meta, const.device)
    out.constant = const
    converter = mode.fake_tensor_converter
    converter.set_tensor_memo(const, out)
    meta_converter = converter.meta_converter  # a view of the constant: a view of the fake
    meta_converter.storage_memo[meta_converter.describer.get_storage_id(
        const.untyped_storage())] = out.untyped_storage()
    converter.add_constant_storage_mapping(out)
    return out


#: Ops whose FakeTensorMode path a faster one replaces (same outputs): checked after
#: fake_rules.RULES.
SHORTCUTS: dict[Any, Callable[..., Any]] = {}

#: FakeTensorMode.dispatch's answers to the metadata queries C++ code makes of a fake tensor
#: (its device, sizes, strides, offset): its first step, taken before anything of this mode.
_META_QUERIES: dict[Any, Callable[[Any], Any]] = dict(
    getattr(_fake_tensor, "_DISPATCH_META_HANDLERS", None) or {})

_SCALARS = (int, float, bool)


def _foreach_lists(mode: CountingFakeMode, args: Any, kwargs: dict[str, Any]
                   ) -> list[Any] | None:
    """The tensor lists of a foreach call, where its meta kernel would return what
    :func:`_foreach_inplace` and :func:`_foreach_new` return: every tensor a floating-point
    fake of this mode (no constant: FakeTensorMode propagates and invalidates those), each
    list as long as the first, the tensors at one index of one shape, dtype and device, every
    other argument a real number or a list of them, no symbolic shapes. Else None."""
    if mode.shape_env is not None or FakeTensorConfig.debug or not args:
        return None
    first = args[0]
    if type(first) not in (list, tuple) or not first:
        return None
    n = len(first)
    lists = [first]
    for a in (*args[1:], *kwargs.values()):
        if type(a) in (list, tuple):
            if len(a) != n:
                return None
            if isinstance(a[0], torch.Tensor):
                lists.append(a)
            elif not all(type(x) in _SCALARS for x in a):
                return None
        elif type(a) not in _SCALARS:
            return None
    for j, s in enumerate(first):
        if (type(s) is not FakeTensor or s.fake_mode is not mode or s.constant is not None
                or not s.dtype.is_floating_point):
            return None
        for other in lists[1:]:
            o = other[j]
            if (type(o) is not FakeTensor or o.fake_mode is not mode or o.constant is not None
                    or o.dtype is not s.dtype or o.shape != s.shape
                    or o.fake_device != s.fake_device):
                return None
    return lists


def _foreach_inplace(mode: CountingFakeMode, func: Any, args: Any,
                     kwargs: dict[str, Any]) -> Any:
    """An in-place foreach op (``torch._foreach_addcdiv_(params, exp_avgs, denoms, steps)``)
    on tensors of matching shapes and dtypes: nothing to make, so nothing to do.

    FakeTensorMode runs the op's meta kernel, a Python loop over the single-tensor op's
    meta function (1 ms a tensor: 1.5 of the 7.2 s of a Llama-3-8B training estimate on
    CUDA went to the optimizer's foreach ops). That kernel returns None where the tensors at
    each index have one shape, dtype and device (:func:`_foreach_lists`), as does this; any
    other call takes FakeTensorMode's path, which checks it.
    """
    if _foreach_lists(mode, args, kwargs) is None:
        return FakeTensorMode.dispatch(mode, func, (), tuple(args), kwargs)
    return None


def _foreach_new(mode: CountingFakeMode, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """An out-of-place elementwise foreach op (``torch._foreach_sqrt(exp_avg_sqs)``) whose
    result keeps the dtype of a floating-point input: one new contiguous fake per index, in
    order, of the first list's shape, dtype and device, where every tensor is contiguous (an
    elementwise kernel's output then is); else FakeTensorMode's path."""
    lists = _foreach_lists(mode, args, kwargs)
    if lists is None or not all(t.is_contiguous() for ts in lists for t in ts):
        return FakeTensorMode.dispatch(mode, func, (), tuple(args), kwargs)
    with no_dispatch():
        metas = [torch.empty(t.shape, dtype=t.dtype, device="meta") for t in lists[0]]
    return [mode.new_fake(meta, t.fake_device) for meta, t in zip(metas, lists[0], strict=True)]


def _foreach_overloads(name: str, returns_list: bool) -> list[Any]:
    """The overloads of ``aten.<name>`` that take tensor lists, numbers and lists of numbers
    (no single tensor: a 0-dim one would take part in type promotion) and return nothing
    (``returns_list`` False) or one tensor list."""
    packet = getattr(torch.ops.aten, name, None)
    found = []
    for overload in packet.overloads() if packet is not None else ():
        op = getattr(packet, overload)
        schema = op._schema
        kinds = []
        for a in schema.arguments:
            t = a.type
            if isinstance(t, torch.ListType):
                t = t.getElementType()
                kinds.append("list" if isinstance(t, torch.TensorType | torch.NumberType)
                             else "other")
            else:
                kinds.append("number" if isinstance(t, torch.NumberType) else "other")
        out = [str(r.type) for r in schema.returns]
        if ("other" not in kinds and kinds[:1] == ["list"]
                and out == (["List[Tensor]"] if returns_list else [])):
            found.append(op)
    return found


#: Elementwise ops whose result has the dtype of a floating-point input and numbers.
_FOREACH_SAME_DTYPE = ("add", "sub", "mul", "div", "lerp", "addcmul", "addcdiv", "sqrt", "neg",
                       "abs", "reciprocal", "exp", "maximum", "clamp_min", "clamp_max")

for _base in _FOREACH_SAME_DTYPE:
    for _op in _foreach_overloads(f"_foreach_{_base}_", returns_list=False):
        SHORTCUTS[_op] = _foreach_inplace
    for _op in _foreach_overloads(f"_foreach_{_base}", returns_list=True):
        SHORTCUTS[_op] = _foreach_new
del _base


def _lift_fresh_fits() -> bool:
    """Whether this torch's FakeTensorMode has the pieces :func:`_lift_fresh` fills in (those
    of torch 2.13); any other takes FakeTensorMode's own path."""
    converter = getattr(_fake_tensor, "FakeTensorConverter", None)
    meta = getattr(_fake_tensor, "MetaConverter", None)
    if converter is None or meta is None or not isinstance(
            getattr(_fake_tensor, "CONSTANT_NUMEL_LIMIT", None), int):
        return False
    made = meta()
    return (all(hasattr(converter, n) for n in ("set_tensor_memo", "add_constant_storage_mapping"))
            and isinstance(getattr(made, "storage_memo", None), dict | weakref.WeakValueDictionary)
            and hasattr(getattr(made, "describer", None), "get_storage_id"))


if _lift_fresh_fits():
    SHORTCUTS[torch.ops.aten.lift_fresh.default] = _lift_fresh


# The shortcuts replace FakeTensorMode methods that are private to PyTorch: each stays only
# where FakeTensorMode's method has the parameters it has in torch 2.13; with any other
# signature (another torch of the supported range) FakeTensorMode's own method runs.
for _name, _params in (("_cache_key", ["self", "state", "func", "args", "kwargs"]),
                       ("_get_output_tensor_from_cache_entry",
                        ["self", "state", "entry", "key", "func", "args"])):
    _theirs = getattr(FakeTensorMode, _name, None)
    if _theirs is None or list(inspect.signature(_theirs).parameters) != _params:
        delattr(CountingFakeMode, _name)
del _name, _params, _theirs


# -- what autograd keeps for the backward ---------------------------------------------------

def record_savers(mode: CountingFakeMode, roots: Iterable[Any]) -> None:
    """Mark the storages the autograd graph of ``roots`` (tensors) keeps for the backward:
    each record's :attr:`Allocation.saved_by` gets the names of the nodes that keep it.

    Read from the graph as it stands (call when the forward ends), without unpacking: a
    saved tensor is read through ``SavedTensor.data``, so no hook runs (a checkpointed
    region's hooks would recompute it) and no op is dispatched. A custom Function's node also
    keeps what its forward put on ``ctx`` (``ctx.tensors = (A, B)``), named
    ``<node>.<attribute>``; a checkpointed region keeps only its inputs, named
    ``checkpoint`` (with the RNG state it restores). The names of custom Functions that
    keep a quantized, packed weight (an integer or 1-byte float tensor) go to
    ``mode.packed_keepers``.
    """
    savers: dict[int, list[str]] = {}
    keepers: dict[int, list[str]] = {}
    frames: set[int] = set()
    packed = [False]  # whether the custom Function being read keeps a packed weight
    where = [""]  # the module of the node being read

    def keep(t: Any, label: str) -> None:
        if not isinstance(t, torch.Tensor):
            return
        for rec in mode.allocations_of(t):
            names = savers.setdefault(id(rec), [])
            if label not in names:
                names.append(label)
            modules = keepers.setdefault(id(rec), [])
            if where[0] not in modules:
                modules.append(where[0])
            if rec.state == STATE_PACKED and packed_dtype(rec.dtype):
                packed[0] = True

    def saved(s: Any, label: str) -> None:
        if isinstance(s, (list, tuple)):
            for x in s:
                saved(x, label)
            return
        if not isinstance(s, torch._C._autograd.SavedTensor):
            keep(s, label)
            return
        try:  # a PyTorch without ``data`` and ``unpack_hook`` names nothing
            data = getattr(s, "data", None)
            hook = getattr(s, "unpack_hook", None)
        except RuntimeError:  # released, or saved undefined
            return
        if hook is None or isinstance(data, torch.Tensor):
            keep(data, label)
            return
        frame = _checkpoint_frame(hook)
        if frame is not None and id(frame) not in frames:
            frames.add(id(frame))
            for arg in getattr(frame, "saved_args", ()):
                saved(arg, "checkpoint")
            for cell in getattr(getattr(frame, "recompute_fn", None), "__closure__", None) or ():
                try:
                    value = cell.cell_contents
                except ValueError:
                    continue
                if isinstance(value, torch.Tensor):  # the CPU RNG state it restores
                    keep(value, "checkpoint")

    stack = [t.grad_fn for t in roots if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen: set[Any] = set(stack)
    while stack:
        node = stack.pop()
        if isinstance(node, BackwardCFunction):  # a replayed block: the nodes it stands for
            node = getattr(node, VIRTUAL_GRAPH, node)
        if isinstance(node, VirtualNode):
            where[0] = node.module
            packed[0] = False
            for label, t in node.items():
                saved(t, label)
            if node.custom and packed[0]:
                mode.packed_keepers.add(node.label)
            for nxt in node.nexts:
                if nxt is not None and nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
            continue
        name = node.name()
        where[0] = mode.module_of_node(node)
        if isinstance(node, BackwardCFunction):
            packed[0] = False
            saved(node._raw_saved_tensors, name)
            for attr, value in vars(node).items():
                if isinstance(value, (torch.Tensor, list, tuple)):
                    _ctx_tensors(value, f"{name}.{attr}", keep)
            if packed[0]:
                mode.packed_keepers.add(name)
        else:
            for attr in _saved_attrs(type(node)):
                try:
                    saved(getattr(node, attr), name)
                except RuntimeError:
                    continue
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    by_id = {id(rec): rec for rec in mode.live.values()}
    for key, names in savers.items():
        rec = by_id.get(key)
        if rec is not None:
            rec.saved_by = tuple(names)
            rec.kept_in = tuple(keepers[key])


#: The attribute of a replayed block's autograd node that gives its :class:`VirtualNode`.
VIRTUAL_GRAPH = "modelsize_virtual_graph"


class VirtualNode:
    """One autograd node of a block that was replayed, not run (block_replay): its name,
    module, the tensors it keeps (``items()``: label and tensor) and the nodes after it, as
    :func:`record_savers` would have read them from the real node."""

    __slots__ = ("custom", "items", "label", "module", "nexts")

    def __init__(self, label: str, module: str, custom: bool,
                 items: Callable[[], Iterable[tuple[str, Any]]]) -> None:
        self.label = label
        self.module = module
        self.custom = custom
        self.items = items
        self.nexts: list[Any] = []


def _ctx_tensors(value: Any, label: str, keep: Callable[[Any, str], None]) -> None:
    if isinstance(value, torch.Tensor):
        keep(value, label)
    elif isinstance(value, (list, tuple)):
        for v in value:
            if isinstance(v, (torch.Tensor, list, tuple)):
                _ctx_tensors(v, label, keep)


_SAVED_ATTRS: dict[type, tuple[str, ...]] = {}


def _saved_attrs(cls: type) -> tuple[str, ...]:
    attrs = _SAVED_ATTRS.get(cls)
    if attrs is None:
        attrs = tuple(a for a in dir(cls) if a.startswith("_raw_saved_"))
        _SAVED_ATTRS[cls] = attrs
    return attrs


def _checkpoint_frame(hook: Any) -> Any:
    """The ``_CheckpointFrame`` behind a non-reentrant checkpoint's unpack hook, if it is one."""
    code = getattr(hook, "__code__", None)
    cells = getattr(hook, "__closure__", None)
    if code is None or not cells:
        return None
    for var, cell in zip(code.co_freevars, cells, strict=False):
        if var == "frame":
            try:
                return cell.cell_contents
            except ValueError:
                return None
    return None
