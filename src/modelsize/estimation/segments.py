"""Record one module call of a trace, and replay it later without dispatching an op.

A *segment* is one call of a module under the counting mode (a decode step's forward, one
decoder layer). :class:`Recorder` turns a call that ran for real into a :class:`Segment`: a
*structure* (everything that must be equal for another call to be replayed from it) and a
list of *numbers* (sizes, which another call may have different values of):

* every tick: its op, the bytes live after it (relative to the call's start), the kernel's
  scratch;
* every storage the call allocates: its size, the tick it is freed at (or that it outlives
  the call), its origin, module and flags;
* what the call leaves behind: the output's tensors, and the state object's (the cache's)
  new tensors and counters, with the tick at which each is put there (a real ``torch.cat``
  frees the old tensor at the tick it makes the new one);
* what it was given: the inputs' and the state's shapes before the call.

A call is refused as a template (``Segment.refused``) where the record would not capture
what it did: a storage it made is kept elsewhere than the output and the state, it freed a
storage the state's updates do not explain, it changed a module's attributes, or a storage
it allocated was sized after the fact.

:func:`replay` runs another call from a segment's plan and numbers: the counting mode
advances through the ticks, appending the same allocation records a real call would; the
tensors the call leaves behind are made as fake tensors of the recorded shapes over new
storages (no op dispatched), put where the call put them, at the tick it put them there; the
output is rebuilt around them. The bytes live at the end must be those recorded, or
:class:`Mismatch` is raised.

For a repeated block the state's paths carry the block's index (``cache.layers[5].keys``): a
segment recorded with ``index`` stores them with that index abstracted (and the module names
under ``prefix``), so that a segment of layer 5 can be replayed as layer 6.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from modelsize.estimation.tracker import Allocation, CountingFakeMode

#: Walks into nested inputs and state objects stop this deep.
_DEPTH = 6

Path = tuple[Any, ...]
_CACHE = ("cache",)  # the state object met again inside the inputs
_INT = ("int",)  # a scalar of the plan whose value is one of the numbers
_IDX = ("index",)  # the block's index in a normalized path
_MISSING = ("missing",)  # a state path that did not exist before the call
_HERE = "\0"  # the block's module name in a normalized module name


class Mismatch(Exception):
    """A replayed call did not end as its record says (the caller traces again)."""


class Refused(Exception):
    """A call cannot be replayed from its record (the reason is the message)."""


def allocations_of_call(mode: CountingFakeMode, first: int, t0: int,
                        t1: int) -> list[Allocation]:
    """The allocations a call made (``mode.allocations[first:]``), each within its ticks
    ``(t0, t1]`` in order, of the current phase and on the device; :class:`Refused` else."""
    phase = len(mode.phases) - 1
    internal = mode.allocations[first:]
    last = t0
    for r in internal:
        if not t0 < r.created <= t1 or r.created < last or r.phase != phase or r.host:
            raise Refused("an allocation outside the call's ticks")
        last = r.created
    return internal


@dataclass
class Plan:
    """What a replay needs besides the numbers (the structure, in usable form)."""

    ops: tuple[Any, ...]
    allocs: tuple[tuple[Any, ...], ...]  # (created, freed, origin, module, flags, materialized)
    scratch_ticks: tuple[int, ...]
    scratch_parts: tuple[int, ...]  # number of parts per scratch tick (0: none recorded)
    storages: tuple[tuple[int, tuple[tuple[torch.dtype, torch.device, int], ...]], ...]
    """Per storage the call leaves behind: its allocation index and its views."""
    assigns: tuple[tuple[int, Path, int, int], ...]  # (tick, state path, storage, view)
    scalars: tuple[tuple[Path, Any], ...]  # state path -> value (_INT: one of the numbers)
    output: tuple[Any, ...]
    extras: tuple[tuple[str, str, Any], ...]  # ("routed" | "read", module, value)
    ticks: int


@dataclass
class Segment:
    """One call: its structure (equal from call to call) and its numbers."""

    pre_shape: tuple[Any, ...]
    pre: list[int]
    shape: tuple[Any, ...]
    body: list[int]
    refused: str = ""
    """Empty when the call can be replayed from this record, else why not."""
    plan: Plan | None = None

    def same_as(self, other: Segment) -> bool:
        """Same structure and numbers (a block repeated exactly)."""
        return (not self.refused and self.pre_shape == other.pre_shape
                and self.shape == other.shape and self.pre == other.pre
                and self.body == other.body)


# -- walking inputs and state -----------------------------------------------------------------


class _TensorLeaf:
    """A tensor of the state as a call began, held weakly (a strong reference would keep its
    storage alive past the tick a real run frees it)."""

    __slots__ = ("key", "numbers", "rec", "ref", "shape")

    def __init__(self, t: torch.Tensor, mode: CountingFakeMode) -> None:
        self.ref = weakref.ref(t)
        self.rec = mode.allocation_of(t) if isinstance(t, FakeTensor) else None
        self.key = t.untyped_storage()._cdata if t.layout is torch.strided else None
        self.numbers, self.shape = tensor_meta(t)

    def __call__(self) -> torch.Tensor | None:
        return self.ref()


class _Opaque:
    """An object the walk does not enter: compared by type (structure) and identity (state)."""

    __slots__ = ("ident", "kind")

    def __init__(self, obj: Any) -> None:
        self.kind = f"{type(obj).__module__}.{type(obj).__qualname__}"
        self.ident = id(obj)


def _enterable(obj: Any) -> bool:
    module = type(obj).__module__ or ""
    return hasattr(obj, "__dict__") and module.startswith("transformers")


def walk(obj: Any, path: Path, out: list[tuple[Path, Any]], state: Any = None,
         depth: int = 0) -> None:
    """``(path, leaf)`` for every tensor, scalar and opaque object under ``obj``
    (``state``, met inside it, is a leaf of its own)."""
    if isinstance(obj, torch.Tensor):
        out.append((path, obj))
    elif state is not None and obj is state and path:
        out.append((path, _CACHE))
    elif obj is None or isinstance(obj, (bool, int, float, str, torch.dtype, torch.device)):
        out.append((path, obj))
    elif depth >= _DEPTH:
        out.append((path, _Opaque(obj)))
    elif isinstance(obj, Mapping):
        out.append((path, ("map", type(obj), len(obj))))
        for k, v in obj.items():
            walk(v, (*path, ("k", k)), out, state, depth + 1)
    elif isinstance(obj, (list, tuple)):
        out.append((path, ("seq", type(obj), len(obj))))
        for i, v in enumerate(obj):
            walk(v, (*path, ("i", i)), out, state, depth + 1)
    elif _enterable(obj):
        out.append((path, ("obj", type(obj))))
        for k, v in vars(obj).items():
            walk(v, (*path, ("a", k)), out, state, depth + 1)
    else:
        out.append((path, _Opaque(obj)))


def _first_index(path: Path) -> Any:
    """The first list index or dict key on ``path`` (a block's slot in the state), or None."""
    return next((key for kind, key in path if kind in ("i", "k")), None)


def normalize(path: Path, index: int | None) -> Path:
    """``path`` with its first index replaced by a placeholder (when it is ``index``)."""
    if index is None:
        return path
    for n, (kind, key) in enumerate(path):
        if kind in ("i", "k"):
            if key == index:
                return (*path[:n], (kind, _IDX), *path[n + 1:])
            return path
    return path


def denormalize(path: Path, index: int | None) -> Path:
    """The inverse of :func:`normalize` for the block at ``index``."""
    if index is None:
        return path
    return tuple((kind, index) if key is _IDX or key == _IDX else (kind, key)
                 for kind, key in path)


def module_name(name: str, prefix: str | None) -> str:
    """``name`` with ``prefix`` (the block's name) abstracted."""
    if prefix is None:
        return name
    if name == prefix:
        return _HERE
    if name.startswith(prefix + "."):
        return _HERE + name[len(prefix):]
    return name


def module_name_for(name: str, prefix: str | None) -> str:
    """The inverse of :func:`module_name` for the block named ``prefix``."""
    if prefix is None or not name.startswith(_HERE):
        return name
    return prefix + name[1:]


def put(root: Any, path: Path, value: Any) -> None:
    """Put ``value`` at ``path`` under ``root`` (a tuple on the way is rebuilt)."""
    kind, key = path[-1]
    parent = get(root, path[:-1])
    if isinstance(parent, tuple):
        items = list(parent)
        items[key] = value
        put(root, path[:-1], type(parent)(items))
    elif kind == "a":
        setattr(parent, key, value)
    else:
        parent[key] = value


def get(root: Any, path: Path) -> Any:
    """The object at ``path`` under ``root``."""
    obj = root
    for kind, key in path:
        obj = getattr(obj, key) if kind == "a" else obj[key]
    return obj


def tensor_meta(t: torch.Tensor) -> tuple[list[int], tuple[Any, ...]]:
    """Numbers (shape, stride, offset, storage bytes) and structure of a tensor leaf."""
    if t.layout is not torch.strided:
        return [], ("sparse", t.layout, t.dtype)
    numbers = [int(n) for n in (*t.shape, *t.stride(), t.storage_offset(),
                                t.untyped_storage().nbytes())]
    return numbers, (t.dtype, t.device, t.dim(), isinstance(t, FakeTensor), t.requires_grad)


def _leaves_numbers(leaves: list[tuple[Path, Any]], storages: dict[int, int]
                    ) -> tuple[list[int], list[Any]]:
    """Numbers and structure of walked leaves; tensors sharing a storage share a group."""
    numbers: list[int] = []
    shape: list[Any] = []
    for path, v in leaves:
        if isinstance(v, (torch.Tensor, _TensorLeaf)):
            if isinstance(v, torch.Tensor):
                n, s = tensor_meta(v)
                key = v.untyped_storage()._cdata if v.layout is torch.strided else None
            else:
                n, s, key = v.numbers, v.shape, v.key
            numbers += n
            group = storages.setdefault(key, len(storages)) if key is not None else -1
            shape.append((path, "t", s, group))
        elif isinstance(v, bool) or v is None or isinstance(v, (str, torch.dtype,
                                                                 torch.device, float)):
            shape.append((path, "v", v))
        elif isinstance(v, int):
            numbers.append(v)
            shape.append((path, "n"))
        elif isinstance(v, _Opaque):
            shape.append((path, "o", v.kind))
        else:
            shape.append((path, "s", v))
    return numbers, shape


def module_state(modules: Iterable[nn.Module]) -> list[Any]:
    """The identities of the modules' tensors and the values of their plain attributes."""
    out: list[Any] = []
    for m in modules:
        for k, v in vars(m).items():
            if k in ("_parameters", "_buffers"):
                out.append(tuple((n, id(t)) for n, t in v.items()))
            elif isinstance(v, torch.Tensor):
                out.append((k, id(v)))
            elif isinstance(v, (int, float, str, bool)) or v is None:
                out.append((k, v))
    return out


# -- recording ------------------------------------------------------------------------------------


@dataclass
class Entry:
    """What the recorder saw as a call began."""

    tick: int
    allocs: int
    live_bytes: int
    live: list[tuple[Allocation, int]]
    state: list[tuple[Path, Any]]
    others: list[tuple[Path, Any]]
    """The state's leaves outside the block's slot (they must not change)."""
    inputs: list[tuple[Path, Any]]
    modules: list[Any]
    first_calls: int
    host_rng: int
    routed: int
    read: int


def _state_leaves(mode: CountingFakeMode, root: Any, index: int | None,
                  slots: tuple[Path, ...] | None = None
                  ) -> tuple[list[tuple[Path, Any]], list[tuple[Path, Any]]]:
    """The state's leaves in the block's slot (all of them without ``index``), normalized,
    and the others. ``slots`` (the containers that hold one entry per block, from
    :func:`slots_of`) walks only the block's entries."""
    leaves: list[tuple[Path, Any]] = []
    if root is not None and index is not None and slots is not None:
        for prefix in slots:
            kind = prefix[-1][0]
            container = get(root, prefix[:-1])
            try:
                entry = container[index]
            except (IndexError, KeyError, TypeError):
                continue
            walk(entry, (*prefix[:-1], (kind, index)), leaves, None, len(prefix))
    elif root is not None:
        walk(root, (), leaves)
    mine: list[tuple[Path, Any]] = []
    others: list[tuple[Path, Any]] = []
    for p, v in leaves:
        leaf = _TensorLeaf(v, mode) if isinstance(v, torch.Tensor) else v
        if index is None or _first_index(p) == index:
            mine.append((normalize(p, index), leaf))
        else:
            others.append((p, leaf))
    return mine, others


def slots_of(root: Any, index: int) -> tuple[Path, ...]:
    """The containers of ``root`` that hold the entry of block ``index`` (``layers[i]``,
    ``is_updated[i]``), each as the path to the entry with ``index`` abstracted."""
    leaves: list[tuple[Path, Any]] = []
    walk(root, (), leaves)
    out: list[Path] = []
    for p, _ in leaves:
        for n, (kind, key) in enumerate(p):
            if kind in ("i", "k"):
                if key == index:
                    slot = (*p[:n], (kind, _IDX))
                    if slot not in out:
                        out.append(slot)
                break
    return tuple(out)


class Recorder:
    """Builds the :class:`Segment` of a call run for real.

    ``values`` (the trace's :class:`~modelsize.estimation.generate._GenerationValues`, if
    any) has the modules where a routing choice was made: a call adds its own.
    """

    def __init__(self, mode: CountingFakeMode, values: Any = None) -> None:
        self.mode = mode
        self.values = values

    def enter(self, inputs: Any, root: Any, *, index: int | None = None, full: bool = True,
              modules: Iterable[nn.Module] = (), slots: tuple[Path, ...] | None = None
              ) -> Entry:
        """What a call is given (``full``: and what :meth:`record` compares after it;
        ``slots``: walk only the block's entries of the state, see :func:`slots_of`)."""
        mode = self.mode
        state, others = _state_leaves(mode, root, index, None if full else slots)
        walked: list[tuple[Path, Any]] = []
        walk(inputs, (), walked, root)
        # held weakly, as the state is: a tensor reached through the inputs (inside an
        # object the call is given) must be freed when the call drops it
        walked = [(p, _TensorLeaf(v, mode) if isinstance(v, torch.Tensor) else v)
                  for p, v in walked]
        if not full:
            return Entry(mode.tick, 0, 0, [], state, [], walked, [], 0, 0, 0, 0)
        routed = len(getattr(self.values, "routed", ()))
        read = len(getattr(self.values, "read_routing", ()))
        return Entry(mode.tick, len(mode.allocations), mode.live_bytes,
                     [(r, r.nbytes) for r in mode.live.values()], state,
                     others if index is not None else [], walked, module_state(modules),
                     len(mode.first_calls), mode.host_rng_copies, routed, read)

    @staticmethod
    def pre(entry: Entry) -> tuple[list[int], tuple[Any, ...]]:
        """The numbers and structure of what the call was given."""
        storages: dict[int, int] = {}
        n1, s1 = _leaves_numbers(entry.inputs, storages)
        n2, s2 = _leaves_numbers(entry.state, storages)
        return n1 + n2, (tuple(s1), tuple(s2))

    def record(self, entry: Entry, root: Any, out: Any, *, index: int | None = None,
               prefix: str | None = None, modules: Iterable[nn.Module] = ()) -> Segment:
        """The segment of the call that began at ``entry`` and returned ``out``."""
        pre, pre_shape = self.pre(entry)
        try:
            body, shape, plan = self._body(entry, root, out, index, prefix, modules)
        except Refused as exc:
            return Segment(pre_shape, pre, ("refused", str(exc)), [], str(exc), None)
        return Segment(pre_shape, pre, shape, body, "", plan)

    def _body(self, entry: Entry, root: Any, out: Any, index: int | None,
              prefix: str | None, modules: Iterable[nn.Module]
              ) -> tuple[list[int], tuple[Any, ...], Plan]:
        mode = self.mode
        t0, t1 = entry.tick, mode.tick
        if len(mode.first_calls) != entry.first_calls or mode.host_rng_copies != entry.host_rng:
            raise Refused("a library's first call or an RNG copy in the call")
        if module_state(modules) != entry.modules:
            raise Refused("the call changed a module's attributes")
        internal = allocations_of_call(mode, entry.allocs, t0, t1)
        index_of = {id(r): i for i, r in enumerate(internal)}
        for r, nbytes in entry.live:
            if r.freed < 0 and r.nbytes != nbytes:
                raise Refused("an earlier storage resized in the call")
        post, others = _state_leaves(mode, root, index)
        post_paths = {p for p, _ in post}
        gone = [p for p, _ in entry.state if p not in post_paths]
        if gone:
            raise Refused(f"the call removed {_show(gone[0])} from the state")
        if [p for p, _ in others] != [p for p, _ in entry.others]:
            raise Refused("the call changed the state's layout outside its slot")
        for (p, before), (_, after) in zip(entry.others, others, strict=True):
            if not _unchanged(before, after):
                raise Refused(f"the call changed the state at {_show(p)}, outside its slot")
        inputs: dict[int, Path] = {}
        for p, v in entry.inputs:
            t = v() if isinstance(v, _TensorLeaf) else None
            if t is not None:
                inputs[id(t)] = p
        views: dict[int, list[tuple[Any, torch.Tensor]]] = {}

        def internal_index(t: torch.Tensor) -> int | None:
            rec = mode.allocation_of(t) if isinstance(t, FakeTensor) else None
            return index_of.get(id(rec)) if rec is not None else None

        def leave(t: torch.Tensor, where: Any) -> tuple[int, int] | None:
            """(allocation, view) of a tensor the call made and leaves behind."""
            i = internal_index(t)
            if i is None or t.requires_grad or t.layout is not torch.strided:
                return None
            if self.values is not None and t in getattr(self.values, "values", {}):
                raise Refused(f"{_show_where(where)} has a value the replay cannot give")
            views.setdefault(i, []).append((where, t))
            return i, len(views[i]) - 1

        old_of: dict[Path, Any] = dict(entry.state)
        changed: list[tuple[Path, tuple[int, int]]] = []
        scalars: list[tuple[Path, Any]] = []
        for path, v in post:
            before = old_of.get(path, _MISSING)
            if before is _MISSING and (path[-1][0] == "i" or isinstance(v, (_Opaque, tuple))):
                raise Refused(f"the call added {_show(path)} to the state")  # see put()
            if isinstance(before, _TensorLeaf) and not isinstance(v, _TensorLeaf):
                raise Refused(f"the state's tensor at {_show(path)} became {type(v).__name__}")
            if isinstance(v, _TensorLeaf):
                now = v()
                assert now is not None  # held by the state
                if isinstance(before, _TensorLeaf) and before() is now:
                    continue
                made = leave(now, ("state", path))
                if made is None:
                    raise Refused(f"the state holds a tensor the call did not make at "
                                  f"{_show(path)}")
                changed.append((path, made))
            elif isinstance(v, _Opaque):
                if not isinstance(before, _Opaque) or before.ident != v.ident:
                    raise Refused(f"the state's object at {_show(path)} changed")
            elif isinstance(v, int) and not isinstance(v, bool):
                scalars.append((path, _INT))
            elif isinstance(v, (bool, str, float, torch.dtype, torch.device)) or v is None:
                scalars.append((path, v))
            elif isinstance(v, tuple) and v and v[0] in ("map", "seq", "obj"):
                if v != before:
                    raise Refused(f"the state's container at {_show(path)} changed")
            else:
                raise Refused(f"the state holds {v!r} at {_show(path)}")
        output = self._output(out, root, inputs, leave)
        alive = {i for i, r in enumerate(internal) if r.freed < 0}
        if alive != set(views):
            raise Refused("a storage the call made is kept outside its output and the state")
        # storages made before the call and freed in it: only the state tensors it replaced
        freed_ext = {id(r) for r, _ in entry.live if r.freed >= 0}
        order = sorted(views)
        where = {i: n for n, i in enumerate(order)}
        explained: set[int] = set()
        assigns: list[tuple[int, Path, int, int]] = []
        for path, (i, view) in changed:
            created = internal[i].created - t0
            at = created
            before = old_of[path]
            rec = before.rec if isinstance(before, _TensorLeaf) else None
            if rec is not None and id(rec) in freed_ext:
                at = rec.freed - t0
                explained.add(id(rec))
                if at < created:
                    raise Refused(f"the old tensor at {_show(path)} freed before the new one")
            assigns.append((at, path, where[i], view))
        if freed_ext - explained:
            raise Refused("the call freed a storage its state updates do not explain")
        output = _renumber(output, where)
        extras = self._extras(entry, prefix)
        # numbers
        body: list[int] = [v - entry.live_bytes for v in mode.timeline[t0:t1]]
        scratch_ticks = tuple(s - t0 for s in range(t0 + 1, t1 + 1) if s in mode.scratch_at)
        body += [mode.scratch_at[t0 + s] for s in scratch_ticks]
        part_counts = tuple(len(mode.scratch_parts.get(t0 + s, ())) for s in scratch_ticks)
        for s in scratch_ticks:
            body += list(mode.scratch_parts.get(t0 + s, ()))
        body += [r.nbytes for r in internal]
        storages: list[tuple[int, tuple[tuple[torch.dtype, torch.device, int], ...]]] = []
        for i in order:
            body.append(views[i][0][1].untyped_storage().nbytes())
            metas = []
            for _, v in views[i]:
                body += [int(n) for n in (*v.shape, *v.stride(), v.storage_offset())]
                metas.append((v.dtype, v.device, v.dim()))
            storages.append((i, tuple(metas)))
        values = {p: v for p, v in post}
        body += [int(values[p]) for p, v in scalars if v is _INT]
        body.append(mode.live_bytes - entry.live_bytes)
        allocs = tuple((r.created - t0, r.freed - t0 if r.freed >= 0 else -1, r.origin,
                        module_name(r.module, prefix),
                        (r.is_grad, r.is_state, r.saved, r.recomputed), i in views)
                       for i, r in enumerate(internal))
        plan = Plan(ops=tuple(mode.ops[t0:t1]), allocs=allocs, scratch_ticks=scratch_ticks,
                    scratch_parts=part_counts, storages=tuple(storages),
                    assigns=tuple(sorted(assigns, key=lambda a: a[0])),
                    scalars=tuple(scalars), output=output, extras=extras, ticks=t1 - t0)
        shape = (plan.ops, plan.allocs, scratch_ticks, part_counts, plan.storages,
                 plan.assigns, plan.scalars, plan.output, plan.extras)
        return body, shape, plan

    def _output(self, out: Any, root: Any, inputs: dict[int, Path], leave: Any,
                depth: int = 0) -> tuple[Any, ...]:
        """The output as a tree of specs: a view the call made, an input, the state, a
        value, or a tuple or ModelOutput of those."""
        from transformers.utils import ModelOutput

        if out is root and root is not None:
            return ("state",)
        if isinstance(out, torch.Tensor):
            made = leave(out, ("out", None))
            if made is not None:
                return ("view", *made)
            if id(out) in inputs:
                return ("input", inputs[id(out)])
            raise Refused("the output holds a tensor the record does not follow")
        if out is None or isinstance(out, (bool, int, float, str)):
            return ("value", out)
        if depth < 3 and isinstance(out, ModelOutput):
            return ("model", type(out), tuple((k, self._output(v, root, inputs, leave,
                                                               depth + 1))
                                              for k, v in out.items()))
        if depth < 3 and type(out) in (tuple, list):
            return ("seq", type(out), tuple(self._output(v, root, inputs, leave, depth + 1)
                                            for v in out))
        raise Refused(f"the call returned a {type(out).__name__}")

    def _extras(self, entry: Entry, prefix: str | None) -> tuple[tuple[str, str, Any], ...]:
        """The routing choices the call recorded (module names abstracted)."""
        values = self.values
        if values is None:
            return ()
        routed = list(getattr(values, "routed", {}).items())[entry.routed:]
        read = list(getattr(values, "read_routing", ()))
        if len(read) != entry.read:
            raise Refused("the call read a routed value")  # a set: its order is not kept
        return tuple(("routed", module_name(k, prefix), v) for k, v in routed)


def _renumber(spec: tuple[Any, ...], where: dict[int, int]) -> tuple[Any, ...]:
    kind = spec[0]
    if kind == "view":
        return ("view", where[spec[1]], spec[2])
    if kind == "model":
        return ("model", spec[1], tuple((k, _renumber(v, where)) for k, v in spec[2]))
    if kind == "seq":
        return ("seq", spec[1], tuple(_renumber(v, where) for v in spec[2]))
    return spec


def _unchanged(before: Any, after: Any) -> bool:
    if isinstance(before, _TensorLeaf) or isinstance(after, _TensorLeaf):
        return (isinstance(before, _TensorLeaf) and isinstance(after, _TensorLeaf)
                and after() is not None and before() is after())
    if isinstance(before, _Opaque) or isinstance(after, _Opaque):
        return (isinstance(before, _Opaque) and isinstance(after, _Opaque)
                and before.ident == after.ident)
    return type(before) is type(after) and bool(before == after)


def _show(path: Path) -> str:
    return "".join(f".{k}" if kind == "a" else f"[{k!r}]" for kind, k in path) or "<state>"


def _show_where(where: Any) -> str:
    return f"the state's tensor at {_show(where[1])}" if where[0] == "state" else "the output"


# -- replaying ----------------------------------------------------------------------------------


def replay(mode: CountingFakeMode, plan: Plan, body: list[int], *, inputs: Any, root: Any,
           index: int | None = None, prefix: str | None = None, values: Any = None,
           progress: bool = True) -> Any:
    """Run a call from ``plan`` and ``body`` (its numbers) without dispatching an op; return
    its output. Raises :class:`Mismatch` if the bytes live at the end are not the recorded
    ones."""
    t0 = mode.tick
    start = mode.live_bytes
    phase = len(mode.phases) - 1
    ticks = plan.ticks
    deltas = body[:ticks]
    pos = ticks
    scratch = dict(zip(plan.scratch_ticks, body[pos:pos + len(plan.scratch_ticks)],
                       strict=True))
    pos += len(plan.scratch_ticks)
    parts: dict[int, tuple[int, ...]] = {}
    for t, n in zip(plan.scratch_ticks, plan.scratch_parts, strict=True):
        if n:
            parts[t] = tuple(body[pos:pos + n])
            pos += n
    sizes = body[pos:pos + len(plan.allocs)]
    pos += len(plan.allocs)
    specs: dict[int, tuple[int, list[tuple[torch.dtype, torch.device, list[int], list[int],
                                            int]]]] = {}
    for i, metas in plan.storages:
        nbytes = body[pos]
        pos += 1
        vs = []
        for dtype, device, dim in metas:
            vs.append((dtype, device, body[pos:pos + dim], body[pos + dim:pos + 2 * dim],
                       body[pos + 2 * dim]))
            pos += 2 * dim + 1
        specs[i] = (nbytes, vs)
    storage_of = {i: n for n, (i, _) in enumerate(plan.storages)}
    made: dict[int, list[torch.Tensor]] = {}
    ints = iter(body[pos:-1])
    end_delta = body[-1]
    assigns = plan.assigns
    a = 0
    k = 0
    n_allocs = len(plan.allocs)
    allocs = plan.allocs
    alloc_list = mode.allocations
    timeline = mode.timeline
    ops = mode.ops
    callback = mode.progress if progress else None
    for j in range(1, ticks + 1):
        mode.tick += 1
        tick = mode.tick
        op = plan.ops[j - 1]
        ops.append(op)
        while k < n_allocs and allocs[k][0] == j:
            _, freed, origin, module, flags, materialized = allocs[k]
            module = module_name_for(module, prefix)
            if materialized:
                nbytes, vs = specs[k]
                tensors = _materialize(mode, nbytes, vs)
                made[storage_of[k]] = tensors
                rec = mode.track(tensors[0], origin)
                if rec.nbytes != sizes[k]:
                    mode.live_bytes += sizes[k] - rec.nbytes
                    rec.nbytes = sizes[k]
                rec.module = module
            else:
                rec = Allocation(sizes[k], origin, tick, phase, module,
                                 t0 + freed if freed >= 0 else -1)
                alloc_list.append(rec)
            rec.is_grad, rec.is_state, rec.saved, rec.recomputed = flags
            k += 1
        while a < len(assigns) and assigns[a][0] == j:
            _, path, n, view = assigns[a]
            put(root, denormalize(path, index), made[n][view])
            a += 1
        extra = scratch.get(j, 0)
        if extra:
            mode.scratch_at[tick] = extra
            if j in parts:
                mode.scratch_parts[tick] = parts[j]
        high = start + deltas[j - 1]
        timeline.append(high)
        if high > mode.peak_bytes:
            mode.peak_bytes = high
            mode.peak_tick = tick
            mode.peak_scratch = extra
            mode.peak_scratch_op = str(op) if extra else ""
        if callback is not None and not tick & 1023:
            callback(tick)
    if k != n_allocs or a != len(assigns):
        raise Mismatch("a replay did not place every allocation")
    for path, value in plan.scalars:
        put(root, denormalize(path, index), next(ints) if value is _INT else value)
    if values is not None:
        for kind, name, value in plan.extras:
            if kind == "routed":
                values.routed.setdefault(module_name_for(name, prefix), value)
    out = _rebuild(plan.output, made, inputs, root, index)
    del made
    if mode.live_bytes - start != end_delta:
        raise Mismatch("a replayed call did not end with the recorded live bytes")
    return out


def _rebuild(spec: tuple[Any, ...], made: dict[int, list[torch.Tensor]], inputs: Any,
             root: Any, index: int | None) -> Any:
    kind = spec[0]
    if kind == "state":
        return root
    if kind == "view":
        return made[spec[1]][spec[2]]
    if kind == "input":
        return get(inputs, denormalize(spec[1], index))
    if kind == "value":
        return spec[1]
    if kind == "model":
        return spec[1](**{k: _rebuild(v, made, inputs, root, index) for k, v in spec[2]})
    return spec[1](_rebuild(v, made, inputs, root, index) for v in spec[2])


def _materialize(mode: CountingFakeMode, nbytes: int,
                 views: list[tuple[torch.dtype, torch.device, list[int], list[int], int]]
                 ) -> list[torch.Tensor]:
    """Fake tensors over one new storage of ``nbytes``, one per view (no op dispatched)."""
    out: list[torch.Tensor] = []
    with torch._C._DisableTorchDispatch():  # plain meta tensors: no mode is to see them
        storage = torch.empty(nbytes, dtype=torch.uint8, device="meta").untyped_storage()
        for dtype, device, shape, stride, offset in views:
            meta = torch.empty(0, dtype=dtype, device="meta")
            meta.set_(storage, offset, shape, stride)
            out.append(mode.new_fake(meta, device))
    return out
