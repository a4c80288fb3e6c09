"""Output formats: one module per format behind the :class:`Writer` protocol, registered here.

The registry is explicit: :data:`WRITERS` names every writer and its module (imported only when
used); :data:`SAME_FORMAT` says which writer keeps each input format (``--to same``);
:data:`CONVERSIONS` are the targets of ``--to`` that any input can be written to.
"""

from __future__ import annotations

import importlib

from modelsize.errors import UsageError
from modelsize.slimming.writers.base import Job, Writer

__all__ = ["CONVERSIONS", "SAME_FORMAT", "WRITERS", "Job", "Writer", "for_input", "get"]

#: writer name -> (module under modelsize.slimming.writers, class).
WRITERS: dict[str, tuple[str, str]] = {
    "safetensors": ("safetensors", "SafetensorsWriter"),
    "pytorch": ("torch", "TorchWriter"),
    "npz": ("numpy", "NpzWriter"),
    "directory": ("directory", "DirectoryWriter"),
    "tensorflow": ("tensorflow", "TensorflowWriter"),
    "keras": ("keras", "KerasWriter"),
    "keras-h5": ("keras", "KerasH5Writer"),
    "t7": ("t7", "T7Writer"),
    "onnx": ("onnx", "OnnxWriter"),
    "gguf": ("gguf", "GgufWriter"),
    "tflite": ("tflite", "TfliteWriter"),
}

#: input format (reader name) -> the writer that keeps it (``--to same``).
SAME_FORMAT: dict[str, str] = {
    "pytorch": "pytorch",
    "pytorch-legacy": "pytorch",
    "pytorch-sharded": "directory",
    "deepspeed": "pytorch",
    "torch-dcp": "pytorch",
    "safetensors": "safetensors",
    "safetensors-index": "safetensors",
    "npz": "npz",
    "npy": "npz",
    "pickle": "npz",
    "tensorflow": "tensorflow",
    "keras": "keras",
    "keras-h5": "keras-h5",
    "t7": "t7",
    "onnx": "onnx",
    "gguf": "gguf",
    "tflite": "tflite",
}

#: ``--to`` targets every input format can be written to.
CONVERSIONS: tuple[str, ...] = ("safetensors", "pytorch", "npz")

_LOADED: dict[str, Writer] = {}


def get(name: str) -> Writer:
    """The writer called ``name`` (its module imported on first use)."""
    writer = _LOADED.get(name)
    if writer is None:
        module, cls = WRITERS[name]
        writer = getattr(importlib.import_module(f"modelsize.slimming.writers.{module}"), cls)()
        _LOADED[name] = writer
    return writer


def for_input(input_format: str, to: str) -> Writer:
    """The writer for ``--to`` (``same``: the one that keeps ``input_format``)."""
    if to == "same":
        name = SAME_FORMAT.get(input_format)
        if name is None:
            raise UsageError(
                f"slim cannot write {input_format} files yet; use --to "
                + " or --to ".join(CONVERSIONS)
            )
        return get(name)
    if to not in CONVERSIONS:
        raise UsageError(f"--to {to!r}: expected same, {', '.join(CONVERSIONS)}")
    return get(to)
