"""The answers of kernel probes (:mod:`modelsize.estimation.scratch`), kept for the process
and on disk.

A probe runs a real kernel once, at full size, to read what the allocator hands it: a
Llama-3-70B training trace runs 13 of them (oneDNN bfloat16 matmuls of 2048 x 8192 x 8192,
flash attention and its backward), 2.5 s of its 10. What a kernel allocates depends on the
call (the op, its arguments' shapes, strides, dtypes and values, grad mode), the build of
PyTorch, the CPU's instruction set and the thread count, and on nothing else, so each answer
is kept:

* for the process, under the call and the settings that can change within one (threads,
  oneDNN on or off, the probe size limits);
* on disk, in ``$MODELSIZE_CACHE_DIR`` (default ``$XDG_CACHE_HOME/modelsize``, else
  ``~/.cache/modelsize``), one JSON file per machine: its name hashes PyTorch's version and
  build configuration, the CPU's model name and flags, and the source of ``scratch.py``
  (which turns a run's events into an answer), so another machine, another PyTorch or
  another modelsize never reads it. ``MODELSIZE_PROBE_CACHE=0`` turns the disk off.

A file that cannot be read or parsed counts as empty; one that cannot be written is left
alone: the cache only ever saves time.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import platform
import tempfile
from pathlib import Path
from typing import Any

import torch

#: An answer: the cost's fields (None: no scratch), the notes the probe gave, its real runs.
Entry = tuple[Any, tuple[str, ...], int]

#: Every answer this process has, by :func:`key`.
_KNOWN: dict[str, Entry] = {}
_LOADED: set[Path] = set()
#: Entries on disk beyond which the file starts again (a bound on its size: ~200 bytes each).
MAX_ENTRIES = 20_000


def key(call: tuple[Any, ...]) -> str | None:
    """The text key of a probe's call and settings, or None where some part of it has no
    stable text (an object printed by its address)."""
    text = repr(call)
    return None if " at 0x" in text else text


def lookup(text: str) -> Entry | None:
    """The answer kept for ``text``, from this process or the disk."""
    found = _KNOWN.get(text)
    if found is None and (path := _path()) is not None and path not in _LOADED:
        _LOADED.add(path)
        for k, v in _read(path).items():
            _KNOWN.setdefault(k, v)
        found = _KNOWN.get(text)
    return found


def store(text: str, entry: Entry) -> None:
    """Keep ``entry`` for the process and, unless turned off, on disk."""
    _KNOWN[text] = entry
    path = _path()
    if path is None:
        return
    on_disk = _read(path)
    if len(on_disk) >= MAX_ENTRIES:
        on_disk = {}
    on_disk[text] = entry
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".probes-", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump({k: [cost, list(notes), runs] for k, (cost, notes, runs)
                       in on_disk.items()}, f)
        os.replace(tmp, path)
    except OSError:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _read(path: Path) -> dict[str, Entry]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    out: dict[str, Entry] = {}
    if isinstance(data, dict):
        for k, v in data.items():
            if (isinstance(v, list) and len(v) == 3 and isinstance(v[1], list)
                    and isinstance(v[2], int) and _valid_cost(v[0])):
                out[k] = (v[0], tuple(str(n) for n in v[1]), v[2])
    return out


def _valid_cost(cost: Any) -> bool:
    return cost is None or (
        isinstance(cost, list) and len(cost) == 4 and isinstance(cost[0], int)
        and all(isinstance(p, list) for p in cost[1:]))


def _path() -> Path | None:
    if os.environ.get("MODELSIZE_PROBE_CACHE", "1").strip().lower() in ("0", "false", "no",
                                                                       "off"):
        return None
    root = os.environ.get("MODELSIZE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "modelsize")
    return Path(root) / f"probes-{_machine()}.json"


@functools.cache
def _machine() -> str:
    """A hash of what a kernel's allocations depend on beyond the call itself."""
    h = hashlib.sha256()
    h.update(torch.__version__.encode())
    h.update(torch.__config__.show().encode())
    h.update(platform.machine().encode())
    h.update(str(torch.backends.cpu.get_cpu_capability()).encode())
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags")):
                    h.update(line.encode())
                if line.strip() == "":
                    break  # the first processor's lines are enough
    except OSError:
        h.update(platform.processor().encode())
    h.update(Path(__file__).with_name("scratch.py").read_bytes())
    return h.hexdigest()[:16]
