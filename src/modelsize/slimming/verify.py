"""Verification: the output, read back by modelsize's own reader, holds exactly the plan.

Every stored tensor must be there under its name, with the planned dtype and shape, and the
CRC-32 of its bytes as read back must equal the CRC-32 of the bytes streamed from the input
(or of their cast) while writing. An alias present in the output must match its original. The
output must carry no unsafe global. Anything else is a modelsize bug: the staged output is
thrown away and nothing is committed.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from pathlib import Path

from modelsize import formats
from modelsize.errors import VerificationError, printable
from modelsize.inventory import Inventory, TensorRecord
from modelsize.slimming.plan import Plan
from modelsize.slimming.source import FileRange, tensor_source
from modelsize.slimming.writers.base import Job, Written


def crc_of(inv: Inventory, record: TensorRecord) -> tuple[int, int]:
    """CRC-32 and length of a tensor's bytes, as modelsize reads them from ``inv``'s files."""
    reader = formats.registry().get(inv.format)
    src = tensor_source(inv, record, getattr(reader, "storage_chunks", None))
    if isinstance(src, FileRange):
        return src.crc(), src.nbytes
    crc, n = 0, 0
    for chunk in src.chunks():
        crc = zlib.crc32(chunk, crc)
        n += len(chunk)
    return crc, n


def _find(by_name: Mapping[str, TensorRecord], *names: str) -> TensorRecord | None:
    """The output tensor under the first of ``names`` it has: the writer's name for it, else
    the input's (multi-file outputs read back under the input's file labels)."""
    for name in names:
        rec = by_name.get(name)
        if rec is not None:
            return rec
    return None


def verify(plan: Plan, job: Job, written: Mapping[str, Written], staged: Path) -> Inventory:
    """Read ``staged`` back and check it against the plan; returns the output's inventory."""
    out = formats.read(staged)
    by_name = {t.name: t for t in out.tensors}
    problems: list[str] = []
    for t in plan.stored:
        rec = _find(by_name, job.output_name(t.name), t.record.name, t.record.key)
        if rec is None:
            problems.append(f"{t.name} is missing")
            continue
        form = getattr(job, "output_form", None)
        dtype, shape = form(t) if form is not None else (t.dtype, t.shape)
        if rec.dtype != dtype or rec.shape != shape:
            problems.append(f"{t.name} reads back as {rec.dtype}{list(rec.shape)}, planned "
                            f"{dtype}{list(shape)}")
            continue
        w = written.get(t.name)
        crc, n = crc_of(out, rec)
        if w is None or (crc, n) != (w.crc, w.nbytes):
            problems.append(f"{t.name}: its bytes read back differ from the bytes written")
    planned = {t.name: t for t in plan.tensors}
    for alias, original in plan.aliases.items():
        rec = _find(by_name, job.output_name(alias), planned[alias].record.name)
        orig = _find(by_name, job.output_name(original), planned[original].record.name)
        if rec is None or orig is None:
            continue  # the format records the alias in its metadata
        if rec.shape != planned[alias].shape:
            problems.append(f"alias {alias} reads back with another shape")
        elif crc_of(out, rec) != crc_of(out, orig):
            problems.append(f"alias {alias} differs from {original}")
    if out.unsafe_globals:
        problems.append("the output would call " + ", ".join(out.unsafe_globals[:3]))
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise VerificationError(
            "the slimmed output failed verification and was not written: "
            + "; ".join(printable(p, 200) for p in problems[:3]) + more
            + " (a modelsize bug: please report it)"
        )
    return out
