"""Make a CPU trace take the kernels a CUDA run would take, where that changes memory.

Fake CUDA tensors abort a CPU-only PyTorch build inside autograd, so the trace always runs on
fake CPU tensors. Two CPU/CUDA differences change memory a lot, and are redirected here when
the estimate is for CUDA:

* dropout: the CPU path keeps a mask of the input's dtype (4 bytes per element in fp32), the
  CUDA path (``native_dropout``) a bool mask;
* ``scaled_dot_product_attention``: CUDA picks flash attention (fp16/bf16, head dim <= 256,
  no mask) or memory-efficient attention, which keep no ``seq x seq`` matrix, even with
  dropout, where the CPU may fall back to the math path.

Not redirected (listed in the estimate's notes): autocast's op lists (CUDA keeps softmax,
layer norm and losses in fp32, the CPU list is shorter) and kernels' internal workspaces.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_ATEN = torch.ops.aten


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
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return None
    if enable_gqa and key.shape[1] != query.shape[1]:
        rep = query.shape[1] // key.shape[1]
        key = key.repeat_interleave(rep, dim=1)
        value = value.repeat_interleave(rep, dim=1)
    head_dim = query.shape[-1]
    low = query.dtype in (torch.float16, torch.bfloat16)
    if low and attn_mask is None and head_dim <= 256 and head_dim % 8 == 0:
        return _ATEN._scaled_dot_product_flash_attention(
            query, key, value, dropout_p, is_causal, False, scale=scale
        )[0]
    if head_dim % 8 == 0:
        need_lse = query.requires_grad or key.requires_grad or value.requires_grad
        return _ATEN._scaled_dot_product_efficient_attention(
            query, key, value, attn_mask, need_lse and torch.is_grad_enabled(), dropout_p,
            is_causal, scale=scale
        )[0]
    return None
