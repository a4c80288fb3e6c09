"""modelsize: why is this model file so big, how much memory will this model need, how to shrink it.

Public API::

    modelsize.inspect(path) -> Report          every byte of a saved model, by category
    modelsize.estimate(model, inputs, ...)     exact memory of inference / a training step
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

from modelsize.categories import Category
from modelsize.errors import (
    AccountingError,
    CorruptFileError,
    EstimateError,
    InputError,
    MissingDependencyError,
    ModelSizeError,
    PathNotFoundError,
    UnknownFormatError,
    UsageError,
)
from modelsize.findings import Finding, FindingKind
from modelsize.inspection import Report, inspect
from modelsize.inventory import FileInfo, Inventory, Region, StorageRecord, TensorRecord

if TYPE_CHECKING:
    from modelsize.estimate import Estimate


def estimate(model: Any, inputs: Any, **kwargs: Any) -> Estimate:
    """Exact peak memory of ``model`` on ``inputs`` (see :func:`modelsize.estimate.estimate`).

    Imported lazily: ``import modelsize`` must not import torch.
    """
    from modelsize.estimate import estimate as _estimate

    return _estimate(model, inputs, **kwargs)


def __getattr__(name: str) -> Any:
    if name == "Estimate":
        from modelsize.estimate import Estimate

        return Estimate
    raise AttributeError(f"module 'modelsize' has no attribute {name!r}")


__all__ = [
    "AccountingError",
    "Category",
    "CorruptFileError",
    "Estimate",
    "EstimateError",
    "FileInfo",
    "Finding",
    "FindingKind",
    "InputError",
    "Inventory",
    "MissingDependencyError",
    "ModelSizeError",
    "PathNotFoundError",
    "Region",
    "Report",
    "StorageRecord",
    "TensorRecord",
    "UnknownFormatError",
    "UsageError",
    "__version__",
    "estimate",
    "inspect",
]
