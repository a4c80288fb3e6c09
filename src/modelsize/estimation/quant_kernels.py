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

For an estimate on CUDA, ``gemm_4bit`` (every 4-bit inference matmul of bitsandbytes 0.50)
follows its CUDA kernel instead (``backends/cuda/ops.py``, :func:`_gemm_4bit_cuda`): below a
batch that bitsandbytes' own heuristic sets for the GPU, the fused kernel makes its output
and nothing else; above it, the weight is dequantized as on CPU. (On an H100, one decoded
token of a 4-layer Llama: the CPU path counted a dequantized weight, 3.3% over the measured
``max_memory_allocated``; the CUDA path is exact, benchmarks/gpu/validate_quantized.py.)

:func:`rule` gives the counting mode the rule of an op (``None``: the op's own fake kernel).
"""

from __future__ import annotations

import ast
import builtins
import functools
import importlib.util
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from modelsize.estimation.fake_rules import bind

Rule = Callable[[Any, Any, Sequence[Any], dict[str, Any]], Any]

#: CPU kernels of bitsandbytes that are torch code (safe to run on fake tensors).
_TORCH_CPU_KERNELS = frozenset({"int8_linear_matmul"})


def rule(func: Any, device_type: str = "cpu") -> Rule | None:
    """The counting rule of a bitsandbytes or optimum-quanto op on ``device_type`` (the
    estimate's device), or None for any other op."""
    namespace = getattr(func, "namespace", None)
    if func is torch.ops.aten.dequantize.self and "optimum.quanto" in sys.modules:
        return _quanto_input_dequantize
    if namespace == "quanto":
        return _quanto_rule(func)
    if namespace != "bitsandbytes":
        return None
    name = func._schema.name.split("::", 1)[1]
    if name.startswith("optimizer_"):
        return None
    if device_type == "cuda" and name == "gemm_4bit":
        return _gemm_4bit_cuda
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


def _dequantize_4bit_cpu(mode: Any, func: Any, args: Sequence[Any],
                         kwargs: dict[str, Any]) -> Any:
    """``dequantize_4bit``'s CPU kernel (``backends/cpu/ops.py``): the torch fallback
    ``_dequantize_4bit_compute`` for AVX-512 with blocks of 2048 or more, or an odd last
    dimension; else a float32 copy of a non-float32 ``absmax``, the output, and C."""
    from bitsandbytes.backends import cpu as _cpu  # noqa: F401  (registers the kernels)
    from bitsandbytes.backends.cpu import ops as cpu_ops
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute
    from bitsandbytes.backends.utils import _get_4bit_code

    p = bind(func, args, kwargs)
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
    p = bind(func, args, kwargs)
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


#: bitsandbytes' ``_gemm_4bit_custom_max_m`` on CUDA: past this batch, always the fallback.
GEMM_4BIT_CUSTOM_MAX_M = 1536
#: ``_GEMM_4BIT_CUSTOM_FLOOR_M``: up to this batch, always the fused kernel.
GEMM_4BIT_CUSTOM_FLOOR_M = 4


def _gemm_4bit_cuda(mode: Any, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """``gemm_4bit``'s CUDA kernel (bitsandbytes' ``backends/cuda/ops.py``). Where
    :func:`uses_fused_kernel` says so, the fused ``cgemm_4bit_*`` kernel: ``A.contiguous()``,
    the output, and a float32 copy of a nested state's offset where it is not float32.
    Otherwise ``_dequant_linear_fallback``: the nested ``absmax`` dequantized into a float32
    buffer and offset (both held to the end), the weight dequantized into an ``N x K``
    buffer of the input's dtype, then ``linear``."""
    p = bind(func, args, kwargs)
    a, shape_b, blocksize = p["A"], tuple(p["shapeB"]), p["blocksize"]
    k = a.shape[-1]
    m = a.numel() // k if k else 0
    n = shape_b[0]
    fused = (m <= GEMM_4BIT_CUSTOM_MAX_M and k % blocksize == 0
             and uses_fused_kernel(a.dtype, m, n, k))

    def body() -> Any:
        if fused:
            x = a.contiguous()
            out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
            offset = p["absmax_offset"]
            offset = offset.to(torch.float32) if offset is not None else None
            del x, offset
            return out
        absmax, absmax_8bit, held = p["absmax"], p["absmax_8bit"], []
        if absmax_8bit is not None:
            held.append(torch.empty_like(absmax_8bit, dtype=torch.float32))
            absmax = held[0] + p["absmax_offset"]
        weight = torch.empty(shape_b, dtype=a.dtype, device=a.device)
        packed = p["B"].contiguous()
        out = torch.nn.functional.linear(a, weight, p["bias"])
        del held, absmax, weight, packed
        return out

    return _inside(mode, body)


def uses_fused_kernel(dtype: torch.dtype, m: int, n: int, k: int) -> bool:
    """Whether bitsandbytes' CUDA ``gemm_4bit`` takes its fused kernel for an ``m x k`` input
    and an ``n x k`` weight on the GPU the estimate models (an H100: sm90, 132 SMs): its own
    heuristic ``_gemm_4bit_use_custom_cuda``, read from the installed bitsandbytes' source
    (its module needs a CUDA build of torch to import) and run on those properties. Where
    that function is not found, its floor: the fused kernel up to 4 rows."""
    heuristic = _fused_heuristic()
    if heuristic is None:
        return m <= GEMM_4BIT_CUSTOM_FLOOR_M
    return bool(heuristic(0, dtype, m, n, k))


@functools.cache
def _fused_heuristic() -> Callable[..., Any] | None:
    """``_gemm_4bit_use_custom_cuda`` compiled from bitsandbytes' ``backends/cuda/ops.py``
    with ``_gpu_dispatch_props`` giving the H100's (132 SMs, sm 9.0); None where the file or
    the function is not there, or it names anything else of its module."""
    from modelsize.estimation.cuda_kernels import SMS

    name = "_gemm_4bit_use_custom_cuda"
    try:
        spec = importlib.util.find_spec("bitsandbytes.backends.cuda.ops")
        origin = spec.origin if spec else None
        tree = ast.parse(Path(origin).read_text(encoding="utf-8")) if origin else None
    except (ImportError, OSError, SyntaxError, ValueError):
        return None
    if tree is None or origin is None:
        return None
    defs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    if len(defs) != 1:
        return None
    fn = defs[0]
    fn.decorator_list = []
    floor = GEMM_4BIT_CUSTOM_FLOOR_M
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id == "_GEMM_4BIT_CUSTOM_FLOOR_M"
                and isinstance(node.value, ast.Constant) and isinstance(node.value.value, int)):
            floor = node.value.value
    namespace: dict[str, Any] = {
        "torch": torch, "_gpu_dispatch_props": lambda index: (SMS, 9, 0),
        "_GEMM_4BIT_CUSTOM_FLOOR_M": floor}
    loads = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)
             and isinstance(n.ctx, ast.Load)}
    bound = ({a.arg for a in fn.args.args}
             | {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)
                and isinstance(n.ctx, ast.Store)} | set(namespace) | set(dir(builtins)))
    if loads - bound:
        return None
    exec(compile(ast.Module(body=[fn], type_ignores=[]), origin, "exec"), namespace)
    return namespace[name]  # type: ignore[no-any-return]


_MANUAL: dict[str, Rule] = {
    "dequantize_4bit": _dequantize_4bit_cpu,
    "gemv_4bit": _gemv_4bit_cpu,
}


def dequantized_bytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes of a dequantized weight of ``shape`` in ``dtype`` (what the 4-bit kernels make
    per call): for the report and tests."""
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


# -- optimum-quanto ---------------------------------------------------------------------------
# quanto's ops (``optimum/quanto/library``) have no fake kernels: under fake tensors the
# dispatcher would run them on zero-filled real tensors and count their outputs only. On CPU:
#
# * ``qbytes_mm`` (int8/float8 weights): its CPU kernel (``library/qbytes_mm.py``,
#   ``qbytes_mm_impl_cpu``) is torch code: its choice is made here as it makes it, and the
#   branch it takes is run as is (:func:`_quanto_qbytes_mm_cpu`);
# * ``unpack`` (int4/int2 weights, every dequantize): its CPU kernel is a C++ extension
#   (``library/extensions/cpp/unpack.cpp``) that ``torch.utils.cpp_extension.load`` compiles on
#   first use (ninja and a C++ compiler at run time); never run on fake tensors, its
#   allocations are written out here (:func:`_quanto_unpack_cpu`);
# * ``quantize_symmetric`` / ``quantize_affine``: their default (torch) kernels, run as is;
# * quanto's linear functions test ``type(input) is not torch.Tensor`` to find a quantized
#   activation and then call ``input.dequantize()``: a fake tensor passes that test, and
#   ``aten.dequantize`` of a plain tensor is a float32 copy the real run never makes (a bf16
#   TinyGemm model: +26,624 B); :func:`_quanto_input_dequantize` gives the input back.

def _quanto_rule(func: Any) -> Rule | None:
    name = func._schema.name.split("::", 1)[1]
    if name == "unpack":
        return _quanto_unpack_cpu
    if name == "qbytes_mm":
        return _quanto_qbytes_mm_cpu
    if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeExplicitAutograd"):
        return _redispatch(torch._C.DispatchKey.CompositeExplicitAutograd)
    return None


def _quanto_unpack_cpu(mode: Any, func: Any, args: Sequence[Any],
                       kwargs: dict[str, Any]) -> Any:
    """``quanto::unpack``'s CPU kernel, ``unpack_4bit``/``unpack_2bit`` in
    ``extensions/cpp/unpack.cpp``: ``torch::cat({(t & 0x0F), (t & 0xF0).__rshift__(4)}, 0)``
    (2-bit: four masks and shifts). Each masked value and each shifted one is a tensor of the
    packed shape; the masked temporaries live until the end of the C++ full expression, so
    until ``cat`` has made its output."""
    p = bind(func, args, kwargs)
    t, bits = p["self"], p["bits"]
    masks = {4: ((0x0F, 0), (0xF0, 4)),
             2: ((0x03, 0), (0x0C, 2), (0x30, 4), (0xC0, 6))}.get(bits)
    if masks is None:
        return _inside(mode, lambda: func.redispatch(
            torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd), t, bits))

    def body() -> Any:
        temps: list[torch.Tensor] = []
        pieces: list[torch.Tensor] = []
        for mask, shift in masks:
            masked = t & mask
            if shift:
                temps.append(masked)
                pieces.append(masked.__rshift__(shift))
            else:
                pieces.append(masked)
        out = torch.cat(pieces, 0)
        del temps, pieces
        return out

    return _inside(mode, body)


def _quanto_qbytes_mm_cpu(mode: Any, func: Any, args: Sequence[Any],
                          kwargs: dict[str, Any]) -> Any:
    """``quanto::qbytes_mm``'s CPU kernel (``qbytes_mm_impl_cpu``), its branches chosen as it
    chooses them, each run as is. Not redispatched: the kernel tests ``type(activations) is
    not torch.Tensor`` (true of a fake tensor) and would then dequantize the input, which a
    real run never does."""
    from optimum.quanto.library import qbytes_mm as q
    from packaging import version

    p = bind(func, args, kwargs)
    a, w, scales = p["A"], p["B"], p["scales"]

    def body() -> Any:
        if (version.parse(torch.__version__).release >= version.parse("2.6.0").release
                and a.dtype == torch.int8 and w.dtype == torch.int8):
            return q.qbytes_int_mm(a, w, scales)
        if a.dtype == torch.bfloat16 and w.dtype == torch.int8 and a.shape[-1] % 4 == 0:
            return q.qbytes_int8pack_mm(a, w, scales)
        return q.qbytes_mm(a, w, scales)

    return _inside(mode, body)


def _called_from_quanto(depth: int = 16) -> bool:
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return False
        if str(frame.f_globals.get("__name__", "")).startswith("optimum.quanto"):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def _quanto_input_dequantize(mode: Any, func: Any, args: Sequence[Any],
                             kwargs: dict[str, Any]) -> Any:
    """``aten.dequantize`` of a plain (fake) tensor called by optimum-quanto: the input itself,
    as in the real run, where the tensor is a ``torch.Tensor`` and quanto never calls it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = args[0]
    if isinstance(x, torch.Tensor) and not x.is_quantized and _called_from_quanto():
        return x
    return FakeTensorMode.dispatch(mode, func, (), args, kwargs)
