"""Output formats: one module per format behind the :class:`Writer` protocol, registered here.

The registry is explicit: :data:`WRITERS` names every writer and its module (imported only when
used); :data:`SAME_FORMAT` says which writer keeps each input format (``--to same``);
:data:`CONVERSIONS` are the targets of ``--to`` that any input can be written to. A plan with
nothing to slim is written by ``copy`` (the input byte for byte) instead: :func:`for_plan`.
:data:`NAMED` is what an output's extension says it is: an output is never given a name that
claims another format than the one written (:func:`check_name`).
"""

from __future__ import annotations

import importlib
from pathlib import Path

from modelsize.errors import UsageError, printable
from modelsize.slimming.plan import Plan
from modelsize.slimming.writers.base import Job, Writer

__all__ = ["CONVERSIONS", "NAMED", "SAME_FORMAT", "WRITERS", "Job", "Writer", "check_name",
           "copyable", "for_input", "for_plan", "get"]

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
    "copy": ("copy", "CopyWriter"),
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


def copyable(plan: Plan, out: str | Path | None) -> bool:
    """Whether the plan has nothing to slim and the input can be copied as it is under
    ``out`` (see :mod:`.copy`)."""
    from modelsize.slimming.writers.copy import copyable as can_copy

    return can_copy(plan, Path(out) if out is not None else None)


def for_plan(plan: Plan, rewritten: int | None) -> Writer | None:
    """For a :func:`copyable` plan, the ``copy`` writer unless the format's writer would
    write the same tensors smaller (``rewritten``: its predicted size, ``None`` when
    unknown): ASCII Lua Torch written as binary is."""
    if rewritten is not None and rewritten < plan.inventory.file_bytes:
        return None
    return get("copy")


#: Output extension -> (what it says the file is, what loads such a file, the writers that
#: write that).
NAMED: dict[str, tuple[str, str, frozenset[str]]] = {
    ".pkl": ("a pickle", "pickle.load", frozenset()),
    ".pickle": ("a pickle", "pickle.load", frozenset()),
    ".joblib": ("a joblib pickle", "joblib.load", frozenset()),
    ".pt": ("a torch file", "torch.load", frozenset({"pytorch"})),
    ".pth": ("a torch file", "torch.load", frozenset({"pytorch"})),
    ".safetensors": ("a safetensors file", "safetensors", frozenset({"safetensors"})),
    ".npz": ("an .npz archive", "np.load", frozenset({"npz"})),
    ".npy": ("an .npy array", "np.load", frozenset({"npz"})),
    ".onnx": ("an ONNX model", "onnx.load", frozenset({"onnx"})),
    ".keras": ("a Keras archive", "keras.saving.load_model", frozenset({"keras"})),
    ".gguf": ("a GGUF file", "llama.cpp", frozenset({"gguf"})),
    ".t7": ("a Lua Torch file", "torch.load of Lua Torch", frozenset({"t7"})),
}
#: Writers whose output names are prefixes or folders (``model.ckpt``, ``model.slim``).
_UNNAMED = frozenset({"tensorflow", "directory", "copy"})
#: What each writer writes, and the extension its files get (for the name suggested).
_WRITES = {"pytorch": ("a torch zip archive", ".pt"),
           "safetensors": ("a safetensors file", ".safetensors"),
           "npz": ("an .npz archive", ".npz"), "onnx": ("an ONNX model", ".onnx"),
           "keras": ("a Keras archive", ".keras"), "keras-h5": ("a Keras HDF5 file", ".h5"),
           "gguf": ("a GGUF file", ".gguf"), "t7": ("a Lua Torch file", ".t7")}


def check_name(writer: Writer, target: Path) -> None:
    """A :class:`UsageError` when ``target``'s extension says it is another format than
    ``writer`` writes: ``x.slim.pkl`` holding an npz archive, which ``pickle.load`` cannot
    read. The message names the extension to use."""
    named = NAMED.get(target.suffix.lower())
    if named is None or writer.name in _UNNAMED or writer.name in named[2]:
        return
    what, loader, _ = named
    writes, ext = _WRITES.get(writer.name, (f"a {writer.name} file", ""))
    better = f"; name it {printable(target.with_suffix(ext).name)}" if ext else ""
    raise UsageError(
        f"{printable(str(target))}: the name says {what}, but slim writes {writes} here, "
        f"which {loader} cannot read{better}")
