"""A pickle virtual machine that parses and never loads.

:func:`scan` runs the opcodes of one pickle (protocols 0-5) and builds the object tree out of
placeholders: a reference to ``module.name`` becomes a :class:`Global` (nothing is imported), a
call becomes a :class:`Call` (nothing is called), a persistent id a :class:`PersistentId`, a
bytes payload a :class:`Blob` (its place in the data, not a copy of it). Dicts, lists, tuples
and sets are real Python containers of those placeholders.

While it parses, the machine judges every callable the real unpickler would import and call:
anything not on a short allowlist of known-safe rebuild functions is *unsafe*
(``posix.system``, ``builtins.eval``, ``__main__.Net``). Loading such a file runs that code.

Every length is checked against the data before slicing, and the memo, the stack, the opcode
count, ``LONG`` sizes and the nesting of hashed values are bounded: malformed input ends in one
:class:`PickleError` naming the opcode and offset, never in a ``RecursionError`` or a hang.

Where the optional extension ``modelsize._pickleops`` is built (``_pickleops.c``), it runs the
opcodes this machine runs inline (memo, ints, MARK, tuples, strings, persistent ids, calls of
the rebuild functions, dicts, lists) on the machine's own state, and stops before any opcode it
does not take on: a rare one, one that fails, one whose call must be judged. This loop runs
that one and hands back. So the extension repeats only success paths, and every error,
judgement and limit stays here; the results are the same either way, to the offsets and the
messages (``tests/formats/test_pickle_compiled.py`` runs every pickle it has both ways). The
pickle of a 100,000-tensor checkpoint parses in 0.44 s instead of 3.0 s with it (the collector
paused, as the torch reader runs it); the whole inspect of that file takes 1.5x less.
``MODELSIZE_PURE_PYTHON=1`` leaves it unused.

What the tree does not need is not kept: a memo entry the pickle never reads back is stored
as None (the extension finds which ones it reads before the parse: ``torch.save`` memoizes
every persistent id and its key, read by nothing once replaced), a tuple of tuples short and
flat enough gets no depth record, equal short tuples of ints are one object (every tensor's
size and stride), and the pages of a mapped file read past are given back. A pickle of
100,000 small tensors keeps 28 MB less at the end of its parse; the values are the same
(``tests/formats/test_pickle_lean.py``).
"""

from __future__ import annotations

import codecs
import mmap
import struct
from _compat_pickle import IMPORT_MAPPING, NAME_MAPPING
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, TypeAlias

from modelsize._extensions import compiled
from modelsize._records import record

#: The compiled loop's module; ``None``: the Python loop runs every opcode (the same results).
_ops = compiled("_pickleops")

if TYPE_CHECKING:
    from modelsize.formats._limits import ParseBudget

#: What the parser reads from: bytes in memory or a memory-mapped file.
Data: TypeAlias = "bytes | bytearray | memoryview | mmap.mmap"

#: Tuples, frozensets and persistent ids nested deeper than this are refused: hashing them
#: recurses in C, where Python's recursion limit does not protect the stack.
MAX_DEPTH = 100
#: Ceilings on work and memory that no real checkpoint pickle comes near.
MAX_OPS = 48 << 20  # 50,331,648: whole blocks
MAX_MEMO = 10_000_000
MAX_STACK = 10_000_000
MAX_LONG_BYTES = 1 << 16
MAX_HASH_COST = 256
MAX_LINE = 1 << 26
HIGHEST_PROTOCOL = 5
#: Opcodes run between checks of the ceilings and the budget.
_BLOCK = 1 << 20
#: How many inline opcodes' time one opcode run by a method costs (measured: ~6x).
_SLOW_WEIGHT = 5
#: Strings longer than this are made only if the budget's memory allows them.
_BIG_TEXT = 16 << 20


class PickleError(ValueError):
    """A malformed pickle. ``offset`` is where parsing stopped; ``unsafe`` what it found before."""

    def __init__(
        self, message: str, offset: int, unsafe: Iterable[str] = (), globals: Iterable[str] = ()
    ) -> None:
        super().__init__(message)
        self.offset = offset
        self.unsafe = list(unsafe)
        self.globals = list(globals)


# The placeholders are plain slotted classes, not dataclasses: defining a dataclass costs about
# a millisecond of every inspect (they are made at import, inspect imports this module), and
# a frozen dataclass is slow to make. Never changed once made, except what BUILD, APPEND(S)
# and SETITEM(S) add to a Call.


class Global:
    """A ``module.name`` reference (``GLOBAL``, ``STACK_GLOBAL``, ``INST``); never imported.

    ``qualname`` is ``module.name``, computed once: it is compared on every call judged.
    Equal (and hashed) by module and name.
    """

    __slots__ = ("module", "name", "qualname")

    def __init__(self, module: str, name: str) -> None:
        self.module = module
        self.name = name
        self.qualname = f"{module}.{name}"

    def __eq__(self, other: object) -> bool:
        if type(other) is not Global:
            return NotImplemented
        return self.module == other.module and self.name == other.name

    def __hash__(self) -> int:
        return hash((self.module, self.name))

    def __repr__(self) -> str:
        return f"Global(module={self.module!r}, name={self.name!r})"

    def __str__(self) -> str:
        return self.qualname


class Call:
    """What ``REDUCE``, ``NEWOBJ``, ``NEWOBJ_EX``, ``OBJ`` or ``INST`` would have built.

    ``state`` is what ``BUILD`` passed; ``items`` and ``dictitems`` collect ``APPEND(S)`` and
    ``SETITEM(S)`` applied to the object. ``kind`` names the opcode family (``reduce``,
    ``newobj``, ``obj``, ``inst``). Calls compare and hash by identity, like the objects they
    stand for.

    ``items``, ``dictitems`` and ``kwargs`` start as shared empty tuples and mapping (a
    checkpoint has two calls per tensor, which almost never get any: three empty containers
    each were a fifth of the memory a pickle of 100,000 tensors took); the parser gives a call
    lists of its own when it adds to them.
    """

    __slots__ = ("args", "dictitems", "func", "items", "kind", "kwargs", "state")

    def __init__(
        self,
        func: object,
        args: tuple[Any, ...],
        state: object = None,
        kind: str = "reduce",
    ) -> None:
        self.func = func
        self.args = args
        self.state = state
        self.items: list[object] | tuple[()] = ()
        self.dictitems: list[tuple[object, object]] | tuple[()] = ()
        self.kind = kind
        self.kwargs: Mapping[Any, Any] = _NO_KWARGS

    def __repr__(self) -> str:
        return (f"Call(func={self.func!r}, args={self.args!r}, state={self.state!r}, "
                f"kind={self.kind!r})")


_NO_KWARGS: Mapping[Any, Any] = MappingProxyType({})


class PersistentId:
    """A ``PERSID``/``BINPERSID`` payload, left for the caller to interpret (equal by value)."""

    __slots__ = ("value",)

    def __init__(self, value: object) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        if type(other) is not PersistentId:
            return NotImplemented
        return bool(self.value == other.value)

    def __hash__(self) -> int:
        return hash(self.value)

    def __repr__(self) -> str:
        return f"PersistentId(value={self.value!r})"


#: :attr:`Blob.kind` of bytes pickled as ``_codecs.encode(<text>, 'latin1')``.
LATIN1 = "latin1"


class Blob:
    """A bytes payload (``BINBYTES``, ``BYTEARRAY8``...): where it lies in the data, not a copy.

    Keeping offsets instead of bytes keeps tensor data out of memory and lets readers account
    for it exactly. :meth:`read` fetches the bytes when a caller really needs them.

    Python 3 pickles ``bytes`` at protocols 0-2 as ``_codecs.encode(<text>, 'latin1')``, the
    text one code point per byte; at protocols 1-2 a ``BINUNICODE`` string, UTF-8 in the data.
    Such a call is parsed (never run) into a blob of kind :data:`LATIN1`: ``nbytes`` is the
    bytes the call returns, ``stored_nbytes`` the UTF-8 bytes it occupies (up to twice as many).
    """

    __slots__ = ("kind", "nbytes", "offset", "stored_nbytes")

    def __init__(
        self, offset: int, nbytes: int, kind: str = "bytes", stored_nbytes: int = -1
    ) -> None:
        self.offset = offset
        self.nbytes = nbytes
        self.kind = kind
        #: Bytes the payload occupies in the data: ``nbytes`` but for ``latin1`` text (UTF-8).
        self.stored_nbytes = nbytes if stored_nbytes < 0 else stored_nbytes

    def _key(self) -> tuple[int, int, str, int]:
        return (self.offset, self.nbytes, self.kind, self.stored_nbytes)

    def __eq__(self, other: object) -> bool:
        if type(other) is not Blob:
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return (f"Blob(offset={self.offset}, nbytes={self.nbytes}, kind={self.kind!r}, "
                f"stored_nbytes={self.stored_nbytes})")

    def read(self, data: Data) -> bytes:
        """The payload's bytes from the data the pickle was scanned in."""
        raw = bytes(memoryview(data)[self.offset : self.offset + self.stored_nbytes])
        if self.kind == LATIN1:
            return raw.decode("utf-8", "surrogatepass").encode("latin-1")
        return raw


class UnhashableKey:
    """Stands in for a dict key or set item that cannot be hashed (a list, a dict...)."""

    __slots__ = ("value",)

    def __init__(self, value: object) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"UnhashableKey(value={self.value!r})"


@record
class PickleScan:
    """The result of scanning one pickle.

    ``value`` is the unpickled placeholder tree, ``end`` the offset just after ``STOP``,
    ``globals`` every referenced global (first-seen order), ``unsafe`` the names of the
    callables that loading would import and call and that are not known to be safe.
    """

    value: object
    end: int
    globals: list[Global]
    unsafe: list[str]
    start: int = 0
    protocol: int = 0
    error: str | None = None
    fails: str = ""
    """Where a load of this pickle must fail, if the parse saw it: the first ``REDUCE`` of
    something never callable (``"byte 2082: REDUCE calls a dict"``); ``""`` if none."""
    shared: bool = True
    """Whether something other than a string, a number, a global or a blob may sit at two
    places in ``value`` (the pickle read one back from its memo, or duplicated it). False
    promises that every container and call of the tree is met once, but tuples of ints (the
    parser makes equal ones once) and what ``persistent_load`` returned (that is the
    caller's)."""


#: ``on_build(obj, offset) -> (new offset, replacement) | None``: see :func:`scan`.
BuildHook = Callable[[Call, int], "tuple[int, object] | None"]


# -- what is safe to call -------------------------------------------------------------------

_TORCH_REBUILD = frozenset(
    f"torch._utils.{n}"
    for n in (
        "_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_parameter",
        "_rebuild_parameter_with_state", "_rebuild_qtensor", "_rebuild_sparse_tensor",
        "_rebuild_sparse_csr_tensor", "_rebuild_nested_tensor",
        "_rebuild_meta_tensor_no_storage", "_rebuild_wrapper_subclass",
        "_rebuild_device_tensor_from_numpy", "_rebuild_device_tensor_from_cpu_tensor",
    )
)
#: Builtin types and helpers that only convert their arguments. Their direct arguments must
#: not be globals: ``set(SomeClass)`` iterates a class, which can run its metaclass's code.
_CONVERTERS = frozenset(
    {
        "builtins.set", "builtins.frozenset", "builtins.list", "builtins.tuple",
        "builtins.dict", "builtins.bytes", "builtins.bytearray", "builtins.int",
        "builtins.float", "builtins.bool", "builtins.str", "builtins.complex",
        "builtins.slice", "builtins.range", "collections.OrderedDict", "collections.Counter",
        "collections.deque", "_codecs.encode", "torch.Size", "torch.device",
    }
)
_NUMPY = frozenset(
    f"numpy.{core}.{n}"
    for core in ("core.multiarray", "_core.multiarray", "core.numeric", "_core.numeric")
    for n in ("_reconstruct", "scalar", "_frombuffer")
) | {"numpy.dtype", "numpy.ndarray"}
#: Callables a torch checkpoint, a NumPy pickle or a TorchScript archive legitimately calls.
SAFE_CALLS: frozenset[str] = (
    _TORCH_REBUILD
    | _CONVERTERS
    | _NUMPY
    | {
        "torch._tensor._rebuild_from_type_v2",
        "torch.serialization._get_layout",
        "torch.nn.parameter.Parameter",
        "torch.Tensor",
        "copyreg._reconstructor",
        "builtins.object",
        "torch.jit._pickle.build_intlist",
        "torch.jit._pickle.build_tensorlist",
        "torch.jit._pickle.build_doublelist",
        "torch.jit._pickle.build_boollist",
        "torch.jit._pickle.build_tensor_from_id",
        "torch.jit._pickle.restore_type_tag",
        # joblib's placeholder for an array whose bytes follow it in the file.
        "joblib.numpy_pickle.NumpyArrayWrapper",
        # torch 0.3/0.4 module pickles: a function whose body is `pass` in today's torch
        # (kept for old pickles only), and the pre-0.4 tensor wrapper.
        "torch.nn.backends.thnn._get_thnn_function_backend",
        "torch.autograd.variable.Variable",
    }
)
_TENSOR_TYPES = frozenset(
    {
        "torch.Tensor", "torch.nn.parameter.Parameter", "torch.nn.parameter.Buffer",
        "torch.nn.parameter.UninitializedParameter", "torch.nn.parameter.UninitializedBuffer",
    }
)


def is_module_class(ref: Global) -> bool:
    """A ``torch.nn`` layer class (``torch.nn.modules.linear.Linear``), safe to instantiate.

    Unpickling creates it with ``__new__`` and fills it through ``Module.__setstate__``: no
    constructor of a user's class runs.
    """
    return (
        ref.module.startswith("torch.nn.modules.")
        and ref.name.isidentifier()
        and ref.name[:1].isupper()
    )


def is_safe_class(ref: Global) -> bool:
    """Whether instantiating ``ref`` (``NEWOBJ``, ``_reconstructor``) runs only known code."""
    name = ref.qualname
    return is_module_class(ref) or name in _TENSOR_TYPES or (
        name in SAFE_CALLS and name not in _TORCH_REBUILD
    )


# -- the machine ----------------------------------------------------------------------------

_U16 = struct.Struct("<H").unpack_from
_I32 = struct.Struct("<i").unpack_from
_U32 = struct.Struct("<I").unpack_from
_U64 = struct.Struct("<Q").unpack_from
_F64 = struct.Struct(">d").unpack_from


#: ``madvise`` advice that unmaps pages (a file's come back from the page cache), if any.
_DONTNEED: int | None = getattr(mmap, "MADV_DONTNEED", None)


class _Stop(Exception):
    pass


class _Fail(Exception):
    """Raised inside an opcode; the loop turns it into a :class:`PickleError` naming the opcode.

    Only the loop knows where the current opcode started, so handlers need not record it.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _name(obj: object) -> str:
    if isinstance(obj, Global):
        return obj.qualname
    if isinstance(obj, Call):
        return f"<object returned by {_name(obj.func)}>"
    if isinstance(obj, PersistentId):
        return "<persistent object>"
    return f"<{type(obj).__name__}>"


def _dynamic(obj: object) -> str:
    return f"<{obj}>" if isinstance(obj, Global) else _name(obj)


_OBJECT = Global("builtins", "object")
_NDARRAY = Global("numpy", "ndarray")


class _Machine:
    def __init__(
        self,
        data: Data,
        offset: int,
        persistent_load: Callable[[object], object] | None,
        on_build: BuildHook | None = None,
        end: int | None = None,
        budget: ParseBudget | None = None,
    ) -> None:
        self.on_build = on_build
        if isinstance(data, memoryview):
            data = data.tobytes()
        self.data = data
        self.view = memoryview(data)
        self.size = len(data) if end is None else min(end, len(data))
        self.pos = offset
        #: Where the pages of a mapped file the parse has read past end (see release_read).
        self.released = offset - offset % mmap.PAGESIZE
        self.budget = budget
        #: Opcodes run by a method call (slower than the inline ones): weighed in the budget.
        self.slow = 0
        #: Tensors and arrays met (persistent ids, bytes payloads): what a budget grows with.
        self.found = 0
        self.persistent_load = persistent_load
        #: The compiled loop (``modelsize._pickleops.run``), where it was built.
        self.fast = _ops.run if _ops is not None else None
        self.stack: list[Any] = []
        self.metastack: list[list[Any]] = []
        # The memo: pickle writes its indices 0, 1, 2... in order, so they are a list (8 bytes
        # an entry where a dict took about 60: torch.save memoizes 8 values a tensor); an index
        # put out of that order (only a hand-made pickle) goes to ``far``, whose keys are always
        # past the list's end. Distinct indices: ``len(memo) + len(far)``.
        self.memo: list[Any] = []
        self.far: dict[int, Any] = {}
        #: ``keep[i]``: whether the pickle ever reads memo entry ``i`` (``_ops.memo_reads``);
        #: the list holds None for the others, so that what only the memo would hold (the
        #: persistent id of every tensor) is let go of. ``None``: every entry is kept (no
        #: compiled module, a pickle that reads its memo by ``GET``, or a BUILD hook, which may
        #: skip bytes the opcodes are read from).
        self.keep: bytes | None = (
            _ops.memo_reads(data, self.size, offset) if _ops is not None and on_build is None
            else None
        )
        self.proto = 0
        self.globals: dict[Global, None] = {}
        self.unsafe: dict[str, None] = {}
        #: The first call of something never callable (see :attr:`PickleScan.fails`).
        self.fails = ""
        # id -> (depth, hash cost, obj) for nested hashable values; keeping the object keeps
        # its id unique.
        self.depths: dict[int, tuple[int, int, object]] = {}
        #: The short tuples of ints made so far (see share).
        self.tuples: dict[tuple[int, ...], tuple[int, ...]] = {}
        #: A memo entry was stored over or out of order (see put); DUP ran.
        self.irregular = self.duplicated = False

    # -- helpers -----------------------------------------------------------------------
    def error(self, reason: str, op: int, name: str) -> PickleError:
        """The error for a failure in the opcode ``name`` that starts at ``op``."""
        where = f"{name} at offset {op}" if name else f"offset {op}"
        return PickleError(
            f"{reason} ({where})", op, self.unsafe, (str(g) for g in self.globals)
        )

    def short(self, n: int) -> _Fail:
        """The failure of a read of ``n`` bytes at the current position."""
        return _Fail(f"needs {n} bytes but only {max(0, self.size - self.pos)} remain in the data")

    def read(self, n: int) -> memoryview:
        pos = self.pos
        end = pos + n
        if n < 0 or end > self.size:
            raise self.short(n)
        self.pos = end
        return self.view[pos:end]

    def read_byte(self) -> int:
        pos = self.pos
        if pos >= self.size:
            raise self.short(1)
        self.pos = pos + 1
        return self.data[pos]

    def read_u32(self) -> int:
        pos = self.pos
        if pos + 4 > self.size:
            raise self.short(4)
        self.pos = pos + 4
        value: int = _U32(self.data, pos)[0]
        return value

    def read_i32(self) -> int:
        pos = self.pos
        if pos + 4 > self.size:
            raise self.short(4)
        self.pos = pos + 4
        value: int = _I32(self.data, pos)[0]
        return value

    def read_u64(self) -> int:
        pos = self.pos
        if pos + 8 > self.size:
            raise self.short(8)
        self.pos = pos + 8
        value: int = _U64(self.data, pos)[0]
        return value

    def readline(self) -> bytes:
        stop = min(self.size, self.pos + MAX_LINE)
        nl = self.data.find(b"\n", self.pos, stop)
        if nl < 0:
            raise _Fail("line argument has no end of line")
        line = bytes(self.view[self.pos : nl])
        self.pos = nl + 1
        return line

    def pop(self) -> Any:
        if not self.stack:
            raise _Fail("stack underflow")
        return self.stack.pop()

    def top(self) -> Any:
        if not self.stack:
            raise _Fail("stack underflow")
        return self.stack[-1]

    def pop_mark(self) -> list[Any]:
        if not self.metastack:
            raise _Fail("no MARK to return to")
        items = self.stack
        self.stack = self.metastack.pop()
        return items

    def nested(self, obj: Any, children: Iterable[object]) -> Any:
        """Record the depth and hashing cost of a tuple, frozenset or persistent id.

        The cost saturates at ``MAX_HASH_COST + 1``: only whether it exceeds
        :data:`MAX_HASH_COST` matters, and saturating at the end or along the way agrees on it.
        A flat tuple (none of its items a tuple, frozenset or persistent id: a tensor's size)
        is not recorded, nor a shallow one (at most :data:`_SHALLOW` items, its nested ones
        all flat tuples: a tensor's rebuild arguments), so that the records do not keep every
        such tuple alive: :func:`_unrecorded` works out their depth and cost from their items.
        """
        depth = cost = 1
        shallow = type(obj) is tuple and len(obj) <= _SHALLOW
        depths = self.depths
        for c in children:
            cost += 1
            if type(c) in _HASHED_NESTED:
                entry = depths.get(id(c))
                if entry is not None and entry[2] is c:
                    if entry[0] >= depth:
                        depth = entry[0] + 1
                    cost += entry[1]
                    shallow = False
                elif type(c) is tuple and c:  # flat or shallow (``()`` as it always was)
                    d, k = _unrecorded(c)
                    if d >= depth:
                        depth = d + 1
                    cost += k
                    if d > 1:
                        shallow = False
        if depth > MAX_DEPTH:
            raise _Fail(f"values nested more than {MAX_DEPTH} levels deep")
        if type(obj) is not tuple or not obj or depth > 2 or (depth == 2 and not shallow):
            depths[id(obj)] = (depth, cost if cost <= MAX_HASH_COST else MAX_HASH_COST + 1, obj)
        return obj

    def share(self, t: tuple[Any, ...]) -> tuple[Any, ...]:
        """The tuple of plain ints equal to ``t`` made before, if any, else ``t`` (kept for the
        next, up to :data:`_MAX_SHARED` of them): the sizes and strides of a checkpoint's
        tensors are a few tuples, not two a tensor. A tuple's identity is nothing a load
        could see (it is immutable, and no placeholder compares or hashes by it)."""
        if not 0 < len(t) <= _SHARED_LEN:
            return t
        for x in t:
            if type(x) is not int:
                return t
        tuples = self.tuples
        found = tuples.get(t)
        if found is not None:
            return found
        if len(tuples) < _MAX_SHARED:
            tuples[t] = t
        return t

    def key(self, obj: object) -> object:
        """``obj`` as a dict key or set item; a stand-in if hashing is impossible or costly.

        Tuples do not cache their hash: a big tuple used as a key a million times would make
        the parse quadratic, so keys that cost more than :data:`MAX_HASH_COST` to hash are
        wrapped (compared by identity) instead.
        """
        t = type(obj)
        if t is str or t is int:
            return obj
        if t in _HASHED_NESTED:
            entry = self.depths.get(id(obj))
            if entry is not None and entry[2] is obj:
                if entry[1] > MAX_HASH_COST:
                    return UnhashableKey(obj)
            elif type(obj) is tuple and obj and _unrecorded(obj)[1] > MAX_HASH_COST:
                return UnhashableKey(obj)
        try:
            hash(obj)
        except TypeError:
            return UnhashableKey(obj)
        return obj

    def text(self, raw: memoryview | bytes, encoding: str, errors: str = "strict") -> str:
        try:
            return str(raw, encoding, errors)
        except (UnicodeDecodeError, ValueError) as exc:
            raise _Fail(f"undecodable text ({exc})") from exc

    def flag(self, name: str) -> None:
        self.unsafe.setdefault(name, None)

    def make_global(self, module: str, name: str) -> Global:
        if self.proto < 3:
            if (module, name) in NAME_MAPPING:
                module, name = NAME_MAPPING[(module, name)]
            elif module in IMPORT_MAPPING:
                module = IMPORT_MAPPING[module]
        ref = Global(module, name)
        self.globals.setdefault(ref, None)
        return ref

    # -- the safety judgement --------------------------------------------------------
    def judge_class(self, cls: object) -> None:
        if isinstance(cls, Global):
            if not is_safe_class(cls):
                self.flag(cls.qualname)
        else:
            self.judge_call(cls, ())

    def judge_call(self, func: object, args: object) -> None:
        """Record ``func`` as unsafe unless calling it with ``args`` is known to be harmless."""
        if not isinstance(func, Global):
            if isinstance(func, PersistentId):
                value = func.value
                if isinstance(value, tuple) and len(value) > 1 and isinstance(value[1], Global):
                    self.judge_class(value[1])
                else:
                    self.flag(_name(func))
            elif isinstance(func, Call) and _name(func.func) not in self.unsafe:
                self.flag(_name(func))
            return  # else calling a str or an int fails on load: nothing runs
        name = func.qualname
        if name not in SAFE_CALLS:
            self.flag(name)
            return
        if name in _PLAIN_CALLS:
            return  # their arguments are data: nothing more to judge
        argv = args if isinstance(args, tuple) else ()
        if name in _CONVERTERS:
            for a in argv:
                if isinstance(a, Global):
                    self.flag(a.qualname)
        elif name == "copyreg._reconstructor" and argv:
            self.judge_class(argv[0])
            if len(argv) > 1 and argv[1] != _OBJECT:
                self.judge_class(argv[1])
        elif name == "torch._tensor._rebuild_from_type_v2" and len(argv) > 2:
            self.judge_call(argv[0], argv[2])
            self.judge_tensor_type(argv[1])
        elif name == "torch._utils._rebuild_wrapper_subclass" and argv:
            self.judge_tensor_type(argv[0])
        elif name.endswith("._reconstruct") and argv and argv[0] != _NDARRAY:
            self.judge_class(argv[0])

    def judge_tensor_type(self, cls: object) -> None:
        if not (isinstance(cls, Global) and cls.qualname in _TENSOR_TYPES):
            self.flag(_name(cls))

    # -- the loop ----------------------------------------------------------------------
    def run(self) -> object:
        """Run the opcodes up to ``STOP``; return the value it leaves on the stack.

        The opcodes ``torch.save`` and ``pickle.dump`` emit most (memo, small ints, tuples,
        strings, calls) are handled inline, on local variables: a call per opcode would be
        most of the time ``inspect`` spends on a checkpoint. The others are ``op_<name>``
        methods, which read and write ``self.pos`` and ``self.stack``: the loop hands its
        locals over before one runs and takes them back after.
        """
        data, size, view = self.data, self.size, self.view
        table = [getattr(self, f"op_{n.lower()}", None) if n else None for n in _NAMES]
        memo, far, metastack = self.memo, self.far, self.metastack
        memo_put, memo_far = self.put, self.memo_far
        nested, judge_call, set_items, extend, share = (
            self.nested, self.judge_call, self.set_items, self.extend, self.share
        )
        persistent_load, keep = self.persistent_load, self.keep
        stack = self.stack
        texts: tuple[_Text | None, _Text | None] = (None, None)
        pos = op = self.pos
        fast, depths, tuples, idle = self.fast, self.depths, self.tuples, 1
        # Each opcode pushes at most one item, MARKs or memoizes at most once: the ceilings on
        # the stack, the MARKs and the memo (and the budget) are checked once per block of
        # opcodes, and can be passed by at most a block.
        try:
            # The ranges count the opcodes (MAX_OPS in all) at no cost per opcode.
            for block in range(MAX_OPS // _BLOCK):
                if block:
                    self.pos, self.stack = pos, stack
                    self.after_block(block * _BLOCK)
                left = _BLOCK
                while left:
                    if fast is not None:
                        # The compiled loop runs what it can; it stops before any opcode it
                        # leaves to this loop (rare ones, failures, judgements).
                        pos, stack, ran, found, texts, exc = fast(
                            data, size, pos, left, stack, metastack, memo, far, depths, texts,
                            persistent_load, keep, tuples)
                        self.found += found
                        if exc is not None:  # raised by persistent_load at ``pos``
                            op = pos
                            raise exc
                        left -= ran
                        if not left:
                            break
                        # One opcode here, or more while the compiled loop makes no progress.
                        idle = 1 if ran else min(2 * idle, 64)
                        chunk = min(left, idle)
                    else:
                        chunk = left
                    left -= chunk
                    for _ in range(chunk):
                        op = pos
                        if op >= size:
                            raise self.error("data ends before the pickle's STOP opcode", op, "")
                        c = data[op]
                        pos = op + 1
                        # Most frequent first (torch.save's protocol 2, then protocol 4's).
                        if c == 0x72:  # LONG_BINPUT
                            if pos + 4 > size:
                                self.pos = pos
                                raise self.short(4)
                            if not stack:
                                raise _Fail("stack underflow")
                            idx = _U32(data, pos)[0]
                            if idx == len(memo) and not far:
                                memo.append(
                                    stack[-1] if keep is None or (idx < len(keep) and keep[idx])
                                    else None)
                            else:
                                memo_put(idx, stack[-1])
                            pos += 4
                        elif c == 0x68:  # BINGET
                            if pos >= size:
                                self.pos = pos
                                raise self.short(1)
                            idx = data[pos]
                            pos += 1
                            stack.append(memo[idx] if idx < len(memo) else memo_far(idx))
                        elif c == 0x4B:  # BININT1
                            if pos >= size:
                                self.pos = pos
                                raise self.short(1)
                            stack.append(data[pos])
                            pos += 1
                        elif c == 0x28:  # MARK
                            metastack.append(stack)
                            stack = []
                        elif c == 0x52:  # REDUCE
                            if len(stack) < 2:
                                raise _Fail("stack underflow")
                            args = stack.pop()
                            func = stack.pop()
                            # Safe callables whose arguments need no judging (the rebuild
                            # functions; any safe one called with no arguments) skip the judge.
                            if type(func) is not Global or not (
                                func.qualname in _PLAIN_CALLS
                                or (args == () and func.qualname in SAFE_CALLS)
                            ):
                                if type(func) in _NOT_CALLABLE and not self.fails:
                                    kind = "bytes" if type(func) is Blob else type(func).__name__
                                    self.fails = f"byte {op}: REDUCE calls a {kind}"
                                judge_call(func, args)
                                # bytes at protocols 1-2: where the text lies, not a call.
                                blob = (
                                    _latin1_blob(args, texts)
                                    if type(func) is Global and func.qualname == "_codecs.encode"
                                    else None
                                )
                            elif args == () and func.qualname == "builtins.bytes":
                                blob = Blob(op, 0)  # b"" at protocols 0-2 (an empty array's data)
                            else:
                                blob = None
                            stack.append(
                                blob if blob is not None else Call(
                                    func, args if type(args) is tuple else self.args_tuple(args)
                                )
                            )
                        elif c == 0x74:  # TUPLE
                            if not metastack:
                                raise _Fail("no MARK to return to")
                            items = stack
                            stack = metastack.pop()
                            stack.append(share(nested(tuple(items), items)))
                        elif c == 0x4D:  # BININT2
                            if pos + 2 > size:
                                self.pos = pos
                                raise self.short(2)
                            stack.append(_U16(data, pos)[0])
                            pos += 2
                        elif c == 0x29:  # EMPTY_TUPLE
                            stack.append(())
                        elif c == 0x58 or c == 0x8C:  # BINUNICODE, SHORT_BINUNICODE
                            width = 4 if c == 0x58 else 1
                            if pos + width > size:
                                self.pos = pos
                                raise self.short(width)
                            n = _U32(data, pos)[0] if width == 4 else data[pos]
                            pos += width
                            end = pos + n
                            if end > size:
                                self.pos = pos
                                raise self.short(n)
                            try:
                                text = str(view[pos:end], "utf-8", "surrogatepass")
                            except (UnicodeDecodeError, ValueError) as exc:
                                raise _Fail(f"undecodable text ({exc})") from exc
                            stack.append(text)
                            # The last two strings' places: bytes pickled as latin-1 text.
                            texts = (texts[1], (text, pos, end))
                            pos = end
                        elif c == 0x89:  # NEWFALSE
                            stack.append(False)
                        elif c == 0x51:  # BINPERSID
                            if not stack:
                                raise _Fail("stack underflow")
                            self.found += 1
                            pid = stack.pop()
                            stack.append(
                                persistent_load(pid) if persistent_load is not None
                                else nested(PersistentId(pid), [pid])
                            )
                        elif c == 0x85:  # TUPLE1
                            if not stack:
                                raise _Fail("stack underflow")
                            first = stack[-1]
                            t: tuple[Any, ...] = (first,)
                            if type(first) in _HASHED_NESTED:
                                stack[-1] = nested(t, t)
                            else:  # flat: nested() records nothing for it
                                stack[-1] = share(t) if type(first) is int else t
                        elif c == 0x86:  # TUPLE2
                            if len(stack) < 2:
                                raise _Fail("stack underflow")
                            first, second = stack[-2], stack[-1]
                            t = (first, second)
                            del stack[-1]
                            if type(first) in _HASHED_NESTED or type(second) in _HASHED_NESTED:
                                stack[-1] = nested(t, t)
                            else:
                                stack[-1] = share(t) if type(first) is int else t
                        elif c == 0x71:  # BINPUT
                            if pos >= size:
                                self.pos = pos
                                raise self.short(1)
                            if not stack:
                                self.pos = pos + 1
                                raise _Fail("stack underflow")
                            idx = data[pos]
                            if idx == len(memo) and not far:
                                memo.append(
                                    stack[-1] if keep is None or (idx < len(keep) and keep[idx])
                                    else None)
                            else:
                                memo_put(idx, stack[-1])
                            pos += 1
                        elif c == 0x94:  # MEMOIZE
                            if not stack:
                                raise _Fail("stack underflow")
                            memo_put(len(memo) + len(far), stack[-1])
                        elif c == 0x6A:  # LONG_BINGET
                            if pos + 4 > size:
                                self.pos = pos
                                raise self.short(4)
                            idx = _U32(data, pos)[0]
                            pos += 4
                            stack.append(memo[idx] if idx < len(memo) else memo_far(idx))
                        elif c == 0x7D:  # EMPTY_DICT
                            stack.append({})
                        elif c == 0x75:  # SETITEMS
                            if not metastack:
                                raise _Fail("no MARK to return to")
                            items = stack
                            stack = metastack.pop()
                            if not stack:
                                raise _Fail("stack underflow")
                            set_items(stack[-1], items)
                        elif c == 0x73:  # SETITEM
                            if len(stack) < 3:
                                # Two pops, then the target: the same checks in the same order.
                                raise _Fail("stack underflow")
                            value = stack.pop()
                            key = stack.pop()
                            set_items(stack[-1], [key, value])
                        elif c == 0x4A:  # BININT
                            if pos + 4 > size:
                                self.pos = pos
                                raise self.short(4)
                            stack.append(_I32(data, pos)[0])
                            pos += 4
                        elif c == 0x5D:  # EMPTY_LIST
                            stack.append([])
                        elif c == 0x65:  # APPENDS
                            if not metastack:
                                raise _Fail("no MARK to return to")
                            items = stack
                            stack = metastack.pop()
                            if not stack:
                                raise _Fail("stack underflow")
                            extend(stack[-1], items)
                        elif c == 0x61:  # APPEND
                            if not stack:
                                raise _Fail("stack underflow")
                            value = stack.pop()
                            if not stack:
                                raise _Fail("stack underflow")
                            extend(stack[-1], [value])
                        elif c == 0x4E:  # NONE
                            stack.append(None)
                        elif c == 0x88:  # NEWTRUE
                            stack.append(True)
                        elif c == 0x87:  # TUPLE3
                            if len(stack) < 3:
                                raise _Fail("stack underflow")
                            t = (stack[-3], stack[-2], stack[-1])
                            del stack[-2:]
                            stack[-1] = share(nested(t, t))
                        elif c == 0x2E:  # STOP
                            if not stack:
                                raise _Fail("STOP with an empty stack")
                            self.pos, self.stack = pos, stack
                            return stack.pop()
                        else:
                            handler = table[c]
                            if handler is None:
                                raise self.error(f"unknown opcode {bytes([c])!r}", op, "")
                            self.pos, self.stack = pos, stack
                            self.slow += 1
                            handler()
                            pos, stack = self.pos, self.stack
            if pos >= size:
                raise self.error("data ends before the pickle's STOP opcode", pos, "")
            if not _NAMES[data[pos]]:
                raise self.error(f"unknown opcode {bytes([data[pos]])!r}", pos, "")
            op = pos
            raise self.error(f"more than {MAX_OPS:,} opcodes", op, _NAMES[data[op]])
        except _Fail as exc:
            raise self.error(exc.reason, op, _NAMES[data[op]]) from exc.__cause__
        except (struct.error, OverflowError, MemoryError, RecursionError) as exc:
            raise self.error(f"{type(exc).__name__}: {exc}", op, _NAMES[data[op]]) from exc

    def after_block(self, ops: int) -> None:
        """After a block of opcodes: the ceilings, and the budget of the parse if it has one."""
        self.check_ceilings()
        if self.budget is not None:
            self.budget.check(ops + _SLOW_WEIGHT * self.slow, self.found)
        self.release_read()

    def release_read(self) -> None:
        """Give back the pages of a mapped file that the parse has read past: they count to the
        process's memory as long as they are mapped (10 MB of a pickle of 100,000 tensors, at
        the end of the parse, when its tree is largest). Read again (a blob's bytes), a page
        comes back from the page cache."""
        data = self.data
        upto = self.pos - self.pos % mmap.PAGESIZE
        if type(data) is mmap.mmap and upto > self.released and _DONTNEED is not None:
            try:
                data.madvise(_DONTNEED, self.released, upto - self.released)
            except (OSError, ValueError):
                return  # only memory is at stake
            self.released = upto

    def check_ceilings(self) -> None:
        """The ceilings on the stack, the MARKs and the memo."""
        if len(self.stack) > MAX_STACK:
            raise _Fail(f"more than {MAX_STACK} items on the stack")
        if len(self.metastack) > MAX_STACK:
            raise _Fail("too many MARKs")
        if len(self.memo) + len(self.far) > MAX_MEMO:
            raise _Fail(f"more than {MAX_MEMO} memo entries")

    # -- opcodes -----------------------------------------------------------------------
    # The rarer ones (the frequent ones are inline in :meth:`run`).
    def op_proto(self) -> None:
        proto = self.read_byte()
        if proto > HIGHEST_PROTOCOL:
            raise _Fail(f"unsupported pickle protocol {proto}")
        self.proto = proto

    def op_frame(self) -> None:
        n = self.read_u64()
        if self.pos + n > self.size:
            raise _Fail(f"frame of {n} bytes runs past the end of the data")

    def op_pop(self) -> None:
        if self.stack:
            self.stack.pop()
        else:
            self.pop_mark()

    def op_pop_mark(self) -> None:
        self.pop_mark()

    def op_dup(self) -> None:
        self.stack.append(self.top())
        self.duplicated = True

    # constants and numbers
    def op_int(self) -> None:
        line = self.readline()
        if line == b"00":
            self.stack.append(False)
        elif line == b"01":
            self.stack.append(True)
        else:
            self.stack.append(self.parse_int(line))

    def parse_int(self, line: bytes) -> int:
        if len(line) > 4000:
            raise _Fail("integer literal longer than 4000 digits")
        try:
            return int(line.rstrip(b"L"), 0 if line[:2] in (b"0x", b"0o") else 10)
        except ValueError as exc:
            raise _Fail(f"bad integer literal {line[:40]!r}") from exc

    def op_long(self) -> None:
        self.stack.append(self.parse_int(self.readline()))

    def op_long1(self) -> None:
        n = self.read_byte()
        self.stack.append(int.from_bytes(self.read(n), "little", signed=True))

    def op_long4(self) -> None:
        n = self.read_i32()
        if n < 0 or n > MAX_LONG_BYTES:
            raise _Fail(f"LONG4 of {n} bytes (at most {MAX_LONG_BYTES} accepted)")
        self.stack.append(int.from_bytes(self.read(n), "little", signed=True))

    def op_float(self) -> None:
        line = self.readline()
        try:
            self.stack.append(float(line))
        except ValueError as exc:
            raise _Fail(f"bad float literal {line[:40]!r}") from exc

    def op_binfloat(self) -> None:
        self.stack.append(_F64(self.read(8))[0])

    # strings and bytes
    def op_string(self) -> None:
        line = self.readline().rstrip(b"\r")
        if len(line) < 2 or line[:1] != line[-1:] or line[:1] not in (b"'", b'"'):
            raise _Fail("STRING argument is not quoted")
        try:
            raw = codecs.escape_decode(line[1:-1])[0]
        except ValueError as exc:
            raise _Fail(f"bad STRING escape ({exc})") from exc
        self.stack.append(raw.decode("latin-1"))

    def op_binstring(self) -> None:
        n = self.read_i32()
        self.reserve(n)
        self.stack.append(self.text(self.read(n), "latin-1"))

    def op_short_binstring(self) -> None:
        n = self.read_byte()
        self.stack.append(self.text(self.read(n), "latin-1"))

    def op_unicode(self) -> None:
        self.stack.append(self.text(self.readline(), "raw-unicode-escape"))

    def op_binunicode8(self) -> None:
        n = self.read_u64()
        self.reserve(n)
        self.stack.append(self.text(self.read(n), "utf-8", "surrogatepass"))

    def reserve(self, n: int) -> None:
        """Before a string of ``n`` bytes is made: whether the budget's memory allows it."""
        if self.budget is not None and n > _BIG_TEXT:
            self.budget.check(0, self.found, more=n)

    def blob(self, n: int, kind: str = "bytes") -> None:
        offset = self.pos
        self.read(n)
        self.found += 1
        self.stack.append(Blob(offset, n, kind))

    def op_binbytes(self) -> None:
        self.blob(self.read_u32())

    def op_short_binbytes(self) -> None:
        self.blob(self.read_byte())

    def op_binbytes8(self) -> None:
        self.blob(self.read_u64())

    def op_bytearray8(self) -> None:
        self.blob(self.read_u64(), "bytearray")

    def op_next_buffer(self) -> None:
        raise _Fail("out-of-band buffers (protocol 5) cannot be read from a file")

    op_readonly_buffer = op_next_buffer

    # containers
    def op_empty_set(self) -> None:
        self.stack.append(set())

    def op_list(self) -> None:
        items = self.pop_mark()
        self.stack.append(items)

    def op_dict(self) -> None:
        items = self.pop_mark()
        if len(items) % 2:
            raise _Fail("odd number of items for DICT")
        key = self.key
        self.stack.append({key(items[i]): items[i + 1] for i in range(0, len(items), 2)})

    def op_frozenset(self) -> None:
        items = [self.key(x) for x in self.pop_mark()]
        self.stack.append(self.nested(frozenset(items), items))

    def extend(self, target: object, items: list[Any]) -> None:
        if isinstance(target, list):
            target.extend(items)
        elif isinstance(target, Call):
            if isinstance(target.items, list):
                target.items.extend(items)
            else:
                target.items = list(items)
        else:
            raise _Fail(f"cannot append to a {type(target).__name__}")

    def set_items(self, target: object, items: list[Any]) -> None:
        if len(items) % 2:
            raise _Fail("odd number of items for SETITEMS")
        if isinstance(target, dict):
            key = self.key
            for i in range(0, len(items), 2):
                k = items[i]
                # str and int keys hash cheaply and never fail: no need for key().
                target[k if type(k) is str or type(k) is int else key(k)] = items[i + 1]
        elif isinstance(target, Call):
            pairs = [(items[i], items[i + 1]) for i in range(0, len(items), 2)]
            if isinstance(target.dictitems, list):
                target.dictitems.extend(pairs)
            else:
                target.dictitems = pairs
        else:
            raise _Fail(f"cannot set items on a {type(target).__name__}")

    def op_additems(self) -> None:
        items = self.pop_mark()
        target = self.top()
        if isinstance(target, set):
            target.update(self.key(x) for x in items)
        elif isinstance(target, Call):
            self.extend(target, items)
        else:
            raise _Fail(f"cannot add items to a {type(target).__name__}")

    # memo
    def put(self, idx: int, value: object) -> None:
        """Memoize ``value`` at ``idx``: in the list where the index is in it or next, else in
        ``far`` (an index the list then reaches leaves ``far``; a negative one, which only the
        text opcodes can write, stays there)."""
        memo = self.memo
        n = len(memo)
        keep = self.keep
        if 0 <= idx <= n and keep is not None and not (idx < len(keep) and keep[idx]):
            value = None  # never read: see ``keep``
        if 0 <= idx < n:
            memo[idx] = value
            self.irregular = True
        elif idx == n:
            memo.append(value)
            far = self.far
            if far:
                far.pop(n, None)
                while n + 1 in far:  # indices put ahead of order join the list
                    n += 1
                    memo.append(far.pop(n))
        else:
            self.far[idx] = value
            self.irregular = True

    def may_share(self) -> bool:
        """:attr:`PickleScan.shared` of the parse that ran: an object can sit at two places
        only if DUP copied it or the memo handed it out again: then it is an entry the parse
        kept (see ``keep``), unless the memo was written out of order or over."""
        keep = self.keep
        if keep is None or self.irregular or self.duplicated:
            return True
        memo = self.memo
        i = keep.find(1)
        while 0 <= i < len(memo):
            if type(memo[i]) not in _ATOMS:
                return True
            i = keep.find(1, i + 1)
        return False

    def memo_far(self, idx: int) -> object:
        """The memo entry at ``idx``, past the list's end."""
        try:
            return self.far[idx]
        except KeyError:
            raise _Fail(f"memo entry {idx} was never stored") from None

    def memo_put(self, idx: int) -> None:
        if not self.stack:
            raise _Fail("stack underflow")
        self.put(idx, self.stack[-1])

    def memo_get(self, idx: int) -> None:
        memo = self.memo
        self.stack.append(memo[idx] if 0 <= idx < len(memo) else self.memo_far(idx))

    def op_put(self) -> None:
        self.memo_put(self.parse_int(self.readline()))

    def op_get(self) -> None:
        self.memo_get(self.parse_int(self.readline()))

    # globals and calls
    def line_name(self) -> str:
        return self.text(self.readline(), "utf-8")

    def op_global(self) -> None:
        module = self.line_name()
        name = self.line_name()
        self.stack.append(self.make_global(module, name))

    def op_stack_global(self) -> None:
        name, module = self.pop(), self.pop()
        if not isinstance(module, str) or not isinstance(name, str):
            # Only a tampered pickle computes a global's name from other objects: the result
            # cannot be known without running it (e.g. after BUILD rewrote a module).
            ref = Global(
                module if isinstance(module, str) else _dynamic(module),
                name if isinstance(name, str) else _dynamic(name),
            )
            self.globals.setdefault(ref, None)
            self.flag(ref.qualname)
            self.stack.append(ref)
            return
        self.stack.append(self.make_global(module, name))

    def ext(self, code: int) -> None:
        ref = Global("copyreg-ext", str(code))
        self.globals.setdefault(ref, None)
        self.flag(ref.qualname)
        self.stack.append(ref)

    def op_ext1(self) -> None:
        self.ext(self.read_byte())

    def op_ext2(self) -> None:
        pos = self.pos
        if pos + 2 > self.size:
            raise self.short(2)
        self.pos = pos + 2
        self.ext(_U16(self.data, pos)[0])

    def op_ext4(self) -> None:
        self.ext(self.read_i32())

    def args_tuple(self, args: object) -> tuple[Any, ...]:
        if isinstance(args, tuple):
            return args
        if isinstance(args, list):
            return tuple(args)
        raise _Fail(f"call arguments are a {type(args).__name__}, not a tuple")

    def op_newobj(self) -> None:
        args = self.pop()
        cls = self.pop()
        self.judge_class(cls)
        self.stack.append(Call(cls, self.args_tuple(args), kind="newobj"))

    def op_newobj_ex(self) -> None:
        kwargs = self.pop()
        args = self.pop()
        cls = self.pop()
        self.judge_class(cls)
        call = Call(cls, self.args_tuple(args), kind="newobj")
        if isinstance(kwargs, dict):
            call.kwargs = kwargs
        self.stack.append(call)

    def op_obj(self) -> None:
        items = self.pop_mark()
        if not items:
            raise _Fail("OBJ without a class")
        cls, args = items[0], tuple(items[1:])
        self.judge_call(cls, args)
        self.stack.append(Call(cls, args, kind="obj"))

    def op_inst(self) -> None:
        module = self.line_name()
        name = self.line_name()
        cls = self.make_global(module, name)
        args = tuple(self.pop_mark())
        self.judge_call(cls, args)
        self.stack.append(Call(cls, args, kind="inst"))

    def op_build(self) -> None:
        state = self.pop()
        target = self.top()
        if isinstance(target, Call):
            target.state = state
            if self.on_build is not None:
                self.after_build(self.on_build, target)
        elif isinstance(target, Global):
            # BUILD on a module or class sets its attributes: loading rewrites code.
            self.flag(target.qualname)
        elif isinstance(target, PersistentId):
            self.flag(_name(target))

    def after_build(self, hook: BuildHook, target: Call) -> None:
        found = hook(target, self.pos)
        if found is None:
            return
        pos, replacement = found
        if not self.pos <= pos <= self.size:
            raise _Fail(f"data after BUILD claims to end at {pos}, past the data")
        self.pos = pos
        self.stack[-1] = replacement

    def op_persid(self) -> None:
        pid = self.text(self.readline(), "ascii")
        self.stack.append(self.persistent(pid))

    def persistent(self, pid: object) -> object:
        if self.persistent_load is not None:
            return self.persistent_load(pid)
        return self.nested(PersistentId(pid), [pid])


#: A string parsed from the data and where its UTF-8 bytes lie: (text, start, end).
_Text: TypeAlias = "tuple[str, int, int]"
_LATIN1_NAMES = frozenset({"latin1", "latin-1", "latin_1", "iso-8859-1", "iso8859-1", "l1"})


def _latin1_blob(args: object, texts: tuple[_Text | None, _Text | None]) -> Blob | None:
    """``_codecs.encode(text, 'latin1')`` as the :class:`Blob` it returns, if ``text`` is one
    of the last two strings parsed (where Python's pickler puts it) and encodes to latin-1."""
    if not (
        type(args) is tuple and len(args) == 2 and type(args[1]) is str
        and args[1].lower() in _LATIN1_NAMES
    ):
        return None
    for found in texts:
        if found is not None and found[0] is args[0]:
            text, start, end = found
            # Code points above 255 make the real call fail: no bytes come of it.
            if text and max(text) > "\xff":
                return None
            return Blob(start, len(text), LATIN1, end - start)
    return None


#: What a pickle builds that is never callable: a load that calls one fails (TypeError).
_NOT_CALLABLE = frozenset({str, bytes, bytearray, int, float, complex, bool, type(None), tuple,
                           list, dict, set, frozenset, Blob})
#: Values that hold nothing: one met at two places of a tree is no shared container.
_ATOMS = frozenset({str, int, float, bool, complex, bytes, type(None), Global, Blob})
#: Types whose hash recurses into their contents (their nesting depth is tracked).
_HASHED_NESTED = frozenset({tuple, frozenset, PersistentId})
#: Items of a tuple left unrecorded though it holds tuples (see :meth:`_Machine.nested`).
_SHALLOW = 8
#: Tuples of ints of at most this many items are made once (see :meth:`_Machine.share`), up to
#: :data:`_MAX_SHARED` distinct ones a pickle.
_SHARED_LEN = 8
_MAX_SHARED = 4096


def _unrecorded(t: tuple[Any, ...]) -> tuple[int, int]:
    """Depth and hashing cost of a non-empty tuple that has no depth record.

    It is flat (depth 1, cost its length plus one), or shallow: at most :data:`_SHALLOW` items,
    among them non-empty tuples, all flat (else it would have been recorded); then its depth is
    2 and its cost what :meth:`_Machine.nested` adds up for it.
    """
    n = len(t)
    depth, cost = 1, n + 1
    if n <= _SHALLOW:
        for x in t:
            if type(x) is tuple and x:
                depth = 2
                cost += len(x) + 1
    return depth, cost


#: Safe callables with no argument that needs judging (see :meth:`_Machine.judge_call`).
_PLAIN_CALLS = SAFE_CALLS - _CONVERTERS - {
    "copyreg._reconstructor", "torch._tensor._rebuild_from_type_v2",
    "torch._utils._rebuild_wrapper_subclass",
} - {n for n in SAFE_CALLS if n.endswith("._reconstruct")}
if _ops is not None:
    _ops.setup(Global, Call, PersistentId, _PLAIN_CALLS, SAFE_CALLS, MAX_DEPTH, MAX_HASH_COST,
               Call(None, ()))

_OPCODES: dict[bytes, str] = {
    b"\x80": "PROTO", b"\x95": "FRAME", b".": "STOP", b"(": "MARK", b"0": "POP",
    b"1": "POP_MARK", b"2": "DUP", b"N": "NONE", b"\x88": "NEWTRUE", b"\x89": "NEWFALSE",
    b"I": "INT", b"L": "LONG", b"J": "BININT", b"K": "BININT1", b"M": "BININT2",
    b"\x8a": "LONG1", b"\x8b": "LONG4", b"F": "FLOAT", b"G": "BINFLOAT", b"S": "STRING",
    b"T": "BINSTRING", b"U": "SHORT_BINSTRING", b"V": "UNICODE", b"X": "BINUNICODE",
    b"\x8c": "SHORT_BINUNICODE", b"\x8d": "BINUNICODE8", b"B": "BINBYTES",
    b"C": "SHORT_BINBYTES", b"\x8e": "BINBYTES8", b"\x96": "BYTEARRAY8",
    b"\x97": "NEXT_BUFFER", b"\x98": "READONLY_BUFFER", b"]": "EMPTY_LIST", b"}": "EMPTY_DICT",
    b"\x8f": "EMPTY_SET", b")": "EMPTY_TUPLE", b"t": "TUPLE", b"\x85": "TUPLE1",
    b"\x86": "TUPLE2", b"\x87": "TUPLE3", b"l": "LIST", b"d": "DICT", b"\x91": "FROZENSET",
    b"a": "APPEND", b"e": "APPENDS", b"s": "SETITEM", b"u": "SETITEMS", b"\x90": "ADDITEMS",
    b"p": "PUT", b"q": "BINPUT", b"r": "LONG_BINPUT", b"\x94": "MEMOIZE", b"g": "GET",
    b"h": "BINGET", b"j": "LONG_BINGET", b"c": "GLOBAL", b"\x93": "STACK_GLOBAL",
    b"\x82": "EXT1", b"\x83": "EXT2", b"\x84": "EXT4", b"R": "REDUCE", b"\x81": "NEWOBJ",
    b"\x92": "NEWOBJ_EX", b"o": "OBJ", b"i": "INST", b"b": "BUILD", b"P": "PERSID",
    b"Q": "BINPERSID",
}
#: Opcode name by byte ("" for bytes that are no opcode); the handler is ``op_<name>``.
_NAMES: list[str] = [""] * 256
for _code, _name_of in _OPCODES.items():
    _NAMES[_code[0]] = _name_of


def scan(
    data: Data,
    *,
    offset: int = 0,
    persistent_load: Callable[[object], object] | None = None,
    on_build: BuildHook | None = None,
    end: int | None = None,
    budget: ParseBudget | None = None,
) -> PickleScan:
    """Parse the pickle starting at ``offset`` without importing or calling anything.

    ``persistent_load``, if given, turns each persistent id into the object pushed in its place
    (it may raise to refuse one); without it, a :class:`PersistentId` is pushed. ``on_build``
    sees every ``BUILD`` of a :class:`Call` with the offset after it; returning
    ``(new offset, replacement)`` skips data a custom unpickler reads inline (joblib writes
    array bytes right after its wrapper object) and replaces the object on the stack. Raises
    :class:`PickleError` on malformed input (its ``unsafe`` lists what was judged unsafe
    before the error: a hostile pickle may break itself after its payload ran).

    The pickle lies in ``data[offset:end]`` (``end``: the end of the data if not given;
    offsets in the result are ``data``'s). ``budget`` bounds the parse's work and memory by
    what it finds (:class:`~modelsize.formats._limits.ParseBudget`: a refusal naming the limit
    when it is spent).
    """
    m = _Machine(data, offset, persistent_load, on_build, end, budget)
    value = m.run()
    return PickleScan(
        value=value, end=m.pos, globals=list(m.globals), unsafe=list(m.unsafe),
        start=offset, protocol=m.proto, fails=m.fails, shared=m.may_share(),
    )


#: First bytes that can start a pickle: PROTO, or the opcodes protocol 0/1 pickles open with.
_PROTO0_STARTS = frozenset(b"(]}).NIJKLMFGSTUVXcl")


def looks_like_pickle(data: Data, offset: int = 0, end: int | None = None) -> bool:
    """Whether a pickle plausibly starts at ``offset`` (cheap check on the first bytes)."""
    size = len(data) if end is None else end
    if offset >= size:
        return False
    first = data[offset]
    if first == 0x80:
        return offset + 1 < size and 2 <= data[offset + 1] <= HIGHEST_PROTOCOL
    return first in _PROTO0_STARTS


def scan_all(
    data: Data, *, offset: int = 0, on_build: BuildHook | None = None, end: int | None = None,
    budget: ParseBudget | None = None,
) -> list[PickleScan]:
    """Scan consecutive pickles until the end of the data or bytes that are no pickle.

    Attackers hide a second pickle after the first ``STOP``; a loader that calls ``load``
    twice runs it. The first pickle must parse (else :class:`PickleError`). A later one that
    breaks off is kept only if it named unsafe callables before breaking (with ``error`` set
    and ``end`` where parsing stopped); otherwise scanning stops before it.
    """
    scans = [scan(data, offset=offset, on_build=on_build, end=end, budget=budget)]
    pos = scans[0].end
    while looks_like_pickle(data, pos, end):
        try:
            scans.append(scan(data, offset=pos, on_build=on_build, end=end, budget=budget))
        except PickleError as exc:
            if exc.unsafe:
                scans.append(
                    PickleScan(
                        value=None, end=max(exc.offset, pos + 1), globals=[],
                        unsafe=exc.unsafe, start=pos, error=str(exc),
                    )
                )
            break
        pos = scans[-1].end
    return scans
