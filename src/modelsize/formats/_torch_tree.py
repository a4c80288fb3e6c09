"""Classify the tensors of a parsed checkpoint pickle: weights, buffers, optimizer state...

Both PyTorch readers (and the generic pickle reader, for NumPy arrays) parse a pickle into a
tree of :mod:`~modelsize.formats._pickle` placeholders. :func:`classify` walks that tree with
dotted paths (``model.conv1.weight``, ``optimizer.state.3.exp_avg``) and declares every tensor
to the :class:`~modelsize.inventory.InventoryBuilder` with its category:

* optimizer state dicts (``state`` + ``param_groups``, Lightning's ``optimizer_states``) hold
  optimizer state, whatever the slot;
* pickled ``nn.Module`` objects: ``_parameters`` are weights, ``_buffers`` buffers, any other
  tensor attribute (``self.last_output = x``) a cached activation;
* keys named ``grad``/``grads``/``gradients``/``*.grad`` hold gradients, ``activations``,
  ``hidden_states``... activations, ``*rng_state*`` other;
* everything else follows the state-dict rule: parameters and floating tensors are weights,
  except the well-known buffer names (``running_mean``, ``inv_freq``...); integer tensors are
  buffers. Paths through an EMA copy (``ema``, ``model_ema``, ``shadow_params``...) add the tag
  ``ema``.

Tensors are recognised in the forms of every torch generation: ``_rebuild_tensor`` (0.3),
``_rebuild_tensor_v2`` (0.4 on), ``_v3``, ``Parameter(data, requires_grad)`` and
``Variable(data)`` (0.3/0.4), ``_rebuild_parameter`` and ``_rebuild_parameter_with_state``;
mappings in the forms of both Pythons (Python 2 rebuilds an ``OrderedDict`` from a list of
``[key, value]`` lists). A storage saved by itself, outside any tensor, is a 1-D tensor tagged
``storage``.

The walk is iterative (no recursion however deep the pickle nests) and visits each object once:
a tensor pickled twice through the memo (tied weights) is declared under both names, as two
views of the same bytes.
"""

from __future__ import annotations

import codecs
import functools
import math
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from modelsize._records import field, record
from modelsize.categories import Category
from modelsize.dtypes import DTYPES, canonical
from modelsize.formats._pickle import (
    LATIN1,
    Blob,
    Call,
    Data,
    Global,
    PersistentId,
    UnhashableKey,
)
from modelsize.inventory import Inventory, InventoryBuilder, StorageRecord

MAX_DIMS = 256
MAX_NAME_PARTS = 64

_BUFFER_NAMES = frozenset(
    {
        "running_mean", "running_var", "num_batches_tracked", "position_ids", "inv_freq",
        "masked_bias", "token_type_ids", "relative_position_index", "_float_tensor",
        "attention_mask", "causal_mask",
    }
)
_WEIGHT_NAMES = frozenset({"weight", "qweight"})
_MASK_NAMES = frozenset({"bias", "mask", "masked_bias"})
_QUANTIZED = frozenset({"qint8", "quint8", "qint32", "quint4x2", "quint2x4"})
_GRAD_KEYS = frozenset({"grad", "grads", "gradients", "gradient"})
_ACTIVATION_KEYS = frozenset(
    {
        "activations", "activation", "outputs", "hidden_states", "features_cache",
        "activation_cache", "cached_activations", "cached_outputs", "intermediate_outputs",
    }
)
_OPTIMIZER_KEYS = frozenset(
    {"optimizer_states", "optimizer_state", "optimizer_state_dict", "optim_state"}
)
_EMA_KEYS = frozenset(
    {"shadow_params", "averaged_model", "averaged_params", "swa_model", "ema", "model_ema"}
)
_RNG_KEYS = frozenset({"rng_state", "rng_states", "random_state", "rng_state.pth"})
_MAPPING_CALLS = frozenset(
    {"collections.OrderedDict", "builtins.dict", "collections.defaultdict", "collections.Counter"}
)
_NUMPY_TYPES = {
    "f2": "float16", "f4": "float32", "f8": "float64", "i1": "int8", "i2": "int16",
    "i4": "int32", "i8": "int64", "u1": "uint8", "u2": "uint16", "u4": "uint32",
    "u8": "uint64", "b1": "bool", "c8": "complex64", "c16": "complex128",
}
#: Classes that old torch pickles call on a tensor to wrap it (see :meth:`_Walker.tensor`).
_WRAPPER_CALLS = frozenset({"torch.nn.parameter.Parameter", "torch.autograd.variable.Variable"})
_SPARSE_PARTS = {
    "torch.sparse_coo": ("indices", "values"),
}


#: TorchScript class name -> (parameter names, buffer names).
ScriptRoles = dict[str, tuple[frozenset[str], frozenset[str]]]


class StorageRef:
    """A storage a persistent id points at, resolved by the reader.

    ``numel`` counts elements of ``dtype`` (bytes for an untyped storage). ``base`` and
    ``view_numel`` describe a legacy storage view: elements ``base .. base + view_numel`` of
    the storage ``key``. A plain slotted class (one is made per tensor; a frozen dataclass is
    slow to make), never changed once made.
    """

    __slots__ = ("base", "dtype", "key", "location", "numel", "view_numel")

    def __init__(
        self,
        key: str,
        dtype: str,
        numel: int,
        location: str = "",
        base: int = 0,
        view_numel: int | None = None,
    ) -> None:
        self.key = key
        self.dtype = dtype
        self.numel = numel
        self.location = location
        self.base = base
        self.view_numel = view_numel

    def _fields(self) -> tuple[str, str, int, str, int, int | None]:
        return (self.key, self.dtype, self.numel, self.location, self.base, self.view_numel)

    def __eq__(self, other: object) -> bool:
        if type(other) is not StorageRef:
            return NotImplemented
        return self._fields() == other._fields()

    def __hash__(self) -> int:
        return hash(self._fields())

    def __repr__(self) -> str:
        return (f"StorageRef(key={self.key!r}, dtype={self.dtype!r}, numel={self.numel}, "
                f"location={self.location!r}, base={self.base}, view_numel={self.view_numel})")

    @property
    def itemsize(self) -> int:
        """Bytes per storage element (packed sub-byte types count one byte, as torch does)."""
        return storage_itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes this reference may reach."""
        numel = self.numel if self.view_numel is None else self.base + self.view_numel
        return numel * self.itemsize


@record
class Summary:
    """What the walk learnt besides the tensors."""

    module_classes: list[str] = field(default_factory=list)
    optimizer: str | None = None
    tensors: int = 0
    #: (file offset, bytes) of the array data declared as storages inside the pickle.
    blobs: list[tuple[int, int]] = field(default_factory=list)
    #: (array bytes, stored bytes) of the arrays pickled as latin-1 text.
    latin1: list[tuple[int, int]] = field(default_factory=list)

    @property
    def has_modules(self) -> bool:
        """Whether the pickle holds module objects (it is then model structure: graph)."""
        return bool(self.module_classes)


_UNSET = object()


class _Path:
    """A dotted path kept as a chain of parents: extending it costs O(1) at any depth."""

    __slots__ = ("key", "named", "parent", "top")

    def __init__(self, parent: _Path | None = None, key: str = "") -> None:
        self.parent = parent
        self.key = key
        #: (depth, dotted name) once asked (the name only up to MAX_NAME_PARTS deep): the
        #: tensors of one module share their parent's.
        self.named: tuple[int, str | None] | None = None
        #: The ancestor (or self) right under the walk's root mapping: see _Walker.container.
        self.top: _Path | object | None = _UNSET

    def child(self, key: str) -> _Path:
        """This path extended by ``key``."""
        return _Path(self, key)

    def name(self) -> str:
        """The dotted name; the last :data:`MAX_NAME_PARTS` parts of a very deep path."""
        named = self.named
        if named is None:
            chain: list[_Path] = []
            known = self
            while known.parent is not None and known.named is None:
                chain.append(known)
                known = known.parent
            depth, text = (0, "") if known.named is None else known.named
            for n in reversed(chain):  # no recursion: paths can be thousands of parts deep
                depth += 1
                if text is not None:
                    text = n.key if depth == 1 else (
                        f"{text}.{n.key}" if depth <= MAX_NAME_PARTS else None)
                n.named = (depth, text)
            named = (depth, text)
        if named[1] is not None:
            return named[1]
        parts: list[str] = []
        node: _Path | None = self
        while node is not None and node.parent is not None and len(parts) < MAX_NAME_PARTS:
            parts.append(node.key)
            node = node.parent
        if node is not None and node.parent is not None:
            parts.append("...")
        return ".".join(reversed(parts))


# _Ctx and _Tensor are plain slotted classes, not dataclasses: one is made per tensor or key
# walked, and defining a dataclass costs about a millisecond of every inspect.


class _Ctx:
    """What the path to a value decides: a forced category, tags, inside an optimizer.

    Never changed once made (contexts are shared by many paths).
    """

    __slots__ = ("forced", "optimizer", "soft", "tags")

    def __init__(
        self,
        forced: Category | None = None,
        soft: bool = False,  # forced by a module attribute: a nested module's own params win
        tags: tuple[str, ...] = (),
        optimizer: bool = False,
    ) -> None:
        self.forced = forced
        self.soft = soft
        self.tags = tags
        self.optimizer = optimizer


class _Tensor:
    """A tensor as its rebuild call describes it."""

    __slots__ = (
        "blob", "dtype", "extras", "offset", "parameter", "requires_grad", "shape", "storage",
        "stride", "subclass",
    )

    def __init__(
        self,
        dtype: str,
        shape: tuple[int, ...],
        stride: tuple[int, ...] | None,
        storage: StorageRef | None,
        offset: int = 0,
        requires_grad: bool = False,
        blob: Blob | None = None,
    ) -> None:
        self.dtype = dtype
        self.shape = shape
        self.stride = stride
        self.storage = storage
        self.offset = offset
        self.requires_grad = requires_grad
        self.parameter = False
        self.blob = blob
        #: The tensor subclass it is rebuilt as (``torchao.quantization.Int8Tensor``), if any.
        self.subclass = ""
        self.extras: list[tuple[str, object]] = []


#: Distinct (size, stride) pairs whose layout a walk remembers (most tensors share a few).
_MAX_LAYOUTS = 1 << 16
#: Distinct keys whose facts a walk remembers.
_MAX_KEY_FACTS = 1 << 14
#: Size and stride tuples a walk remembers as checked (see _Walker.plain_layout).
_MAX_CHECKED = 1 << 12


def _layout(shape: tuple[int, ...], stride: tuple[int, ...]) -> tuple[int, int, bool]:
    """(elements, span in elements, contiguous) of a strided view with as many strides as
    dimensions (the span counts from its first element; 0 for an empty view)."""
    n = math.prod(shape)
    contiguous = True
    span = 0
    if n:
        span = expected = 1
        for d, s in zip(reversed(shape), reversed(stride), strict=True):
            span += (d - 1) * s
            if d != 1 and s != expected:
                contiguous = False
            expected *= d
    return n, span, contiguous


#: What ``torch.save`` calls to rebuild a tensor (since torch 0.4).
_V2 = "torch._utils._rebuild_tensor_v2"
#: Values that hold nothing to walk.
_LEAVES = (str, bytes, int, float, complex, Blob, Global)


class _Invalid(Exception):
    """A rebuild call whose arguments make no sense: the reader turns it into a corrupt error."""


def _past_storage(t: _Tensor, name: str, end: int, ref: StorageRef) -> _Invalid:
    return _Invalid(f"tensor {name!r} ({t.dtype}{list(t.shape)} at element {t.offset}) "
                    f"reaches byte {end} of storage {ref.key!r}, which holds {ref.nbytes}")


def global_name(obj: object) -> str:
    """``module.name`` of a :class:`Global`, else an empty string."""
    return obj.qualname if isinstance(obj, Global) else ""


_ITEMSIZES: dict[str, int] = {}


def storage_itemsize(dtype: str) -> int:
    """Bytes per element of a storage of ``dtype``: packed sub-byte types count one byte."""
    size = _ITEMSIZES.get(dtype)
    if size is None:
        dt = DTYPES.get(dtype)
        if dt is None:
            return 1
        size = _ITEMSIZES[dtype] = max(1, math.ceil(dt.itemsize))
    return size


def mapping_items(obj: object) -> list[tuple[object, object]] | None:
    """The key/value pairs of a dict or of a dict-like object being rebuilt, else ``None``."""
    if isinstance(obj, dict):
        return [(k.value if isinstance(k, UnhashableKey) else k, v) for k, v in obj.items()]
    if isinstance(obj, Call) and global_name(obj.func) in _MAPPING_CALLS:
        pairs: list[tuple[object, object]] = []
        if obj.args and isinstance(obj.args[0], (list, tuple)):
            # Python 3 pickles pairs as tuples; Python 2's OrderedDict.__reduce__ as [key, value]
            # lists (every PyTorch 0.x state dict saved under Python 2).
            pairs.extend(
                (p[0], p[1]) for p in obj.args[0]
                if isinstance(p, (tuple, list)) and len(p) == 2
            )
        elif obj.args and isinstance(obj.args[0], dict):
            pairs.extend(obj.args[0].items())
        pairs.extend(obj.dictitems)
        return pairs
    return None


def _is_mapping(obj: object) -> bool:
    """Whether :func:`mapping_items` of ``obj`` is not ``None`` (without making the pairs)."""
    return isinstance(obj, dict) or (
        isinstance(obj, Call) and global_name(obj.func) in _MAPPING_CALLS)


def _is_optimizer_state(obj: object) -> bool:
    if isinstance(obj, dict):
        return "state" in obj and "param_groups" in obj
    items = mapping_items(obj)
    if items is None:
        return False
    keys = {k for k, _ in items if isinstance(k, str) and k in _OPTIMIZER_STATE_KEYS}
    return len(keys) == 2


_OPTIMIZER_STATE_KEYS = frozenset({"state", "param_groups"})


_SEPARATORS = re.compile(r"[._\-]")


def _tokens(key: str) -> list[str]:
    return _SEPARATORS.split(key)


def _is_ema(key: str) -> bool:
    # The substring test first: most keys hold no "ema", and splitting them is the cost.
    return key in _EMA_KEYS or ("ema" in key and "ema" in _tokens(key))


def _key_facts(k: str) -> tuple[bool, Category | None, bool]:
    """What a lower-cased key says by itself: (names optimizer state, category, EMA copy)."""
    if not (k in _KEY_WORDS or "rng" in k or "ema" in k or k.endswith(".grad")):
        return _NO_FACTS  # what most keys say: checked at once (a flat state dict's all differ)
    new: Category | None = None
    if k in _GRAD_KEYS or k.endswith(".grad"):
        new = Category.GRADIENTS
    elif k in _ACTIVATION_KEYS:
        new = Category.ACTIVATIONS
    elif k in _RNG_KEYS or ("rng" in k and "rng" in _tokens(k)):
        new = Category.OTHER
    facts = (k in _OPTIMIZER_KEYS, new, _is_ema(k))
    # A handful of distinct answers, each kept once: the walk caches one per distinct key.
    return _FACTS.setdefault(facts, facts)


_FACTS: dict[tuple[bool, Category | None, bool], tuple[bool, Category | None, bool]] = {}
_NO_FACTS = _FACTS.setdefault((False, None, False), (False, None, False))
#: Every key some fact of _key_facts names whole.
_KEY_WORDS = _GRAD_KEYS | _ACTIVATION_KEYS | _RNG_KEYS | _OPTIMIZER_KEYS | _EMA_KEYS


def _by_name(key: str, dtype: str) -> Category:
    """The category of a tensor that no context forces and that is no parameter: what its
    last key part and its dtype say."""
    last = key.rsplit(".", 1)[-1].lower()
    if last in _WEIGHT_NAMES or last.endswith("_weight") or dtype in _QUANTIZED:
        return Category.WEIGHTS
    if last in _BUFFER_NAMES:
        return Category.BUFFERS
    if last in _MASK_NAMES and dtype in ("bool", "uint8"):
        return Category.BUFFERS
    dt = DTYPES.get(dtype)
    return Category.WEIGHTS if dt is not None and dt.floating else Category.BUFFERS


def _naturals(values: tuple[object, ...]) -> bool:
    """Whether every item of ``values`` is a plain ``int`` (no bool) >= 0."""
    for d in values:  # noqa: SIM110 - a loop: all() of a generator costs twice as much
        if type(d) is not int or d < 0:
            return False
    return True


def _ints(obj: object, what: str) -> tuple[int, ...]:
    if type(obj) is tuple and len(obj) <= MAX_DIMS:
        # The common case, checked without building anything: a tuple of plain ints >= 0.
        for d in obj:
            if type(d) is not int or d < 0:
                break
        else:
            return obj
    if isinstance(obj, Call) and global_name(obj.func) == "torch.Size" and obj.args:
        obj = obj.args[0]
    if not isinstance(obj, (tuple, list)) or len(obj) > MAX_DIMS:
        raise _Invalid(f"{what} is not a tuple of at most {MAX_DIMS} integers")
    if not all(isinstance(d, int) for d in obj):
        raise _Invalid(f"{what} holds something other than integers")
    if any(d < 0 for d in obj):
        raise _Invalid(f"{what} {tuple(obj)} has a negative entry")
    return tuple(int(d) for d in obj)


def _dtype_of(obj: object) -> str:
    name = canonical(global_name(obj)) if isinstance(obj, Global) else None
    if name is None:
        raise _Invalid(f"unknown tensor dtype {global_name(obj) or type(obj).__name__}")
    return name


def numpy_dtype(obj: object) -> str | None:
    """Canonical dtype of a pickled ``numpy.dtype(...)`` we can itemize as a tensor."""
    if not (isinstance(obj, Call) and global_name(obj.func) == "numpy.dtype" and obj.args):
        return None
    code = obj.args[0]
    if not isinstance(code, str):
        return None
    order = obj.state[1] if isinstance(obj.state, tuple) and len(obj.state) > 1 else "<"
    if order == ">" and code.lstrip("<>=|") not in ("i1", "u1", "b1"):
        return None  # big-endian data: itemized as bytes, not as a tensor
    return _NUMPY_TYPES.get(code.lstrip("<>=|"))


_ITEMSIZE_CODE = re.compile(r"^[<>=|]?([a-zA-Z])(\d*)")


def numpy_itemsize(dtype: object) -> int | None:
    """Bytes per element of a pickled ``numpy.dtype(...)``; ``None`` for objects or unknowns."""
    if not (isinstance(dtype, Call) and global_name(dtype.func) == "numpy.dtype" and dtype.args):
        return None
    code = dtype.args[0]
    state = dtype.state if isinstance(dtype.state, tuple) else ()
    if len(state) > 5 and type(state[5]) is int and state[5] > 0:
        return state[5]  # flexible types (strings, records) carry their element size
    match = _ITEMSIZE_CODE.match(code) if isinstance(code, str) else None
    if match is None or match.group(1) == "O" or not match.group(2):
        return None
    size = int(match.group(2))
    return size * 4 if match.group(1) == "U" else size


class _Walker:
    def __init__(
        self, builder: InventoryBuilder, blob_base: int | None, script_roles: ScriptRoles,
        unshared: bool = False,
    ) -> None:
        self.builder = builder
        #: No call sits at two places in the tree, and the caller needs it no more (see
        #: :func:`classify`).
        self.unshared = unshared
        self.blob_base = blob_base
        self.script_roles = script_roles
        self.summary = Summary()
        #: Objects walked that are no tensors: met again, they are not walked again.
        self.seen: set[int] = set()
        #: The calls walked that are tensors (a call hashes by identity): met again, they are
        #: declared again. The calls themselves, not their ids: no int object for each.
        self.tensors: set[Call] = set()
        self.optimizer_keys: set[str] = set()
        self.optimizer_dicts: dict[int, bool] = {}
        #: What each key says by itself (see :func:`_key_facts`): keys repeat thousands of times
        #: (a module's ``weight``); up to :data:`_MAX_KEY_FACTS` keys are kept (a flat state
        #: dict's are all distinct: keeping them would only cost memory).
        self.key_facts: dict[str | int, tuple[bool, Category | None, bool]] = {}
        #: The pickle's Global for ``_rebuild_tensor_v2``, once met.
        self.v2: object = None
        self.todo: list[tuple[object, _Path, _Ctx]] = []
        #: The path of the root when it is a mapping (its keys are containers), else None.
        self.root_path: _Path | None = None
        #: (size, stride) -> its :func:`_layout`, for the common tensors' checks.
        self.layouts: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[int, int, bool]] = {}
        #: id(size) -> (size, stride, layout) of tuples checked by plain_layout.
        self.checked: dict[int, tuple[object, object, tuple[int, int, bool]]] = {}

    # -- recognising tensors ----------------------------------------------------------
    def tensor(self, call: Call) -> _Tensor | None:
        """The tensor a rebuild call builds, or ``None`` if the call builds no tensor."""
        name = global_name(call.func)
        a = call.args
        if name == "torch._utils._rebuild_tensor_v2":
            return self.strided(a, None, requires_grad_at=4)
        if name == "torch._utils._rebuild_tensor":
            return self.strided(a, None, requires_grad_at=-1)
        if name == "torch._utils._rebuild_qtensor":
            t = self.strided(a, None, requires_grad_at=5)
            qparams = a[4] if len(a) > 4 and isinstance(a[4], tuple) else ()
            if len(qparams) >= 3:  # per-channel schemes keep scales and zero points as tensors
                t.extras = [("q_per_channel_scales", qparams[1]),
                            ("q_per_channel_zero_points", qparams[2])]
            return t
        if name == "torch._utils._rebuild_tensor_v3":
            if len(a) < 7:
                raise _Invalid("_rebuild_tensor_v3 needs 7 arguments")
            return self.strided(a, _dtype_of(a[6]), requires_grad_at=4)
        if name.startswith("torch._utils._rebuild_parameter"):
            inner = self.inner(a[0] if a else None, name)
            inner.parameter = True
            if len(a) > 3:
                inner.extras.append(("", a[3]))
            return inner
        if name in _WRAPPER_CALLS and a and isinstance(a[0], Call):
            # torch 0.3/0.4 reduce a Parameter to ``Parameter(data, requires_grad)`` and a
            # Variable to ``Variable(data)``: the class called on the tensor it wraps.
            wrapped = self.tensor(a[0])
            if wrapped is not None:
                wrapped.parameter = name == "torch.nn.parameter.Parameter"
                return wrapped
        if name == "torch._tensor._rebuild_from_type_v2":
            if len(a) < 3 or not isinstance(a[2], tuple):
                raise _Invalid("_rebuild_from_type_v2 needs (func, type, args, state)")
            inner = self.inner(Call(a[0], a[2]), name)
            kind = global_name(a[1])
            if kind == "torch.nn.parameter.Parameter":
                inner.parameter = True
            elif kind and kind != "torch.Tensor":
                inner.subclass = kind
            if len(a) > 3:
                inner.extras.append(("", a[3]))
            return inner
        if name == "torch._utils._rebuild_device_tensor_from_cpu_tensor":
            return self.inner(a[0] if a else None, name)
        if name == "torch._utils._rebuild_meta_tensor_no_storage":
            if len(a) < 3:
                raise _Invalid("_rebuild_meta_tensor_no_storage needs 3 arguments")
            return _Tensor(_dtype_of(a[0]), _ints(a[1], "size"), _ints(a[2], "stride"), None)
        if name == "torch._utils._rebuild_wrapper_subclass":
            if len(a) < 4:
                raise _Invalid("_rebuild_wrapper_subclass needs 4 arguments")
            return _Tensor(_dtype_of(a[1]), _ints(a[2], "size"), _ints(a[3], "stride"), None)
        if name == "torch._utils._rebuild_sparse_tensor" and len(a) > 1:
            layout = a[0]
            if isinstance(layout, Call) and layout.args:  # torch.serialization._get_layout(name)
                layout = layout.args[0]
            parts = _SPARSE_PARTS.get(
                layout if isinstance(layout, str) else global_name(layout),
                ("compressed_indices", "plain_indices", "values"),
            )
            data = a[1] if isinstance(a[1], tuple) else ()
            t = _Tensor("", (), None, None)
            t.extras = list(zip(parts, data, strict=False))
            return t
        if name == "torch._utils._rebuild_nested_tensor":
            t = _Tensor("", (), None, None)
            t.extras = list(zip(("buffer", "sizes", "strides", "offsets"), a, strict=False))
            return t
        if name.endswith("multiarray._reconstruct") and isinstance(call.state, tuple):
            return self.numpy_array(call.state)
        return None

    def inner(self, data: object, name: str) -> _Tensor:
        t = self.tensor(data) if isinstance(data, Call) else None
        if t is None:
            raise _Invalid(f"{name.rsplit('.', 1)[-1]} wraps no tensor")
        return t

    def strided(self, a: tuple[Any, ...], dtype: str | None, requires_grad_at: int) -> _Tensor:
        if len(a) < 4:
            raise _Invalid("tensor rebuild call needs (storage, offset, size, stride)")
        storage = a[0]
        if isinstance(storage, PersistentId):
            storage = None  # a torch pickle read on its own: the data is not in this file
        elif not isinstance(storage, StorageRef):
            raise _Invalid(f"tensor storage is a {type(storage).__name__}, not a saved storage")
        if not isinstance(a[1], int) or a[1] < 0:
            raise _Invalid(f"tensor storage offset {describe(a[1])} is not a non-negative integer")
        shape, stride = _ints(a[2], "size"), _ints(a[3], "stride")
        if len(shape) != len(stride):
            raise _Invalid(f"size {shape} and stride {stride} differ in length")
        rg = 0 <= requires_grad_at < len(a) and a[requires_grad_at] is True
        if storage is None:
            dt = dtype or (storage_dtype(a[0].value[1]) if _pid_has_type(a[0]) else None)
            return _Tensor(dt or "uint8", shape, stride, None, a[1], rg)
        return _Tensor(dtype or storage.dtype, shape, stride, storage, a[1], rg)

    def numpy_array(self, state: tuple[Any, ...]) -> _Tensor | None:
        if len(state) < 5 or not isinstance(state[4], Blob):
            return None
        dtype = numpy_dtype(state[2])
        try:
            shape = _ints(state[1], "shape")
        except _Invalid:
            return None
        if dtype is None or DTYPES[dtype].nbytes(math.prod(shape)) != state[4].nbytes:
            return None
        blob: Blob = state[4]
        at = blob.offset + (self.blob_base or 0)
        key = f"{LATIN1_KEY}{at}" if blob.kind == LATIN1 else f"pickle bytes at {at}"
        ref = StorageRef(key, dtype, math.prod(shape))
        return _Tensor(dtype, shape, None, ref, blob=blob)

    # -- categories -------------------------------------------------------------------
    def category(self, t: _Tensor, path: _Path, ctx: _Ctx) -> Category:
        if ctx.forced is not None:
            return ctx.forced
        if t.parameter or t.requires_grad:
            return Category.WEIGHTS
        return _by_name(path.key, t.dtype)

    def is_optimizer_state(self, value: object) -> bool:
        """Cached per object: a dict shared under many keys is inspected once."""
        if isinstance(value, Call):
            func = value.func
            if (func.qualname if isinstance(func, Global) else "") not in _MAPPING_CALLS:
                return False  # builds no mapping (a tensor): not cached, there is one per tensor
        elif not isinstance(value, dict):
            return False
        found = self.optimizer_dicts.get(id(value))
        if found is None:
            found = self.optimizer_dicts[id(value)] = _is_optimizer_state(value)
        return found

    def enter(self, ctx: _Ctx, key: object, value: object) -> _Ctx:
        if type(key) is str or type(key) is int:  # not bool or float: True == 1 == 1.0
            facts = self.key_facts.get(key)
            if facts is None:
                facts = _key_facts(str(key).lower())
                if len(self.key_facts) < _MAX_KEY_FACTS:
                    self.key_facts[key] = facts
        else:
            facts = _key_facts(str(key).lower())
        optimizer_key, new, ema = facts
        forced, soft, tags, opt = ctx.forced, ctx.soft, ctx.tags, ctx.optimizer
        if forced is None or soft:
            if optimizer_key or self.is_optimizer_state(value):
                new, opt = Category.OPTIMIZER_STATE, True
            if new is not None:
                forced, soft = new, False
        if ema and "ema" not in tags:
            tags = (*tags, "ema")
        if forced is ctx.forced and soft == ctx.soft and tags is ctx.tags and opt == ctx.optimizer:
            return ctx  # contexts never change once made: most keys share their parent's
        return _Ctx(forced, soft, tags, opt)

    # -- declaring --------------------------------------------------------------------
    def declare(self, t: _Tensor, path: _Path, ctx: _Ctx) -> None:
        name = path.name() or "tensor"
        if t.dtype:
            cat = self.category(t, path, ctx)
            tags = (*ctx.tags, f"subclass={t.subclass}") if t.subclass else ctx.tags
            self.declare_one(t, name, cat, tags, path)
        else:
            # A composite (sparse, nested): every part takes the category of its values.
            values = next((e for k, e in t.extras if k in ("values", "buffer")), None)
            vt = self.tensor(values) if isinstance(values, Call) else None
            cat = self.category(vt, path, ctx) if vt is not None else Category.WEIGHTS
        if not t.extras:
            return
        sub_ctx = _Ctx(cat, False, ctx.tags, ctx.optimizer)
        # A wrapper subclass (torchao's Int8Tensor: no storage of its own) keeps its data in
        # its state: those tensors are parts of this one, of its category and its container.
        wrapper = bool(t.dtype) and t.storage is None
        if wrapper:
            path.top = self.top(path)
        for suffix, extra in reversed(t.extras):
            sub = path.child(suffix) if suffix else path
            self.todo.append((extra, sub, sub_ctx if suffix or wrapper else ctx))

    def declare_storage(self, ref: StorageRef, path: _Path, ctx: _Ctx) -> None:
        """A storage met outside any tensor, declared as a 1-D tensor over all its elements."""
        numel = ref.numel if ref.view_numel is None else ref.view_numel
        t = _Tensor(ref.dtype, (numel,), None, ref)
        self.declare_one(t, path.name() or "storage", self.category(t, path, ctx),
                         (*ctx.tags, "storage"), path)

    def container(self, path: _Path) -> str:
        """The root mapping's key above ``path`` (with its dot) when the tensor lies deeper than
        the root's own values: ``model.`` for ``model.fc1.weight`` in ``{"model": state_dict}``."""
        top = self.top(path)
        return top.key + "." if isinstance(top, _Path) else ""

    def top(self, path: _Path) -> object:
        """The ancestor right under the root mapping that makes ``path``'s container, or None."""
        root = self.root_path
        parent = path.parent
        if root is None or parent is None or path is root or parent is root:
            return None
        # The ancestor right under the root, found once per path node and kept on it.
        chain: list[_Path] = []
        node: _Path | None = parent
        while node is not None and node.top is _UNSET and node.parent is not root:
            chain.append(node)
            node = node.parent
        top = None if node is None else node if node.top is _UNSET else node.top
        if node is not None and node.top is _UNSET:
            node.top = top
        for n in chain:
            n.top = top
        return top

    def declare_one(
        self, t: _Tensor, name: str, cat: Category, tags: tuple[str, ...], path: _Path
    ) -> None:
        ref = t.storage
        self.summary.tensors += 1
        container = self.container(path)
        if ref is None:
            self.builder.add_tensor(name, t.dtype, t.shape, cat, strides=t.stride, tags=tags,
                                    container=container)
            return
        dt = DTYPES.get(t.dtype)
        if dt is None:
            raise _Invalid(f"tensor {name!r} has unknown dtype {t.dtype}")
        if dt.block == 1 and not ref.base and ref.view_numel is None and t.blob is None:
            self.declare_plain(t, dt.block_bytes, ref, name, cat, tags, container)
            return
        shape = t.shape
        n = math.prod(shape)
        base = ref.base * ref.itemsize if ref.base else 0
        if n:
            stride = t.stride
            if stride is None:
                span = n
            else:
                span = 1
                for d, s in zip(shape, stride, strict=False):
                    span += (d - 1) * s
            end = base + dt.nbytes(t.offset) + dt.nbytes(span)
            if end > ref.nbytes:
                raise _past_storage(t, name, end, ref)
        if t.blob is not None:
            if self.blob_base is None:
                # Array bytes we cannot place in the file stay part of the pickle's bytes.
                self.builder.add_tensor(name, t.dtype, t.shape, cat, tags=tags,
                                        container=container)
                return
            if not self.builder.has_storage(ref.key):
                blob = t.blob
                offset = self.blob_base + blob.offset
                # Latin-1 text is "encoded" data: storage_chunks gives slim its bytes.
                self.builder.add_storage(
                    ref.key, offset, blob.stored_nbytes, logical_nbytes=blob.nbytes,
                    compressed=blob.kind == LATIN1, dtype=t.dtype,
                )
                self.summary.blobs.append((offset, blob.stored_nbytes))
                if blob.kind == LATIN1:
                    self.summary.latin1.append((blob.nbytes, blob.stored_nbytes))
        offset = t.offset + base // storage_itemsize(t.dtype)
        self.builder.add_tensor(
            name, t.dtype, t.shape, cat, storage=ref.key, storage_offset=offset,
            strides=t.stride, tags=tags, container=container,
        )

    def declare_plain(self, t: _Tensor, size: int, ref: StorageRef, name: str, cat: Category,
                      tags: tuple[str, ...], container: str) -> None:
        """:meth:`declare_one` of the common tensor: a dtype of whole bytes per element, in a
        storage that is no legacy view, not pickled array bytes (most tensors of a file). The
        same checks and the same record, contiguity found as the span is."""
        shape, stride, offset = t.shape, t.stride, t.offset
        if stride is None:
            n = span = math.prod(shape)
            contiguous = True
        else:  # (strided() checked that they have as many dimensions)
            n, span, contiguous = _layout(shape, stride)
        if n:
            end = (offset + span) * size
            if end > ref.numel * ref.itemsize:
                raise _past_storage(t, name, end, ref)
        self.builder.add_plain_tensor(name, t.dtype, shape, n * size, cat, ref.key, offset * size,
                                      None if contiguous else stride, tags, container)

    def plain_layout(self, shape: object, stride: object) -> tuple[int, int, bool] | None:
        """:func:`_layout` of a tensor's size and stride in the common form (tuples of plain
        ints >= 0, as many of each, at most :data:`MAX_DIMS`), else ``None``. Kept for the very
        tuples checked (the parser makes each distinct short one once: a hit is a check and a
        lookup less a tensor), and by value."""
        found = self.checked.get(id(shape))
        if found is not None and found[0] is shape and found[1] is stride:
            return found[2]
        if (type(shape) is not tuple or type(stride) is not tuple
                or len(shape) != len(stride) or len(shape) > MAX_DIMS
                or not _naturals(shape) or not _naturals(stride)):
            return None
        layout = self.layouts.get((shape, stride))
        if layout is None:
            layout = _layout(shape, stride)
            if len(self.layouts) < _MAX_LAYOUTS:
                self.layouts[(shape, stride)] = layout
        if len(self.checked) < _MAX_CHECKED:
            self.checked[id(shape)] = (shape, stride, layout)  # (they keep the id theirs)
        return layout

    def plain_tensor(self, call: Call, path: _Path, ctx: _Ctx) -> bool:
        """Declare the tensor of a ``_rebuild_tensor_v2`` call in its common form (a storage
        of whole-byte elements that is no legacy view, a storage offset, size and stride
        tuples of plain ints), as :meth:`tensor` and :meth:`declare` would, without the
        :class:`_Tensor` between them; ``False``, declaring nothing, for any other form (the
        general path then takes it, with its checks and messages)."""
        a = call.args
        if type(a) is not tuple or len(a) < 4:
            return False
        ref, offset, shape, stride = a[0], a[1], a[2], a[3]
        if (type(ref) is not StorageRef or ref.base or ref.view_numel is not None
                or type(offset) is not int or offset < 0):
            return False
        layout = self.plain_layout(shape, stride)
        if layout is None:
            return False
        dtype = ref.dtype
        dt = DTYPES.get(dtype)
        if dt is None or dt.block != 1:
            return False
        requires_grad = len(a) > 4 and a[4] is True
        name = path.name() or "tensor"
        cat = ctx.forced
        if cat is None:
            cat = Category.WEIGHTS if requires_grad else _by_name(path.key, dtype)
        self.summary.tensors += 1
        container = self.container(path)
        size = dt.block_bytes
        n, span, contiguous = layout
        if n:
            end = (offset + span) * size
            if end > ref.numel * size:
                raise _past_storage(_Tensor(dtype, shape, stride, ref, offset), name, end, ref)
        self.builder.add_plain_tensor(name, dtype, shape, n * size, cat, ref.key, offset * size,
                                      None if contiguous else stride, ctx.tags, container)
        return True

    # -- walking ----------------------------------------------------------------------
    def walk(self, root: object, prefix: tuple[str, ...] = ()) -> None:
        path = _Path()
        for part in prefix:
            path = path.child(part)
        # A file holding just an optimizer state dict (torch.save(opt.state_dict()), HF's
        # optimizer.pt) is optimizer state from the root down.
        top = _Ctx()
        if _is_mapping(root) and self.module_state_of(root) is None:
            self.root_path = path
        if self.is_optimizer_state(root):
            top = _Ctx(Category.OPTIMIZER_STATE, optimizer=True)
        self.todo = todo = [(root, path, top)]
        seen = self.seen
        tensors = self.tensors
        plain_tensor = self.plain_tensor
        # The runs of a mapping's tensors are plain_tensor's work done in bulk: where it is
        # replaced (a test of the general path), so are they.
        runs = type(self).plain_tensor is _PLAIN_TENSOR
        while todo:
            value, path, ctx = todo.pop()
            if value is None or isinstance(value, _LEAVES):
                continue
            if type(value) is Call and value in tensors:
                if not (ctx.soft and ctx.forced is Category.ACTIVATIONS):
                    # One tensor pickled under a second name through the memo (tied weights):
                    # a second view of the same bytes, so that no key of the file is lost. A
                    # module's plain attribute that refers to a tensor already declared (an
                    # LSTM's ``_flat_weights`` list of its own parameters) is no tensor of its
                    # own: ``state_dict()`` does not list it.
                    t = self.tensor(value)
                    if t is not None:
                        self.declare(t, path, ctx)
                continue
            ident = id(value)
            if ident in seen:
                continue
            if type(value) is StorageRef:
                # A storage saved by itself (torch.save({"s": t.untyped_storage()})): its
                # elements are data, as a 1-D tensor of the storage's dtype.
                seen.add(ident)
                self.declare_storage(value, path, ctx)
                continue
            if isinstance(value, Call):
                # Tensors first, and without a generator: they are most of what is walked (and
                # a tensor is no mapping: it has no optimizer keys). The common one first.
                func = value.func
                if func is self.v2 or (type(func) is Global and func.qualname == _V2):
                    self.v2 = func
                    if plain_tensor(value, path, ctx):
                        tensors.add(value)
                        continue
                t = self.tensor(value)
                if t is not None:
                    tensors.add(value)
                    self.declare(t, path, ctx)
                    continue
            seen.add(ident)
            if ctx.optimizer:
                items = mapping_items(value)
                if items:
                    self.optimizer_keys.update(k for k, _ in items if isinstance(k, str))
            rest = self.mapping_of(value)
            if rest is not None and runs:
                owner: dict[Any, Any] | list[Any] | None = None
                if self.unshared:
                    # Met once, and needed no more: the run lets go of each tensor it declares
                    # (a mapping call's pairs are then the run's own list's alone).
                    owner = value if type(value) is dict else rest if type(rest) is list else None
                    if type(value) is Call:
                        value.args, value.dictitems = (), ()
                rest = self.plain_run(rest, path, ctx, owner)
            children = (list(self.children(value, path, ctx)) if rest is None
                        else self.mapping_children(rest, path, ctx))
            children.reverse()
            # Its leading tensors in the common form are declared here, in order: they are
            # what the loop would take next, and a tensor has nothing under it to walk. (Each
            # is let go of once declared, as the loop lets go of what it took.)
            v2 = self.v2
            while children:
                child, cpath, cctx = children[-1]
                if type(child) is not Call:
                    break
                func = child.func
                if not (func is v2 or (type(func) is Global and func.qualname == _V2)):
                    break
                self.v2 = v2 = func
                if child in tensors or id(child) in seen or not plain_tensor(child, cpath, cctx):
                    break
                tensors.add(child)
                children.pop()
            todo.extend(children)
            del children

    def mapping_of(self, value: object) -> Iterable[tuple[object, object]] | None:
        """The key/value pairs the walk takes as ``value``'s children when it is a mapping (a
        dict's own items view: no list of them is made), else ``None``."""
        if type(value) is dict:
            return value.items()
        if isinstance(value, Call):
            return mapping_items(value) if self.module_state(value) is None else None
        if isinstance(value, dict):
            return mapping_items(value) or []
        return None

    def plain_run(
        self, items: Iterable[tuple[object, object]], path: _Path, ctx: _Ctx,
        owner: dict[Any, Any] | list[Any] | None = None,
    ) -> list[tuple[object, object]]:
        """Declare the leading values of a mapping's ``items`` that are tensors in
        :meth:`plain_tensor`'s common form under a ``str`` key, in order, as the walk would
        declare them one by one (each through :meth:`enter` and :meth:`plain_tensor`, with the
        same checks and the same record), without a path or a context for each (most of what
        a state dict holds); return the items from the first that is not one (their keys as
        the mapping holds them: :meth:`mapping_children` takes them so).

        Where the tree is :attr:`unshared`, each tensor is let go of once declared (its call
        then holds no arguments, and ``owner``, the dict ``items`` views or the list they are,
        holds None in its place): the memory of its call, storage reference and hooks goes to
        the records being made, not to more of the process's.
        """
        it = iter(items)
        path.name()
        depth, text = path.named or (0, "")
        depth += 1
        if depth > MAX_NAME_PARTS or text is None:
            return list(it)  # names cut short: the general path makes them
        container = self.container(_Path(path, ""))  # the same for every key under ``path``
        key_facts, tensors, seen, unshared = (
            self.key_facts, self.tensors, self.seen, self.unshared)
        add, checked, plain_layout = self.builder.add_plain_tensor, self.checked, self.plain_layout
        v2 = self.v2
        ctx_forced, ctx_soft, ctx_tags = ctx.forced, ctx.soft, ctx.tags
        ema_tags = ctx_tags if "ema" in ctx_tags else (*ctx_tags, "ema")
        free = ctx_forced is None or ctx_soft
        weights, optimizer_state = Category.WEIGHTS, Category.OPTIMIZER_STATE
        sizes: dict[str, int] = {}  # dtype -> bytes an element, for dtypes of whole bytes
        owner_dict = owner if type(owner) is dict else None
        owner_list = owner if type(owner) is list else None
        declared = 0
        for pair in it:
            key, value = pair
            if type(key) is not str or type(value) is not Call:
                break
            func = value.func
            if func is not v2:
                if not (type(func) is Global and func.qualname == _V2):
                    break
                v2 = func
            # (a call met once, unshared, is in neither)
            if not unshared and (value in tensors or id(value) in seen):
                break
            # plain_tensor's checks
            a = value.args
            if type(a) is not tuple or len(a) < 4:
                break
            ref, offset, shape, stride = a[0], a[1], a[2], a[3]
            if (type(ref) is not StorageRef or ref.base or ref.view_numel is not None
                    or type(offset) is not int or offset < 0):
                break
            found = checked.get(id(shape))
            if found is not None and found[0] is shape and found[1] is stride:
                n, span, contiguous = found[2]
            else:
                layout = plain_layout(shape, stride)
                if layout is None:
                    break
                n, span, contiguous = layout
            dtype = ref.dtype
            size = sizes.get(dtype)
            if size is None:
                dt = DTYPES.get(dtype)
                if dt is None or dt.block != 1:
                    break
                size = sizes[dtype] = dt.block_bytes
            # enter(ctx, key, value) (a tensor is no optimizer state dict), and the category
            facts = key_facts.get(key)
            if facts is None:
                facts = _key_facts(key.lower())
                if len(key_facts) < _MAX_KEY_FACTS:
                    key_facts[key] = facts
            cat = ctx_forced
            if free:
                if facts[0]:
                    cat = optimizer_state
                elif facts[1] is not None:
                    cat = facts[1]
            if cat is None:
                cat = weights if len(a) > 4 and a[4] is True else _by_name(key, dtype)
            name = (key if depth == 1 else f"{text}.{key}") or "tensor"
            if n:
                end = (offset + span) * size
                if end > ref.numel * size:
                    raise _past_storage(_Tensor(dtype, shape, stride, ref, offset), name, end,
                                        ref)
            add(name, dtype, shape, n * size, cat, ref.key, offset * size,
                None if contiguous else stride, ema_tags if facts[2] else ctx_tags, container)
            if unshared:
                value.args = ()
                if owner_dict is not None:
                    owner_dict[key] = None
                elif owner_list is not None:
                    owner_list[declared] = None
            else:
                tensors.add(value)
            declared += 1
        else:
            pair = None
        self.v2 = v2
        self.summary.tensors += declared
        return [] if pair is None else [pair, *it]

    def children(
        self, value: object, path: _Path, ctx: _Ctx
    ) -> Iterator[tuple[object, _Path, _Ctx]]:
        """What ``value`` holds (a :class:`Call` here builds no tensor: walk() checked)."""
        if isinstance(value, Call):
            module = self.module_state(value)
            if module is not None:
                yield from self.module_children(module, path, ctx)
                return
            items = mapping_items(value)
            if items is not None:
                yield from self.mapping_children(items, path, ctx)
                return
            # Any other object: its arguments, appended items, set items and BUILD state.
            for i, arg in enumerate(value.args):
                yield arg, path.child(str(i)) if len(value.args) > 1 else path, ctx
            yield from ((v, path.child(str(i)), ctx) for i, v in enumerate(value.items))
            yield from self.mapping_children(value.dictitems, path, ctx)
            state = value.state
            if isinstance(state, tuple) and len(state) == 2 and isinstance(state[0], dict):
                state = {**state[0], **(state[1] if isinstance(state[1], dict) else {})}
            state_items = mapping_items(state)
            if state_items is not None:
                yield from self.mapping_children(state_items, path, ctx)
            elif state is not None:
                yield state, path, ctx
        elif isinstance(value, dict):
            yield from self.mapping_children(mapping_items(value) or [], path, ctx)
        elif isinstance(value, (list, tuple, set, frozenset)):
            for i, v in enumerate(value):
                yield v, path.child(str(i)), ctx
        elif isinstance(value, (UnhashableKey, PersistentId)):
            yield value.value, path, ctx

    def mapping_children(
        self, items: Iterable[tuple[object, object]], path: _Path, ctx: _Ctx
    ) -> list[tuple[object, _Path, _Ctx]]:
        """Each value of ``items`` with its path and context, as a list (no generator: a
        state dict's keys are most of what is walked)."""
        enter = self.enter
        out = []
        for k, v in items:
            key = k.value if isinstance(k, UnhashableKey) else k
            out.append((v, _Path(path, key if type(key) is str else _key_text(key)),
                        enter(ctx, key, v)))
        return out

    def module_state_of(self, value: object) -> tuple[str, dict[Any, Any], bool] | None:
        """:meth:`module_state` of any value (``None`` for what is not a rebuild call)."""
        return self.module_state(value) if isinstance(value, Call) else None

    def module_state(self, call: Call) -> tuple[str, dict[Any, Any], bool] | None:
        """(class name, attribute dict, is TorchScript) of a pickled module object, else None.

        TorchScript classes keep their ``__torch__.`` prefix: it is the key of their roles.
        """
        cls = call.func
        if global_name(call.func) == "copyreg._reconstructor" and call.args:
            cls = call.args[0]
        elif call.kind == "reduce":
            return None
        state = call.state
        if isinstance(state, tuple) and state and isinstance(state[0], dict):
            state = state[0]
        if not isinstance(state, dict):
            return None
        cname = global_name(cls)
        if cname.startswith("__torch__."):
            return cname, state, True
        keys = {k for k in state if isinstance(k, str)}
        if "_parameters" in keys and "_modules" in keys:
            return cname or "<unknown>", state, False
        return None

    def module_children(
        self, module: tuple[str, dict[Any, Any], bool], path: _Path, ctx: _Ctx
    ) -> Iterator[tuple[object, _Path, _Ctx]]:
        cname, state, scripted = module
        shown = cname.removeprefix("__torch__.")
        if shown not in self.summary.module_classes:
            self.summary.module_classes.append(shown)
        if ctx.soft:
            ctx = _Ctx(None, False, ctx.tags, ctx.optimizer)
        if scripted:
            yield from self.script_children(cname, state, path, ctx)
            return
        roles = {"_parameters": Category.WEIGHTS, "_buffers": Category.BUFFERS}
        for key, value in state.items():
            if key in roles:
                forced = ctx.forced or roles[key]
                sub = _Ctx(forced, False, ctx.tags, ctx.optimizer)
                for k, v in mapping_items(value) or []:
                    yield v, path.child(_key_text(k)), self.enter(sub, k, v)
            elif key == "_modules":
                for k, v in mapping_items(value) or []:
                    yield v, path.child(_key_text(k)), self.enter(ctx, k, v)
            else:
                sub = ctx if ctx.forced else _Ctx(Category.ACTIVATIONS, True, ctx.tags, False)
                yield value, path.child(_key_text(key)), self.enter(sub, key, value)

    def script_children(
        self, cname: str, state: dict[Any, Any], path: _Path, ctx: _Ctx
    ) -> Iterator[tuple[object, _Path, _Ctx]]:
        """A TorchScript module's attributes: its code says which are parameters and buffers."""
        known = self.script_roles.get(cname)
        for key, value in state.items():
            sub = ctx
            if known is not None and ctx.forced is None:
                if key in known[0]:
                    sub = _Ctx(Category.WEIGHTS, False, ctx.tags)
                elif key in known[1]:
                    sub = _Ctx(Category.BUFFERS, False, ctx.tags)
                else:
                    sub = _Ctx(Category.ACTIVATIONS, True, ctx.tags)
            yield value, path.child(_key_text(key)), self.enter(sub, key, value)

    # -- facts ------------------------------------------------------------------------
    def optimizer_name(self) -> str | None:
        k = self.optimizer_keys
        if not k:
            return None
        if "exp_avg_sq_row" in k or "exp_avg_sq_r" in k:
            return "Adafactor"
        if "exp_avg" in k and "exp_inf" in k:
            return "Adamax"
        if "mu_product" in k:
            return "NAdam"
        if "exp_avg" in k and "exp_avg_sq" in k:
            return "Adam/AdamW (amsgrad)" if "max_exp_avg_sq" in k else "Adam/AdamW"
        if "momentum_buffer" in k:
            return "SGD with momentum"
        if "square_avg" in k:
            return "Adadelta" if "acc_delta" in k else "RMSprop"
        if "prev" in k and "step_size" in k:
            return "Rprop"
        if "ax" in k and "eta" in k:
            return "ASGD"
        if "sum" in k:
            return "Adagrad"
        if "betas" in k:
            return "Adam-like (no state yet)"
        if "momentum" in k and "dampening" in k:
            return "SGD"
        return None


#: The walker's own plain_tensor (see :meth:`_Walker.walk`: its runs are that method's work).
_PLAIN_TENSOR = _Walker.plain_tensor


def _pid_has_type(pid: object) -> bool:
    return (
        isinstance(pid, PersistentId) and isinstance(pid.value, tuple) and len(pid.value) > 1
    )


def _key_text(key: object) -> str:
    """A dict key as a path component (never the ``repr`` of an arbitrary object)."""
    if isinstance(key, (str, int, float, type(None), Global)):
        return str(key)
    if isinstance(key, tuple) and all(isinstance(k, (str, int)) for k in key):
        return ",".join(str(k) for k in key)
    return f"<{type(key).__name__}>"


def classify(
    root: object,
    builder: InventoryBuilder,
    *,
    prefix: tuple[str, ...] = (),
    blob_base: int | None = None,
    script_roles: ScriptRoles | None = None,
    unshared: bool = False,
) -> Summary:
    """Declare every tensor under ``root`` to ``builder`` with its category.

    Tensors whose storage is a :class:`StorageRef` view storages the reader declared. NumPy
    arrays whose data lies inside the pickle (a :class:`Blob`) get a storage declared here at
    file offset ``blob_base + blob.offset`` (listed in :attr:`Summary.blobs`, for the reader to
    cut out of the pickle's region); with ``blob_base=None`` their bytes stay in the pickle.
    ``script_roles`` maps TorchScript class names to their parameter and buffer names (see
    :func:`script_roles`). Nonsense rebuild arguments raise the builder's
    :class:`~modelsize.errors.CorruptFileError`.

    ``unshared`` is the caller's word that no call or container sits at two places in
    ``root`` (:attr:`~modelsize.formats._pickle.PickleScan.shared` is False) and that it needs
    the tree no more: a tensor of a state dict then drops its rebuild arguments once declared
    (they are never read again), and the records being made take their memory (a quarter of
    a pickle's tree of small tensors).
    """
    builder.layout = "pickle"
    walker = _Walker(builder, blob_base, script_roles or {}, unshared)
    try:
        walker.walk(root, prefix)
    except _Invalid as exc:
        raise builder.corrupt(str(exc)) from exc
    walker.summary.optimizer = walker.optimizer_name()
    if walker.summary.latin1:
        data = sum(n for n, _ in walker.summary.latin1)
        stored = sum(n for _, n in walker.summary.latin1)
        count = len(walker.summary.latin1)
        what = "1 NumPy array keeps its" if count == 1 else f"{count} NumPy arrays keep their"
        builder.notes.append(
            f"{what} data as latin-1 text (_codecs.encode: bytes pickled by Python 3 at "
            f"protocol 2): {data:,} bytes stored as {stored:,} bytes of UTF-8"
        )
    if walker.summary.module_classes:
        builder.facts["module_classes"] = ", ".join(walker.summary.module_classes)
    if walker.summary.optimizer:
        builder.facts["optimizer"] = walker.summary.optimizer
    return walker.summary


def storage_dtype(storage_type: object) -> str | None:
    """Canonical dtype of a storage class named in a persistent id (``torch.FloatStorage``)."""
    return _storage_dtype(global_name(storage_type))


@functools.lru_cache(maxsize=256)
def _storage_dtype(name: str) -> str | None:
    if not name.startswith("torch."):
        return None
    bare = name.rsplit(".", 1)[-1]
    if bare in ("UntypedStorage", "TypedStorage", "ByteStorage"):
        return "uint8"
    return canonical(bare) if bare.endswith("Storage") else None


#: Storage key prefix of array data pickled as latin-1 text (see :func:`latin1_chunks`).
LATIN1_KEY = "pickle latin-1 text at "
_LATIN1_CHUNK = 1 << 20


def latin1_chunks(inv: Inventory, storage: StorageRecord) -> Iterator[bytes]:
    """The bytes of a storage pickled as latin-1 text (UTF-8 in the file), a chunk at a time.

    A reader's ``storage_chunks`` for such storages (their key starts with
    :data:`LATIN1_KEY`): slim writes the array's bytes, not the text that encodes them.
    """
    decoder = codecs.getincrementaldecoder("utf-8")("surrogatepass")
    with open(inv.files[storage.file].path, "rb") as fh:
        fh.seek(storage.offset)
        left = storage.nbytes
        while left:
            raw = fh.read(min(left, _LATIN1_CHUNK))
            if not raw:
                raise ValueError(f"storage {storage.key} ends early")
            left -= len(raw)
            yield decoder.decode(raw, final=not left).encode("latin-1")


def torch_storage_chunks(inv: Inventory, storage: StorageRecord) -> Iterator[bytes]:
    """``storage_chunks`` of the torch readers: NumPy arrays pickled as latin-1 text (a
    Trainer's ``rng_state.pth`` holds one), under their key or a merged checkpoint's
    ``label:key``. Any other encoded storage (a deflated zip member) is refused in one line."""
    if storage.key.rsplit(":", 1)[-1].startswith(LATIN1_KEY):
        yield from latin1_chunks(inv, storage)
        return
    from modelsize.errors import UsageError, printable

    raise UsageError(
        f"{printable(str(inv.files[storage.file].path))}: storage {printable(storage.key)} is "
        f"stored compressed in a way modelsize cannot decode ({inv.format}); nothing was written")


def add_pickle_region(
    builder: InventoryBuilder,
    start: int,
    end: int,
    category: Category,
    label: str,
    holes: Sequence[tuple[int, int]] = (),
) -> None:
    """Declare bytes ``start..end`` as ``category``, except the ``(offset, nbytes)`` holes.

    The holes are array data inside the pickle, declared as storages of their own.
    """
    pos = start
    for offset, nbytes in sorted(h for h in holes if start <= h[0] < end):
        builder.add_region(pos, offset - pos, category, label)
        pos = offset + nbytes
    builder.add_region(pos, end - pos, category, label)


def describe(obj: object) -> str:
    """A short, safe description of a parsed value for an error message."""
    if isinstance(obj, (str, int, bytes, type(None))):
        return repr(obj)[:80]
    if isinstance(obj, Global):
        return str(obj)[:80]
    return f"a {type(obj).__name__}"


_SCRIPT_CLASS = re.compile(r"^class (\w+)\(Module\):$")
_SCRIPT_LIST = re.compile(r"^  __(parameters|buffers)__ = \[(.*)\]$")


def script_roles(module: str, source: str) -> ScriptRoles:
    """Parameter and buffer names of the classes in one TorchScript ``code/`` file.

    TorchScript flattens modules into plain attributes; its generated source keeps the roles
    (``__parameters__ = ["weight", "bias", ]``). The text is matched, never executed.
    """
    roles: ScriptRoles = {}
    current = None
    found: dict[str, frozenset[str]] = {}
    for line in source.splitlines():
        head = _SCRIPT_CLASS.match(line)
        if head is not None:
            current = f"{module}.{head.group(1)}"
            found = {}
            continue
        entry = _SCRIPT_LIST.match(line) if current else None
        if entry is not None and current is not None:
            found[entry.group(1)] = frozenset(re.findall(r'"([^"]*)"', entry.group(2)))
            if len(found) == 2:
                roles[current] = (found["parameters"], found["buffers"])
    return roles


def place_python2_array(data: Data, obj: Call, build_end: int) -> None:
    """A ``BUILD`` hook for :func:`~modelsize.formats._pickle.scan`: the data of a Python 2
    NumPy array is a ``str`` (the parser decodes it); give it its place in ``data`` instead, a
    :class:`Blob`, so that the array is itemized like a Python 3 one. Returns ``None`` (the
    hook's "nothing to skip")."""
    state = obj.state
    if (
        isinstance(state, tuple) and len(state) == 5 and type(state[4]) is str
        and global_name(obj.func).endswith("multiarray._reconstruct")
    ):
        blob = _python2_array_data(data, build_end, state[4])
        if blob is not None:
            obj.state = (*state[:4], blob)


def _python2_array_data(data: Data, build_end: int, raw: str) -> Blob | None:
    """Where the ``str`` data of a Python 2 array lies, from the opcodes that end its BUILD.

    Python 2 pickles ``ndarray.__reduce__``'s state as ``MARK ... <data> [PUT] TUPLE [PUT]
    BUILD``, the data a ``BINSTRING``/``SHORT_BINSTRING`` of the raw bytes: the few layouts
    that end at ``build_end`` are tried, and one is taken only where the string's header
    holds its length and its first and last bytes are the parsed string's.
    """
    n = len(raw)
    if build_end < 2 or data[build_end - 1] != ord("b"):
        return None
    for tuple_end in _before_put(data, build_end - 1):
        if tuple_end < 1 or data[tuple_end - 1] != ord("t"):
            continue
        for end in _before_put(data, tuple_end - 1):
            start = end - n
            if start >= 5 and data[start - 5] == ord("T"):
                header_ok = int.from_bytes(data[start - 4 : start], "little") == n
            elif start >= 2 and data[start - 2] == ord("U"):
                header_ok = data[start - 1] == n
            else:
                continue
            probe = min(n, 64)
            if (
                header_ok
                and bytes(data[start : start + probe]) == raw[:probe].encode("latin-1")
                and bytes(data[end - probe : end]) == raw[n - probe :].encode("latin-1")
            ):
                return Blob(start, n)
    return None


def _before_put(data: Data, end: int) -> list[int]:
    """``end``, and where a ``BINPUT``/``LONG_BINPUT`` that could end at ``end`` starts."""
    found = [end]
    if end >= 2 and data[end - 2] == ord("q"):
        found.append(end - 2)
    if end >= 5 and data[end - 5] == ord("r"):
        found.append(end - 5)
    return found
