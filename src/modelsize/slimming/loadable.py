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
* Keras ``.h5`` (legacy: ``keras.src.legacy.saving.legacy_h5_format``): the ``model_config``
  attribute (if any) a JSON object naming a class; every layer ``layer_names`` lists a group,
  and every weight its ``weight_names`` lists a dataset of that group; floats of IEEE layout.

* ``.tflite``: schema version 3, the only one the interpreter reads.
* ``.safetensors``: tensors that cover the data area, no byte left over (the library's
  "incomplete metadata, file not fully covered").

Each problem is one line; an empty list means the output loads as far as these rules go.
"""

from __future__ import annotations

import io
import json
import math
import zipfile
import zlib
from collections import Counter
from collections.abc import Callable
from typing import Any

from modelsize.errors import CorruptFileError, LimitError, printable
from modelsize.inventory import Inventory

#: A C ``npy_intp``: NumPy's largest element count and byte size.
_MAX_INTP = 2**63 - 1


def problems_loading(inv: Inventory) -> list[str]:
    """Why the framework's loader would refuse ``inv``'s files (empty: it would not)."""
    checks: dict[str, Callable[[Inventory], list[str]]] = {
        "npy": _npy_problems, "npz": _npz_problems, "keras": _keras_problems,
        "keras-h5": _keras_h5_problems, "tflite": _tflite_problems,
        "safetensors": _safetensors_problems, "safetensors-index": _safetensors_problems,
        "onnx": _onnx_problems,
    }
    check = checks.get(inv.format)
    return check(inv) if check is not None else []


def refuse_unloadable(inv: Inventory, whole: bool = False) -> None:
    """Refuse, before anything is written, an input its framework would not load: the output
    could not be verified by the same rules (a limit it needs is refused as the limit).

    ``whole`` (an input copied as it is, or read in place by h5py): the members of an ``.npz``
    (or the weights of a ``.keras``, whose JSON members the reader checks) are also read
    through, each checked against its CRC-32 and size, as :mod:`zipfile` checks them when
    ``np.load`` or Keras reads them. Other members of a ``.keras`` (assets) are left alone:
    a deflate bomb there is copied, never inflated.

    An inventory already passed (with ``whole`` at least as asked) is not read again: slim
    checks an archive up front and its writer may ask again."""
    if _passed[0] is inv and (_passed[1] or not whole):
        return
    keras = inv.format == "keras"
    problems = _keras_problems(inv, limits=True) if keras else problems_loading(inv)
    if problems:
        raise CorruptFileError(inv.files[0].path, inv.format,
                               f"{problems[0]}: its framework would not load it")
    if whole and inv.format in ("npz", "keras"):
        from modelsize.formats import _zip
        from modelsize.formats.keras import WEIGHTS_MEMBER
        from modelsize.inventory import InventoryBuilder

        path = inv.files[0].path
        builder = InventoryBuilder(inv.format, [path])
        members = [m for m in _zip.members(path, builder)
                   if inv.format == "npz" or m.name == WEIGHTS_MEMBER]
        unrecorded = next((m for m in members if not _zip.crc_recorded(m)), None)
        if unrecorded is not None:  # torch writes CRC 0 for "none"; zipfile checks it as is
            raise CorruptFileError(path, inv.format, f"member {printable(unrecorded.name)} "
                                   "records CRC-32 0 for its bytes: zipfile refuses to read it")
        _zip.check_members(path, members, builder)
    _passed[:] = [inv, whole]


#: The last inventory :func:`refuse_unloadable` passed, and whether it was read through whole.
_passed: list[Any] = [None, False]


# -- NumPy -----------------------------------------------------------------------------------


def _npy_problems(inv: Inventory) -> list[str]:
    from modelsize.formats.numpy import _Prefixes

    path = inv.files[0].path
    size = path.stat().st_size
    prefixes = _Prefixes(path)
    try:
        return _array_problems(prefixes.at(0, size), path.name, size, {})
    finally:
        prefixes.close()


def _npz_problems(inv: Inventory) -> list[str]:
    """Each member's header, read through one open handle (stored members) or inflated only
    as far as the header (deflated ones)."""
    from modelsize.formats import _zip
    from modelsize.formats.numpy import _inflate_prefix, _Prefixes
    from modelsize.inventory import InventoryBuilder

    path = inv.files[0].path
    members = _zip.members(path, InventoryBuilder("npz", [path]))
    problems: list[str] = []
    twice = [n for n, k in Counter(m.name for m in members).items() if k > 1]
    if twice:
        problems.append(f"member {printable(twice[0])} appears twice in the archive")
    seen: dict[bytes, tuple[tuple[int, ...], int, bool] | str] = {}
    prefixes = _Prefixes(path)
    try:
        for m in members:
            if m.name.endswith("/"):
                continue
            read = (prefixes.at(m.data_offset, m.compress_size) if m.method == _zip.STORED
                    else _inflate_prefix(path, m))
            problems += _array_problems(read, f"member {m.name}", m.file_size, seen)
    finally:
        prefixes.close()
    return problems


def _array_problems(read_prefix: Callable[[int], bytes], what: str, size: int,
                    seen: dict[bytes, tuple[tuple[int, ...], int, bool] | str]) -> list[str]:
    """What ``np.load(allow_pickle=False)`` would refuse in the ``.npy`` stream of ``size``
    bytes whose first bytes ``read_prefix`` gives (only its header is read). ``seen`` keeps
    headers already parsed (an archive's repeat)."""
    start = read_prefix(12)
    version = tuple(start[6:8])
    pre = 10 if version == (1, 0) else 12
    if start[:6] != b"\x93NUMPY" or version not in ((1, 0), (2, 0)) or len(start) < pre:
        return [f"{printable(what)}: not a .npy stream of a version modelsize writes"]
    length = int.from_bytes(start[8:pre], "little")
    raw = read_prefix(pre + length)
    parsed = seen.get(raw)
    if parsed is None:
        parsed = seen[raw] = _parse_numpy_header(raw, size)
    if isinstance(parsed, str):
        return [f"{printable(what)}: {parsed}"]
    shape, itemsize, has_object = parsed
    if has_object:
        return [f"{printable(what)}: an object array (np.load refuses it without "
                "allow_pickle=True)"]
    count = math.prod(shape)
    if count > _MAX_INTP or count * itemsize > _MAX_INTP:
        return [f"{printable(what)}: shape {list(shape)} is larger than NumPy's largest array"]
    if size - len(raw) < count * itemsize:
        return [f"{printable(what)}: holds {size - len(raw)} bytes of data, its header needs "
                f"{count * itemsize}"]
    return []


def _parse_numpy_header(raw: bytes, size: int) -> tuple[tuple[int, ...], int, bool] | str:
    """(shape, itemsize, has objects) of a ``.npy`` header (magic, version, length, dict), by
    NumPy's own parser when NumPy is installed, else modelsize's (which accepts no more than
    NumPy's); a string saying why not when it fails. Headers of any length are read: the
    writer decides them, and NumPy reads long ones when told to."""
    try:
        from numpy.lib import format as npformat
    except ImportError:
        from modelsize.formats.numpy import parse_header

        try:
            h = parse_header(lambda n: raw[:n], size)
        except ValueError as exc:
            return printable(str(exc), 120)
        return h.shape, h.dtype.itemsize, h.dtype.has_object
    read = (npformat.read_array_header_1_0 if raw[6] == 1 else npformat.read_array_header_2_0)
    try:
        shape, _, dtype = read(io.BytesIO(raw[8:]), max_header_size=1 << 30)
    except (ValueError, TypeError, OverflowError, SyntaxError, EOFError, KeyError) as exc:
        return f"NumPy cannot read its header ({printable(str(exc), 120)})"
    return tuple(shape), int(dtype.itemsize), bool(dtype.hasobject)


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
            except (zipfile.BadZipFile, zlib.error, EOFError) as exc:  # a CRC of 0, say
                problems.append(f"{member}: zipfile refuses it ({printable(str(exc), 120)})")
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


def _keras_h5_problems(inv: Inventory) -> list[str]:
    """What Keras's legacy HDF5 loader (``load_model``, ``load_weights``) looks up by name."""
    from modelsize.formats import _limits
    from modelsize.formats._hdf5 import HDF5Error

    try:
        h5 = _read_h5(inv)
    except HDF5Error as exc:
        return [f"HDF5 structure unreadable ({printable(exc.reason, 120)})"]
    problems: list[str] = []
    config = h5.groups.get("/", {}).get("model_config")
    if (config is not None and isinstance(config.value, str)
            and len(config.value) <= _limits.JSON_BYTES.value()):
        try:
            doc = json.loads(config.value)
        except (ValueError, RecursionError) as exc:
            problems.append(f"the model_config attribute is not valid JSON "
                            f"({printable(str(exc), 120)})")
        else:
            if not (isinstance(doc, dict) and isinstance(doc.get("class_name"), str)):
                problems.append("the model_config attribute is not a Keras model config (an "
                                "object with class_name)")
    odd = next((d.path for d in h5.datasets if d.dtype_class == "float" and d.dtype is None),
               None)
    if odd is not None:
        problems.append(f"{printable(odd.lstrip('/'), 80)} is a floating type of no IEEE "
                        "layout (h5py maps some to NumPy and refuses others; Keras writes "
                        "IEEE floats)")
    datasets = {d.path for d in h5.datasets}
    for layer, group, weight in _listed(h5):
        if weight is None:
            problems.append(f"layer_names lists {printable(layer, 80)}, which has no group")
        elif f"{group}/{weight}" not in datasets:
            problems.append(f"layer {printable(layer, 80)} lists the weight "
                            f"{printable(weight, 80)}, which is not a dataset of its group")
    return problems


def keras_h5_listed(inv: Inventory) -> dict[str, str]:
    """Tensor name -> layer, for every dataset a layer's ``weight_names`` lists (Keras's
    legacy loader reads each of them: none can be dropped)."""
    h5 = _read_h5(inv)
    return {f"{group}/{weight}".lstrip("/"): layer
            for layer, group, weight in _listed(h5) if weight is not None}


def _read_h5(inv: Inventory) -> Any:
    import mmap

    from modelsize.formats._hdf5 import BytesBlob, read_hdf5

    with open(inv.files[0].path, "rb") as fh, \
            mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        return read_hdf5(BytesBlob(mm))


def _listed(h5: Any) -> list[tuple[str, str, str | None]]:
    """(layer, its group, weight) for every weight the layers list; weight None for a layer
    without a group."""
    base = "/model_weights" if "/model_weights" in h5.groups else "/"
    out: list[tuple[str, str, str | None]] = []
    for layer in _names(h5.groups.get(base, {}), "layer_names"):
        group = f"{base.rstrip('/')}/{layer}"
        if group not in h5.groups:
            out.append((layer, group, None))
            continue
        out += [(layer, group, w) for w in _names(h5.groups[group], "weight_names")]
    return out


def _names(attrs: dict[str, Any], name: str) -> list[str]:
    """A list attribute as Keras reads it: whole, or in chunks ``name0``, ``name1``... (a value
    modelsize does not decode gives nothing to check)."""
    if name in attrs:
        chunks = [attrs[name].value]
    else:
        chunks = []
        while f"{name}{len(chunks)}" in attrs:
            chunks.append(attrs[f"{name}{len(chunks)}"].value)
    out: list[str] = []
    for value in chunks:
        if isinstance(value, list):
            out += value
        elif isinstance(value, str):
            out.append(value)
    return out


def _tflite_problems(inv: Inventory) -> list[str]:
    """The interpreter reads schema version 3 only ("Model provided is schema version N not
    equal to supported version 3")."""
    from modelsize.formats.tflite import UNLOADABLE_FACT

    version = inv.facts.get("tflite.schema_version")
    if version is not None and version != "3":
        return [f"schema version {printable(version, 20)}: the TFLite interpreter reads "
                "version 3 only"]
    why = inv.facts.get(UNLOADABLE_FACT)
    return [why] if why is not None else []


def _onnx_problems(inv: Inventory) -> list[str]:
    """What onnxruntime refuses though the checker passes it: a model without a graph, a
    main-graph input or output typed as a tensor of element type 0."""
    from modelsize.formats.onnx import UNLOADABLE_FACT

    why = inv.facts.get(UNLOADABLE_FACT)
    return [why] if why is not None else []


def _safetensors_problems(inv: Inventory) -> list[str]:
    """Data-area bytes no tensor claims: the safetensors library refuses the file."""
    from modelsize.formats.safetensors import STRAY
    from modelsize.inventory import LazyInventory

    # A verified output's totals: stray bytes are a region its reader declared.
    regions = inv.declared_regions if isinstance(inv, LazyInventory) else inv.regions
    stray = next((r for r in regions if r.label == STRAY), None)
    if stray is None:
        return []
    return [f"{printable(inv.files[stray.file].path.name, 80)}: {stray.nbytes} bytes of the data "
            "area belong to no tensor (the safetensors library: 'file not fully covered')"]
