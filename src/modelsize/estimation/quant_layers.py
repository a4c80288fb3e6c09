"""GPTQ and AWQ linear layers, for models whose checkpoints hold them (their kernels are
CUDA libraries that are not installed here, so modelsize has its own layer classes).

Each class holds the checkpoint's tensors under the checkpoint's names, with the packed
shapes and dtypes the libraries register (``qweight``, ``qzeros``, ``scales``, ``g_idx``,
``bias``: frozen ``nn.Parameter`` s, so the report counts them as the model's parameters),
and its ``forward`` is the libraries' torch fallback kernel written out as plain torch code:
the same ops, so the same allocations, whether it runs for real on CPU (``--verify``) or on
the trace's fake tensors:

* :class:`GPTQLinear`: GPTQModel's ``TorchQuantLinear`` (``gptqmodel/nn_modules/qlinear/
  torch.py``, ``forward``/``_forward``) and ``PackableQuantLinear.dequantize_weight``
  (``gptqmodel/nn_modules/qlinear/__init__.py``), eager (GPTQModel compiles
  ``dequantize_weight`` with inductor where it can, which fuses its temporaries away);
* :class:`AWQLinear` ``gemm``: AutoAWQ's ``WQLinear_GEMM.forward`` without ``awq_ext``
  (``awq/modules/linear/gemm.py``) and ``dequantize_gemm`` (``awq/utils/packing_utils.py``);
  ``gemv``: ``WQLinear_GEMV`` (``awq/modules/linear/gemv.py``) has no torch kernel: its
  forward makes what the CUDA kernel returns (a float16 output) and no scratch (unvalidated).

:func:`pack_gptq` and :func:`pack_awq` write the packed layouts from integer weights, as
``PackableQuantLinear.pack`` and ``WQLinear_GEMM.from_linear`` do (for tests: the unpacking
is checked against them).
"""

from __future__ import annotations

import math

import torch
from torch import nn

#: AutoAWQ's GEMM packing order of 8 nibbles in an int32 (``AWQ_ORDER``), and its inverse.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


def _frozen(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str | None
            ) -> nn.Parameter:
    return nn.Parameter(torch.zeros(shape, dtype=dtype, device=device), requires_grad=False)


class GPTQLinear(nn.Module):
    """A GPTQ linear layer (GPTQModel's ``TorchQuantLinear``): ``bits`` 2, 4 or 8 packed in
    int32 along the input dimension.

    ``qweight`` int32 ``[in * bits / 32, out]``, ``qzeros`` int32 ``[groups, out * bits /
    32]``, ``scales`` float16 ``[groups, out]``, ``g_idx`` int32 ``[in]`` (the group of each
    input feature; with act-order, ``desc_act``, a permutation of groups), ``bias`` float16.
    """

    def __init__(self, bits: int, group_size: int, in_features: int, out_features: int,
                 bias: bool, device: torch.device | str | None = None) -> None:
        super().__init__()
        if bits not in (2, 4, 8):
            raise ValueError(f"GPTQ with {bits} bits: only 2, 4 and 8 are modelled")
        self.bits, self.in_features, self.out_features = bits, in_features, out_features
        self.group_size = group_size if group_size != -1 else in_features
        self.pack_factor = 32 // bits
        self.maxq = 2 ** bits - 1
        groups = math.ceil(in_features / self.group_size)
        self.qweight = _frozen((in_features // self.pack_factor, out_features), torch.int32,
                               device)
        self.qzeros = _frozen((groups, out_features // self.pack_factor), torch.int32, device)
        self.scales = _frozen((groups, out_features), torch.float16, device)
        self.g_idx = _frozen((in_features,), torch.int32, device)
        self.bias = _frozen((out_features,), torch.float16, device) if bias else None
        # post_init's shift table (GPTQModel keeps two views of it, wf_unsqueeze_zero and
        # wf_unsqueeze_neg_one: one storage per layer)
        self.register_buffer("wf", torch.arange(0, 32, bits, dtype=torch.int32,
                                                device=device).unsqueeze(0), persistent=False)
        self.dequant_dtype = torch.int16 if bits == 8 else torch.int8

    def dequantize_weight(self) -> torch.Tensor:
        """The ``[in, out]`` weight: ``scales[g_idx] * (w - zeros[g_idx])``."""
        wf = self.get_buffer("wf")
        zeros = torch.bitwise_right_shift(
            torch.unsqueeze(self.qzeros, 2).expand(-1, -1, self.pack_factor),
            wf.unsqueeze(0)).to(self.dequant_dtype)
        zeros = torch.bitwise_and(zeros, self.maxq).reshape(self.scales.shape)
        weight = torch.bitwise_and(
            torch.bitwise_right_shift(
                torch.unsqueeze(self.qweight, 1).expand(-1, self.pack_factor, -1),
                wf.unsqueeze(-1)).to(self.dequant_dtype),
            self.maxq)
        weight = weight.reshape(weight.shape[0] * weight.shape[1], weight.shape[2])
        g_idx = self.g_idx.long()
        return self.scales[g_idx] * (weight - zeros[g_idx])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out_shape = (*x.shape[:-1], self.out_features)
        x = x.reshape(-1, x.shape[-1])
        x_dtype = x.dtype
        weights = self.dequantize_weight().to(x.dtype)
        out = torch.matmul(x, weights).reshape(out_shape)
        if self.bias is not None:
            out.add_(self.bias)
        return out.to(x_dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bits={self.bits}, group_size={self.group_size}, "
                f"bias={self.bias is not None}")


def _awq_zeros_width(in_features: int, group_size: int, pack_num: int = 8) -> int:
    """``calculate_zeros_width`` of AutoAWQ's ``gemv.py``."""
    multiplier = {True: 1}.get(group_size >= 128) or {64: 2, 32: 4}.get(group_size)
    if multiplier is None:
        raise ValueError(f"AWQ GEMV with group size {group_size}: not 32, 64 or >= 128")
    base = (in_features // group_size + pack_num - 1) // pack_num
    return (base + multiplier - 1) // multiplier * multiplier


class AWQLinear(nn.Module):
    """An AWQ linear layer (AutoAWQ's ``WQLinear_GEMM`` or ``WQLinear_GEMV``), 4 bits.

    GEMM: ``qweight`` int32 ``[in, out / 8]`` (nibbles in ``AWQ_ORDER``), ``qzeros`` int32
    ``[in / group, out / 8]``, ``scales`` float16 ``[in / group, out]``. GEMV: ``qweight``
    ``[out, in / 8]``, ``qzeros`` ``[out, w]`` and ``scales`` ``[out, 8 w]`` with ``w``
    AutoAWQ's ``calculate_zeros_width``. ``bias`` float16.
    """

    def __init__(self, bits: int, group_size: int, in_features: int, out_features: int,
                 bias: bool, version: str = "gemm",
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        if bits != 4:
            raise ValueError(f"AWQ with {bits} bits: only 4 bits exist")
        if version not in ("gemm", "gemv"):
            raise ValueError(f"AWQ version {version!r}: only gemm and gemv are modelled")
        self.bits, self.in_features, self.out_features = bits, in_features, out_features
        self.group_size = group_size if group_size != -1 else in_features
        self.version = version
        pack = 32 // bits
        if version == "gemm":
            groups = in_features // self.group_size
            self.qweight = _frozen((in_features, out_features // pack), torch.int32, device)
            self.qzeros = _frozen((groups, out_features // pack), torch.int32, device)
            self.scales = _frozen((groups, out_features), torch.float16, device)
        else:
            width = _awq_zeros_width(in_features, self.group_size, pack)
            self.qweight = _frozen((out_features, in_features // pack), torch.int32, device)
            self.qzeros = _frozen((out_features, width), torch.int32, device)
            self.scales = _frozen((out_features, width * pack), torch.float16, device)
        self.bias = _frozen((out_features,), torch.float16, device) if bias else None

    def dequantize_weight(self) -> torch.Tensor:
        """GEMM's ``dequantize_gemm``: the float16 ``[in, out]`` weight."""
        return dequantize_gemm(self.qweight, self.qzeros, self.scales, self.bits,
                               self.group_size)

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out_shape = (*x.shape[:-1], self.out_features)
        input_dtype = x.dtype
        if self.version == "gemv":
            x = x.reshape(-1, x.shape[-1])
        if input_dtype != torch.float16:
            x = x.half()
        if self.version == "gemm":
            out = torch.matmul(x, self.dequantize_weight())
        else:  # awq_ext.gemv_forward_cuda / gemmv2_forward_cuda: their float16 output
            out = x.new_empty((x.shape[0], self.out_features))
        if input_dtype != torch.float16:
            out = out.to(dtype=input_dtype)
        out = out + self.bias if self.bias is not None else out
        return out.reshape(out_shape)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bits={self.bits}, group_size={self.group_size}, version={self.version}, "
                f"bias={self.bias is not None}")


def dequantize_gemm(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                    bits: int, group_size: int) -> torch.Tensor:
    """AutoAWQ's ``dequantize_gemm`` (``awq/utils/packing_utils.py``): unpack the nibbles
    (``unpack_awq``), undo the packing order (``reverse_awq_order``), mask, then
    ``(w - z) * s`` with the group's zeros and scales repeated over its rows."""
    shifts = torch.arange(0, 32, bits, device=qzeros.device)
    iweight = torch.bitwise_right_shift(qweight[:, :, None], shifts[None, None, :]).to(
        torch.int8)
    iweight = iweight.view(iweight.shape[0], -1)
    izeros = torch.bitwise_right_shift(qzeros[:, :, None], shifts[None, None, :]).to(
        torch.int8)
    izeros = izeros.view(izeros.shape[0], -1)
    order = torch.arange(izeros.shape[-1], dtype=torch.int32, device=izeros.device)
    order = order.view(-1, 32 // bits)[:, list(AWQ_REVERSE_ORDER)].view(-1)
    izeros = izeros[:, order]
    iweight = iweight[:, order]
    iweight = torch.bitwise_and(iweight, (2 ** bits) - 1)
    izeros = torch.bitwise_and(izeros, (2 ** bits) - 1)
    scales = scales.repeat_interleave(group_size, dim=0)
    izeros = izeros.repeat_interleave(group_size, dim=0)
    return (iweight - izeros) * scales


# -- packing (tests) -------------------------------------------------------------------------


def pack_gptq(intweight: torch.Tensor, zeros: torch.Tensor, bits: int) -> tuple[torch.Tensor,
                                                                                torch.Tensor]:
    """``qweight``, ``qzeros`` from integer weights ``[out, in]`` and zeros ``[groups,
    out]``, as ``PackableQuantLinear.pack`` packs them (bits 2, 4, 8): input rows packed
    into int32 rows, zero columns into int32 columns, lowest bits first."""
    pf = 32 // bits
    w = intweight.t().contiguous().to(torch.int64)
    qweight = torch.zeros((w.shape[0] // pf, w.shape[1]), dtype=torch.int64)
    for row in range(qweight.shape[0]):
        for j in range(pf):
            qweight[row] |= w[row * pf + j] << (bits * j)
    z = zeros.to(torch.int64)
    qzeros = torch.zeros((z.shape[0], z.shape[1] // pf), dtype=torch.int64)
    for col in range(qzeros.shape[1]):
        for j in range(pf):
            qzeros[:, col] |= z[:, col * pf + j] << (bits * j)
    return _int32(qweight), _int32(qzeros)


def pack_awq(intweight: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor,
                                                                    torch.Tensor]:
    """``qweight``, ``qzeros`` from integer weights ``[out, in]`` and zeros ``[groups,
    out]``, as ``WQLinear_GEMM.from_linear`` packs them (4 bits, ``AWQ_ORDER``)."""
    w = intweight.t().contiguous().to(torch.int64)
    qweight = torch.zeros((w.shape[0], w.shape[1] // 8), dtype=torch.int64)
    for col in range(qweight.shape[1]):
        for i in range(8):
            qweight[:, col] |= w[:, col * 8 + AWQ_ORDER[i]] << (i * 4)
    z = zeros.to(torch.int64)
    qzeros = torch.zeros((z.shape[0], z.shape[1] // 8), dtype=torch.int64)
    for col in range(qzeros.shape[1]):
        for i in range(8):
            qzeros[:, col] |= z[:, col * 8 + AWQ_ORDER[i]] << (i * 4)
    return _int32(qweight), _int32(qzeros)


def _int32(t: torch.Tensor) -> torch.Tensor:
    """The low 32 bits of int64 values as int32 (two's complement, as numpy's astype)."""
    return (t & 0xFFFFFFFF).to(torch.int64).where(t & 0x80000000 == 0,
                                                  (t & 0xFFFFFFFF) - (1 << 32)).to(torch.int32)


# -- fine-grained fp8 (transformers' FP8Linear, CUDA path) -----------------------------------


def _act_quant_scratch(x: torch.Tensor, block_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernel's dynamic activation quantization makes (``act_quant`` /
    ``per_token_group_quant_fp8``): the input in float8_e4m3fn and one float32 scale per
    ``block_k`` input features of each row."""
    q = torch.empty_like(x, dtype=torch.float8_e4m3fn)
    s = x.new_empty((*x.shape[:-1], math.ceil(x.shape[-1] / block_k)), dtype=torch.float32)
    return q, s


def dequantize_fp8_weight(weight: torch.Tensor, scale_inv: torch.Tensor,
                          block_size: tuple[int, int] | None, dtype: torch.dtype
                          ) -> torch.Tensor:
    """transformers' ``_dequantize_fp8_weight`` (``integrations/finegrained_fp8.py``): the
    weight cast to ``dtype``, scaled in place by its blocks' ``scale_inv`` (the scales
    repeated over rows only, broadcast over columns through a view)."""
    scale = scale_inv.to(dtype)
    weight = weight.to(dtype)
    if block_size is None:
        return weight.mul_(scale)
    rows, cols = weight.shape[-2:]
    full, rem = divmod(cols, block_size[1])
    scale = scale.repeat_interleave(block_size[0], dim=-2)[..., :rows, :]
    weight[..., : full * block_size[1]].unflatten(-1, (full, block_size[1])).mul_(
        scale[..., :full, None])
    if rem:
        weight[..., full * block_size[1]:].mul_(scale[..., full:])
    return weight


class _FP8LinearFunction(torch.autograd.Function):
    """transformers' ``FP8LinearFunction``: the forward is the fp8 kernel (its allocations:
    the quantized input, its scales, the output in the input's dtype); the backward
    dequantizes the weight (``_dequantize_fp8_weight``) and returns the input's gradient only."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor,
                weight: torch.Tensor, scale_inv: torch.Tensor,
                block_size: tuple[int, int] | None) -> torch.Tensor:
        ctx.save_for_backward(weight, scale_inv)
        ctx.block_size = block_size  # type: ignore[attr-defined]
        return _fp8_matmul(x, weight, block_size)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, *grads: torch.Tensor
                 ) -> tuple[torch.Tensor | None, ...]:
        weight, scale_inv = ctx.saved_tensors  # type: ignore[attr-defined]
        w = dequantize_fp8_weight(weight, scale_inv, ctx.block_size,  # type: ignore[attr-defined]
                                  grads[0].dtype)
        return grads[0] @ w, None, None, None


def _fp8_matmul(x: torch.Tensor, weight: torch.Tensor,
                block_size: tuple[int, int] | None) -> torch.Tensor:
    # the quantized input and its scales live until the matmul returns; then the output
    block_k = block_size[1] if block_size is not None else x.shape[-1]
    q, s = _act_quant_scratch(x, block_k)
    out = x.new_empty((*x.shape[:-1], weight.shape[0]))
    del q, s
    return out


class FP8Linear(nn.Module):
    """transformers' ``FP8Linear`` (``integrations/finegrained_fp8.py``) as loading builds it
    on a CUDA device of compute capability 8.9 or more: ``weight`` float8_e4m3fn ``[out,
    in]``, ``weight_scale_inv`` float32 ``[ceil(out / bn), ceil(in / bk)]`` (a scalar
    without ``weight_block_size``), ``activation_scale`` float32 scalar for the static scheme,
    ``bias`` in the model's dtype. Its forward allocates what the kernel path allocates (the
    Triton ``finegrained_fp8.matmul`` of the hub kernel: dynamic per-token-group activation
    quantization, ``act_quant``, then ``w8a8_block_fp8_matmul`` into an output of the
    input's dtype; the bias added in place), not its values: unvalidated on CUDA here.
    """

    def __init__(self, in_features: int, out_features: int,
                 block_size: tuple[int, int] | None, bias: bool, dtype: torch.dtype,
                 activation_scheme: str = "dynamic",
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.block_size = block_size
        self.weight = _frozen((out_features, in_features), torch.float8_e4m3fn, device)
        if block_size is None:
            self.weight_scale_inv = _frozen((), torch.float32, device)
        else:
            self.weight_scale_inv = _frozen((math.ceil(out_features / block_size[0]),
                                             math.ceil(in_features / block_size[1])),
                                            torch.float32, device)
        self.activation_scale = (_frozen((), torch.float32, device)
                                 if activation_scheme == "static" else None)
        self.bias = _frozen((out_features,), dtype, device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            out = _FP8LinearFunction.apply(x, self.weight, self.weight_scale_inv,
                                           self.block_size)
        else:
            out = _fp8_matmul(x, self.weight, self.block_size)
        if self.bias is not None:
            out.add_(self.bias)
        return out  # type: ignore[no-any-return]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"block_size={self.block_size}, bias={self.bias is not None}")
