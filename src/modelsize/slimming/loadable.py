"""What a framework's own loader checks before it reads a tensor, checked on a slimmed output.

Verification compares what was read back with what was written; that alone would vouch for an
output its framework refuses (a dtype NumPy cannot make, a member name Keras finds twice).
:func:`problems_loading` applies the loader's rules, reading metadata only, never tensor data:

* ``.npy``/``.npz``: each array's header through NumPy's own parser when NumPy is installed
  (``numpy.lib.format``: magic, version, header dict, ``descr`` made into a dtype), else through
  modelsize's, which accepts no more than NumPy does; then what ``np.load`` with
  ``allow_pickle=False`` would refuse: object arrays, shapes past NumPy's largest array, data
  shorter than the header says.
* ``.keras``: Keras 3's rules: member names unique, ``config.json`` a JSON object naming a class,
  ``metadata.json`` (if any) a JSON object, a ``model.weights.h5`` (already read back by
  modelsize's HDF5 reader), and every layer the weights name present in the config.

Each problem is one line; an empty list means the output loads as far as these rules go.
"""

from __future__ import annotations

import json
import math
import zipfile
from collections import Counter
from collections.abc import Callable
from typing import IO, Any

from modelsize.errors import CorruptFileError, LimitError, printable
from modelsize.inventory import Inventory

#: A C ``npy_intp``: NumPy's largest element count and byte size.
_MAX_INTP = 2**63 - 1


def problems_loading(inv: Inventory) -> list[str]:
    """Why the framework's loader would refuse ``inv``'s files (empty: it would not)."""
    checks: dict[str, Callable[[Inventory], list[str]]] = {
        "npy": _npy_problems, "npz": _npz_problems, "keras": _keras_problems,
    }
    check = checks.get(inv.format)
    return check(inv) if check is not None else []


def refuse_unloadable(inv: Inventory) -> None:
    """Refuse, before anything is written, an input its framework would not load: the output
    could not be verified by the same rules (a limit it needs is refused as the limit)."""
    keras = inv.format == "keras"
    problems = _keras_problems(inv, limits=True) if keras else problems_loading(inv)
    if problems:
        raise CorruptFileError(inv.files[0].path, inv.format,
                               f"{problems[0]}: its framework would not load it")


# -- NumPy -----------------------------------------------------------------------------------


def _npy_problems(inv: Inventory) -> list[str]:
    path = inv.files[0].path
    with open(path, "rb") as fh:
        return _array_problems(fh, path.name, path.stat().st_size)


def _npz_problems(inv: Inventory) -> list[str]:
    path = inv.files[0].path
    problems: list[str] = []
    with zipfile.ZipFile(path) as zf:
        infos = zf.infolist()
        twice = [n for n, k in Counter(i.filename for i in infos).items() if k > 1]
        if twice:
            problems.append(f"member {printable(twice[0])} appears {len(twice)} time(s) more "
                            "than once")
        for info in infos:
            if info.filename.endswith("/"):
                continue
            with zf.open(info) as fh:
                problems += _array_problems(fh, f"member {info.filename}", info.file_size)
    return problems


def _array_problems(fh: IO[bytes], what: str, size: int) -> list[str]:
    """What ``np.load(allow_pickle=False)`` would refuse in the ``.npy`` stream ``fh`` of
    ``size`` bytes (only its header is read)."""
    try:
        parsed = _numpy_header(fh)
    except ImportError:
        parsed = None
    except (ValueError, TypeError, OverflowError, SyntaxError, EOFError, KeyError) as exc:
        return [f"{printable(what)}: NumPy cannot read its header ({printable(str(exc), 120)})"]
    if parsed is None:  # no NumPy: modelsize's parser, which accepts no more than NumPy's
        from modelsize.formats.numpy import parse_header

        fh.seek(0)
        head = fh.read(1 << 21)
        try:
            h = parse_header(lambda n: head[:n], size)
        except ValueError as exc:
            return [f"{printable(what)}: {printable(str(exc), 120)}"]
        shape, itemsize, has_object, header_end = (h.shape, h.dtype.itemsize,
                                                   h.dtype.has_object, h.nbytes)
    else:
        shape, itemsize, has_object, header_end = parsed
    if has_object:
        return [f"{printable(what)}: an object array (np.load refuses it without "
                "allow_pickle=True)"]
    count = math.prod(shape)
    if count > _MAX_INTP or count * itemsize > _MAX_INTP:
        return [f"{printable(what)}: shape {list(shape)} is larger than NumPy's largest array"]
    if size - header_end < count * itemsize:
        return [f"{printable(what)}: holds {size - header_end} bytes of data, its header needs "
                f"{count * itemsize}"]
    return []


def _numpy_header(fh: IO[bytes]) -> tuple[tuple[int, ...], int, bool, int]:
    """(shape, itemsize, has objects, header end) of a ``.npy`` stream, by NumPy's own parser
    (``ImportError`` without NumPy). Headers of any length are read: the writer decides them,
    and NumPy reads long ones when told to."""
    from numpy.lib import format as npformat

    version = npformat.read_magic(fh)
    read: Any
    if version == (1, 0):
        read = npformat.read_array_header_1_0
    elif version == (2, 0):
        read = npformat.read_array_header_2_0
    else:
        raise ValueError(f"format version {version} is not one modelsize writes")
    shape, _, dtype = read(fh, max_header_size=1 << 30)
    return tuple(shape), int(dtype.itemsize), bool(dtype.hasobject), fh.tell()


# -- Keras -----------------------------------------------------------------------------------


def _keras_problems(inv: Inventory, limits: bool = False) -> list[str]:
    """Keras 3's rules; with ``limits``, a document past a modelsize limit raises (the
    refusal names the limit) instead of being a problem."""
    from modelsize.formats import _limits
    from modelsize.formats.keras import WEIGHTS_MEMBER, unknown_groups, weight_groups

    path = inv.files[0].path
    problems: list[str] = []
    with zipfile.ZipFile(path) as zf:
        infos = zf.infolist()
        names = Counter(i.filename for i in infos)
        twice = sorted(n for n, k in names.items() if k > 1)
        if twice:
            problems.append(f"member {printable(twice[0])} appears twice in the archive")
        documents: dict[str, Any] = {}
        for member in ("config.json", "metadata.json"):
            if member not in names:
                continue
            info = zf.getinfo(member)
            try:
                _limits.JSON_BYTES.check(path, info.file_size, member)
                documents[member] = json.loads(zf.read(info))
            except LimitError:
                if limits:
                    raise
                problems.append(f"{member} is larger than modelsize parses")
            except (ValueError, RecursionError) as exc:
                problems.append(f"{member} is not valid JSON ({printable(str(exc), 120)})")
    config = documents.get("config.json")
    if "config.json" not in names:
        problems.append("the archive has no config.json")
    elif "config.json" in documents and not (
        isinstance(config, dict) and isinstance(config.get("class_name"), str)
    ):
        problems.append("config.json is not a Keras model config (an object with class_name)")
    if "metadata.json" in documents and not isinstance(documents["metadata.json"], dict):
        problems.append("metadata.json is not a JSON object")
    if WEIGHTS_MEMBER not in names:
        problems.append(f"the archive has no {WEIGHTS_MEMBER}")
    groups = weight_groups(config)
    if groups is not None:
        unknown = unknown_groups((t.name for t in inv.tensors), groups)
        if unknown:
            problems.append(f"{WEIGHTS_MEMBER} holds variables of layer {printable(unknown[0])}"
                            ", which no layer of config.json accounts for (Keras cannot load "
                            "them)")
    return problems
