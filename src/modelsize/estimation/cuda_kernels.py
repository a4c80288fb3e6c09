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
convolutions of benchmarks/gpu_train.py's ConvNet). :func:`conv_workspace_note` names them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
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
    """Workspace of the call; no log-sum-exp without a gradient (the meta kernel sizes one)."""
    query, key, value = args[0], args[1], args[2]
    lse = args[4] if len(args) > 4 else False
    return KernelCost(cudnn_workspace(query, key, value),
                      (None, None if lse else 0, None, None))


def _cudnn_backward(args: Sequence[Any]) -> KernelCost:
    """The backward's workspace: a float32 accumulator of dq and the float32 row sums of
    ``dO * O``, plus 256 bytes (measured: 6,390,016 bytes at batch 4, 12 heads, 512 queries,
    head dim 64, on an H100 with cuDNN 9.19)."""
    query = args[1]
    b, h, sq, d = (int(n) for n in query.shape)
    return KernelCost(b * h * sq * d * 4 + b * h * sq * 4 + CUDNN_PREFILL_WORKSPACE)


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
    for op in (aten.mm.default, aten.bmm.default, aten.baddbmm.default, aten.addbmm.default,
               aten.addmv.default, aten.mv.default, aten.dot.default, aten.vdot.default):
        models.libraries[op] = _cublas
    models.libraries[aten.addmm.default] = _addmm_library
    models.libraries[aten._addmm_activation.default] = lambda args: "cublaslt"


def conv_workspace_note(ops: Sequence[Any]) -> str | None:
    """The note of a program that convolves on CUDA (cuDNN's workspaces are not counted)."""
    names = {str(op) for op in ops}
    if not any("convolution" in n for n in names):
        return None
    return ("cuda: cuDNN convolution workspaces are not counted: cuDNN's heuristics pick an "
            "engine per call at run time, whose workspace (allocated for the call, freed "
            "after it) measured 0 to 3.3 times the convolution's input on an H100")
