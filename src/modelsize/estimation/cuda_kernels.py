"""Make a CPU trace take the kernels a CUDA run would take, where that changes memory.

Fake CUDA tensors abort a CPU-only PyTorch build inside autograd, so the trace always runs on
fake CPU tensors. Where the CPU and CUDA paths allocate differently, a trace for CUDA is
redirected here:

* dropout: the CPU path keeps a mask of the input's dtype (4 bytes per element in fp32), the
  CUDA path (``native_dropout``) a bool mask;
* ``scaled_dot_product_attention``: the backend a CUDA build picks
  (:mod:`modelsize.estimation.sdpa_cuda`; cuDNN first on an H100), which keeps no
  ``seq x seq`` matrix, where the CPU may fall back to the math path;
* the workspaces CUDA kernels take from the caching allocator (:func:`cuda_models`): cuDNN
  attention's per call, and which calls create a thread's cuBLAS / cuBLASLt handle (whose
  workspaces :mod:`modelsize.estimation.device` places);
* autocast's op lists: :mod:`modelsize.estimation.cuda_autocast`.

cuDNN's convolution workspaces are not predicted: with ``cudnn.benchmark`` off, PyTorch asks
cuDNN's heuristics for engine configurations and runs the first that builds, and each
engine's workspace is its own (on an H100 with cuDNN 9.19, 0 to 3.3 times the input for the
convolutions of benchmarks/gpu_train.py's ConvNet). :func:`cuda_notes` names them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from modelsize.estimation.scratch import KernelCost, ScratchModels

_ATEN = torch.ops.aten

#: cuDNN attention's workspace for a call with more than one query (measured on an H100,
#: cuDNN 9.19: the same for every shape of benchmarks/gpu_*.py, forward with and without
#: gradient, masked or causal).
CUDNN_PREFILL_WORKSPACE = 256


class _Reroute(TorchFunctionMode):
    """Dropout and attention as the CUDA kernels run them."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.dropout:
            return _dropout(*args, **kwargs)
        if func is F.scaled_dot_product_attention:
            out = _attention(*args, **kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)


class CudaKernelChoices(_Reroute):
    """Reroute dropout and attention to the CUDA kernels' memory behaviour, in the forward
    and in activation checkpointing's recomputation.

    The autograd engine does not carry torch-function modes into the backward, where
    checkpointing recomputes its forward: without help the recomputation would take the CPU
    kernels, save other tensors than the forward did, and checkpoint would refuse ("a
    different number of tensors was saved"). A real CUDA run recomputes with the same CUDA
    kernels, so both checkpoint implementations recompute inside the rerouting mode here.
    """

    def __enter__(self) -> CudaKernelChoices:
        import torch.utils.checkpoint as ckpt

        self._saved = [(ckpt, "_run_fn_with_dynamo_disabled",
                        ckpt._run_fn_with_dynamo_disabled),
                       (ckpt.CheckpointFunction, "backward",
                        ckpt.CheckpointFunction.__dict__["backward"])]
        ckpt._run_fn_with_dynamo_disabled = _rerouted(ckpt._run_fn_with_dynamo_disabled)
        ckpt.CheckpointFunction.backward = staticmethod(  # type: ignore[method-assign]
            _rerouted(ckpt.CheckpointFunction.backward))
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        for owner, name, orig in reversed(self._saved):
            setattr(owner, name, orig)


def _rerouted(fn: Any) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        with _Reroute():
            return fn(*args, **kwargs)

    return run


def _dropout(input: torch.Tensor, p: float = 0.5, training: bool = True,
             inplace: bool = False) -> torch.Tensor:
    if not training or p == 0.0 or p == 1.0 or input.numel() == 0:
        return F.dropout(input, p, training, inplace)
    out, _mask = torch.native_dropout(input, p, True)
    if inplace:
        return input.copy_(out)
    return out


def _attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
               is_causal: bool = False, scale: float | None = None,
               enable_gqa: bool = False) -> torch.Tensor | None:
    from modelsize.estimation.sdpa_cuda import attention

    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return None
    return attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def cudnn_workspace(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> int:
    """The workspace of one cuDNN attention forward.

    More than one query: :data:`CUDNN_PREFILL_WORKSPACE`. One query (a decode step): cuDNN
    splits the keys; measured on an H100 with cuDNN 9.19 at batch 1 (8 heads x dim 256 over
    16k and over 1024 keys, 32 heads x dim 64 over 2k keys: 528,512, 66,176 and 135,296
    bytes), it is ``batch x heads x splits x (4 x dim + 8) + 128`` with ``splits`` the keys
    in blocks of 128, at most 512 per ``batch x heads``. Fitted, not read from cuDNN: larger
    batches are a prediction.
    """
    b, h, sq = int(query.shape[0]), int(query.shape[1]), int(query.shape[2])
    if sq != 1:
        return CUDNN_PREFILL_WORKSPACE
    sk, dv = int(key.shape[2]), int(value.shape[-1])
    splits = max(1, min(math.ceil(sk / 128), 512 // max(1, b * h)))
    return b * h * splits * (4 * dv + 8) + 128


def _cudnn_forward(args: Sequence[Any]) -> KernelCost:
    """Workspace of the call; no log-sum-exp without a gradient (the meta kernel sizes one);
    the seed and offset allocated before the output."""
    query, key, value = args[0], args[1], args[2]
    lse = args[4] if len(args) > 4 else False
    return KernelCost(cudnn_workspace(query, key, value),
                      (None, None if lse else 0, None, None), order=(2, 3, 0, 1))


def _cudnn_backward(args: Sequence[Any]) -> KernelCost:
    """The backward's workspace: a float32 accumulator of dq and the float32 row sums of
    ``dO * O``, plus 256 bytes (measured: 6,390,016 bytes at batch 4, 12 heads, 512 queries,
    head dim 64, on an H100 with cuDNN 9.19)."""
    query = args[1]
    b, h, sq, d = (int(n) for n in query.shape)
    return KernelCost(b * h * sq * d * 4 + b * h * sq * 4 + CUDNN_PREFILL_WORKSPACE)


#: An H100 SXM: streaming multiprocessors and resident threads per multiprocessor.
SMS = 132
THREADS_PER_SM = 2048


def reduce_buffers(shape: Sequence[int], strides: Sequence[int], reduced: Sequence[int],
                   itemsize: int, accsize: int, max_threads: int = 512) -> tuple[int, int]:
    """The global buffer and semaphores (bytes) of ``gpu_reduce_kernel`` reducing ``reduced``
    of a tensor (``shape``, ``strides`` in elements), or ``(0, 0)``.

    ``setReduceConfig`` in ``aten/src/ATen/native/cuda/Reduce.cuh``: when each output has
    enough inputs and the outputs are few, the inputs of an output are split across thread
    blocks that combine their partial results through a buffer of ``accsize x outputs x
    blocks per output`` (times the block width and the output vector when the reduced dim is
    not the fastest) and one semaphore per block column. The dims are those TensorIterator
    makes: size-1 dims dropped, the reduced ones first, each group by increasing input
    stride, neighbours whose strides chain coalesced. The data pointer is taken as aligned.
    """
    dims = [(int(n), int(st), d in reduced) for d, (n, st) in enumerate(zip(shape, strides,
                                                                           strict=True))
            if n != 1]
    numel = math.prod(n for n, _, _ in dims)
    if not numel:
        return (0, 0)
    order = (sorted((d for d in dims if d[2]), key=lambda d: d[1])
             + sorted((d for d in dims if not d[2]), key=lambda d: d[1]))
    merged: list[tuple[int, int, bool]] = []
    for n, st, red in order:
        if merged and merged[-1][2] == red and merged[-1][1] * merged[-1][0] == st:
            merged[-1] = (merged[-1][0] * n, merged[-1][1], red)
        else:
            merged.append((n, st, red))
    n_reduce = sum(1 for d in merged if d[2])
    outputs = math.prod(n for n, _, red in merged if not red)
    inputs = numel // outputs
    if not merged:
        fastest_reduced, dim0, dim1, fastest = True, 1, 1, 1
    else:
        fastest_reduced = n_reduce == len(merged) or merged[0][1] < merged[n_reduce][1]
        if fastest_reduced:
            dim0, dim1, fastest = inputs, outputs, merged[0][1]
        else:
            dim0, dim1, fastest = outputs, inputs, merged[n_reduce][1]
    out_vec = 1
    if fastest == 1:
        if fastest_reduced and dim0 >= 128 and n_reduce == 1:
            dim0 //= 4  # vectorize along the input (input_vec_size = vt0 = 4)
        elif not fastest_reduced:
            out_vec = 4
            while out_vec > 1 and (merged[n_reduce][0] % out_vec or any(
                    st % out_vec for i, (_, st, _) in enumerate(merged) if i != n_reduce)):
                out_vec //= 2
            dim0 //= out_vec
    threads = max_threads // out_vec

    def pow2(n: int) -> int:
        return 1 << (max(n, 1).bit_length() - 1) if n < threads else threads

    width = min(pow2(dim0), 32)
    height = min(pow2(dim1), threads // width)
    width = min(pow2(dim0), threads // height)
    step_in = step_out = 1
    if not merged or fastest_reduced:
        x_reduce, step_in = True, width
    else:
        x_reduce, step_out = False, width
    per_thread = -(-inputs // step_in)
    y_split = per_thread >= min(height * 16, 256)
    if y_split:
        step_in *= height
    else:
        step_out *= height
    target = SMS * (THREADS_PER_SM // (width * height))
    grid_x = -(-(outputs // out_vec) // step_out)
    per_thread = -(-inputs // step_in)
    if not (y_split and per_thread >= 256 and grid_x <= target):
        return (0, 0)
    ctas = max(-(-per_thread // 256), min(-(-target // grid_x), -(-per_thread // 16)))
    if ctas <= 1:
        return (0, 0)
    size = accsize * outputs * ctas * (1 if x_reduce else width * out_vec)
    return (size, 4 * grid_x)


def _accsize(dtype: torch.dtype) -> int:
    """``at::acc_type`` on CUDA: float for half/bfloat16/float, double, int64 for integers."""
    if dtype in (torch.float16, torch.bfloat16, torch.float32):
        return 4
    if dtype.is_complex:
        return 16 if dtype == torch.complex128 else 8
    return 8


def _reduction(args: Sequence[Any]) -> KernelCost | None:
    """``sum`` and ``mean`` over some dims (a list, or all of them): a bool or integer input
    first becomes an int64 copy (``make_reduction`` casts to the result's dtype on CUDA,
    measured: 8 bytes per element of a summed bool mask), then the reduction's buffers."""
    x = args[0]
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        return None
    dims = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else None
    reduced = (range(x.dim()) if not dims else [d % x.dim() for d in dims])
    pieces: tuple[int, ...] = ()
    shape, strides, itemsize = list(x.shape), list(x.stride()), x.element_size()
    if not x.is_floating_point() and not x.is_complex() and x.dtype != torch.int64:
        pieces = (x.numel() * 8,)
        strides = list(torch.empty(shape, device="meta").stride())
        itemsize = 8
    buffer, semaphores = reduce_buffers(shape, strides, list(reduced), itemsize,
                                        _accsize(x.dtype))
    if buffer:
        pieces += (buffer, semaphores)
    if not pieces or not sum(pieces):
        return None
    return KernelCost(sum(pieces), parts=pieces)


def _cublas_copy(m: Any) -> int:
    """Bytes of the contiguous copy ``prepare_matrix_for_cublas`` (``Blas.cpp``) makes of a
    matrix operand cuBLAS cannot read as it is: neither dim has stride 1 with the other's
    stride at least its size (an expanded gradient, a sliced view). Batched operands are
    judged on their last two dims."""
    if not isinstance(m, torch.Tensor) or m.dim() < 2 or m.numel() == 0:
        return 0
    rows, cols = int(m.shape[-2]), int(m.shape[-1])
    rs, cs = int(m.stride(-2)), int(m.stride(-1))
    if (rs == 1 and cs >= max(1, rows)) or (cs == 1 and rs >= max(1, cols)):
        return 0
    if m.dim() > 2 and m.is_contiguous():
        return 0
    return m.numel() * m.element_size()


def _operands(*at: int) -> Callable[[Sequence[Any]], KernelCost | None]:
    """The copies of the matrix operands at ``at`` that cuBLAS needs, as scratch."""
    def cost(args: Sequence[Any]) -> KernelCost | None:
        pieces = tuple(n for n in (_cublas_copy(args[i]) for i in at if i < len(args)) if n)
        if not pieces:
            return None
        return KernelCost(sum(pieces), parts=pieces if len(pieces) > 1 else ())
    return cost


def _addmm_library(args: Sequence[Any]) -> str:
    """``addmm`` with a bias vector takes cuBLASLt (``isInputCompliesAddmmCudaLt``)."""
    bias, mat1, mat2 = args[0], args[1], args[2]
    if (isinstance(bias, torch.Tensor) and bias.dim() == 1 and mat1.dim() == 2
            and mat2.shape[0] > 1 and mat2.shape[1] > 1
            and mat1.dtype in (torch.float32, torch.float16, torch.bfloat16)):
        return "cublaslt"
    return "cublas"


def _cublas(args: Sequence[Any]) -> str:
    return "cublas"


def cuda_models(models: ScratchModels) -> None:
    """Fill ``models`` (for ``device_type="cuda"``) with the CUDA kernels' models."""
    aten = _ATEN
    models.costs[aten._scaled_dot_product_cudnn_attention.default] = _cudnn_forward
    models.costs[aten._scaled_dot_product_cudnn_attention_backward.default] = _cudnn_backward
    for op, at in ((aten.mm.default, (0, 1)), (aten.bmm.default, (0, 1)),
                   (aten.addmm.default, (1, 2)), (aten.baddbmm.default, (1, 2))):
        models.costs[op] = _operands(*at)
    for op in (aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default):
        models.costs[op] = _reduction
    # fused_dropout's kernel allocates its bool mask before its output
    models.costs[aten.native_dropout.default] = lambda args: KernelCost(order=(1, 0))
    for op in (aten.mm.default, aten.bmm.default, aten.baddbmm.default, aten.addbmm.default,
               aten.addmv.default, aten.mv.default, aten.dot.default, aten.vdot.default):
        models.libraries[op] = _cublas
    models.libraries[aten.addmm.default] = _addmm_library
    models.libraries[aten._addmm_activation.default] = lambda args: "cublaslt"


def cuda_notes(ops: Sequence[Any]) -> list[str]:
    """The notes of a CUDA estimate: what it was checked on; for a program that convolves,
    that cuDNN's convolution workspaces are not counted."""
    notes = ["cuda: the kernels and allocator of PyTorch 2.11 on an H100 (sm90, cuDNN 9.19), "
             "checked there and on an H200 within 0.07% of max_memory_allocated "
             "(benchmarks/RESULTS.md); other GPUs and versions are not"]
    if any("convolution" in str(op) for op in set(ops)):
        notes.append("cuda: cuDNN convolution workspaces are not counted: cuDNN's heuristics "
                     "pick an engine per call at run time, whose workspace (allocated for the "
                     "call, freed after it) measured 0 to 3.3 times the convolution's input "
                     "on an H100")
    return notes
