"""CUDA's autocast policy, applied by a trace that runs on CPU tensors.

A trace for CUDA runs fake CPU tensors, so ``torch.autocast`` would follow the CPU's op
lists, which differ from CUDA's: on CUDA ``pow``, ``exp``, ``rsqrt``, ``softmax``,
``log_softmax``, ``layer_norm``, ``sum`` and the losses run in float32 (their bfloat16 inputs
cast up, their outputs float32), where the CPU keeps them in the lower precision; the CPU's
float32 list has ``cross_entropy_loss`` (CUDA casts inside it, at ``log_softmax`` and
``nll_loss``) and its ``promote`` list ``cat``, ``stack`` and ``index_copy``. A GELU written
with ``pow`` keeps float32 intermediates on CUDA: twice the bytes of the CPU's.

:func:`cuda_policy` replaces, for the duration of a trace, the kernels CPU autocast registers
(``TORCH_LIBRARY_IMPL(aten, AutocastCPU, ...)``) by Python kernels that follow the CUDA
registrations of ``aten/src/ATen/autocast_mode.cpp`` (PyTorch 2.11: the
``AT_FORALL_LOWER_PRECISION_FP``, ``AT_FORALL_FP32``, ``AT_FORALL_FP32_SET_OPT_DTYPE``,
``AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE`` and ``AT_FORALL_PROMOTE`` lists of
``autocast_mode.h``), with ``cached_cast``'s cache of the lower
precision casts of float32 leaves that require grad (the model's weights), kept until the
outermost autocast region ends. An op on neither list falls through with autocast still on
for the ops it calls, as on CUDA.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

_LOWER = """_convolution.deprecated _convolution conv1d conv2d conv3d conv_tbc conv_transpose1d
conv_transpose2d.input conv_transpose3d.input convolution prelu addmm addmv addr matmul einsum mm
mv linalg_vecdot linear addbmm baddbmm bmm chain_matmul linalg_multi_dot _thnn_fused_lstm_cell
_thnn_fused_gru_cell lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell
_scaled_dot_product_flash_attention scaled_dot_product_attention cudnn_convolution
cudnn_convolution_transpose"""
_FP32 = """acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan
pow.Tensor_Scalar pow.Tensor_Tensor pow.Scalar softplus layer_norm native_layer_norm rms_norm
group_norm frobenius_norm.dim nuclear_norm nuclear_norm.dim cosine_similarity poisson_nll_loss
cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss kl_div l1_loss smooth_l1_loss
huber_loss mse_loss margin_ranking_loss multilabel_margin_loss soft_margin_loss
triplet_margin_loss multi_margin_loss binary_cross_entropy_with_logits dist pdist cdist renorm
logsumexp upsample_nearest1d _upsample_nearest_exact1d upsample_nearest2d
_upsample_nearest_exact2d upsample_nearest3d _upsample_nearest_exact3d upsample_linear1d
upsample_bilinear2d _upsample_bilinear2d_aa upsample_trilinear3d upsample_bicubic2d
_upsample_bicubic2d_aa"""
_FP32_SET_OPT_DTYPE = """prod prod.dim_int prod.dim_Dimname softmax.int softmax.Dimname
log_softmax.int log_softmax.Dimname cumprod cumprod.dimname cumsum cumsum.dimname
linalg_vector_norm linalg_matrix_norm linalg_matrix_norm.str_ord sum sum.dim_IntList
sum.dim_DimnameList"""
_PROMOTE = """addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot
scatter_add"""
#: ``fp32_append_dtype``: the op, and the overload it redispatches to with ``dtype=float32``.
_APPEND_DTYPE = {"norm.Scalar": "norm.ScalarOpt_dtype",
                 "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype",
                 "norm.names_ScalarOpt_dim": "norm.names_ScalarOpt_dim_dtype"}
_BANNED = ("binary_cross_entropy",)

#: The CUDA policy of each op overload (``name`` or ``name.overload``).
POLICY: dict[str, str] = {
    **dict.fromkeys(_LOWER.split(), "lower_precision_fp"),
    **dict.fromkeys(_FP32.split(), "fp32"),
    **dict.fromkeys(_FP32_SET_OPT_DTYPE.split(), "fp32_set_opt_dtype"),
    **dict.fromkeys(_APPEND_DTYPE, "fp32_append_dtype"),
    **dict.fromkeys(_PROMOTE.split(), "promote"),
    **dict.fromkeys(_BANNED, "banned"),
}

_KEY = torch._C.DispatchKey.AutocastCPU
_KEYSET = torch._C.DispatchKeySet(_KEY)


def _overload(name: str) -> Any:
    """``torch.ops.aten.<name>`` as an OpOverload (``.default`` when no overload is named),
    or None where this PyTorch lacks it."""
    base, _, overload = name.partition(".")
    packet = getattr(torch.ops.aten, base, None)
    if packet is None:
        return None
    return getattr(packet, overload or "default", None)


@functools.cache
def cpu_registrations() -> tuple[str, ...]:
    """The op overloads CPU autocast registers kernels for in this PyTorch (read once, before
    any of them is replaced)."""
    names = torch._C._dispatch_get_all_op_names()
    return tuple(sorted(n.removeprefix("aten::") for n in names if n.startswith("aten::")
                        and torch._C._dispatch_has_kernel_for_dispatch_key(n, "AutocastCPU")))


class _Casts:
    """``cached_cast`` and its cache of lower-precision casts of float32 weights."""

    def __init__(self) -> None:
        self.cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def clear(self) -> None:
        self.cache.clear()

    def cast(self, to: torch.dtype, arg: Any) -> Any:
        if isinstance(arg, (list, tuple)):
            return type(arg)(self.cast(to, a) for a in arg)
        if not _eligible(arg) or arg.dtype == to:
            return arg
        if (to == torch.get_autocast_dtype("cpu") and arg.dtype == torch.float32
                and arg.requires_grad and arg.is_leaf and not arg._is_view()
                and torch.is_autocast_cache_enabled()):
            hit = self.cache.get(id(arg))
            if hit is not None and hit[0] is arg:
                return hit[1]
            casted = arg.to(to)
            self.cache[id(arg)] = (arg, casted)
            return casted
        return arg.to(to)


def _eligible(arg: Any) -> bool:
    """``is_eligible``: a floating-point tensor (on the device: every tensor of the trace)
    that is not float64."""
    return (isinstance(arg, torch.Tensor) and arg.is_floating_point()
            and arg.dtype != torch.float64)


def _first_tensor(args: tuple[Any, ...]) -> Any:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
        if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
            return a[0]
    return None


def _kernel(name: str, op: Any, policy: str, casts: _Casts) -> Callable[..., Any]:
    """The Python autocast kernel of ``op`` under the CUDA ``policy``."""
    if policy == "banned":
        def banned(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(
                "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to "
                "autocast (CUDA autocast refuses them): use binary_cross_entropy_with_logits")
        return banned
    if policy == "fp32_set_opt_dtype":
        names = [a.name for a in op._schema.arguments]
        at = names.index("dtype") if "dtype" in names else -1

        def set_dtype(*args: Any, **kwargs: Any) -> Any:
            with torch._C._ExcludeDispatchKeyGuard(_KEYSET):
                if at >= 0 and _eligible(_first_tensor(args)):
                    if at < len(args):
                        if args[at] is None:
                            args = (*args[:at], torch.float32, *args[at + 1:])
                    elif kwargs.get("dtype") is None:
                        kwargs = {**kwargs, "dtype": torch.float32}
                return op(*args, **kwargs)
        return set_dtype
    if policy == "fp32_append_dtype":
        target = _overload(_APPEND_DTYPE[name])

        def append(*args: Any, **kwargs: Any) -> Any:
            with torch._C._ExcludeDispatchKeyGuard(_KEYSET):
                if _eligible(_first_tensor(args)):
                    return target(*args, dtype=torch.float32, **kwargs)
                return op(*args, **kwargs)
        return append

    def cast(*args: Any, **kwargs: Any) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(_KEYSET):
            if policy == "lower_precision_fp":
                to = torch.get_autocast_dtype("cpu")
            elif policy == "fp32":
                to = torch.float32
            else:  # promote: the widest floating type among the eligible arguments
                to = torch.get_autocast_dtype("cpu")
                for a in (*args, *kwargs.values()):
                    for t in (a if isinstance(a, (list, tuple)) else (a,)):
                        if _eligible(t):
                            to = torch.promote_types(to, t.dtype)
            # the C++ wrapper casts its arguments as GCC evaluates them: last first
            kwargs = {k: casts.cast(to, kwargs[k]) for k in reversed(list(kwargs))}
            args = tuple(reversed([casts.cast(to, a) for a in reversed(args)]))
            return op(*args, **kwargs)
    return cast


def _fallthrough(op: Any) -> Callable[..., Any]:
    """A CPU-only autocast op: run below autocast, autocast still on for what it calls."""
    def run(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        return op.redispatch(keyset.remove(_KEY), *args, **kwargs)
    return run


@contextlib.contextmanager
def cuda_policy() -> Iterator[None]:
    """Within: CPU autocast follows CUDA's op lists (see the module docstring)."""
    registered = cpu_registrations()
    casts = _Casts()
    lib = torch.library.Library("aten", "IMPL")
    original_clear = torch.clear_autocast_cache

    def clear() -> None:
        original_clear()
        casts.clear()

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Overriding a previously registered kernel"
            for name, policy in POLICY.items():
                op = _overload(name)
                if op is not None:
                    lib.impl(name, _kernel(name, op, policy, casts), "AutocastCPU")
            for name in registered:
                if name not in POLICY:
                    op = _overload(name)
                    if op is not None:
                        lib.impl(name, _fallthrough(op), "AutocastCPU", with_keyset=True)
        torch.clear_autocast_cache = clear  # type: ignore[assignment]
        yield
    finally:
        torch.clear_autocast_cache = original_clear  # type: ignore[assignment]
        casts.clear()
        lib._destroy()
