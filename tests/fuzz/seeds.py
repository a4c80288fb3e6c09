"""Seed files of every format ``slim`` writes, made by the real frameworks.

Each seed is a folder (``root``) holding one model: ``entry`` is what ``slim``/``inspect`` are
given (a file in it, a checkpoint prefix, or the folder itself, ``""``), ``targets`` are the
files a mutation may change, and ``variants`` the ways it is slimmed: the arguments, the name of
the output and the loader that checks it (see :mod:`tests.fuzz.serve`).

Made here with the framework in this venv: torch (zip and legacy ``torch.save`` of a training
checkpoint: weights, buffers, Adam state, a tied weight), safetensors (one file; two shards and
an index), NumPy (``.npy``, ``.npz`` stored and deflated, a pickle of arrays), gguf-py, and a
Lua Torch ``.t7`` by a small encoder of torch7's ``File.lua`` layout (Lua cannot run here; the
``torchfile`` package, a reader we did not write, loads it). Copied from ``tests/fixtures``
(each written by its real framework: see the ``generate.py`` and ``MANIFEST.json`` beside it):
ONNX, Keras ``.keras`` (stored and deflated) and ``.h5`` (Keras 3 weights, tf_keras full model
and weights), TF checkpoints (TF1 with ``.meta``, TF2 with slots), the HF Trainer, DeepSpeed
and DCP folders. TFLite is converted by TensorFlow in its own venv
(:func:`tflite_seed_code`), once per session.
"""

from __future__ import annotations

import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


@dataclass(frozen=True)
class Variant:
    """One way to slim a seed: ``args`` after ``slim IN -o OUT``; ``out`` the output's name;
    ``loader`` what checks it (:data:`tests.fuzz.serve.LOADERS`, or ``tf:`` ones)."""

    args: tuple[str, ...]
    out: str
    loader: str


@dataclass(frozen=True)
class Seed:
    name: str
    root: Path
    entry: str
    targets: tuple[str, ...]
    variants: tuple[Variant, ...]
    #: a file the loader needs beside the output (a Keras architecture for ``.weights.h5``)
    extra: str = ""

    @property
    def input(self) -> Path:
        return self.root / self.entry if self.entry else self.root


def _v(out: str, loader: str, *args: str) -> Variant:
    return Variant(tuple(args), out, loader)


# -- made here ---------------------------------------------------------------------------------


def _torch_checkpoint(torch):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.BatchNorm1d(4),
                                torch.nn.Linear(4, 6, bias=False))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 6)).sum().backward()
    opt.step()
    sd = model.state_dict()
    return {"model": sd, "optimizer": opt.state_dict(), "epoch": 3,
            "tied": sd["0.weight"], "half": sd["2.weight"].half()}


def torch_seeds(out: Path) -> list[Seed]:
    import torch

    ckpt = _torch_checkpoint(torch)
    (out / "torch-zip").mkdir()
    torch.save(ckpt, out / "torch-zip" / "ckpt.pt")
    (out / "torch-legacy").mkdir()
    torch.save(ckpt, out / "torch-legacy" / "ckpt.pt", _use_new_zipfile_serialization=False)
    variants = (_v("o.pt", "torch"), _v("o.pt", "torch", "--dedupe"),
                _v("o.pt", "torch", "--cast", "float16"),
                _v("o.safetensors", "safetensors", "--to", "safetensors"),
                _v("o.npz", "npz", "--to", "npz"))
    return [Seed("torch-zip", out / "torch-zip", "ckpt.pt", ("ckpt.pt",), variants),
            Seed("torch-legacy", out / "torch-legacy", "ckpt.pt", ("ckpt.pt",), variants)]


def safetensors_seeds(out: Path) -> list[Seed]:
    import json

    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 6)).astype(np.float32)
    tensors = {"embed.weight": w, "head.weight": w.copy(), "norm.bias": np.zeros(6, np.float32),
               "ids": np.arange(5, dtype=np.int64), "half": np.ones(3, np.float16)}
    (out / "safetensors").mkdir()
    save_file(tensors, str(out / "safetensors" / "model.safetensors"), metadata={"format": "pt"})
    shard = out / "safetensors-sharded"
    shard.mkdir()
    names = sorted(tensors)
    files = {"model-00001-of-00002.safetensors": names[:2],
             "model-00002-of-00002.safetensors": names[2:]}
    weight_map = {}
    for fname, keys in files.items():
        save_file({k: tensors[k] for k in keys}, str(shard / fname))
        weight_map.update({k: fname for k in keys})
    total = sum(int(t.nbytes) for t in tensors.values())
    (shard / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    single = (_v("o.safetensors", "safetensors", "--cast", "float16"),
              _v("o.safetensors", "safetensors", "--dedupe"),
              _v("o.safetensors", "safetensors"),
              _v("o.pt", "torch", "--to", "pytorch"))
    return [Seed("safetensors", out / "safetensors", "model.safetensors",
                 ("model.safetensors",), single),
            Seed("safetensors-sharded", shard, "", tuple(sorted(p.name for p in shard.iterdir())),
                 (_v("o", "directory", "--cast", "float16"), _v("o", "directory", "--dedupe"),
                  _v("o.safetensors", "safetensors", "--to", "safetensors")))]


def numpy_seeds(out: Path) -> list[Seed]:
    import pickle

    import numpy as np

    rng = np.random.default_rng(1)
    arrays = {"w": rng.standard_normal((3, 5)), "b": np.arange(4, dtype=np.int32),
              "w_copy": None, "h": np.ones((2, 2), np.float16)}
    arrays["w_copy"] = arrays["w"].copy()
    for name in ("npy", "npz", "npz-deflated", "pickle"):
        (out / name).mkdir()
    np.save(out / "npy" / "w.npy", arrays["w"])
    np.savez(out / "npz" / "arrays.npz", **arrays)
    np.savez_compressed(out / "npz-deflated" / "arrays.npz", **arrays)
    with open(out / "pickle" / "arrays.pkl", "wb") as fh:
        pickle.dump({"weights": arrays, "step": 7}, fh, protocol=4)
    npz = (_v("o.npz", "npz", "--cast", "float16"), _v("o.npz", "npz", "--dedupe"),
           _v("o.npz", "npz"), _v("o.safetensors", "safetensors", "--to", "safetensors"))
    return [Seed("npy", out / "npy", "w.npy", ("w.npy",),
                 (_v("o.npz", "npz", "--cast", "float16"), _v("o.npz", "npz"))),
            Seed("npz", out / "npz", "arrays.npz", ("arrays.npz",), npz),
            Seed("npz-deflated", out / "npz-deflated", "arrays.npz", ("arrays.npz",), npz),
            Seed("pickle", out / "pickle", "arrays.pkl", ("arrays.pkl",),
                 (_v("o.npz", "npz", "--dedupe"), _v("o.npz", "npz", "--to", "npz"),
                  _v("o.npz", "npz", "--cast", "float16")))]


def gguf_seeds(out: Path) -> list[Seed]:
    import gguf
    import numpy as np

    rng = np.random.default_rng(2)
    (out / "gguf").mkdir()
    w = gguf.GGUFWriter(str(out / "gguf" / "model.gguf"), arch="llama")
    w.add_name("fuzz")
    w.add_context_length(32)
    w.add_array("test.ints", [1, 2, 3])
    w.add_token_list(["<unk>", "<s>", "a", "b"])
    same = rng.standard_normal((4, 8)).astype(np.float32)
    w.add_tensor("token_embd.weight", same)
    w.add_tensor("output.weight", same.copy())
    w.add_tensor("blk.0.attn_norm.weight", np.ones(8, dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return [Seed("gguf", out / "gguf", "model.gguf", ("model.gguf",),
                 (_v("o.gguf", "gguf", "--dedupe"), _v("o.gguf", "gguf", "--cast", "float16"),
                  _v("o.gguf", "gguf")))]


class _T7:
    """torch7 ``File.lua`` ``writeObject``, binary, 8-byte longs: tables, numbers, strings,
    booleans, tensors and storages (enough for an ``nn`` module saved after a backward)."""

    def __init__(self) -> None:
        self.out = bytearray()
        self.index = 0

    def int_(self, v: int) -> None:
        self.out += struct.pack("<i", v)

    def string(self, s: str) -> None:
        self.int_(len(s))
        self.out += s.encode()

    def obj(self, x: object) -> None:
        if isinstance(x, bool):
            self.int_(5)
            self.int_(int(x))
        elif isinstance(x, (int, float)):
            self.int_(1)
            self.out += struct.pack("<d", float(x))
        elif isinstance(x, str):
            self.int_(2)
            self.string(x)
        elif isinstance(x, dict):
            self.index += 1
            self.int_(3)
            self.int_(self.index)
            self.int_(len(x))
            for k, v in x.items():
                self.obj(k)
                self.obj(v)
        elif isinstance(x, tuple) and x[0] == "module":
            self.index += 1
            self.int_(4)
            self.int_(self.index)
            self.string("V 1")
            self.string(x[1])
            self.obj(x[2])
        elif isinstance(x, tuple) and x[0] == "tensor":
            # ("tensor", values) or ("tensor", values, size, stride): a 1-d view of the values
            values = x[1]
            size, stride = (x[2], x[3]) if len(x) == 4 else (len(values), 1)
            self.index += 1
            self.int_(4)
            self.int_(self.index)
            self.string("V 1")
            self.string("torch.FloatTensor")
            self.int_(1)
            self.out += struct.pack("<qqq", size, stride, 1)  # size, stride, offset (1-based)
            self.index += 1
            self.int_(4)
            self.int_(self.index)
            self.string("V 1")
            self.string("torch.FloatStorage")
            self.out += struct.pack("<q", len(values))
            self.out += struct.pack(f"<{len(values)}f", *values)
        else:
            raise TypeError(type(x))


def t7_seeds(out: Path) -> list[Seed]:
    def tensor(n: int, k: float) -> tuple[str, list[float]]:
        return ("tensor", [k * (i + 1) for i in range(n)])

    linear = ("module", "nn.Linear", {
        "weight": tensor(12, 0.5), "bias": tensor(4, 0.25), "gradWeight": tensor(12, -1.0),
        "gradBias": tensor(4, -2.0), "output": tensor(8, 3.0), "train": True,
        "_type": "torch.FloatTensor"})
    enc = _T7()
    enc.obj(("module", "nn.Sequential", {"modules": {1: linear}, "train": False,
                                         "output": tensor(8, 1.5)}))
    (out / "t7").mkdir()
    (out / "t7" / "model.t7").write_bytes(bytes(enc.out))
    return [Seed("t7", out / "t7", "model.t7", ("model.t7",),
                 (_v("o.t7", "t7"), _v("o.t7", "t7", "--cast", "float16"),
                  _v("o.safetensors", "safetensors", "--to", "safetensors")))]


# -- copied from tests/fixtures ------------------------------------------------------------------


def _copy(src: Path, dst: Path) -> Path:
    if src.is_dir():
        shutil.copytree(src, dst)
    else:
        dst.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst / src.name)
    return dst


def _files(root: Path) -> tuple[str, ...]:
    return tuple(sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()))


def fixture_seeds(out: Path) -> list[Seed]:
    seeds = []
    onnx = _copy(FIXTURES / "onnx", out / "onnx")
    for f in ("MANIFEST.json", "generate.py"):
        (onnx / f).unlink()
    seeds.append(Seed("onnx", onnx, "mlp.onnx", ("mlp.onnx",),
                      (_v("o.onnx", "onnx"), _v("o.onnx", "onnx", "--no-graph", "--dedupe"),
                       _v("o.onnx", "onnx", "--cast", "float16", "--no-graph"))))
    seeds.append(Seed("onnx-external", onnx, "external.onnx",
                      ("external.onnx", "external.onnx.data"),
                      (_v("o.onnx", "onnx", "--no-graph"),
                       _v("o.onnx", "onnx", "--external-data", "always", "--no-graph"))))
    keras = out / "keras"
    keras.mkdir()
    for f in ("model.keras", "model_deflated.keras", "legacy.h5", "model.weights.h5",
              "legacy_weights.h5"):
        shutil.copy2(FIXTURES / "keras" / f, keras / f)
    kv = (_v("o.keras", "tf:keras"), _v("o.keras", "tf:keras", "--cast", "float16"))
    seeds += [Seed("keras", keras, "model.keras", ("model.keras",), kv),
              Seed("keras-deflated", keras, "model_deflated.keras", ("model_deflated.keras",), kv),
              Seed("keras-h5", keras, "legacy.h5", ("legacy.h5",),
                   (_v("o.h5", "tf:keras"), _v("o.h5", "tf:keras", "--cast", "float16"))),
              Seed("keras-weights-h5", keras, "model.weights.h5", ("model.weights.h5",),
                   (_v("o.weights.h5", "tf:keras-weights"),), extra="model.keras")]
    tf = out / "tensorflow"
    tf.mkdir()
    for name in ("tf1", "tf2_slots"):
        _copy(FIXTURES / "tensorflow" / name, tf / name)
    seeds += [Seed("tf1-checkpoint", tf / "tf1", "model.ckpt", _files(tf / "tf1"),
                   (_v("o.ckpt", "tf:checkpoint"),
                    _v("o.ckpt", "tf:checkpoint", "--cast", "float16"))),
              Seed("tf2-checkpoint", tf / "tf2_slots", "weights", _files(tf / "tf2_slots"),
                   (_v("o.ckpt", "tf:checkpoint"),
                    _v("o.safetensors", "safetensors", "--to", "safetensors")))]
    hf = _copy(FIXTURES / "hf_trainer" / "checkpoint-2", out / "hf" / "checkpoint-2")
    seeds.append(Seed("hf-trainer", hf, "", _files(hf), (_v("o", "directory"),
                                                         _v("o", "directory", "--dedupe"))))
    ds = _copy(FIXTURES / "deepspeed" / "zero1", out / "deepspeed" / "zero1")
    seeds.append(Seed("deepspeed", ds, "", _files(ds),
                      (_v("o.pt", "torch"), _v("o.safetensors", "safetensors", "--to",
                                               "safetensors"))))
    dcp = _copy(FIXTURES / "torch_dcp" / "two_ranks", out / "dcp" / "two_ranks")
    seeds.append(Seed("torch-dcp", dcp, "", _files(dcp), (_v("o.pt", "torch"),)))
    return seeds


#: name -> (builder, the import it needs); each builder writes its seeds under a folder.
BUILDERS: dict[str, tuple[Callable[[Path], list[Seed]], str]] = {
    "torch": (torch_seeds, "torch"),
    "safetensors": (safetensors_seeds, "safetensors"),
    "numpy": (numpy_seeds, "numpy"),
    "gguf": (gguf_seeds, "gguf"),
    "t7": (t7_seeds, "struct"),
    "fixtures": (fixture_seeds, "struct"),
}


def build(out: Path) -> list[Seed]:
    """Every seed this venv can make (a builder whose framework is missing is left out)."""
    import importlib.util

    seeds = []
    for name, (builder, needs) in BUILDERS.items():
        if importlib.util.find_spec(needs) is None:
            continue
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        seeds += builder(folder)
    return seeds


def tflite_seed(root: Path) -> Seed:
    """The TFLite seed written by :func:`tflite_seed_code` into ``root``."""
    return Seed("tflite", root, "model.tflite", ("model.tflite",),
                (_v("o.tflite", "tf:tflite"), _v("o.tflite", "tf:tflite", "--cast", "float16"),
                 _v("o.tflite", "tf:tflite", "--dedupe")))


#: Run by TensorFlow's Python with the output folder as argv[1]: a Keras model with a
#: duplicated constant, converted by TFLiteConverter.
TFLITE_SEED_CODE = """
import os, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import numpy as np, tensorflow as tf
w = np.arange(12, dtype=np.float32).reshape(4, 3) / 7

class M(tf.Module):
    @tf.function(input_signature=[tf.TensorSpec([1, 4], tf.float32)])
    def __call__(self, x):
        a = tf.matmul(x, tf.constant(w))
        b = tf.matmul(x, tf.constant(w.copy() + 0))
        return {"y": tf.nn.relu(a) + b + tf.constant(np.ones(3, np.float32))}

m = M()
conv = tf.lite.TFLiteConverter.from_concrete_functions([m.__call__.get_concrete_function()], m)
conv.optimizations = []
open(os.path.join(sys.argv[1], "model.tflite"), "wb").write(conv.convert())
"""
