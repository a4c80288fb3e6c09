from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from modelsize.estimation.segments import Mismatch, Recorder, Segment, replay
from modelsize.estimation.tracker import CountingFakeMode

#: A step this many tokens or fewer from a length the config or the cache names runs for real.
MARGIN = 4
#: Config keys (any part, lower case) whose integer values are lengths where a step may change,
#: and words that make a key something else (a layer count or period, an audio mask).
_LENGTH_WORDS = ("window", "chunk", "position", "length", "context", "seq")
_NOT_LENGTH = ("layer", "pattern", "mask", "feed_forward")


class Retrace(Exception):
    """Replayed steps were not confirmed: trace again with steps ``lo..hi`` run for real."""

    def __init__(self, lo: int, hi: int, why: str) -> None:
        super().__init__(f"decode steps {lo}..{hi}: {why}")
        self.lo, self.hi, self.why = lo, hi, why


@dataclass
class StepRecord:
    """One decode forward run for real: its step and its segment."""

    step: int
    segment: Segment


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


# -- templates ------------------------------------------------------------------------------------


@dataclass
class _Template:
    step: int
    base: Segment
    pre_slope: list[int]
    body_slope: list[int]

    def predict(self, step: int) -> tuple[list[int], list[int]]:
        d = step - self.step
        return ([b + d * s for b, s in zip(self.base.pre, self.pre_slope, strict=True)],
                [b + d * s for b, s in zip(self.base.body, self.body_slope, strict=True)])

    def matches(self, rec: StepRecord) -> bool:
        seg = rec.segment
        if seg.refused or seg.pre_shape != self.base.pre_shape or seg.shape != self.base.shape:
            return False
        pre, body = self.predict(rec.step)
        return seg.pre == pre and seg.body == body


def _template(r1: StepRecord, r2: StepRecord, r3: StepRecord) -> _Template | None:
    """The template of three consecutive real steps, if they agree."""
    s1, s2, s3 = r1.segment, r2.segment, r3.segment
    if s1.refused or s2.refused or s3.refused:
        return None
    if not (r1.step + 1 == r2.step and r2.step + 1 == r3.step):
        return None
    if not (s1.pre_shape == s2.pre_shape == s3.pre_shape and s1.shape == s2.shape == s3.shape):
        return None
    if len(s1.pre) != len(s3.pre) or len(s1.body) != len(s3.body):
        return None
    pre_slope = [c - b for b, c in zip(s2.pre, s3.pre, strict=True)]
    body_slope = [c - b for b, c in zip(s2.body, s3.body, strict=True)]
    if any(b - a != s for a, b, s in zip(s1.pre, s2.pre, pre_slope, strict=True)):
        return None
    if any(b - a != s for a, b, s in zip(s1.body, s2.body, body_slope, strict=True)):
        return None
    return _Template(r3.step, s3, pre_slope, body_slope)


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
    ``forced`` are steps that must run for real; ``enabled`` False runs every step for real.
    ``values`` is the trace's :class:`~modelsize.estimation.generate._GenerationValues`.
    """

    def __init__(self, mode: CountingFakeMode, model: nn.Module, new_tokens: int,
                 step_of: Callable[[], int], forced: set[int] | None = None,
                 enabled: bool = True,
                 cache_of: Callable[[Mapping[str, Any]], Any] | None = None,
                 values: Any = None) -> None:
        self.mode = mode
        self.model = model
        self.last = new_tokens - 1
        self.step_of = step_of
        self.forced = forced or set()
        self.enabled = enabled and self.last >= 5
        self.cache_of = cache_of or (lambda kwargs: None)
        self.recorder = Recorder(mode, values)
        self.values = values
        self.records: list[StepRecord] = []
        self.template: _Template | None = None
        self.summary = DecodeSummary(note="" if self.enabled or not enabled
                                     else "too few to replay")
        self.prefill_tokens = 0
        self.lengths = config_lengths(model)
        self.verified = 0  # the last decode step that ran for real
        self.pending = False  # replayed steps since the last real one
        self.refused = ""  # why the first step that cannot be replayed cannot

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """The model's ``forward`` goes through :meth:`forward` for the block."""
        if not self.enabled:
            yield
            return
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
            assert self.template is not None
            entry = self.recorder.enter(kwargs, cache, full=False)
            pre, pre_shape = self.recorder.pre(entry)
            del entry
            predicted, body = self.template.predict(step)
            plan = self.template.base.plan
            if pre_shape == self.template.base.pre_shape and pre == predicted and plan:
                try:
                    out = replay(self.mode, plan, body, inputs=kwargs, root=cache,
                                 values=self.values)
                except Mismatch as exc:
                    raise Retrace(self.verified + 1, step, str(exc)) from None
                self.summary.replayed.append(step)
                self.pending = True
                return out
        self.summary.real.append(step)
        if cache is None or args or self.mode.depth or not self.mode.counting:
            self._after(StepRecord(step, Segment((), [], ("refused",), [], "no cache")))
            return original(*args, **kwargs)
        modules = list(self.model.modules())
        entry = self.recorder.enter(kwargs, cache, modules=modules)
        if not self.records:
            self._learn_lengths(cache)
        out = original(*args, **kwargs)
        segment = self.recorder.record(entry, self.cache_of(kwargs), out, modules=modules)
        del entry
        self._after(StepRecord(step, segment))
        return out

    def finish(self, steps: int) -> None:
        """After ``generate()`` (``steps`` decode steps): replayed steps that no real step
        confirmed are retraced."""
        if not self.enabled:
            self.summary.steps, self.summary.real = steps, list(range(1, steps + 1))
        if self.pending:
            raise Retrace(self.verified + 1, self.summary.steps,
                          "the last steps were replayed and never confirmed")
        if not self.summary.replayed and self.enabled and not self.summary.note:
            self.summary.note = self.refused or "no three consecutive steps agreed"

    # -- policy ---------------------------------------------------------------------------

    def _may_replay(self, step: int) -> bool:
        return (self.template is not None and step < self.last and step not in self.forced
                and not self._near_length(step) and not self.mode.depth
                and self.mode.counting)

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
        if rec.segment.refused and not self.refused:
            self.refused = f"step {rec.step} cannot be replayed: {rec.segment.refused}"
        if self.template is not None and self.template.matches(rec):
            self.template = _Template(rec.step, rec.segment, self.template.pre_slope,
                                      self.template.body_slope)
        elif len(self.records) == 3:
            self.template = _template(*self.records)
        else:
            self.template = None

    def _learn_lengths(self, cache: Any) -> None:
        """Lengths the cache's counters name (a sliding window, an attention chunk)."""
        from modelsize.estimation.segments import walk

        leaves: list[tuple[Any, Any]] = []
        walk(cache, (), leaves)
        for path, v in leaves:
            name = str(path[-1][1]).lower() if path else ""
            if isinstance(v, int) and not isinstance(v, bool) and v > 0 \
                    and any(w in name for w in ("window", "chunk")):
                self.lengths.add(v)
