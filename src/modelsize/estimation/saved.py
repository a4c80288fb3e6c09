"""What a training step keeps for the backward at its peak, and what it need not keep.

The activations category of an estimate, storage by storage (:class:`Allocation`), grouped
by the module and op that made each storage and the autograd nodes that keep it
(:func:`modelsize.estimation.tracker.record_savers` names them when the forward ends), so
the rows add up to the activations at the peak to the byte. The findings, each with the
bytes at the peak that its change frees:

* **dequantized weight**: a floating-point tensor kept by an autograd node whose values
  derive from model state alone (no input) with a quantized, packed weight among it (an
  integer or 1-byte float parameter or buffer; :attr:`Allocation.state`). The backward can
  make it again from the packed weight. bitsandbytes PR 1935: ``F.linear`` on the
  dequantized weight with autograd on, whose ``MmBackward0`` kept the bf16 weight.
* **input for a frozen weight**: an input-derived tensor kept only by custom autograd
  Functions that also keep a quantized weight. For a linear layer ``y = x Wᵀ`` the input
  serves only ``grad_W = gᵀ x``, and a quantized weight gets no gradient (the rule assumes
  the Function is linear in its input, as a quantized linear is). bitsandbytes PR 1270:
  ``MatMul4Bit`` kept ``ctx.tensors = (A, B)``; the fix keeps ``(None, B)``.
* **recomputable**: the output of a pointwise op (or a copy) kept by an autograd node while
  every input-derived argument it was computed from is kept too and alive at the peak: the
  backward could compute it again. Reported per op where it adds up to at least
  :data:`RECOMPUTABLE_SHARE` of the activations (GELU's intermediates in every layer are
  one finding, not twelve).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Sequence

from modelsize.estimation.result import (
    SavedFinding,
    SavedFindingKind,
    SavedForBackward,
    SavedTensors,
)
from modelsize.estimation.tracker import (
    STATE_NONE,
    STATE_PACKED,
    Allocation,
    Origin,
    packed_dtype,
)

#: The smallest share of the activations at the peak that a recomputable finding reports.
RECOMPUTABLE_SHARE = 0.01


def op_name(op: object) -> str:
    """``aten.mm`` for ``torch.ops.aten.mm.default``; a string as it is; ``""`` for None."""
    if op is None:
        return ""
    if isinstance(op, str):
        return op
    packet = getattr(op, "overloadpacket", None)
    return str(packet) if packet is not None else str(op)


def savers(rec: Allocation) -> tuple[str, ...]:
    """The names of what keeps ``rec`` (see :attr:`SavedTensors.saved_by`)."""
    if rec.saved_by:
        return rec.saved_by
    if rec.recomputed:
        return ("recomputed",)
    return ()


def saved_for_backward(activations: Sequence[Allocation], live: Iterable[Allocation],
                       packed_nodes: Collection[str] = ()) -> SavedForBackward:
    """The table and findings of the records counted as activations at the peak; ``live``
    is every record alive then (where a recomputable tensor's inputs are looked up),
    ``packed_nodes`` the custom Functions that keep a packed weight
    (``CountingFakeMode.packed_keepers``)."""
    Key = tuple[str, str, tuple[str, ...], str, tuple[int, ...], tuple[str, ...]]
    groups: dict[Key, list[int]] = {}
    for rec in activations:
        dtype = str(rec.dtype).removeprefix("torch.") if rec.dtype is not None else ""
        key = (rec.module or "<model>", op_name(rec.op), savers(rec), dtype, rec.shape,
               tuple(m or "<model>" for m in rec.kept_in))
        g = groups.setdefault(key, [0, 0])
        g[0] += 1
        g[1] += rec.nbytes
    rows = tuple(sorted((SavedTensors(m, op, by, dt, sh, n, b, kin)
                         for (m, op, by, dt, sh, kin), (n, b) in groups.items()),
                        key=lambda r: (-r.nbytes, r.module, r.op)))
    total = sum(r.nbytes for r in activations)
    alive = {id(r) for r in live}
    findings = [*_dequantized(activations), *_for_frozen_weights(activations, packed_nodes),
                *_recomputable(activations, alive, total)]
    findings.sort(key=lambda f: -f.nbytes)
    return SavedForBackward(rows, total, tuple(findings))


def _float(rec: Allocation) -> bool:
    return rec.dtype is not None and rec.dtype.is_floating_point and not packed_dtype(rec.dtype)


def _tensors(n: int, shape: str) -> str:
    return f"{n} tensor{'s' if n > 1 else ''} of {shape or 'one element'}"


def _human(n: int) -> str:
    from modelsize.report.units import human_bytes

    return human_bytes(n)


def _dequantized(acts: Sequence[Allocation]) -> list[SavedFinding]:
    """One finding per module pattern (``layers.*.mlp.gate_proj``: the same module of every
    layer) and keeper."""
    groups: dict[tuple[str, tuple[str, ...]], list[Allocation]] = {}
    for rec in acts:
        if rec.saved_by and rec.state == STATE_PACKED and _float(rec):
            groups.setdefault((_layer(rec.module), rec.saved_by), []).append(rec)
    out = []
    for (pattern, by), recs in groups.items():
        n = sum(r.nbytes for r in recs)
        first = recs[0]
        modules = sorted({r.module or "<model>" for r in recs})
        module = modules[0] if len(modules) == 1 else pattern
        where = module if len(modules) == 1 else f"{module} ({len(modules)} modules)"
        shape = "x".join(map(str, first.shape))
        dtype = str(first.dtype).removeprefix("torch.")
        out.append(SavedFinding(
            SavedFindingKind.DEQUANTIZED_WEIGHT, module, op_name(first.op), by, len(recs), n,
            len(modules),
            f"{where} keeps a dequantized {dtype} copy of a quantized weight for the "
            f"backward ({_tensors(len(recs), shape)}, {_human(n)}, made by {op_name(first.op)}, "
            f"kept by {', '.join(by)}): keep only the packed weight and dequantize it again "
            "in the backward (compute the forward's matmul under torch.no_grad() inside a "
            "custom autograd.Function, as bitsandbytes PR 1935 does)"))
    return out


def _for_frozen_weights(acts: Sequence[Allocation],
                        packed_nodes: Collection[str]) -> list[SavedFinding]:
    """Input-derived tensors whose every keeper is a custom Function that keeps a packed
    weight too (its labels: ``Node`` or ``Node.attribute``)."""
    groups: dict[tuple[str, tuple[str, ...]], list[Allocation]] = {}
    for rec in acts:
        if not rec.saved_by or rec.state != STATE_NONE:
            continue
        if all(label.split(".", 1)[0] in packed_nodes for label in rec.saved_by):
            keeper = ", ".join(m or "<model>" for m in rec.kept_in) or "<model>"
            groups.setdefault((keeper, rec.saved_by), []).append(rec)
    out = []
    for (module, by), recs in groups.items():
        n = sum(r.nbytes for r in recs)
        first = recs[0]
        shape = "x".join(map(str, first.shape))
        node = by[0].split(".", 1)[0]
        out.append(SavedFinding(
            SavedFindingKind.INPUT_FOR_FROZEN_WEIGHT, module, op_name(first.op), by,
            len(recs), n, 1,
            f"{module} keeps its input for the backward ({_tensors(len(recs), shape)}, "
            f"{_human(n)}, "
            f"kept by {', '.join(by)}) beside a quantized weight, which gets no gradient; "
            f"for a linear layer the input serves only the weight's gradient: keep only "
            f"the packed weight in {node} (as bitsandbytes PR 1270 made MatMul4Bit do)"))
    return out


def _recomputable(acts: Sequence[Allocation], alive: set[int],
                  total: int) -> list[SavedFinding]:
    groups: dict[tuple[str, tuple[str, ...]], list[Allocation]] = {}
    for rec in acts:
        if not rec.saved_by or not rec.sources or rec.origin is not Origin.FORWARD:
            continue
        if rec.state != STATE_NONE:
            continue
        if all(id(s) in alive and (s.saved_by or s.origin is Origin.INPUT)
               for s in rec.sources):
            groups.setdefault((op_name(rec.op), rec.saved_by), []).append(rec)
    out = []
    for (op, by), recs in groups.items():
        n = sum(r.nbytes for r in recs)
        if n < RECOMPUTABLE_SHARE * total:
            continue
        modules = sorted({_layer(r.module) for r in recs})
        where = f"module {modules[0]}" + (f" and {len(modules) - 1} more"
                                           if len(modules) > 1 else "")
        out.append(SavedFinding(
            SavedFindingKind.RECOMPUTABLE, modules[0], op, by, len(recs), n, len(modules),
            f"{len(recs)} outputs of {op} ({_human(n)}, in {where}) are kept for the "
            f"backward by {', '.join(by)} although the tensors they were computed from are "
            "kept too: recompute them in the backward (selective activation checkpointing "
            "with a policy that recomputes pointwise ops, a fused kernel, or a custom "
            "autograd.Function that keeps only the inputs)"))
    return out


def _layer(module: str) -> str:
    """``h.3.mlp.act`` -> ``h.*.mlp.act``: one name for a module repeated in every layer."""
    return re.sub(r"\.\d+(\.|$)", r".*\1", module or "<model>")
