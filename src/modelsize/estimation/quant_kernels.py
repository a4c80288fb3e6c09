"""What bitsandbytes' CPU kernels allocate, for the counting mode.

bitsandbytes registers its ops with ``torch.library`` and gives each a fake kernel that
makes its outputs only. A real CPU run allocates more: ``gemm_4bit`` has no CPU kernel, so the
dispatcher runs its default implementation, ``_gemm_4bit_default_impl`` in
``bitsandbytes/backends/default/ops.py``, which dequantizes the whole weight (the nested
``absmax`` first, then an ``N x K`` copy of the weight in the input's dtype) and calls
``linear``. Where the op's real CPU kernel is torch code, the rule runs that code on the
fake tensors, so each of its allocations is counted as the real run makes it:

* no CPU kernel (``gemm_4bit``, the ``int8_*`` ops of ``Linear8bitLt``): the default kernel,
  ``backends/default/ops.py``, run as is (``CompositeExplicitAutograd``);
* ``int8_linear_matmul``: its CPU kernel (``backends/cpu/ops.py``, ``torch._int_mm``), run
  as is;
* CPU kernels that call the C library (``dequantize_4bit``, ``gemv_4bit``): never run on
  fake tensors (they would read fake data pointers); their allocations are written out here
  from ``backends/cpu/ops.py`` (:func:`_dequantize_4bit_cpu`, :func:`_gemv_4bit_cpu`);
* other C kernels (``dequantize_blockwise``, ``quantize_blockwise``): their fake kernels,
  which make exactly the outputs the CPU kernels ``torch.empty`` before calling C.

:func:`rule` gives the counting mode the rule of an op (``None``: the op's own fake kernel).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

Rule = Callable[[Any, Any, Sequence[Any], dict[str, Any]], Any]

#: CPU kernels of bitsandbytes that are torch code (safe to run on fake tensors).
_TORCH_CPU_KERNELS = frozenset({"int8_linear_matmul"})


def rule(func: Any) -> Rule | None:
    """The counting rule of a bitsandbytes op, or None for any other op."""
    if getattr(func, "namespace", None) != "bitsandbytes":
        return None
    name = func._schema.name.split("::", 1)[1]
    if name.startswith("optimizer_"):
        return None
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    full = func.name()
    if has(full, "CPU"):
        if name in _TORCH_CPU_KERNELS:
            return _redispatch(torch._C.DispatchKey.CPU)
        return _MANUAL.get(name)
    if has(full, "CompositeExplicitAutograd"):
        return _redispatch(torch._C.DispatchKey.CompositeExplicitAutograd)
    return None


def _inside(mode: Any, body: Callable[[], Any]) -> Any:
    """Run ``body``, whose ops the mode counts one by one (it marks a kernel it runs as one
    op as ``depth``; these ops are the kernel's parts, each a real allocation)."""
    depth = mode.depth
    mode.depth = 0
    try:
        with mode:
            return body()
    finally:
        mode.depth = depth


def _redispatch(key: Any) -> Rule:
    keyset = torch._C.DispatchKeySet(key)

    def run(mode: Any, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        return _inside(mode, lambda: func.redispatch(keyset, *args, **kwargs))

    return run


def _bind(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i, a in enumerate(func._schema.arguments):
        if i < len(args):
            out[a.name] = args[i]
        elif a.name in kwargs:
            out[a.name] = kwargs[a.name]
        else:
            out[a.name] = a.default_value if a.has_default_value() else None
    return out


def _dequantize_4bit_cpu(mode: Any, func: Any, args: Sequence[Any],
                         kwargs: dict[str, Any]) -> Any:
    """``dequantize_4bit``'s CPU kernel (``backends/cpu/ops.py``): the torch fallback
    ``_dequantize_4bit_compute`` for AVX-512 with blocks of 2048 or more, or an odd last
    dimension; else a float32 copy of a non-float32 ``absmax``, the output, and C."""
    from bitsandbytes.backends import cpu as _cpu  # noqa: F401  (registers the kernels)
    from bitsandbytes.backends.cpu import ops as cpu_ops
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute
    from bitsandbytes.backends.utils import _get_4bit_code

    p = _bind(func, args, kwargs)
    a, absmax, blocksize, shape, dtype = (p["A"], p["absmax"], p["blocksize"], p["shape"],
                                          p["dtype"])

    def body() -> Any:
        if (getattr(cpu_ops, "_has_avx512", False) and blocksize >= 2048) or shape[-1] % 2:
            flat = a if a.dtype == torch.uint8 else a.view(torch.uint8)
            code = _get_4bit_code(p["quant_type"], flat.device)
            return _dequantize_4bit_compute(flat.reshape(-1), absmax, code, blocksize,
                                            shape, dtype)
        scales = absmax if absmax.dtype == torch.float32 else absmax.float()
        out = torch.empty(tuple(shape), dtype=dtype, device=a.device)
        del scales
        return out

    return _inside(mode, body)


def _gemv_4bit_cpu(mode: Any, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """``gemv_4bit``'s CPU kernel (``backends/cpu/ops.py``, registered where the CPU has
    AVX512-BF16): the input and ``absmax`` cast to bfloat16, a bfloat16 output the C kernel
    fills, cast back to the input's dtype. (With the optional ``kernels-community`` kernel
    installed, the output is that kernel's: not modelled; it is not installed here.)"""
    p = _bind(func, args, kwargs)
    a, b, shape_b, absmax = p["A"], p["B"], p["shapeB"], p["absmax"]

    def body() -> Any:
        dtype = a.dtype
        x = a if dtype == torch.bfloat16 else a.to(torch.bfloat16)
        scales = absmax if absmax.dtype == torch.bfloat16 else absmax.to(torch.bfloat16)
        final = (*x.shape[:-1], shape_b[0])
        x = x.reshape(-1, x.shape[-1])
        out = torch.empty((*x.shape[:-1], shape_b[0]), dtype=x.dtype, device=x.device)
        del x, scales
        if dtype != torch.bfloat16:
            out = out.to(dtype)
        return out.reshape(final)

    del b
    return _inside(mode, body)


_MANUAL: dict[str, Rule] = {
    "dequantize_4bit": _dequantize_4bit_cpu,
    "gemv_4bit": _gemv_4bit_cpu,
}


def dequantized_bytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes of a dequantized weight of ``shape`` in ``dtype`` (what the 4-bit kernels make
    per call): for the report and tests."""
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()
