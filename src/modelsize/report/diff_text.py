"""Plain-text rendering of a :class:`~modelsize.diff.Diff`."""

from __future__ import annotations

from modelsize.diff import Diff, QuantizedPair, TensorChange
from modelsize.errors import printable
from modelsize.inventory import Inventory, TensorRecord
from modelsize.quantization import QuantizedWeight, is_quantized
from modelsize.report.table import table
from modelsize.report.units import human_bytes

#: Rows shown per list (added, removed, changed) before "... and N more".
MAX_ROWS = 20




def _signed(n: int) -> str:
    if n == 0:
        return "="
    return ("+" if n > 0 else "-") + human_bytes(abs(n))


def _ratio(a: int, b: int) -> str:
    if a == b:
        return ""
    if a == 0:
        return "new"
    return f"{100.0 * (b - a) / a:+.0f}%"


def _shape(t: TensorRecord) -> str:
    return "x".join(str(d) for d in t.shape) or "scalar"


def _side(label: str, inv: Inventory) -> str:
    return (f"{label}: {printable(str(inv.path))}  ({inv.format}, {inv.file_bytes:,} bytes, "
            f"{len(inv.tensors)} tensors)")


def _tensor_rows(title: str, tensors: tuple[TensorRecord, ...]) -> list[str]:
    if not tensors:
        return []
    rows = [["name", "dtype", "shape", "size", "category"]]
    for t in sorted(tensors, key=lambda t: -t.nbytes)[:MAX_ROWS]:
        rows.append([printable(t.name, 70), t.dtype, _shape(t), human_bytes(t.nbytes),
                     t.category.value])
    lines = ["", f"{title} ({len(tensors)}, {human_bytes(sum(t.nbytes for t in tensors))})"]
    lines += table(rows, "lllrl")
    if len(tensors) > MAX_ROWS:
        lines.append(f"  ... and {len(tensors) - MAX_ROWS} more")
    return lines


def _change_rows(changes: tuple[TensorChange, ...]) -> list[str]:
    if not changes:
        return []
    rows = [["name", "A", "B"]]
    for c in sorted(changes, key=lambda c: -max(c.a.nbytes, c.b.nbytes))[:MAX_ROWS]:
        rows.append([
            printable(c.name, 70),
            f"{c.a.dtype} {_shape(c.a)} {c.a.category.value}",
            f"{c.b.dtype} {_shape(c.b)} {c.b.category.value}",
        ])
    lines = ["", f"Changed dtype, shape or category ({len(changes)})"]
    lines += table(rows, "lll")
    if len(changes) > MAX_ROWS:
        lines.append(f"  ... and {len(changes) - MAX_ROWS} more")
    return lines


def _weight(w: QuantizedWeight) -> str:
    """``bfloat16 4096x4096 (16 bits)``, ``4-bit GPTQ, group 128 (4.25 bits)``."""
    bits = f"{w.bits_per_weight:.3f}".rstrip("0").rstrip(".")
    shape = "" if is_quantized(w.layout) or not w.shape else " " + "x".join(map(str, w.shape))
    return f"{printable(w.label, 60)}{shape} ({bits} bits)"


def _quantized_rows(pairs: tuple[QuantizedPair, ...]) -> list[str]:
    if not pairs:
        return []
    lines = ["", f"Quantized weights beside their source ({len(pairs)})"]
    for p in sorted(pairs, key=lambda p: -max(p.a.parameters, p.b.parameters))[:MAX_ROWS]:
        lines.append(f"  {printable(p.name, 70)}: {_weight(p.a)} -> {_weight(p.b)}")
    if len(pairs) > MAX_ROWS:
        lines.append(f"  ... and {len(pairs) - MAX_ROWS} more")
    return lines


def render_diff(d: Diff) -> str:
    """Bytes by category side by side, then tensors removed, added and changed."""
    lines = [_side("A", d.a), _side("B", d.b), ""]
    rows = [["category", "A", "B", "change", ""]]
    for cat, (x, y) in d.category_delta().items():
        if x or y:
            rows.append([cat.value, f"{x:,}", f"{y:,}", _signed(y - x), _ratio(x, y)])
    fa, fb = d.a.file_bytes, d.b.file_bytes
    rows.append(["total", f"{fa:,}", f"{fb:,}", _signed(fb - fa), _ratio(fa, fb)])
    lines += table(rows, "lrrrr")
    lines += ["", f"Tensors: {d.unchanged} with the same dtype, shape and category, "
                  f"{len(d.changed)} changed, {len(d.removed)} only in A, {len(d.added)} "
                  "only in B"]
    if d.renamed:
        lines.append(f"  ({d.renamed} matched after dropping file labels or 'module.' prefixes)")
    if d.by_layout:
        lines.append(f"  ({d.by_layout} matched by layout across formats: same dtype and shape, "
                     "or the same dimensions in another order)")
    lines += _tensor_rows("Only in A (removed)", d.removed)
    lines += _tensor_rows("Only in B (added)", d.added)
    lines += _change_rows(d.changed)
    lines += _quantized_rows(d.quantized)
    return "\n".join(lines) + "\n"
