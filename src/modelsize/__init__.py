"""modelsize: why is this model file so big, how much memory will this model need, how to shrink it.

Public API::

    modelsize.inspect(path) -> Report          every byte of a saved model, by category
    modelsize.estimate(model, inputs, ...)     exact memory of inference / a training step
    modelsize.slim(path, out, ...) -> SlimReport   a smaller copy, streamed and verified
    modelsize.check(path, ...) -> CheckResult  the rules a file breaks (size, findings), for CI

The functions are not the subpackages that implement them (``modelsize.estimation``,
``modelsize.slimming``): importing a subpackage never rebinds ``modelsize.estimate``.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (type checkers know it)

__version__ = "0.1.0"


def _interrupted_at_start(signum: int, frame: object) -> None:
    """A Ctrl-C before the command's own handler is in place: nothing to clean up yet."""
    import os

    os.write(2, b"modelsize: interrupted\n")
    os._exit(130)


def _command_starting() -> None:
    """When importing this package is the start of the ``modelsize`` command (``python -m
    modelsize``, the console script), a Ctrl-C until :func:`modelsize.cli.main` takes over
    (runpy finding ``__main__``, the CLI's own imports) ends it as the CLI would: one line,
    exit 130, no traceback. Imported as a library, nothing changes."""
    import sys

    argv = list(getattr(sys, "orig_argv", ()))
    as_module = any(argv[i : i + 2] == ["-m", "modelsize"] for i in range(len(argv)))
    script = bool(sys.argv) and sys.argv[0].rsplit("/", 1)[-1] == "modelsize"
    if not (as_module or script):
        return
    import signal

    try:
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, _interrupted_at_start)
    except ValueError:  # not the main thread
        pass


_command_starting()

# ``import modelsize`` stays cheap (the CLI's start-up, Ctrl-C included, goes through it): every
# public name is imported on first use (PEP 562).
_LAZY: dict[str, str] = {
    "Category": "modelsize.categories",
    "CheckResult": "modelsize.checking",
    "Violation": "modelsize.checking",
    "check": "modelsize.checking",
    "AccountingError": "modelsize.errors",
    "CorruptFileError": "modelsize.errors",
    "EstimateError": "modelsize.errors",
    "InputError": "modelsize.errors",
    "MissingDependencyError": "modelsize.errors",
    "ModelSizeError": "modelsize.errors",
    "PathNotFoundError": "modelsize.errors",
    "UnknownFormatError": "modelsize.errors",
    "UsageError": "modelsize.errors",
    "VerificationError": "modelsize.errors",
    "Finding": "modelsize.findings",
    "FindingKind": "modelsize.findings",
    "Report": "modelsize.inspection",
    "inspect": "modelsize.inspection",
    "FileInfo": "modelsize.inventory",
    "Inventory": "modelsize.inventory",
    "Region": "modelsize.inventory",
    "StorageRecord": "modelsize.inventory",
    "TensorRecord": "modelsize.inventory",
    "Estimate": "modelsize.estimation",
    "SlimReport": "modelsize.slimming",
}

if TYPE_CHECKING:
    from typing import Any

    from modelsize.categories import Category
    from modelsize.checking import CheckResult, Violation, check
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
        VerificationError,
    )
    from modelsize.estimation import Estimate
    from modelsize.findings import Finding, FindingKind
    from modelsize.inspection import Report, inspect
    from modelsize.inventory import FileInfo, Inventory, Region, StorageRecord, TensorRecord
    from modelsize.slimming import SlimReport


def estimate(model: Any, inputs: Any, **kwargs: Any) -> Estimate:
    """Exact peak memory of ``model`` on ``inputs`` (see :func:`modelsize.estimation.estimate`).

    Imported lazily: ``import modelsize`` must not import torch.
    """
    from modelsize.estimation import estimate as _estimate

    return _estimate(model, inputs, **kwargs)


def slim(path: Any, out: Any = None, **kwargs: Any) -> SlimReport:
    """A smaller copy of a checkpoint, verified (see :func:`modelsize.slimming.slim`)."""
    from modelsize.slimming import slim as _slim

    return _slim(path, out, **kwargs)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'modelsize' has no attribute {name!r}")
    value = getattr(__import__(module, fromlist=[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "AccountingError",
    "Category",
    "CheckResult",
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
    "SlimReport",
    "StorageRecord",
    "TensorRecord",
    "UnknownFormatError",
    "UsageError",
    "VerificationError",
    "Violation",
    "__version__",
    "check",
    "estimate",
    "inspect",
    "slim",
]
