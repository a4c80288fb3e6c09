"""Nothing lost: the input is never touched, and an interrupted slim leaves nothing behind."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import modelsize
from modelsize.slimming.output import Output
from tests.conftest import assert_one_line_error, run_cli

safetensors_numpy = pytest.importorskip("safetensors.numpy")

# A child that slims and, once some data is written, says so and waits to be killed.
_CHILD = textwrap.dedent("""
    import sys, time, modelsize
    said = []
    def progress(done, total):
        if done and not said:
            said.append(1)
            print("writing", flush=True)
            time.sleep(60)
    modelsize.slim(sys.argv[1], sys.argv[2], progress=progress)
""")


def _big(path: Path) -> str:
    rng = np.random.default_rng(0)
    tensors = {f"layer{i}.weight": rng.standard_normal((512, 512), dtype=np.float32)
               for i in range(8)}
    tensors["exp_avg"] = np.zeros(1000, np.float32)
    safetensors_numpy.save_file(tensors, str(path))
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT, signal.SIGTERM])
def test_interrupted_slim_leaves_nothing(tmp_path: Path, sig: signal.Signals) -> None:
    src = tmp_path / "in.safetensors"
    digest = _big(src)
    out = tmp_path / "out.safetensors"
    code = _CHILD
    if sig != signal.SIGKILL:  # the CLI's handlers turn SIGTERM into a clean stop; so here
        code = "import signal\nsignal.signal(signal.SIGTERM, lambda *a: (_ for _ in ()).throw(" \
               "KeyboardInterrupt()))\n" + _CHILD
    with subprocess.Popen([sys.executable, "-c", code, str(src), str(out)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as child:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "writing"
        child.send_signal(sig)
        child.wait(timeout=60)
    assert child.returncode != 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.safetensors"]
    assert hashlib.sha256(src.read_bytes()).hexdigest() == digest


def test_cli_sigterm_leaves_nothing(tmp_path: Path) -> None:
    src = tmp_path / "in.safetensors"
    _big(src)
    # Slow the write down from outside: a FIFO as the progress of nothing is not possible, so
    # SIGTERM the CLI at once and accept either outcome but never a partial file.
    with subprocess.Popen([sys.executable, "-m", "modelsize", "slim", str(src), "-o",
                           str(tmp_path / "o.safetensors")], stderr=subprocess.PIPE,
                          text=True) as proc:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names in (["in.safetensors"], ["in.safetensors", "o.safetensors"])
    if "o.safetensors" in names:
        safetensors_numpy.load_file(str(tmp_path / "o.safetensors"))


def test_bad_input_writes_nothing(tmp_path: Path) -> None:
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\": 1}")
    proc = run_cli("slim", str(bad), "-o", str(tmp_path / "o.safetensors"))
    assert_one_line_error(proc, bad)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.safetensors"]
    proc = run_cli("slim", str(tmp_path / "missing.pt"))
    assert_one_line_error(proc, tmp_path / "missing.pt")


def test_unknown_option_values_are_one_line(tmp_path: Path) -> None:
    src = tmp_path / "in.safetensors"
    _big(src)
    proc = run_cli("slim", str(src), "--drop", "weights")
    assert proc.returncode == 2 and "expected one of" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.safetensors"]


def test_stale_staging_folder_is_cleaned(tmp_path: Path) -> None:
    src = tmp_path / "in.safetensors"
    _big(src)
    stale = tmp_path / ".out.safetensors.modelsize-tmp-deadbeef"
    stale.mkdir()
    (stale / "out.safetensors").write_bytes(b"half")
    modelsize.slim(src, tmp_path / "out.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.safetensors", "out.safetensors"]


def test_without_o_tmpfile_a_failure_still_cleans_up(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    out = Output(tmp_path / "x.bin")
    out._anonymous = False  # as on a filesystem without O_TMPFILE
    fh = out.open("x.bin")
    fh.write(b"partial")
    assert any(p.name.startswith(".x.bin.modelsize-partial-") for p in tmp_path.iterdir())
    out.discard()
    assert list(tmp_path.iterdir()) == []


def test_commit_is_atomic_replace(tmp_path: Path) -> None:
    target = tmp_path / "x.bin"
    target.write_bytes(b"old")
    inode_before = os.stat(target).st_ino
    out = Output(target, force=True)
    out.check(["x.bin"])
    out.open("x.bin").write(b"new")
    out.seal()
    assert target.read_bytes() == b"old"  # untouched until commit
    out.commit("x.bin")
    assert target.read_bytes() == b"new" and os.stat(target).st_ino != inode_before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.bin"]


def test_without_o_tmpfile_the_commit_still_refuses_an_out_that_appeared(
        tmp_path: Path) -> None:
    from modelsize.errors import OutputError

    target = tmp_path / "x.bin"
    out = Output(target)
    out._anonymous = False  # as on a filesystem without O_TMPFILE
    out.check(["x.bin"])
    out.open("x.bin").write(b"new")
    out.seal()
    target.write_bytes(b"someone else's")
    with pytest.raises(OutputError, match="appeared while slim was writing"):
        out.commit("x.bin")
    out.discard()
    assert target.read_bytes() == b"someone else's"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.bin"]


@pytest.mark.parametrize("renameat2", [True, False])
def test_folder_commit(tmp_path: Path, renameat2: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    from modelsize.errors import OutputError
    from modelsize.slimming import output

    if not renameat2:  # a C library without it: check, then rename
        monkeypatch.setattr(output, "_renameat2", lambda *args: False)
    target = tmp_path / "out"

    def write(force: bool, data: bytes) -> Output:
        out = Output(target, directory=True, force=force)
        out.check(["a.bin"])
        out.open("a.bin").write(data)
        out.seal()
        return out

    first = write(False, b"one")
    second = write(False, b"two")
    first.commit()
    with pytest.raises(OutputError, match="appeared while slim was writing"):
        second.commit()
    second.discard()
    assert (target / "a.bin").read_bytes() == b"one"
    third = write(True, b"three")
    third.commit()  # --force: swapped in whole
    assert (target / "a.bin").read_bytes() == b"three"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
