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

_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _bind(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
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
    p = _bind(func, args, kwargs)
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
               FakeTensorMode.__torch_dispatch__(mode, func, (), tuple(args), kwargs))
    grad_input = out[0]
    x = _bind(func, args, kwargs)["input"]
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
               FakeTensorMode.__torch_dispatch__(mode, func, (), tuple(args), kwargs))
    grad_input = out[0]
    if grad_input is None or grad_input.is_contiguous():
        return out
    with mode:
        return (torch.empty(grad_input.shape, dtype=grad_input.dtype,
                            device=grad_input.device), *out[1:])


#: ATen overload -> the rule that replaces its fake implementation.
RULES: dict[Any, Callable[..., Any]] = {
    torch.ops.aten._grouped_mm.default: _grouped_mm,
    torch.ops.aten.native_batch_norm_backward.default: _batch_norm_backward,
    torch.ops.aten.native_layer_norm_backward.default: _layer_norm_backward,
}
