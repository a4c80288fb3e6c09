"""What a graph slim (ONNX or TensorFlow) reports beyond every slim's :class:`SlimReport`:
the passes run and the outputs of the original and the slimmed model compared.

Free of NumPy and of the frameworks: the CLI imports it to describe its options."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from modelsize.slimming.result import SlimReport


@dataclass(frozen=True)
class OutputDiff:
    """One output of the model compared."""

    name: str
    max_abs: float
    max_rel: float

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"name": self.name, "max_abs": self.max_abs, "max_rel": self.max_rel}


@dataclass(frozen=True)
class Comparison:
    """Every output compared, the tolerance, what ran them and the verdict (ONNX and TF)."""

    outputs: tuple[OutputDiff, ...]
    tolerance: float
    kind: str
    runner: str = "onnxruntime"
    """What ran both models (the report's "Verified: ... ran")."""
    inputs: str = ""
    """How the inputs were made, when not by the default rule (free dimensions 1, ...)."""

    @property
    def max_rel(self) -> float:
        """The worst relative difference over all outputs."""
        return max((o.max_rel for o in self.outputs), default=0.0)

    @property
    def ok(self) -> bool:
        """Whether every output is within the tolerance."""
        return self.max_rel <= self.tolerance

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"outputs": [o.to_dict() for o in self.outputs], "tolerance": self.tolerance,
                "kind": self.kind, "runner": self.runner, "inputs": self.inputs,
                "max_rel": self.max_rel, "ok": self.ok}


class PassRow(Protocol):
    """A pass (or mode) of a graph slim as its report lists it."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        ...


@dataclass(frozen=True)
class GraphSlimReport(SlimReport):
    """A :class:`SlimReport` of a graph slim (ONNX or TensorFlow): the passes run and the
    outputs compared."""

    passes: tuple[PassRow, ...] = ()
    comparison: Comparison | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form: the slim report plus ``passes`` and ``outputs_compared``."""
        out = super().to_dict()
        out["passes"] = [p.to_dict() for p in self.passes]
        out["outputs_compared"] = None if self.comparison is None else self.comparison.to_dict()
        return out
