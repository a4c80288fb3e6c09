"""``modelsize.check(path, ...) -> CheckResult``: a model file held to a team's rules, for CI.

A rule is a size limit or a finding kind that must not occur (optimizer state in a file meant
for inference, tensors saved twice, code in a pickle). Each broken rule is a
:class:`Violation` with the bytes it costs and the command that fixes it; the file is read the
way ``inspect`` reads it (headers only, never its code).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modelsize.errors import UsageError
from modelsize.findings import FindingKind
from modelsize.inspection import inspect
from modelsize.report.units import human_bytes, percent

#: What ``modelsize check`` forbids unless told otherwise: what a file shipped for inference
#: should never carry. ``ema`` and ``wide_dtype`` are matters of taste: forbid them by name.
DEFAULT_FORBID: tuple[FindingKind, ...] = (
    FindingKind.UNSAFE_CODE,
    FindingKind.OPTIMIZER_STATE,
    FindingKind.GRADIENTS,
    FindingKind.ACTIVATIONS,
    FindingKind.UNUSED_STORAGE,
    FindingKind.DUPLICATES,
)


@dataclass(frozen=True)
class Violation:
    """One broken rule: ``rule`` is ``max_size`` or a finding kind."""

    rule: str
    bytes: int
    message: str
    action: str

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"rule": self.rule, "bytes": self.bytes, "message": self.message,
                "action": self.action}


@dataclass(frozen=True)
class CheckResult:
    """The rules one model file breaks (none: it passes)."""

    path: Path
    format: str
    file_bytes: int
    violations: tuple[Violation, ...]

    @property
    def ok(self) -> bool:
        """True when the file breaks no rule."""
        return not self.violations

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"path": str(self.path), "format": self.format, "file_bytes": self.file_bytes,
                "ok": self.ok, "violations": [v.to_dict() for v in self.violations]}

    def lines(self) -> list[str]:
        """One line per violation, each naming the file, the rule, the bytes and the fix."""
        return [f"{self.path}: {v.rule}: {v.message} "
                f"({'where the bytes go' if v.rule == 'max_size' else 'fix'}: {v.action})"
                for v in self.violations]


def parse_forbid(names: str | Iterable[str]) -> tuple[FindingKind, ...]:
    """``"optimizer_state,duplicates"`` -> finding kinds; ``""`` or ``"none"`` forbids none."""
    items = names.split(",") if isinstance(names, str) else list(names)
    out: list[FindingKind] = []
    known = {k.value: k for k in FindingKind if k != FindingKind.FIX_ALL}
    for raw in items:
        name = raw.strip().lower().replace("-", "_")
        if not name or name == "none":
            continue
        if name not in known:
            raise UsageError(f"--forbid: unknown finding {raw.strip()!r} "
                             f"(one of: {', '.join(known)})")
        if known[name] not in out:
            out.append(known[name])
    return tuple(out)


def check(path: str | Path, *, max_size: int | None = None,
          forbid: Iterable[FindingKind | str] = DEFAULT_FORBID) -> CheckResult:
    """Hold the model at ``path`` to the rules: at most ``max_size`` bytes, no finding in
    ``forbid``. Unreadable input raises the same errors :func:`modelsize.inspect` does."""
    kinds = parse_forbid([k.value if isinstance(k, FindingKind) else k for k in forbid])
    report = inspect(path)
    size = report.file_bytes
    violations: list[Violation] = []
    if max_size is not None and size > max_size:
        violations.append(Violation(
            "max_size", size - max_size,
            f"{human_bytes(size)} is over the limit of {human_bytes(max_size)} "
            f"by {human_bytes(size - max_size)}",
            f"modelsize inspect {report.inventory.path}",
        ))
    for f in report.findings:
        if f.kind in kinds:
            share = f" ({percent(f.bytes, size)} of the file)" if f.bytes else ""
            violations.append(Violation(f.kind.value, f.bytes, f.message.rstrip(".") + share,
                                        f.action))
    return CheckResult(Path(path), report.format, size, tuple(violations))
