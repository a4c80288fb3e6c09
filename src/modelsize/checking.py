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
from modelsize.report.units import human_bytes, parse_size, percent

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

    path: Path | str  # a str for a URL
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
        if not isinstance(raw, str):
            raise UsageError(f"--forbid: expected finding names, not {type(raw).__name__}")
        name = raw.strip().lower().replace("-", "_")
        if not name or name == "none":
            continue
        if name not in known:
            raise UsageError(f"--forbid: unknown finding {raw.strip()!r} "
                             f"(one of: {', '.join(known)})")
        if known[name] not in out:
            out.append(known[name])
    return tuple(out)


def parse_max_size(value: int | str | None, option: str = "max_size") -> int | None:
    """A size limit as the CLI takes it (``"500MB"``, ``"2GiB"``, ``"1e9"``) or as bytes (an
    ``int``); ``None`` is no limit. Anything else is a one-line :class:`UsageError`."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            return parse_size(value)
        except ValueError as exc:
            raise UsageError(f"{option}: {exc}") from None
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise UsageError(f"{option}: a size cannot be negative (got {value})")
        return value
    raise UsageError(f"{option}: expected a number of bytes or a size such as '500MB' or "
                     f"'2GiB', not {type(value).__name__}")


def _url(path: str | Path) -> str | None:
    """``path`` if it is a URL modelsize reads remotely (``http(s)://``, ``hf://``...)."""
    if "://" not in str(path):
        return None
    from modelsize.remote import is_remote

    return str(path) if is_remote(path) else None


def _inspect_remote(url: str) -> Any:
    from modelsize.remote import inspect_remote

    return inspect_remote(url).report


def check(path: str | Path, *, max_size: int | str | None = None,
          forbid: Iterable[FindingKind | str] = DEFAULT_FORBID) -> CheckResult:
    """Hold the model at ``path`` to the rules: at most ``max_size`` (bytes, or a size as the
    CLI takes it: ``"500MB"``, ``"2GiB"``), no finding in ``forbid``. Unreadable input raises
    the same errors :func:`modelsize.inspect` does."""
    limit = parse_max_size(max_size)
    kinds = parse_forbid(forbid if isinstance(forbid, str) else
                         [k.value if isinstance(k, FindingKind) else k for k in forbid])
    url = _url(path)
    report = inspect(path) if url is None else _inspect_remote(url)
    size = report.file_bytes
    violations: list[Violation] = []
    if limit is not None and size > limit:
        violations.append(Violation(
            "max_size", size - limit,
            f"{human_bytes(size)} is over the limit of {human_bytes(limit)} "
            f"by {human_bytes(size - limit)}",
            f"modelsize inspect {url or report.inventory.path}",
        ))
    for f in report.findings:
        if f.kind in kinds:
            share = f" ({percent(f.bytes, size)} of the file)" if f.bytes else ""
            violations.append(Violation(f.kind.value, f.bytes, f.message.rstrip(".") + share,
                                        f.action))
    return CheckResult(url or Path(path), report.format, size, tuple(violations))
