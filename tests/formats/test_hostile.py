"""The picklescan corpus: exploit pickles are named, benign files read, nothing ever runs.

The files live in ../shared/fixtures/hostile/picklescan (see its PROVENANCE.md); the tests skip
when that folder is absent. They are only ever parsed, never loaded.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from modelsize.errors import InputError
from modelsize.formats import read, registry
from tests.conftest import SHARED_FIXTURES, shared_fixture

CORPUS = ("hostile", "picklescan")
BENIGN = frozenset(
    {
        "benign0_v0.pkl", "benign0_v3.pkl", "benign0_v4.pkl", "pytorch_model.bin",
        "new_pytorch_model.bin", "int_array.npy", "int_arrays.npz",
        "int_arrays_compressed.npz",
    }
)
#: Not model files at all (a PNG, an encrypted zip of text, 7 stray bytes): refused cleanly.
NOT_MODELS = frozenset({"bad_pytorch.pt", "benign_password_protected.zip", "not_a_pickle.bin"})
#: Object arrays of plain ints: loading needs allow_pickle, but they call nothing.
DATA_ONLY = frozenset({"object_array.npy", "object_arrays.npz", "object_arrays_compressed.npz"})
#: Modules the exploits would import if anything were loaded.
EXPLOIT_MODULES = (
    "requests", "aiohttp", "idlelib", "pip", "bdb", "pydoc", "cProfile", "profile", "pty",
    "ctypes", "venv", "ensurepip", "imaplib", "cloudpickle", "runpy", "timeit", "trace",
    "doctest", "lib2to3", "webbrowser", "code", "_aix_support", "_osx_support", "_pyrepl",
    "torch", "numpy.f2py", "http.client", "urllib.request", "socket", "asyncio",
)


def corpus_files() -> list[str]:
    root = SHARED_FIXTURES.joinpath(*CORPUS)
    if not root.exists():
        return ["<absent>"]
    return sorted(f"{d.name}/{f.name}" for d in root.iterdir() if d.is_dir() for f in d.iterdir())


def numpy_reader_registered() -> bool:
    return "npy" in registry().names


@pytest.mark.parametrize("name", corpus_files())
def test_corpus_file(name: str) -> None:
    path = shared_fixture(*CORPUS, *name.split("/"))
    base = path.name
    if base.endswith((".npy", ".npz")) and not numpy_reader_registered():
        pytest.skip("the numpy reader is not registered")
    if base in NOT_MODELS:
        with pytest.raises(InputError):
            read(path)
        return
    if base in BENIGN:
        inv = read(path)
        assert inv.unsafe_globals == ()
        assert inv.file_bytes == path.stat().st_size
        return
    if base in DATA_ONLY:
        with contextlib.suppress(InputError):
            read(path)
        return
    try:
        inv = read(path)
    except InputError:
        return  # refused: exit 2, nothing loaded
    assert inv.unsafe_globals, f"{name} calls code on load but no unsafe global was reported"
    assert inv.file_bytes == path.stat().st_size


def test_reading_the_corpus_touches_nothing(tmp_path: Path) -> None:
    root = shared_fixture(*CORPUS)
    workdir = tmp_path / "empty"
    workdir.mkdir()
    script = textwrap.dedent(
        """
        import json, sys
        events = []
        def hook(event, args):
            if event in ("os.system", "subprocess.Popen", "os.exec", "os.posix_spawn",
                         "os.spawn", "os.fork", "socket.connect", "socket.getaddrinfo",
                         "ctypes.dlopen", "webbrowser.open", "os.remove", "os.rename"):
                events.append(event)
            elif event == "open" and isinstance(args[1], str) and set(args[1]) & set("wax+"):
                events.append(f"open for writing: {args[0]}")
        import modelsize.formats as formats
        from modelsize.errors import InputError
        before = set(sys.modules)
        sys.addaudithook(hook)
        read = 0
        for path in sys.argv[1:]:
            try:
                formats.read(path)
                read += 1
            except InputError:
                pass
        print(json.dumps({"events": events, "read": read,
                          "new_modules": sorted(set(sys.modules) - before)}))
        """
    )
    files = [str(f) for d in sorted(root.iterdir()) if d.is_dir() for f in sorted(d.iterdir())]
    proc = subprocess.run(
        [sys.executable, "-c", script, *files],
        cwd=workdir, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["events"] == []
    assert result["read"] > 0
    imported = [m for m in result["new_modules"] if m.split(".")[0] in {
        e.split(".")[0] for e in EXPLOIT_MODULES} and m not in sys.modules]
    assert imported == []
    assert list(workdir.iterdir()) == []
