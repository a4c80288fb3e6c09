"""Decode steps replayed from the steps before them, tick for tick.

A decode step of ``generate()`` runs the model's forward over one new token per row. What the
forward allocates depends on the step index only through sizes that grow by the same amount
every step (the dynamic cache's ``torch.cat``, the attention scores over one more key, the
mask one column wider) or not at all (a static cache, a recurrent state), until a cache length
where the code changes course (a sliding window fills). So the trace records each decode
forward it runs for real as a :class:`StepRecord`: every tick's op, the bytes live after it
(relative to the forward's start), each storage the forward allocates (size, tick of its free),
the kernels' scratch, what the forward leaves behind (the cache's new tensors and counters,
the output's logits) and what it was given (the inputs' and the cache's shapes). A record is
a *structure* (everything that must be equal from step to step) and a list of *numbers*.

Three consecutive real steps with the same structure whose numbers move by the same amount
from one to the next make a template: step ``k``'s numbers are predicted as the last one's plus
``k - k3`` times that difference. A predicted step is *replayed* (:meth:`DecodeReplay.forward`):
the counting mode advances through the predicted ticks with no op dispatched, appends the
same allocation records a real forward would, and makes the tensors the forward leaves
behind as fake tensors of the predicted shapes, put where the forward puts them, at the tick
it puts them there (so the old cache tensor is freed at the tick a real ``torch.cat`` frees
it). ``generate()``'s own code keeps running for real between forwards: the token choice,
the growing ``input_ids`` and mask, beam reordering and the end of the loop are traced as
always. The timeline, the peak, the records and so every category and the device estimate
are those of the full trace.

Steps run for real where the pattern is not established:

* the first decode steps, until three consecutive ones agree; a forward whose record cannot
  be replayed (it leaves a tensor somewhere the record does not follow, changes a module's
  attributes, ...) never becomes a template;
* a step whose cache length is within :data:`MARGIN` tokens of a length the model's config
  names (sliding windows, attention chunks, position limits: where a window fills the step
  changes) or a cache counter names: three real steps after it establish the new pattern;
* a step whose inputs or cache differ from the prediction (checked before every replay);
* the last step, always.

The first real step after replayed ones must equal its prediction exactly, or the replayed
ones are not trusted: :class:`Retrace` is raised, and the caller traces the generation again
with the steps from the last verified one to that step run for real (a pattern that changed
at a length nothing names is found this way, at the cost of a second trace). Caches whose
steps are known not to be affine (the offloaded cache's moves, the quantized caches'
residual buffer that fills and empties) are traced step by step.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes

from modelsize.estimation.tracker import Allocation, CountingFakeMode

#: A step this many tokens or fewer from a length the config or the cache names runs for real.
MARGIN = 4
#: Config keys (any part, lower case) whose integer values are lengths where a step may change,
#: and words that make a key something else (a layer count or period, an audio mask).
_LENGTH_WORDS = ("window", "chunk", "position", "length", "context", "seq")
_NOT_LENGTH = ("layer", "pattern", "mask", "feed_forward")
#: Walks into nested inputs and cache objects stop this deep.
_DEPTH = 5

Path = tuple[Any, ...]


class Retrace(Exception):
    """Replayed steps were not confirmed: trace again with steps ``lo..hi`` run for real."""

    def __init__(self, lo: int, hi: int, why: str) -> None:
        super().__init__(f"decode steps {lo}..{hi}: {why}")
        self.lo, self.hi, self.why = lo, hi, why


class _Refused(Exception):
    pass


@dataclass
class StepRecord:
    """One decode forward: its structure (equal from step to step) and its numbers."""

    step: int
    pre_shape: tuple[Any, ...]
    pre: list[int]
    shape: tuple[Any, ...]
    body: list[int]
    replayable: str = ""
    """Empty when the record can be replayed, else why not."""
    plan: _Plan | None = None


@dataclass
class _Plan:
    """What a replay needs besides the numbers (the structure, in usable form)."""

    ops: tuple[Any, ...]
    allocs: tuple[tuple[Any, ...], ...]  # (created, freed, origin, module, flags, materialized)
    scratch_ticks: tuple[int, ...]
    scratch_parts: tuple[int, ...]  # number of parts per scratch tick (0: none recorded)
    storages: tuple[tuple[int, tuple[tuple[torch.dtype, torch.device, int], ...]], ...]
    """Per materialized storage: its allocation index and its views (dtype, device, dims)."""
    assigns: tuple[tuple[int, Path, int, int], ...]  # (tick, state path, storage, view)
    scalars: tuple[tuple[Path, Any], ...]  # state path -> value (_INT: one of the numbers)
    output: tuple[type, tuple[tuple[str, tuple[Any, ...]], ...]]
    ticks: int


@dataclass
class DecodeSummary:
    """Which decode steps were traced and which replayed."""

    steps: int = 0
    real: list[int] = field(default_factory=list)
    replayed: list[int] = field(default_factory=list)
    retraces: int = 0
    note: str = ""

    def describe(self) -> str:
        """One line: the steps traced, the steps replayed, the attempts."""
        if not self.steps:
            return "no decode step"
        if not self.replayed:
            why = f" ({self.note})" if self.note else ""
            return f"all {self.steps} decode steps traced{why}"
        again = f"; {self.note}" if self.retraces else ""
        return (f"{len(self.real)} of {self.steps} decode steps traced "
                f"({_ranges(self.real)}), {len(self.replayed)} replayed from them "
                f"({_ranges(self.replayed)}: sizes affine in the step){again}")


def _ranges(steps: list[int]) -> str:
    out: list[str] = []
    for s in sorted(steps):
        if out and out[-1].split("-")[-1] == str(s - 1):
            out[-1] = out[-1].split("-")[0] + f"-{s}"
        else:
            out.append(str(s))
    return ", ".join(out)


# -- walking inputs and the cache ---------------------------------------------------------------


class _TensorLeaf:
    """A tensor of the cache as a forward began, held weakly (a strong reference would keep
    its storage alive past the tick a real run frees it)."""

    __slots__ = ("numbers", "rec", "ref", "shape")

    def __init__(self, t: torch.Tensor, mode: CountingFakeMode) -> None:
        self.ref = weakref.ref(t)
        self.rec = mode.allocation_of(t) if isinstance(t, FakeTensor) else None
        self.numbers, self.shape = _tensor_meta(t)

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


def _walk(obj: Any, path: Path, out: list[tuple[Path, Any]], cache: Any, depth: int) -> None:
    """``(path, leaf)`` for every tensor, scalar and opaque object under ``obj``."""
    if isinstance(obj, torch.Tensor):
        out.append((path, obj))
    elif obj is cache and path:
        out.append((path, _CACHE))
    elif obj is None or isinstance(obj, (bool, int, float, str, torch.dtype, torch.device)):
        out.append((path, obj))
    elif depth >= _DEPTH:
        out.append((path, _Opaque(obj)))
    elif isinstance(obj, Mapping):
        out.append((path, ("map", type(obj), len(obj))))
        for k, v in obj.items():
            _walk(v, (*path, ("k", k)), out, cache, depth + 1)
    elif isinstance(obj, (list, tuple)):
        out.append((path, ("seq", type(obj), len(obj))))
        for i, v in enumerate(obj):
            _walk(v, (*path, ("i", i)), out, cache, depth + 1)
    elif _enterable(obj):
        out.append((path, ("obj", type(obj))))
        for k, v in vars(obj).items():
            _walk(v, (*path, ("a", k)), out, cache, depth + 1)
    else:
        out.append((path, _Opaque(obj)))


_CACHE = ("cache",)
_INT = ("int",)  # a scalar of the plan whose value is one of the numbers


def _set(root: Any, path: Path, value: Any) -> None:
    """Put ``value`` at ``path`` under ``root`` (a tuple on the way is rebuilt)."""
    kind, key = path[-1]
    parent = _get(root, path[:-1])
    if isinstance(parent, tuple):
        items = list(parent)
        items[key] = value
        _set(root, path[:-1], type(parent)(items))
    elif kind == "a":
        setattr(parent, key, value)
    else:
        parent[key] = value


def _get(root: Any, path: Path) -> Any:
    obj = root
    for kind, key in path:
        obj = getattr(obj, key) if kind == "a" else obj[key]
    return obj


# -- the record of one real forward ---------------------------------------------------------------


@dataclass
class _Entry:
    """What the recorder saw as a forward began."""

    tick: int
    allocs: int
    live_bytes: int
    live: list[tuple[Allocation, int]]
    state: list[tuple[Path, Any]]
    inputs: list[tuple[Path, Any]]
    modules: list[Any]
    first_calls: int
    host_rng: int


def _tensor_meta(t: torch.Tensor) -> tuple[list[int], tuple[Any, ...]]:
    """Numbers (shape, stride, offset, storage bytes) and structure of a tensor leaf."""
    if t.layout is not torch.strided:
        return [], ("sparse", t.layout, t.dtype)
    st = t.untyped_storage()
    numbers = [*t.shape, *t.stride(), t.storage_offset(), st.nbytes()]
    return numbers, (t.dtype, t.device, t.dim(), isinstance(t, FakeTensor), t.requires_grad)


def _leaves_numbers(leaves: list[tuple[Path, Any]], storages: dict[int, int]
                    ) -> tuple[list[int], list[Any]]:
    """Numbers and structure of walked leaves; tensors sharing a storage share a group."""
    numbers: list[int] = []
    shape: list[Any] = []
    for path, v in leaves:
        if isinstance(v, (torch.Tensor, _TensorLeaf)):
            if isinstance(v, torch.Tensor):
                n, s = _tensor_meta(v)
                key = v.untyped_storage()._cdata if v.layout is torch.strided else None
            else:
                n, s = v.numbers, v.shape
                key = id(v.rec) if v.rec is not None else None
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


def _module_state(model: nn.Module) -> list[Any]:
    """The identities of every module's tensors and the values of its plain attributes."""
    out: list[Any] = []
    for m in model.modules():
        for k, v in vars(m).items():
            if k in ("_parameters", "_buffers"):
                out.append(tuple((n, id(t)) for n, t in v.items()))
            elif isinstance(v, torch.Tensor):
                out.append((k, id(v)))
            elif isinstance(v, (int, float, str, bool)) or v is None:
                out.append((k, v))
    return out


class _Recorder:
    """Builds the :class:`StepRecord` of a forward run for real."""

    def __init__(self, mode: CountingFakeMode, model: nn.Module) -> None:
        self.mode = mode
        self.model = model

    def enter(self, kwargs: Mapping[str, Any], cache: Any, full: bool = True) -> _Entry:
        """What a forward is given (``full``: and what the recorder compares after it)."""
        mode = self.mode
        leaves: list[tuple[Path, Any]] = []
        _walk(cache, (), leaves, None, 0)
        state = [(p, _TensorLeaf(v, mode) if isinstance(v, torch.Tensor) else v)
                 for p, v in leaves]
        del leaves
        inputs: list[tuple[Path, Any]] = []
        _walk(dict(kwargs), (), inputs, cache, 0)
        if not full:
            return _Entry(mode.tick, 0, 0, [], state, inputs, [], 0, 0)
        return _Entry(mode.tick, len(mode.allocations), mode.live_bytes,
                      [(r, r.nbytes) for r in mode.live.values()], state, inputs,
                      _module_state(self.model), len(mode.first_calls), mode.host_rng_copies)

    def record(self, step: int, entry: _Entry, cache: Any, out: Any) -> StepRecord:
        pre, pre_shape = self.pre_numbers(entry)
        try:
            body, shape, plan = self._body(entry, cache, out)
            why = ""
        except _Refused as exc:
            body, shape, plan, why = [], ("refused", str(exc)), None, str(exc)
        return StepRecord(step, pre_shape, pre, shape, body, why, plan)

    @staticmethod
    def pre_numbers(entry: _Entry) -> tuple[list[int], tuple[Any, ...]]:
        storages: dict[int, int] = {}
        n1, s1 = _leaves_numbers(entry.inputs, storages)
        n2, s2 = _leaves_numbers(entry.state, storages)
        return n1 + n2, (tuple(s1), tuple(s2))

    def _body(self, entry: _Entry, cache: Any, out: Any
              ) -> tuple[list[int], tuple[Any, ...], _Plan]:
        mode = self.mode
        t0, t1 = entry.tick, mode.tick
        ticks = t1 - t0
        if len(mode.first_calls) != entry.first_calls or mode.host_rng_copies != entry.host_rng:
            raise _Refused("a library's first call or an RNG copy in the forward")
        if _module_state(self.model) != entry.modules:
            raise _Refused("the forward changed a module's attributes")
        phase = len(mode.phases) - 1
        internal = mode.allocations[entry.allocs:]
        index = {id(r): i for i, r in enumerate(internal)}
        last = t0
        for r in internal:
            if not t0 < r.created <= t1 or r.created < last or r.phase != phase or r.host:
                raise _Refused("an allocation outside the forward's ticks")
            last = r.created
        for r, nbytes in entry.live:
            if r.freed < 0 and r.nbytes != nbytes:
                raise _Refused("an earlier storage resized in the forward")
        # what the forward leaves behind: the cache's tensors and the output's
        post: list[tuple[Path, Any]] = []
        _walk(cache, (), post, None, 0)
        pre_paths = [p for p, _ in entry.state]
        if [p for p, _ in post] != pre_paths:
            raise _Refused("the cache's layout changed")
        inputs = {id(v): p for p, v in entry.inputs if isinstance(v, torch.Tensor)}
        views: dict[int, list[tuple[Any, torch.Tensor]]] = {}

        def internal_index(t: torch.Tensor) -> int | None:
            rec = mode.allocation_of(t) if isinstance(t, FakeTensor) else None
            return index.get(id(rec)) if rec is not None else None

        old_of: dict[Path, Any] = dict(entry.state)
        changed: list[tuple[Path, torch.Tensor]] = []
        scalars: list[tuple[Path, Any]] = []
        for path, v in post:
            before = old_of[path]
            if isinstance(before, _TensorLeaf) and not isinstance(v, torch.Tensor):
                raise _Refused(f"the cache's tensor at {_show(path)} became {type(v).__name__}")
            if isinstance(v, torch.Tensor):
                if isinstance(before, _TensorLeaf) and before() is v:
                    continue
                i = internal_index(v)
                if i is None or v.requires_grad or v.layout is not torch.strided:
                    raise _Refused(f"the cache holds a tensor the forward did not make at "
                                   f"{_show(path)}")
                views.setdefault(i, []).append((("state", path), v))
                changed.append((path, v))
            elif isinstance(v, _Opaque):
                if not isinstance(before, _Opaque) or before.ident != v.ident:
                    raise _Refused(f"the cache's object at {_show(path)} changed")
            elif isinstance(v, int) and not isinstance(v, bool):
                scalars.append((path, _INT))
            elif isinstance(v, (bool, str, float, torch.dtype, torch.device)) or v is None:
                scalars.append((path, v))
            elif isinstance(v, tuple) and v and v[0] in ("map", "seq", "obj"):
                if v != before:
                    raise _Refused(f"the cache's container at {_show(path)} changed")
            elif v is not _CACHE:
                raise _Refused(f"the cache holds {v!r} at {_show(path)}")
        from transformers.utils import ModelOutput

        if not isinstance(out, ModelOutput):
            raise _Refused(f"the forward returned {type(out).__name__}, not a ModelOutput")
        fields: list[tuple[str, tuple[Any, ...]]] = []
        for key, v in out.items():
            if v is cache:
                fields.append((key, ("cache",)))
            elif isinstance(v, torch.Tensor):
                i = internal_index(v)
                if i is not None and not v.requires_grad and v.layout is torch.strided:
                    views.setdefault(i, []).append((("out", key), v))
                    fields.append((key, ("view", i, len(views[i]) - 1)))
                elif id(v) in inputs:
                    fields.append((key, ("input", inputs[id(v)])))
                else:
                    raise _Refused(f"the output's {key} is a tensor the record does not follow")
            else:
                raise _Refused(f"the output's {key} is a {type(v).__name__}")
        alive = {i for i, r in enumerate(internal) if r.freed < 0}
        if alive != set(views):
            raise _Refused("a storage the forward made is kept outside the cache and the "
                           "output")
        # external frees: only the cache tensors the forward replaced
        freed_ext = {id(r) for r, _ in entry.live if r.freed >= 0}
        assigns: list[tuple[int, Path, int, int]] = []
        storage_order = sorted(views)
        where = {i: n for n, i in enumerate(storage_order)}
        explained: set[int] = set()
        for path, v in changed:
            i = internal_index(v)
            assert i is not None
            view = next(n for n, (w, _) in enumerate(views[i]) if w == ("state", path))
            created = internal[i].created - t0
            at = created
            before = old_of[path]
            rec = before.rec if isinstance(before, _TensorLeaf) else None
            if rec is not None and id(rec) in freed_ext:
                at = rec.freed - t0
                explained.add(id(rec))
                if at < created:
                    raise _Refused(f"the old tensor at {_show(path)} freed before the new one")
            assigns.append((at, path, where[i], view))
        if freed_ext - explained:
            raise _Refused("the forward freed a storage the cache's updates do not explain")
        for key, spec in fields:  # output views by storage order
            if spec[0] == "view":
                fields[fields.index((key, spec))] = (key, ("view", where[spec[1]], spec[2]))
        # numbers
        body: list[int] = [v - entry.live_bytes for v in mode.timeline[t0:t1]]
        scratch_ticks = tuple(t - t0 for t in range(t0 + 1, t1 + 1) if t in mode.scratch_at)
        body += [mode.scratch_at[t0 + t] for t in scratch_ticks]
        part_counts = tuple(len(mode.scratch_parts.get(t0 + t, ())) for t in scratch_ticks)
        for t in scratch_ticks:
            body += list(mode.scratch_parts.get(t0 + t, ()))
        body += [r.nbytes for r in internal]
        storages: list[tuple[int, tuple[tuple[torch.dtype, torch.device, int], ...]]] = []
        for i in storage_order:
            vs = views[i]
            body.append(vs[0][1].untyped_storage().nbytes())
            metas = []
            for _, v in vs:
                body += [int(n) for n in (*v.shape, *v.stride(), v.storage_offset())]
                metas.append((v.dtype, v.device, v.dim()))
            storages.append((i, tuple(metas)))
        scalar_values = dict(post)
        body += [scalar_values[p] for p, v in scalars if v is _INT]
        body.append(mode.live_bytes - entry.live_bytes)
        materialized = set(views)
        allocs = tuple((r.created - t0, r.freed - t0 if r.freed >= 0 else -1, r.origin,
                        r.module, (r.is_grad, r.is_state, r.saved, r.recomputed),
                        i in materialized) for i, r in enumerate(internal))
        plan = _Plan(ops=tuple(mode.ops[t0:t1]), allocs=allocs, scratch_ticks=scratch_ticks,
                     scratch_parts=part_counts, storages=tuple(storages),
                     assigns=tuple(sorted(assigns, key=lambda a: a[0])),
                     scalars=tuple(scalars), output=(type(out), tuple(fields)), ticks=ticks)
        shape = (plan.ops, plan.allocs, scratch_ticks, part_counts, plan.storages,
                 plan.assigns, plan.scalars, plan.output)
        return body, shape, plan


def _show(path: Path) -> str:
    return "".join(f".{k}" if kind == "a" else f"[{k!r}]" for kind, k in path) or "<cache>"


# -- templates ------------------------------------------------------------------------------------


@dataclass
class _Template:
    base: StepRecord
    pre_slope: list[int]
    body_slope: list[int]

    def predict(self, step: int) -> tuple[list[int], list[int]]:
        d = step - self.base.step
        return ([b + d * s for b, s in zip(self.base.pre, self.pre_slope, strict=True)],
                [b + d * s for b, s in zip(self.base.body, self.body_slope, strict=True)])

    def matches(self, rec: StepRecord) -> bool:
        if rec.pre_shape != self.base.pre_shape or rec.shape != self.base.shape:
            return False
        pre, body = self.predict(rec.step)
        return rec.pre == pre and rec.body == body


def _template(r1: StepRecord, r2: StepRecord, r3: StepRecord) -> _Template | None:
    """The template of three consecutive real steps, if they agree."""
    if r1.replayable or r2.replayable or r3.replayable:
        return None
    if not (r1.step + 1 == r2.step and r2.step + 1 == r3.step):
        return None
    if not (r1.pre_shape == r2.pre_shape == r3.pre_shape and r1.shape == r2.shape == r3.shape):
        return None
    if len(r1.pre) != len(r3.pre) or len(r1.body) != len(r3.body):
        return None
    pre_slope = [c - b for b, c in zip(r2.pre, r3.pre, strict=True)]
    body_slope = [c - b for b, c in zip(r2.body, r3.body, strict=True)]
    if any(b - a != s for a, b, s in zip(r1.pre, r2.pre, pre_slope, strict=True)):
        return None
    if any(b - a != s for a, b, s in zip(r1.body, r2.body, body_slope, strict=True)):
        return None
    return _Template(r3, pre_slope, body_slope)


# -- the forward wrapper ----------------------------------------------------------------------


def config_lengths(model: nn.Module) -> set[int]:
    """Integer lengths the model's config names (windows, chunks, position limits)."""
    config = getattr(model, "config", None)
    to_dict = getattr(config, "to_dict", None)
    found: set[int] = set()

    def visit(obj: Any, named: bool) -> None:
        if isinstance(obj, Mapping):
            for k, v in obj.items():
                key = str(k).lower()
                visit(v, named or (any(w in key for w in _LENGTH_WORDS)
                                   and not any(w in key for w in _NOT_LENGTH)))
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                visit(v, named)
        elif named and isinstance(obj, int) and not isinstance(obj, bool) and obj > 0:
            found.add(obj)

    if callable(to_dict):
        visit(to_dict(), False)
    return found


class DecodeReplay:
    """Runs decode forwards for real or replays them (see the module docstring).

    ``step_of()`` tells the decode step of the forward about to run (0 for a prefill forward);
    ``forced`` are steps that must run for real; ``enabled`` False runs every step for real
    (the records are still taken, which costs little).
    """

    def __init__(self, mode: CountingFakeMode, model: nn.Module, new_tokens: int,
                 step_of: Callable[[], int], forced: set[int] | None = None,
                 enabled: bool = True, cache_of: Callable[[Mapping[str, Any]], Any] | None = None
                 ) -> None:
        self.mode = mode
        self.model = model
        self.last = new_tokens - 1
        self.step_of = step_of
        self.forced = forced or set()
        self.enabled = enabled and self.last >= 5
        self.cache_of = cache_of or (lambda kwargs: None)
        self.recorder = _Recorder(mode, model)
        self.records: list[StepRecord] = []
        self.template: _Template | None = None
        self.summary = DecodeSummary(note="" if self.enabled else "too few to replay")
        self.prefill_tokens = 0
        self.lengths = config_lengths(model)
        self.verified = 0  # the last decode step that ran for real
        self.pending = False  # replayed steps since the last real one
        self.refused = ""  # why the first unreplayable step was

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """The model's ``forward`` goes through :meth:`forward` for the block."""
        had = "forward" in vars(self.model)
        original = self.model.forward

        # generate() reads the forward's signature (logits_to_keep, cache_position...): the
        # wrapper shows the original's
        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            return self.forward(original, args, kwargs)

        vars(self.model)["forward"] = forward
        try:
            yield
        finally:
            if had:
                vars(self.model)["forward"] = original
            else:
                del vars(self.model)["forward"]

    def forward(self, original: Callable[..., Any], args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> Any:
        """A decode forward run for real (and recorded) or replayed."""
        step = self.step_of()
        if step <= 0:
            self._count_prompt(kwargs)
            return original(*args, **kwargs)
        cache = self.cache_of(kwargs)
        self.summary.steps = max(self.summary.steps, step)
        if cache is not None and not args and self._may_replay(step):
            entry = self.recorder.enter(kwargs, cache, full=False)
            pre, pre_shape = self.recorder.pre_numbers(entry)
            del entry
            assert self.template is not None
            predicted_pre, body = self.template.predict(step)
            if pre_shape == self.template.base.pre_shape and pre == predicted_pre:
                out = self._replay(step, self.template.base, body, kwargs, cache)
                self.summary.replayed.append(step)
                self.pending = True
                return out
        if cache is None or args or self.mode.depth or not self.mode.counting:
            self.summary.real.append(step)
            self._after(StepRecord(step, (), [], ("refused", "no cache"), [], "no cache"))
            return original(*args, **kwargs)
        entry = self.recorder.enter(kwargs, cache)
        if not self.records and not self.summary.real:
            self._learn_lengths(entry)
        out = original(*args, **kwargs)
        rec = self.recorder.record(step, entry, self.cache_of(kwargs), out)
        self.summary.real.append(step)
        self._after(rec)
        return out

    def finish(self) -> None:
        """After ``generate()``: replayed steps that no real step confirmed are retraced."""
        if self.pending:
            raise Retrace(self.verified + 1, self.summary.steps,
                          "the last steps were replayed and never confirmed")
        if not self.summary.replayed and self.enabled and not self.summary.note:
            self.summary.note = self.refused or "no three consecutive steps agreed"

    # -- policy ---------------------------------------------------------------------------

    def _may_replay(self, step: int) -> bool:
        return (self.enabled and self.template is not None and step < self.last
                and step not in self.forced and not self._near_length(step)
                and not self.mode.depth and self.mode.counting)

    def _near_length(self, step: int) -> bool:
        length = self.prefill_tokens + step  # the cache's tokens after this step
        return any(abs(length - n) <= MARGIN for n in self.lengths)

    def _count_prompt(self, kwargs: Mapping[str, Any]) -> None:
        for key in ("input_ids", "decoder_input_ids"):
            t = kwargs.get(key)
            if isinstance(t, torch.Tensor) and t.dim():
                self.prefill_tokens += int(t.shape[-1])
                return
        t = kwargs.get("inputs_embeds")
        if isinstance(t, torch.Tensor) and t.dim() >= 2:
            self.prefill_tokens += int(t.shape[-2])

    def _after(self, rec: StepRecord) -> None:
        """A real step's record: confirm the replayed steps before it, update the template."""
        if self.pending:
            assert self.template is not None
            if not self.template.matches(rec):
                raise Retrace(self.verified + 1, rec.step,
                              f"step {rec.step}, traced after replayed ones, differs from its "
                              "prediction")
            self.pending = False
        self.verified = rec.step
        self.records = [*self.records[-2:], rec]
        if rec.replayable and not self.refused:
            self.refused = f"step {rec.step} cannot be replayed: {rec.replayable}"
        if self.template is not None and self.template.matches(rec):
            self.template = _Template(rec, self.template.pre_slope, self.template.body_slope)
        elif len(self.records) == 3:
            self.template = _template(*self.records)
        else:
            self.template = None

    def _learn_lengths(self, entry: _Entry) -> None:
        """Lengths the cache's counters name (a window, a static cache's length)."""
        for path, v in entry.state:
            name = str(path[-1][1]).lower() if path else ""
            if isinstance(v, int) and not isinstance(v, bool) and v > 0 \
                    and any(w in name for w in ("window", "chunk")):
                self.lengths.add(v)

    # -- replay ---------------------------------------------------------------------------

    def _replay(self, step: int, template: StepRecord, body: list[int],
                kwargs: Mapping[str, Any], cache: Any) -> Any:
        plan = template.plan
        assert plan is not None
        mode = self.mode
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
        made: dict[int, list[torch.Tensor]] = {}
        specs: dict[int, tuple[int, list[tuple[torch.dtype, torch.device, list[int],
                                                list[int], int]]]] = {}
        for n, (i, metas) in enumerate(plan.storages):
            nbytes = body[pos]
            pos += 1
            vs = []
            for dtype, device, dim in metas:
                shape = body[pos:pos + dim]
                stride = body[pos + dim:pos + 2 * dim]
                offset = body[pos + 2 * dim]
                pos += 2 * dim + 1
                vs.append((dtype, device, shape, stride, offset))
            specs[i] = (nbytes, vs)
            made[n] = []
        storage_of = {i: n for n, (i, _) in enumerate(plan.storages)}
        ints = iter(body[pos:-1])
        end_delta = body[-1]
        assigns = list(plan.assigns)
        a = 0
        alloc_list = mode.allocations
        timeline = mode.timeline
        k = 0
        n_allocs = len(plan.allocs)
        progress = mode.progress
        for j in range(1, ticks + 1):
            mode.tick += 1
            tick = mode.tick
            op = plan.ops[j - 1]
            mode.ops.append(op)
            while k < n_allocs and plan.allocs[k][0] == j:
                _, freed, origin, module, flags, materialized = plan.allocs[k]
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
                _set(cache, path, made[n][view])
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
            if progress is not None and not tick & 1023:
                progress(tick)
        if k != n_allocs or a != len(assigns):
            raise Retrace(self.verified + 1, step, "a replay did not place every allocation")
        for path, value in plan.scalars:
            _set(cache, path, next(ints) if value is _INT else value)
        out_type, fields = plan.output
        values: dict[str, Any] = {}
        for key, spec in fields:
            if spec[0] == "cache":
                values[key] = cache
            elif spec[0] == "view":
                values[key] = made[spec[1]][spec[2]]
            else:
                values[key] = _get(dict(kwargs), spec[1])
        del made
        if mode.live_bytes - start != end_delta:
            raise Retrace(self.verified + 1, step,
                          "a replayed step did not end with the predicted live bytes")
        return out_type(**values)


def _materialize(mode: CountingFakeMode, nbytes: int,
                 views: list[tuple[torch.dtype, torch.device, list[int], list[int], int]]
                 ) -> list[torch.Tensor]:
    """Fake tensors over one new storage of ``nbytes``, one per view (no op dispatched)."""
    out: list[torch.Tensor] = []
    with _disable_current_modes():
        storage = torch.empty(nbytes, dtype=torch.uint8, device="meta").untyped_storage()
        for dtype, device, shape, stride, offset in views:
            meta = torch.empty(0, dtype=dtype, device="meta")
            meta.set_(storage, offset, shape, stride)
            out.append(mode.fake_tensor_converter.from_meta_and_device(mode, meta, device))
    return out
