"""``inspect --load-cost``: the RAM and time of the usual ways to load a checkpoint, measured.

Each way runs in a fresh subprocess with the real framework (``torch.load`` with and without
``mmap``/``weights_only``, safetensors ``load_file`` vs ``safe_open``, Keras ``load_model``
vs building the model and ``load_weights``, NumPy ``load`` vs ``mmap_mode``...). The child
reports its peak RSS (``ru_maxrss``) and wall time right after importing the framework and
again after loading: the difference is what the load itself costs. The framework's own import
cost is the first of its children's (printed before it loads), reported beside. The
cheapest way is the safe way with the smallest peak RSS (then the fastest).

Safety: a way that would unpickle without restrictions (``torch.load(weights_only=False)``,
``torch.load()`` before torch 2.6, DCP's ``pickle.load`` of ``.metadata``) is marked unsafe:
it runs whatever code a pickle names, so it is never named cheapest or fastest (the report
would read as advice to use it), and it is skipped when the inventory lists unsafe globals.
Ways whose framework is not installed are skipped, saying so. A way that would load more bytes
than the machine has available is skipped rather than run into swap.

Known limitations: peak RSS counts pages touched, so ``mmap`` ways look as cheap as the data
they did not read; numbers vary by a few MiB between runs (allocator, page cache); Windows has
no ``ru_maxrss`` and gets no measurement.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import re
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import Any

from modelsize.errors import printable
from modelsize.formats.base import check_file
from modelsize.inventory import Inventory

#: Wall-clock limit of one measuring subprocess.
TIMEOUT_SECONDS = 900.0

# The measuring child: argv = [way code, JSON list of paths]. Paths never enter the code.
_CHILD = """\
import json, sys, time
t0 = time.perf_counter()
import resource
def peak():
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb if sys.platform == "darwin" else kb * 1024
paths = json.loads(sys.argv[1])
held = []
{imports}
t1, p1 = time.perf_counter(), peak()
print(json.dumps({{"import_peak": p1, "import_seconds": t1 - t0}}), flush=True)
{load}
t2, p2 = time.perf_counter(), peak()
print(json.dumps({{"import_peak": p1, "import_seconds": t1 - t0, "peak": p2,
                  "seconds": t2 - t0}}))
"""


class WayStatus(str, Enum):
    """What happened to one way of loading."""

    MEASURED = "measured"
    SKIPPED = "skipped"
    FAILED = "failed"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Way:
    """One way to load a file: the framework it needs and the code that loads ``paths``."""

    name: str
    framework: str
    imports: str
    load: str
    unrestricted_unpickling: bool = False
    maps_lazily: bool = False


@dataclass(frozen=True)
class WayResult:
    """The cost of one way: bytes and seconds beyond the framework's own import."""

    way: str
    framework: str
    status: WayStatus
    peak_rss_bytes: int | None = None
    seconds: float | None = None
    total_peak_rss_bytes: int | None = None
    total_seconds: float | None = None
    note: str = ""
    #: the way unpickles without restrictions: it runs any code the file names
    unsafe: bool = False

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "way": self.way, "framework": self.framework, "status": self.status.value,
            "peak_rss_bytes": self.peak_rss_bytes, "seconds": self.seconds,
            "total_peak_rss_bytes": self.total_peak_rss_bytes,
            "total_seconds": self.total_seconds, "note": self.note, "unsafe": self.unsafe,
        }


@dataclass(frozen=True)
class ImportCost:
    """Peak RSS and time of a framework's imports (``code``), as the first child that loads with
    it measured them: right after its imports, before it loads."""

    framework: str
    code: str
    peak_rss_bytes: int
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"framework": self.framework, "imports": self.code,
                "peak_rss_bytes": self.peak_rss_bytes, "seconds": self.seconds}


@dataclass(frozen=True)
class LoadCost:
    """Every way measured (or skipped) for one checkpoint."""

    path: Path
    format: str
    file_bytes: int
    ways: tuple[WayResult, ...]
    imports: tuple[ImportCost, ...] = ()
    notes: tuple[str, ...] = field(default=())

    @property
    def measured(self) -> list[WayResult]:
        """The ways that ran to the end."""
        return [w for w in self.ways if w.status is WayStatus.MEASURED]

    @property
    def cheapest(self) -> WayResult | None:
        """The safe measured way with the smallest peak RSS (then the shortest time); an
        unsafe way is never recommended, however cheap."""
        return min((w for w in self.measured if not w.unsafe),
                   key=lambda w: (w.peak_rss_bytes or 0, w.seconds or 0.0), default=None)

    @property
    def fastest(self) -> WayResult | None:
        """The safe measured way with the shortest time."""
        return min((w for w in self.measured if not w.unsafe),
                   key=lambda w: w.seconds or 0.0, default=None)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        cheapest, fastest = self.cheapest, self.fastest
        return {
            "path": str(self.path),
            "format": self.format,
            "file_bytes": self.file_bytes,
            "import_cost": [i.to_dict() for i in self.imports],
            "ways": [w.to_dict() for w in self.ways],
            "cheapest": cheapest.way if cheapest else None,
            "fastest": fastest.way if fastest else None,
            "notes": list(self.notes),
        }


# -- the ways ---------------------------------------------------------------------------------

_TORCH = "import torch"
_SAFETENSORS = "import torch\nimport safetensors.torch\nfrom safetensors import safe_open"
_NUMPY = "import numpy"
_KERAS = "import keras"
_DCP = ("import torch\nfrom torch.distributed.checkpoint import FileSystemReader\n"
        "from torch.distributed.checkpoint.state_dict_loader import _load_state_dict\n"
        "from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner")


def _torch_load(**kwargs: str) -> str:
    extra = "".join(f", {k}={v}" for k, v in kwargs.items())
    return f'held = [torch.load(p, map_location="cpu"{extra}) for p in paths]'


_TORCH_WAYS = (
    # unrestricted_unpickling of torch.load() is decided by the installed torch: _plan.
    Way("torch.load()", "torch", _TORCH, _torch_load()),
    Way("torch.load(mmap=True)", "torch", _TORCH, _torch_load(mmap="True"), maps_lazily=True),
    Way("torch.load(weights_only=True)", "torch", _TORCH, _torch_load(weights_only="True")),
    Way("torch.load(weights_only=False)", "torch", _TORCH, _torch_load(weights_only="False"),
        unrestricted_unpickling=True),
)
_SAFETENSORS_WAYS = (
    Way("safetensors.torch.load_file", "safetensors", _SAFETENSORS,
        "held = [safetensors.torch.load_file(p) for p in paths]", maps_lazily=True),
    Way("safetensors.safe_open + get_tensor", "safetensors", _SAFETENSORS,
        "for p in paths:\n"
        "    with safe_open(p, framework='pt') as f:\n"
        "        held.append({k: f.get_tensor(k) for k in f.keys()})", maps_lazily=True),
)
_NPY_WAYS = (
    Way("numpy.load", "numpy", _NUMPY,
        "held = [numpy.load(p, allow_pickle=False) for p in paths]"),
    Way("numpy.load(mmap_mode='r')", "numpy", _NUMPY,
        "held = [numpy.load(p, mmap_mode='r', allow_pickle=False) for p in paths]",
        maps_lazily=True),
)
_NPZ_WAYS = (
    Way("numpy.load (every array)", "numpy", _NUMPY,
        "for p in paths:\n"
        "    with numpy.load(p, allow_pickle=False) as z:\n"
        "        held.append({k: z[k] for k in z.files})"),
)
_KERAS_WAYS = (
    Way("keras.models.load_model(compile=True)", "keras", _KERAS,
        "held = [keras.models.load_model(p, compile=True) for p in paths]"),
    Way("keras.models.load_model(compile=False)", "keras", _KERAS,
        "held = [keras.models.load_model(p, compile=False) for p in paths]"),
)
_KERAS_BUILD = Way(
    "build from config.json + load_weights", "keras", _KERAS + "\nimport json, zipfile",
    "for p in paths:\n"
    "    with zipfile.ZipFile(p) as z:\n"
    "        model = keras.saving.deserialize_keras_object(json.loads(z.read('config.json')))\n"
    "    model.load_weights(p)\n"
    "    held.append(model)",
)
_DCP_WAYS = (
    Way("torch.distributed.checkpoint load (whole state dict)", "torch", _DCP,
        "sd = {}\n"
        "_load_state_dict(sd, storage_reader=FileSystemReader(paths[0]),\n"
        "                 planner=_EmptyStateDictLoadPlanner(), no_dist=True)\n"
        "held.append(sd)", unrestricted_unpickling=True),
)


def _plan(inv: Inventory) -> tuple[list[Way], list[str], list[str]]:
    """The ways that apply to the inventory's format, the paths they load, and notes."""
    files = [f.path for f in inv.files]
    fmt = inv.format
    if fmt in ("pytorch", "pytorch-legacy", "pytorch-sharded", "deepspeed"):
        paths = [str(p) for p in files if p.suffix not in (".json",) and p.name != "latest"]
        ways = list(_TORCH_WAYS)
        if _torch_load_defaults_to_pickle():
            ways[0] = replace(ways[0], unrestricted_unpickling=True)
        notes = []
        if fmt == "pytorch-legacy":
            ways = [w for w in ways if not w.maps_lazily]
            notes.append("torch.load(mmap=True) needs the zip format: legacy files cannot map")
        if fmt == "deepspeed":
            notes.append("DeepSpeed files pickle DeepSpeed classes: only weights_only=False "
                         "loads them (unsafe: it runs any code the file's pickle names), and "
                         "only where deepspeed is installed")
        return ways, paths, notes
    if fmt == "torch-dcp":
        return list(_DCP_WAYS), [str(inv.path if inv.path.is_dir() else inv.path.parent)], []
    if fmt in ("safetensors", "safetensors-index"):
        paths = [str(p) for p in files if p.suffix == ".safetensors"]
        return list(_SAFETENSORS_WAYS), paths, []
    if fmt == "npy":
        return list(_NPY_WAYS), [str(p) for p in files], []
    if fmt == "npz":
        return list(_NPZ_WAYS), [str(p) for p in files], [
            "numpy.load ignores mmap_mode for .npz archives: only the full load is measured"]
    if fmt in ("keras", "keras-h5"):
        paths = [str(inv.path)]
        ways = list(_KERAS_WAYS)
        notes = []
        if fmt == "keras":
            ways.append(_KERAS_BUILD)
        else:
            notes.append("building the model and load_weights needs the model's code for an "
                         ".h5 file: not measured")
        if inv.path.name.endswith(".weights.h5"):
            return [], paths, ["a weights-only file loads only into a model built by its own "
                               "code: no way to measure without it"]
        return ways, paths, notes
    return [], [], [f"no load ways are known for {fmt} files"]


def _torch_load_defaults_to_pickle() -> bool:
    """Whether the installed torch's ``torch.load()`` unpickles without restrictions (its
    default became ``weights_only=True`` in torch 2.6); read from its metadata, no import."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = re.match(r"(\d+)\.(\d+)", version("torch"))
    except PackageNotFoundError:
        return False
    if found is None:
        return False
    major, minor = int(found[1]), int(found[2])
    return (major, minor) < (2, 6)


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


@dataclass(frozen=True)
class _Sample:
    import_peak: int
    import_seconds: float
    peak: int
    seconds: float


def _run_child(imports: str, load: str, paths: list[str], timeout: float
               ) -> tuple[_Sample | str, tuple[int, float] | None]:
    """What one child measured, or the reason it failed; and its imports' peak and seconds,
    which it prints as soon as they are done (None: the imports failed, or it printed
    nothing)."""
    code = _CHILD.format(imports=imports, load=load)
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code, json.dumps(paths)],
            capture_output=True, text=True, timeout=timeout,
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (
            exc.stdout or "")
        return f"did not finish within {timeout:.0f} s", _imported(out)
    except OSError as exc:
        return f"could not start a subprocess ({exc})", None
    imported = _imported(proc.stdout)
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        return printable(lines[-1] if lines else f"exit status {proc.returncode}", 300), imported
    try:
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        return _Sample(int(out["import_peak"]), float(out["import_seconds"]),
                       int(out["peak"]), float(out["seconds"])), imported
    except (ValueError, IndexError, KeyError, TypeError):
        return "the subprocess printed no measurement", imported


def _imported(stdout: str) -> tuple[int, float] | None:
    """The imports' peak and seconds a child printed first (after anything the framework's
    import printed), or None."""
    for line in stdout.splitlines():
        if line.startswith('{"import_peak"'):
            try:
                got = json.loads(line)
                return int(got["import_peak"]), float(got["import_seconds"])
            except (ValueError, KeyError, TypeError):
                return None
    return None


def measure_load_cost(
    inv: Inventory, *, ways: Sequence[str] | None = None, timeout: float = TIMEOUT_SECONDS
) -> LoadCost:
    """Measure the usual ways to load the checkpoint of ``inv``, each in a fresh subprocess.

    ``ways`` limits the run to the named ways (see :class:`Way` names). Never raises for a
    way that fails: its :class:`WayResult` says why. A path to load that is a FIFO, device or
    socket is an :class:`~modelsize.errors.InputError` before any child starts.
    """
    planned, paths, notes = _plan(inv)
    for path in paths:
        # A FIFO would hang every child until its timeout; a device has no size to load. A
        # file gone since it was read is left to each way to report.
        with contextlib.suppress(OSError):
            check_file(path)
    if ways is not None:
        planned = [w for w in planned if w.name in ways]
    results: list[WayResult] = []
    imports: dict[str, ImportCost | str] = {}
    if sys.platform == "win32":
        return LoadCost(inv.path, inv.format, inv.file_bytes, tuple(
            WayResult(w.name, w.framework, WayStatus.SKIPPED,
                      note="peak RSS cannot be measured on Windows") for w in planned
        ), (), tuple(notes))
    available = _available_memory()
    for way in planned:
        unsafe = way.unrestricted_unpickling

        def skip(why: str, way: Way = way) -> None:
            results.append(WayResult(way.name, way.framework, WayStatus.SKIPPED, note=why,
                                     unsafe=way.unrestricted_unpickling))

        if importlib.util.find_spec(way.framework) is None:
            skip(f"{way.framework} is not installed")
            continue
        if way.unrestricted_unpickling and inv.unsafe_globals:
            skip("not run: the file's pickles call " + ", ".join(inv.unsafe_globals[:3])
                 + (" ..." if len(inv.unsafe_globals) > 3 else "")
                 + ", which an unrestricted unpickler would execute")
            continue
        if (available is not None and not way.maps_lazily
                and inv.file_bytes > 0.8 * available):
            skip(f"not run: loading {inv.file_bytes} bytes needs more than the {available} "
                 "bytes of memory available")
            continue
        base = imports.get(way.imports)
        if isinstance(base, str):
            results.append(WayResult(way.name, way.framework, WayStatus.FAILED,
                                     note=f"importing {way.framework} failed: {base}",
                                     unsafe=unsafe))
            continue
        # One child per way; the first of a framework's children also gives its import cost
        # (it prints its imports' peak and time before it loads).
        sample, imported = _run_child(way.imports, way.load, paths, timeout)
        if imported is not None:
            imports.setdefault(way.imports, ImportCost(way.framework, way.imports, *imported))
        elif isinstance(sample, str) and base is None:
            imports[way.imports] = sample
            results.append(WayResult(way.name, way.framework, WayStatus.FAILED,
                                     note=f"importing {way.framework} failed: {sample}",
                                     unsafe=unsafe))
            continue
        if isinstance(sample, str):
            results.append(WayResult(way.name, way.framework, WayStatus.FAILED, note=sample,
                                     unsafe=unsafe))
            continue
        # The import's share is measured in the same child (right after its imports), which
        # is steadier than subtracting another child's numbers.
        results.append(WayResult(
            way.name, way.framework, WayStatus.MEASURED,
            peak_rss_bytes=sample.peak - sample.import_peak,
            seconds=sample.seconds - sample.import_seconds,
            total_peak_rss_bytes=sample.peak, total_seconds=sample.seconds,
            note="memory-mapped: RAM grows as tensors are first used" if way.maps_lazily else "",
            unsafe=unsafe,
        ))
    return LoadCost(
        inv.path, inv.format, inv.file_bytes, tuple(results),
        tuple(i for i in imports.values() if isinstance(i, ImportCost)), tuple(notes),
    )
