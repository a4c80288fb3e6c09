"""Fake-tensor rules for ops whose meta kernel does not match what the real kernel does.

:data:`RULES` maps an ATen overload to ``rule(mode, func, args, kwargs) -> outputs``; the
counting mode calls it instead of the op's own fake implementation. A rule must allocate its
outputs the way the real (CPU) kernel does, through ``torch.empty_strided`` and friends
under the mode, so the tracker counts them.

* ``aten._grouped_mm`` (the mixture-of-experts matmul transformers uses): the meta kernel
  accepts only bfloat16, while the kernel every device without a fused grouped GEMM runs
  (``_grouped_mm_fallback`` in ATen's ``GroupedMMUtils.h``: one ``mm_out`` per group into
  slices of the output) takes float32, bfloat16 and float16. Its output is the only
  allocation: the last dimension's stride is padded to 16 bytes (measured: ``(M, 13)``
  float32 gets strides ``(16, 1)``, a 1012-byte storage), and the per-group ``mm_out`` calls
  write into it without a temporary (measured: no other allocator event, on every layout
  the kernel accepts).
* ``aten.native_batch_norm_backward``: the meta kernel lays ``grad_input`` out like
  ``grad_out``, the CPU kernel like ``input`` (``empty_like(input,
  input.suggest_memory_format())``; measured). The two differ when a channels-last
  activation gets a contiguous gradient (a residual's accumulated gradient); the convolution
  backward that consumes ``grad_input`` then reorders it (a feature-map-sized oneDNN buffer)
  in the trace and not in the real run, or the other way round.
* ``aten.native_layer_norm_backward``: the meta kernel lays ``grad_input`` out like
  ``grad_out``, the CPU kernel always contiguous (``empty_like`` of the contiguous input,
  ``LEGACY_CONTIGUOUS_MEMORY_FORMAT``; measured). A transposed gradient (Swin's pooler reads
  the final LayerNorm's output transposed) then costs the trace a ``clone`` at the next
  ``reshape`` that the real run does not make.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch._prims_common import suggest_memory_format
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.weak import WeakIdKeyDictionary

_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def bind(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The op's arguments by schema name, defaults filled in."""
    out: dict[str, Any] = {}
    for i, a in enumerate(func._schema.arguments):
        if i < len(args):
            out[a.name] = args[i]
        elif a.name in kwargs:
            out[a.name] = kwargs[a.name]
        else:
            out[a.name] = a.default_value if a.has_default_value() else None
    return out


def _check_grouped_mm_strides(mat: torch.Tensor) -> None:
    """The kernel's stride check: one unit-stride dimension, 16-byte aligned leading one."""
    sizes, strides = mat.shape, mat.stride()
    align = 16 // mat.element_size()
    if strides[-2] == 1 and strides[-1] >= max(1, sizes[-2]):
        lead = strides[-1]
    elif strides[-1] == 1 and strides[-2] >= max(1, sizes[-1]):
        lead = strides[-2]
    else:
        raise RuntimeError(
            f"Invalid strides/sizes, got {list(strides)} for strides and {list(sizes)} for sizes"
        )
    if lead % align:
        raise RuntimeError("strides should be multiple of 16 bytes")


def _grouped_mm(mode: Any, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """``aten._grouped_mm``: the checks and the one output of the ATen kernel."""
    p = bind(func, args, kwargs)
    a, b, offs = p["self"], p["mat2"], p["offs"]
    for name, m in (("mat_a", a), ("mat_b", b)):
        if m.dtype not in _GROUPED_MM_DTYPES:
            raise RuntimeError(
                f"Expected {name} to be Float32, BFloat16 or Float16 matrix, got {m.dtype}"
            )
        if m.dim() not in (2, 3):
            raise RuntimeError(f"{name} has to be 2 or 3d")
    a2, b2 = a.dim() == 2, b.dim() == 2
    if not (a2 and b2) and a.shape[-1] != b.shape[-2]:
        raise RuntimeError("contraction dimension of mat_a and mat_b must match")
    _check_grouped_mm_strides(a)
    _check_grouped_mm_strides(b)
    if (offs is not None) != (a2 or b2):
        raise RuntimeError("Have to provide offsets if there is a 2d matrix, "
                           "or no offset if both matrices are 3d")
    if offs is not None:
        if offs.dim() != 1:
            raise RuntimeError("offs has to be 1D")
        if offs.dtype != torch.int32:
            raise RuntimeError("Offsets have to be int32")
    if p["bias"] is not None:
        raise RuntimeError("Bias not supported yet")
    out_dtype = p["out_dtype"] if p["out_dtype"] is not None else a.dtype
    if out_dtype != a.dtype:
        raise RuntimeError("Grouped gemm output dtype must match `mat_a` dtype")
    if a.dtype != b.dtype:  # the first mm_out refuses the pair
        raise RuntimeError(
            f"expected m1 and m2 to have the same dtype, but got: {a.dtype} != {b.dtype}"
        )
    if a2 and b2:
        size = [offs.shape[0], a.shape[0], b.shape[1]]
    elif a2:
        if offs.shape[0] != b.shape[0]:
            raise RuntimeError("matrix batch sizes have to match")
        size = [a.shape[0], b.shape[-1]]
    elif b2:
        if offs.shape[0] != a.shape[0]:
            raise RuntimeError("matrix batch sizes have to match")
        size = [a.shape[1], b.shape[1]]
    else:
        if a.shape[0] != b.shape[0]:
            raise RuntimeError("batched dimension has to match")
        size = [a.shape[0], a.shape[1], b.shape[-1]]
    align = 16 // torch.empty((), dtype=out_dtype, device="meta").element_size()
    padded = -(-size[-1] // align) * align
    stride = [padded, 1] if len(size) == 2 else [size[1] * padded, padded, 1]
    with mode:
        return torch.empty_strided(size, stride, dtype=out_dtype, device=a.device)


def _batch_norm_backward(mode: Any, func: Any, args: Sequence[Any],
                         kwargs: dict[str, Any]) -> Any:
    """``aten.native_batch_norm_backward``: ``grad_input`` in ``input``'s memory format."""
    out = cast(tuple[Any, ...],
               FakeTensorMode.dispatch(mode, func, (), tuple(args), kwargs))
    grad_input = out[0]
    x = bind(func, args, kwargs)["input"]
    if grad_input is None or x.dim() not in (4, 5):
        return out
    layout = suggest_memory_format(x)
    if grad_input.is_contiguous(memory_format=layout):
        return out
    with mode:
        return (torch.empty_like(x, memory_format=layout), *out[1:])


def _layer_norm_backward(mode: Any, func: Any, args: Sequence[Any],
                         kwargs: dict[str, Any]) -> Any:
    """``aten.native_layer_norm_backward``: a contiguous ``grad_input``."""
    out = cast(tuple[Any, ...],
               FakeTensorMode.dispatch(mode, func, (), tuple(args), kwargs))
    grad_input = out[0]
    if grad_input is None or grad_input.is_contiguous():
        return out
    with mode:
        return (torch.empty(grad_input.shape, dtype=grad_input.dtype,
                            device=grad_input.device), *out[1:])


# -- sparse COO ------------------------------------------------------------------------------

_aten = torch.ops.aten
#: fake sparse tensor -> the real values of its indices, where the trace knows them
_REAL_INDICES: WeakIdKeyDictionary = WeakIdKeyDictionary()
#: the note of a coalesce whose indices' values the trace does not have
UNKNOWN_INDICES = ("sparse gradients: the index values are not known (meta or fake inputs), "
                   "so coalesce keeps every index as distinct: an upper bound; pass the real "
                   "input tensors for the exact count")


def _sparse(mode: Any, sparse_dim: int, dense_dim: int, size: Sequence[int],
            indices: torch.Tensor, values: torch.Tensor, coalesced: bool | None) -> Any:
    """A sparse COO tensor over ``indices`` and ``values`` (no allocation), under ``mode``."""
    with mode:
        return _aten._sparse_coo_tensor_with_dims_and_tensors.default(
            sparse_dim, dense_dim, list(size), indices, values, dtype=values.dtype,
            layout=torch.sparse_coo, device=values.device, is_coalesced=coalesced)


def _sparse_coo(mode: Any, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """``_sparse_coo_tensor_with_dims_and_tensors``: as the fake kernel does; the real values
    of the indices are kept beside the result when the trace has them."""
    out = FakeTensorMode.dispatch(mode, func, (), tuple(args), kwargs)
    values = getattr(mode, "real_values", None)
    indices = bind(func, args, kwargs)["indices"]
    real = values.value_of(indices) if values is not None else None
    if real is not None:
        _REAL_INDICES[out] = real
    return out


def _clone(mode: Any, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """``clone`` of a sparse COO tensor: a contiguous copy of the values, then of the indices.

    The autograd engine's ``AccumulateGrad`` clones a new sparse gradient only when its
    indices or values are not contiguous, or when something else holds them: a real run
    otherwise keeps them (a shallow copy). Under a dispatch mode the Python references of
    ``_indices()`` and ``_values()`` always fail the engine's use-count test, so the rule
    takes the real run's branch.
    """
    x = args[0]
    if x.layout is not torch.sparse_coo:
        return FakeTensorMode.dispatch(mode, func, (), tuple(args), kwargs)
    with mode:
        indices, values = x._indices(), x._values()
        node = torch._C._current_autograd_node()
        if (node is not None and node.name() == "torch::autograd::AccumulateGrad"
                and not torch.is_grad_enabled() and indices.is_contiguous()
                and values.is_contiguous()):
            out = _sparse(mode, x.sparse_dim(), x.dense_dim(), x.shape, indices, values,
                          x.is_coalesced())
            if x in _REAL_INDICES:
                _REAL_INDICES[out] = _REAL_INDICES[x]
            return out
        new_values = torch.empty(values.shape, dtype=values.dtype, device=values.device)
        new_indices = torch.empty(indices.shape, dtype=indices.dtype, device=indices.device)
        coalesced = x.is_coalesced()
    out = _sparse(mode, x.sparse_dim(), x.dense_dim(), x.shape, new_indices, new_values,
                  coalesced)
    if x in _REAL_INDICES:
        _REAL_INDICES[out] = _REAL_INDICES[x]
    return out


def _coalesce(mode: Any, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """``_coalesce`` of a sparse COO tensor (CPU): every entry's room, narrowed to the
    distinct indices."""
    x = args[0]
    with mode:
        indices, values = x._indices(), x._values()
    sparse_dim, nnz = int(indices.shape[0]), int(indices.shape[1])
    real = _REAL_INDICES.get(x)
    if real is not None:
        with _disable_current_modes():
            distinct_indices = torch.unique(real.reshape(sparse_dim, -1), dim=1)
        distinct = int(distinct_indices.shape[1])
    else:
        distinct_indices, distinct = None, nnz
        notes = getattr(getattr(mode, "scratch", None), "notes", None)
        if notes is not None and UNKNOWN_INDICES not in notes and nnz > 1:
            notes.append(UNKNOWN_INDICES)
    with mode:  # the kernel's sort buffers: scratch.py
        new_indices = torch.empty((sparse_dim, nnz), dtype=indices.dtype)
        new_values = torch.empty(values.shape, dtype=values.dtype)
        kept_indices = new_indices.narrow(1, 0, distinct)
        kept_values = new_values.narrow(0, 0, distinct)
    out = _sparse(mode, x.sparse_dim(), x.dense_dim(), x.shape, kept_indices, kept_values, True)
    if distinct_indices is not None:
        _REAL_INDICES[out] = distinct_indices
    return out


def _sparse_mask(mode: Any, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """``dense.sparse_mask(mask)``: the dense values at the mask's indices, multiplied by the
    mask's one-element ones; the result owns a copy of the mask's indices."""
    dense, mask = args[0], args[1]
    if mask.layout is not torch.sparse_coo or dense.layout is not torch.strided:
        return FakeTensorMode.dispatch(mode, func, (), tuple(args), kwargs)
    sparse_dim = mask.sparse_dim()
    with mode:  # the ones and the gathered values: scratch.py
        indices = mask._indices()
        rows = (int(indices.shape[1]), *dense.shape[sparse_dim:])
        new_indices = torch.empty(indices.shape, dtype=indices.dtype)
        new_values = torch.empty(rows, dtype=dense.dtype)
        coalesced = mask.is_coalesced()
    out = _sparse(mode, sparse_dim, mask.dense_dim(), dense.shape, new_indices, new_values,
                  coalesced)
    if mask in _REAL_INDICES:
        _REAL_INDICES[out] = _REAL_INDICES[mask]
    return out


#: the note of in-place arithmetic on a sparse tensor, which the rules do not model
SPARSE_INPLACE = ("in-place arithmetic on a sparse tensor (SGD's momentum buffer on sparse "
                  "gradients) is not modelled: the CPU kernels replace its indices and values "
                  "with new, larger ones (an uncoalesced sum), which the estimate leaves out")


def _sparse_inplace(mode: Any, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """``add_``/``mul_`` on a sparse ``self``: noted (see :data:`SPARSE_INPLACE`)."""
    if args and isinstance(args[0], torch.Tensor) and args[0].layout is torch.sparse_coo:
        notes = getattr(getattr(mode, "scratch", None), "notes", None)
        if notes is not None and SPARSE_INPLACE not in notes:
            notes.append(SPARSE_INPLACE)
    return FakeTensorMode.dispatch(mode, func, (), tuple(args), kwargs)


#: ATen overload -> the rule that replaces its fake implementation.
RULES: dict[Any, Callable[..., Any]] = {
    torch.ops.aten._grouped_mm.default: _grouped_mm,
    torch.ops.aten.native_batch_norm_backward.default: _batch_norm_backward,
    torch.ops.aten.native_layer_norm_backward.default: _layer_norm_backward,
    torch.ops.aten._sparse_coo_tensor_with_dims_and_tensors.default: _sparse_coo,
    torch.ops.aten.clone.default: _clone,
    torch.ops.aten._coalesce.default: _coalesce,
    torch.ops.aten.sparse_mask.default: _sparse_mask,
    torch.ops.aten.add_.Tensor: _sparse_inplace,
    torch.ops.aten.mul_.Tensor: _sparse_inplace,
}
