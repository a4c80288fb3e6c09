"""Fault injection: slim under a changing input, full or read-only disks, concurrent slims,
SIGKILL and Ctrl-C. Each case ends in a verified OUT or in one line and nothing left behind.

Windows are made deterministic by hooks the code already has (``progress``, the module-level
``verify`` of :mod:`modelsize.slimming.core`, monkeypatched ``os`` calls), never by sleeps:
the change, the second slim or the kill happens at a known point of the first slim.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

import modelsize
from modelsize.cli import main
from modelsize.errors import InputError
from modelsize.slimming import core
from tests.conftest import REPO

safetensors_numpy = pytest.importorskip("safetensors.numpy")

#: Kept tensors (each 256 KiB, under the kernel-copy threshold: streamed, progress after each)
#: and one optimizer tensor the default slim drops.
_NAMES = [f"layer{i}.weight" for i in range(6)]


def _tensors(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {n: rng.standard_normal((128, 512), dtype=np.float32) for n in _NAMES}
    out["layer0.weight.exp_avg"] = np.zeros(16, np.float32)
    return out


def _kept(seed: int) -> dict[str, np.ndarray]:
    return {n: a for n, a in _tensors(seed).items() if n in _NAMES}


KEPT_BYTES = 6 * 128 * 512 * 4  # what the output's tensors hold, at least


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two checkpoints of one shape (``a``, ``b``: the next save of a training loop), as one
    file each and as sharded folders (index + two shards)."""
    root = tmp_path_factory.mktemp("models")
    made: dict[str, Path] = {}
    for key, seed in (("a", 1), ("b", 2)):
        tensors = _tensors(seed)
        safetensors_numpy.save_file(tensors, str(root / f"{key}.safetensors"))
        folder = root / f"{key}_sharded"
        folder.mkdir()
        names = sorted(tensors)
        shards = {"model-00001-of-00002.safetensors": names[:4],
                  "model-00002-of-00002.safetensors": names[4:]}
        for shard, members in shards.items():
            safetensors_numpy.save_file({n: tensors[n] for n in members}, str(folder / shard))
        index = {"metadata": {}, "weight_map": {n: s for s, ms in shards.items() for n in ms}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        made[key] = root / f"{key}.safetensors"
        made[f"{key}_sharded"] = folder
    return made


def _copy(src: Path, dest: Path, *, old_mtime: bool = True) -> Path:
    if src.is_dir():
        shutil.copytree(src, dest)
        files = list(dest.iterdir())
    else:
        shutil.copyfile(src, dest)
        files = [dest]
    if old_mtime:  # saved an hour ago: a rewrite now always shows in mtime
        past = time.time() - 3600
        for f in files:
            os.utime(f, (past, past))
    return dest


def _everything(folder: Path) -> set[str]:
    """Every path under ``folder``, hidden ones included, relative to it. A killed run's janitor
    may remove a staging folder while it is listed: the listing is then taken again."""
    for _ in range(100):
        try:
            return {str(p.relative_to(folder)) for p in folder.rglob("*")}
        except FileNotFoundError:
            time.sleep(0.01)
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


def _load_folder(folder: Path) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        out.update(safetensors_numpy.load_file(str(shard)))
    return out


def _same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> bool:
    return sorted(got) == sorted(want) and all(np.array_equal(got[k], want[k]) for k in want)


def _one_line(capsys: pytest.CaptureFixture[str], *needles: str) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert ".modelsize-" not in lines[0], lines[0]  # never the hidden staging name
    return lines[0]


def _on_first_progress(monkeypatch: pytest.MonkeyPatch, action: Callable[[], None]) -> None:
    """Run ``action`` once, when the first tensor's bytes have been written (mid-read)."""
    from modelsize.slimming.writers.base import Meter

    real = Meter.advance
    done: list[bool] = []

    def advance(self: Meter, n: int) -> None:
        real(self, n)
        if not done:
            done.append(True)
            action()

    monkeypatch.setattr(Meter, "advance", advance)


# -- 1. the input changes while it is read ------------------------------------------------------
def test_input_replaced_by_rename_mid_read(tmp_path: Path, models: dict[str, Path],
                                           monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    src = _copy(models["a"], tmp_path / "in.safetensors")
    out = tmp_path / "out.safetensors"

    def save_next_checkpoint() -> None:  # as a training loop does: write, then rename over
        _copy(models["b"], tmp_path / "in.tmp", old_mtime=False)
        os.replace(tmp_path / "in.tmp", src)

    _on_first_progress(monkeypatch, save_next_checkpoint)
    assert main(["slim", str(src), "-o", str(out)]) == 2
    line = _one_line(capsys, "changed while it was being read; nothing was written")
    assert line == f"modelsize: {src} changed while it was being read; nothing was written"
    assert _everything(tmp_path) == {"in.safetensors"}


def test_input_rewritten_in_place_mid_read(tmp_path: Path, models: dict[str, Path],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    src = _copy(models["a"], tmp_path / "in.safetensors")
    out = tmp_path / "out.safetensors"

    def rewrite() -> None:  # same size, other bytes, same inode
        with open(src, "r+b") as fh:
            fh.write(models["b"].read_bytes())

    _on_first_progress(monkeypatch, rewrite)
    with pytest.raises(InputError, match="changed while it was being read; nothing was written"):
        modelsize.slim(src, out)
    assert _everything(tmp_path) == {"in.safetensors"}


def test_shard_of_a_folder_replaced_mid_read(tmp_path: Path, models: dict[str, Path],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    src = _copy(models["a_sharded"], tmp_path / "in")
    shard = "model-00002-of-00002.safetensors"

    def replace_shard() -> None:
        shutil.copyfile(models["b_sharded"] / shard, tmp_path / "next")
        os.replace(tmp_path / "next", src / shard)

    _on_first_progress(monkeypatch, replace_shard)
    with pytest.raises(InputError, match="changed while it was being read"):
        modelsize.slim(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert {p for p in _everything(tmp_path) if not p.startswith("in")} == set()


def test_tf_prefix_data_rewritten_mid_read(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # A TF1 Saver checkpoint: prefix.index + three prefix.data-* shards (committed fixture).
    folder = _copy(REPO / "tests/fixtures/tensorflow/tf1_sharded", tmp_path / "ckpt")
    datas = sorted(folder.glob("model.ckpt.data-*"))
    assert len(datas) == 3

    def rewrite() -> None:
        for data in datas:
            raw = bytearray(data.read_bytes())
            raw[-1] ^= 0xFF
            data.write_bytes(bytes(raw))

    _on_first_progress(monkeypatch, rewrite)
    with pytest.raises(InputError, match="changed while it was being read"):
        modelsize.slim(folder / "model.ckpt", folder / "out.ckpt")
    assert not list(folder.glob("out.ckpt*")) and not list(folder.glob(".*"))


@pytest.mark.parametrize("how", ["rename", "in_place"])
def test_inspect_refuses_a_file_that_changed_while_read(tmp_path: Path, how: str,
                                                       models: dict[str, Path],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import modelsize.inspection as inspection

    src = _copy(models["a"], tmp_path / "in.safetensors")
    # A different header size: the sums inspect would print belong to neither file.
    other = {"x": np.zeros(3, np.float32)}
    real = inspection.formats.read

    def read_then_change(path: object) -> object:
        inv = real(path)  # type: ignore[arg-type]
        if how == "rename":
            safetensors_numpy.save_file(other, str(tmp_path / "next"))
            os.replace(tmp_path / "next", src)
        else:
            with open(src, "r+b") as fh:
                fh.seek(-4, os.SEEK_END)
                fh.write(b"\x01\x02\x03\x04")
        return inv

    monkeypatch.setattr(inspection.formats, "read", read_then_change)
    with pytest.raises(InputError, match="changed while it was being read"):
        modelsize.inspect(src)


# -- 2. space and permissions ----------------------------------------------------------------
@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[..., Path]]:
    """``tmpfs(size, ro=False)``: a fresh tmpfs mount (skip where mounting is not allowed)."""
    mounted: list[Path] = []

    def mount(size: str, ro: bool = False) -> Path:
        where = tmp_path / f"mnt{len(mounted)}"
        where.mkdir()
        opts = f"size={size}" + (",ro" if ro else "")
        if shutil.which("mount") is None:
            pytest.skip("no mount command here")
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def test_no_room_is_refused_before_writing(tmp_path: Path, models: dict[str, Path],
                                           tmpfs: Callable[..., Path],
                                           capsys: pytest.CaptureFixture[str]) -> None:
    small = tmpfs("1m")
    out = small / "out.safetensors"
    assert main(["slim", str(models["a"]), "-o", str(out)]) == 2
    line = _one_line(capsys, str(out), "needs", "free", "nothing was written")
    assert "1.5 MiB" in line, line  # 6 x 256 KiB and the header: at least 1,572,864 bytes
    assert _everything(small) == set()


def test_disk_full_mid_write(tmp_path: Path, models: dict[str, Path],
                             tmpfs: Callable[..., Path], monkeypatch: pytest.MonkeyPatch,
                             capsys: pytest.CaptureFixture[str]) -> None:
    disk = tmpfs("4m")
    out = disk / "out.safetensors"

    def fill() -> None:  # someone else takes the rest of the disk
        with open(disk / "filler", "wb") as fh, pytest.raises(OSError):
            while True:
                fh.write(b"\0" * 65536)
                fh.flush()

    _on_first_progress(monkeypatch, fill)
    assert main(["slim", str(models["a"]), "-o", str(out)]) == 2
    _one_line(capsys, f"modelsize: {out}: cannot write it: no space left on the device",
              "nothing was written")
    assert _everything(disk) == {"filler"}


@pytest.mark.parametrize(("where", "code"), [
    ("fsync", errno.ENOSPC), ("fsync", errno.EDQUOT), ("link", errno.ENOSPC),
    ("link", errno.EROFS), ("tmpfile", errno.EACCES),
])
def test_write_errors_are_one_line(tmp_path: Path, models: dict[str, Path], where: str,
                                   code: int, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out.safetensors"
    real_open = os.open

    def fail(*args: object, **kwargs: object) -> None:
        raise OSError(code, os.strerror(code))

    def tmpfile_denied(path: object, flags: int, *args: object, **kwargs: object) -> int:
        if flags & getattr(os, "O_TMPFILE", 0) == getattr(os, "O_TMPFILE", -1):
            raise PermissionError(code, os.strerror(code), str(path))
        return real_open(path, flags, *args, **kwargs)  # type: ignore[arg-type]

    if where == "tmpfile" and not hasattr(os, "O_TMPFILE"):
        pytest.skip("no O_TMPFILE here")
    monkeypatch.setattr(os, {"fsync": "fsync", "link": "link", "tmpfile": "open"}[where],
                        tmpfile_denied if where == "tmpfile" else fail)
    assert main(["slim", str(models["a"]), "-o", str(out)]) == 2
    _one_line(capsys, f"modelsize: {out}: cannot write it: ", "nothing was written")
    assert _everything(tmp_path) == set()


def test_read_only_folder(tmp_path: Path, models: dict[str, Path], tmpfs: Callable[..., Path],
                          capsys: pytest.CaptureFixture[str]) -> None:
    # As root, chmod 555 stops nothing: a read-only mount does.
    ro = tmpfs("1m", ro=True)
    out = ro / "out.safetensors"
    assert main(["slim", str(models["a"]), "-o", str(out)]) == 2
    assert _one_line(capsys) == (f"modelsize: {out}: {ro} is on a read-only filesystem; "
                                 "nothing was written")


# -- 3. concurrent slims -------------------------------------------------------------------------
def _second_slim_during_verify(monkeypatch: pytest.MonkeyPatch,
                               second: Callable[[], object]) -> None:
    """While the first slim verifies its staged output, a second slim runs to its end."""
    real = core.verify
    ran: list[bool] = []

    def verify(*args: object, **kwargs: object) -> object:
        if not ran:
            ran.append(True)
            second()
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(core, "verify", verify)


def test_out_that_appears_meanwhile_is_not_replaced(tmp_path: Path, models: dict[str, Path],
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out.safetensors"
    # The second slim must also find the first one's live staging folder and leave it alone.
    _second_slim_during_verify(monkeypatch, lambda: modelsize.slim(models["b"], out))
    assert main(["slim", str(models["a"]), "-o", str(out)]) == 2
    assert _one_line(capsys) == (f"modelsize: {out} appeared while slim was writing; "
                                 "nothing was replaced")
    assert _same(safetensors_numpy.load_file(str(out)), _kept(2))
    assert _everything(tmp_path) == {"out.safetensors"}


@pytest.mark.parametrize("layout", ["file", "folder"])
def test_concurrent_forced_slims_both_succeed_last_wins(tmp_path: Path, layout: str,
                                                       models: dict[str, Path],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = (models["a"], models["b"]) if layout == "file" else (models["a_sharded"],
                                                                 models["b_sharded"])
    out = tmp_path / ("out.safetensors" if layout == "file" else "out")
    seconds: list[modelsize.SlimReport] = []
    _second_slim_during_verify(
        monkeypatch, lambda: seconds.append(modelsize.slim(b, out, force=True)))
    first = modelsize.slim(a, out, force=True)
    assert first.verified and seconds and seconds[0].verified
    got = (safetensors_numpy.load_file(str(out)) if layout == "file" else _load_folder(out))
    assert _same(got, _kept(1))  # the first slim committed last
    assert {p.split("/")[0] for p in _everything(tmp_path)} == {out.name}


# -- 4. SIGKILL ---------------------------------------------------------------------------------
_KILLED_AT = textwrap.dedent("""
    import os, signal, sys

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    import modelsize.slimming.core as core
    from modelsize.slimming.output import Output

    point = sys.argv[1]
    if point == "written":
        Output.seal = die
    elif point == "fsync":
        os.fsync = die
    elif point == "verify":
        core.verify = die
    elif point == "rename":
        Output.commit = die
    from modelsize.cli import main
    sys.exit(main(sys.argv[2:]))
""")


def _no_trace_left(folder: Path, keep: set[str], out_name: str) -> None:
    """Wait (the killed run's janitor removes its staging at once) for nothing but ``keep``."""
    deadline = time.monotonic() + 20
    while _everything(folder) - keep and time.monotonic() < deadline:
        time.sleep(0.02)
    left = _everything(folder) - keep
    assert not any(Path(p).name == out_name for p in left), left
    assert left == set(), left


def test_sigkill_leaves_nothing_anywhere(tmp_path: Path, models: dict[str, Path]) -> None:
    cases = [("written", "file"), ("fsync", "file"), ("verify", "file"), ("rename", "file"),
             ("verify", "folder"), ("rename", "folder")]
    for point, layout in cases:
        folder = tmp_path / f"{point}-{layout}"
        folder.mkdir()
        src = models["a"] if layout == "file" else models["a_sharded"]
        out = folder / ("out.safetensors" if layout == "file" else "out")
        proc = subprocess.run([sys.executable, "-c", _KILLED_AT, point, "slim", str(src), "-o",
                               str(out)], capture_output=True, text=True, timeout=120)
        assert proc.returncode == -signal.SIGKILL, (point, proc.stderr)
        _no_trace_left(folder, set(), out.name)


def test_next_run_removes_only_dead_owners_staging(tmp_path: Path,
                                                  models: dict[str, Path]) -> None:
    # Staging folders whose janitor died too (a whole cgroup killed): one of a dead process,
    # one of a live one. Each holds a whole output.
    gone = subprocess.Popen(["true"])
    gone.wait()
    with subprocess.Popen(["sleep", "60"]) as alive:
        dead_dir = tmp_path / f".out.safetensors.modelsize-partial-{gone.pid}-0badc0de"
        live_dir = tmp_path / f".other.safetensors.modelsize-partial-{alive.pid}-0123abcd"
        for d, name in ((dead_dir, "out.safetensors"), (live_dir, "other.safetensors")):
            d.mkdir()
            shutil.copyfile(models["a"], d / name)
        try:
            modelsize.slim(models["a"], tmp_path / "out.safetensors")
            assert not dead_dir.exists()
            assert (live_dir / "other.safetensors").is_file()
        finally:
            alive.kill()
    shutil.rmtree(live_dir)
    assert _everything(tmp_path) == {"out.safetensors"}


# -- 5. Ctrl-C -----------------------------------------------------------------------------------
def _interrupt(args: list[str], delay: float) -> tuple[int, list[str]]:
    """Run ``python -m modelsize ARGS``; once our package is imported (``-X importtime``
    says so: from there on the code running is ours), wait ``delay`` and send SIGINT."""
    ours = threading.Event()
    lines: list[str] = []
    with subprocess.Popen([sys.executable, "-X", "importtime", "-m", "modelsize", *args],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) as proc:

        def drain() -> None:
            assert proc.stderr is not None
            for line in proc.stderr:
                if line.startswith("import time:"):
                    if line.rstrip().endswith("| modelsize"):
                        ours.set()
                else:
                    lines.append(line.rstrip("\n"))
            ours.set()

        reader = threading.Thread(target=drain)
        reader.start()
        assert ours.wait(60)
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=120)
        reader.join(60)
    return rc, lines


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_during_an_import_is_raised_once_the_import_is_done(tmp_path: Path,
                                                                     sig: str) -> None:
    """A KeyboardInterrupt raised inside the import machinery can be swallowed (torch's C
    start-up clears errors), printed as "Exception ignored" (importlib's lock callbacks) or
    abort the process (C++ start-up code): the command's Ctrl-C handler, and slim's SIGTERM
    one, wait for the import."""
    (tmp_path / "slowmod.py").write_text(textwrap.dedent(f"""
        import os, signal, time
        os.kill(os.getpid(), signal.{sig})
        start = time.monotonic()
        while time.monotonic() - start < 0.3:
            pass
        DONE = True
    """))
    handlers = {"SIGINT": ("from modelsize.cli import _Interrupts", "_Interrupts.catch()",
                           "contextlib.nullcontext()"),
                "SIGTERM": ("from modelsize.cli.slim import _interruptible", "",
                            "_interruptible()")}
    imports, setup, context = handlers[sig]
    code = textwrap.dedent(f"""
        import contextlib, sys, time
        sys.path.insert(0, {str(tmp_path)!r})
        {imports}
        {setup}
        try:
            with {context}:
                import slowmod
                start = time.monotonic()
                while time.monotonic() - start < 5:
                    pass
            print("not raised")
        except KeyboardInterrupt:
            print("raised", getattr(sys.modules.get("slowmod"), "DONE", False))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "raised True\n", "")


def test_ctrl_c_at_start_up_and_while_writing(tmp_path: Path, models: dict[str, Path]) -> None:
    # estimate imports torch and traces for seconds: each delay lands somewhere inside.
    for delay in (0.0, 0.05, 0.2, 0.5, 1.0):
        rc, lines = _interrupt(["estimate", "seed-cnn"], delay)
        assert (rc, lines) == (130, ["modelsize: interrupted"]), delay
    # While slim writes: the signal comes from inside, after the first tensor.
    code = textwrap.dedent("""
        import os, signal, sys
        from modelsize.slimming.writers.base import Meter
        real = Meter.advance
        def advance(self, n):
            real(self, n)
            os.kill(os.getpid(), signal.SIGINT)
        Meter.advance = advance
        sys.argv = ["modelsize", *sys.argv[1:]]
        from modelsize.cli import main
        sys.exit(main())
    """)
    out = tmp_path / "out.safetensors"
    proc = subprocess.run([sys.executable, "-c", code, "slim", str(models["a"]), "-o", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stderr) == (130, "modelsize: interrupted\n")
    _no_trace_left(tmp_path, set(), out.name)
