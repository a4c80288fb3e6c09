"""The fuzz target for ``modelsize slim``: mutated inputs of every format, and what must hold.

For each case a seed (:mod:`tests.fuzz.seeds`) is copied, one of its files mutated
(:mod:`tests.fuzz.mutations`), and ``modelsize inspect IN`` and ``modelsize slim IN -o OUT
ARGS`` run (in a runner process, :mod:`tests.fuzz.serve`). Then:

* each command exits 0, or 2 with exactly one line on stderr (``modelsize: ...``) and no
  traceback; never 1 ("internal error") or anything else; nothing on stderr on exit 0;
* no command runs longer than the timeout or past the RSS limit (1 GiB: a case over it in the
  runner is run again in a fresh process, measured by ``getrusage(RUSAGE_CHILDREN)`` in a small
  wrapper, and only that measurement counts);
* slim's exit 0 leaves OUT, which ``modelsize inspect`` reads and the format's own framework
  loads (``torch.load(weights_only=True)``, ``safe_open``, ``np.load(allow_pickle=False)``,
  ``onnx.checker`` and an onnxruntime session, ``GGUFReader``, ``torchfile``, Keras
  ``load_model``/``load_weights``, ``tf.train.load_checkpoint``, ``tf.lite.Interpreter``);
  where it does not, the input is tried with the same loader and the answer noted;
* slim's exit 2 leaves nothing (no OUT, no staging folder); the input is never changed.

A case that breaks one of these is a :class:`Failure`; :func:`write_reproducer` saves the
mutated input and the commands that show it.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tests.fuzz import mutations
from tests.fuzz.seeds import Seed, Variant

REPO = Path(__file__).resolve().parents[2]
GiB = 1 << 30
RSS_LIMIT = GiB
#: A worker past this RSS is killed at once (the machine is shared); the case is then measured
#: again in a fresh process.
RSS_KILL = 3 * GiB


def _modelsize_path() -> str:
    import modelsize

    return str(Path(modelsize.__file__).resolve().parents[1])


def worker_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (_modelsize_path(), str(REPO), env.get("PYTHONPATH", "")) if p)
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    env.pop("MODELSIZE_DEBUG", None)
    env.update(extra or {})
    return env


class Worker:
    """A :mod:`tests.fuzz.serve` process in ``role``, started on first use and again after it
    died or was killed."""

    def __init__(self, role: str, python: str = sys.executable) -> None:
        self.role, self.python = role, python
        self.proc: subprocess.Popen[bytes] | None = None
        self.peak_rss = 0

    def _start(self) -> subprocess.Popen[bytes]:
        if self.proc is None or self.proc.poll() is not None:
            env = worker_env({"HOME": os.environ.get("HOME", "/tmp")} if self.role != "tf"
                             else {"HOME": str(Path(os.environ.get("TMPDIR", "/tmp")))})
            self.proc = subprocess.Popen(
                [self.python, "-m", "tests.fuzz.serve", self.role], cwd=REPO, env=env,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                start_new_session=True)
        return self.proc

    def _rss(self, pid: int) -> int:
        try:
            with open(f"/proc/{pid}/status") as fh:
                for line in fh:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._forget()

    def _forget(self) -> None:
        if self.proc is not None:
            for pipe in (self.proc.stdin, self.proc.stdout):
                if pipe is not None:
                    with contextlib.suppress(OSError):  # a pipe to a killed process
                        pipe.close()
        self.proc = None

    def request(self, obj: dict[str, Any], timeout: float) -> dict[str, Any]:
        """The answer, or ``{"killed": "timeout"|"rss"}``, or ``{"died": returncode}``."""
        proc = self._start()
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write((json.dumps(obj) + "\n").encode())
            proc.stdin.flush()
        except BrokenPipeError:
            self.kill()
            return {"died": "broken pipe"}
        deadline = time.monotonic() + timeout
        line = b""
        while True:
            ready, _, _ = select.select([proc.stdout], [], [], 0.05)
            if ready:
                chunk = os.read(proc.stdout.fileno(), 1 << 16)
                if not chunk:
                    rc = proc.wait()
                    self._forget()
                    return {"died": rc}
                line += chunk
                if line.endswith(b"\n"):
                    return json.loads(line)
                continue
            rss = self._rss(proc.pid)
            self.peak_rss = max(self.peak_rss, rss)
            if rss > RSS_KILL:
                self.kill()
                return {"killed": "rss", "rss": rss}
            if time.monotonic() > deadline:
                self.kill()
                return {"killed": "timeout"}

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        self._forget()


#: Runs a command as its only child and prints its exit code, seconds and peak RSS: the
#: wrapper is small, so ``RUSAGE_CHILDREN``'s ``ru_maxrss`` (which an exec'd child starts
#: from its parent's RSS) is the command's own. A child past the kill limit (argv[2]) is
#: killed, so a blow-up measured here never takes the machine's memory.
_MEASURE = """
import json, resource, subprocess, sys, tempfile, time
timeout, limit = float(sys.argv[1]), int(sys.argv[2])
t0 = time.monotonic()
rc = None
with tempfile.TemporaryFile() as err:
    p = subprocess.Popen(sys.argv[3:], stdout=subprocess.DEVNULL, stderr=err)
    while p.poll() is None:
        try:
            with open(f"/proc/{p.pid}/status") as fh:
                rss = next((int(x.split()[1]) * 1024 for x in fh if x.startswith("VmRSS:")), 0)
        except OSError:
            rss = 0
        if rss > limit or time.monotonic() - t0 > timeout:
            rc = "rss" if rss > limit else "timeout"
            p.kill()
            p.wait()
            break
        time.sleep(0.02)
    rc = p.returncode if rc is None else rc
    err.seek(0)
    text = err.read().decode("utf-8", "replace")
print(json.dumps({"rc": rc, "secs": round(time.monotonic() - t0, 2), "stderr": text[-2000:],
                  "peak": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}))
"""


def measure_fresh(argv: list[str], timeout: float) -> dict[str, Any]:
    """``python -m modelsize ARGV`` in a fresh process: exit code, seconds, stderr, peak RSS."""
    proc = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(timeout), str(RSS_KILL), sys.executable, "-m",
         "modelsize", *argv], capture_output=True, text=True, env=worker_env(),
        timeout=timeout + 60)
    return json.loads(proc.stdout)


# -- cases ---------------------------------------------------------------------------------------


@dataclass
class Case:
    seed: str
    index: int
    variant: Variant
    target: str
    steps: list[str]
    folder: Path
    input: Path
    output: Path

    def argv(self, verb: str) -> list[str]:
        if verb == "slim":
            return ["slim", str(self.input), "-o", str(self.output), *self.variant.args]
        if verb == "reread":
            return ["inspect", str(self.output)]
        return ["inspect", str(self.input)]


@dataclass
class Result:
    case: Case
    problems: list[str] = field(default_factory=list)
    outcome: str = ""  # slimmed / refused / kept as given / ...
    notes: list[str] = field(default_factory=list)
    runs: dict[str, Any] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return bool(self.problems)

    @property
    def peak(self) -> int:
        """The largest peak RSS of its commands (bytes)."""
        return max((r.get("peak", 0) for r in self.runs.values() if isinstance(r, dict)),
                   default=0)

    @property
    def seconds(self) -> float:
        """The longest of its commands (seconds)."""
        return max((float(r.get("secs", 0)) for r in self.runs.values() if isinstance(r, dict)),
                   default=0.0)

    def summary(self) -> str:
        c = self.case
        return (f"{c.seed}#{c.index} [{' '.join(c.variant.args) or 'default'}] {c.target}: "
                f"{'; '.join(c.steps)} => {' | '.join(self.problems)}")


def make_case(seed: Seed, index: int, rng: random.Random | None, work: Path,
              variant: Variant | None = None) -> Case:
    """Copy ``seed`` into a fresh folder under ``work`` and mutate one of its files (none
    when ``rng`` is None: the seed as it is)."""
    folder = work / f"{seed.name}-{index:05d}"
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    shutil.copytree(seed.root, folder / "in", symlinks=True)
    steps: list[str] = []
    if rng is None:
        assert variant is not None
        target = seed.targets[0]
    else:
        variant = rng.choice(seed.variants)
        target = rng.choice(seed.targets)
        path = folder / "in" / target
        data = path.read_bytes()
        mutated, steps = mutations.mutate_many(data, mutations.family_of(target, data), rng)
        path.write_bytes(mutated)
    return Case(seed.name, index, variant, target, steps, folder,
                folder / "in" / seed.entry if seed.entry else folder / "in",
                folder / variant.out)


def _leftovers(folder: Path, output: Path) -> list[str]:
    """What a refused slim left beside OUT: OUT itself, its shards, staging folders."""
    stem = output.name.split(".")[0]
    return sorted(p.name for p in output.parent.iterdir()
                  if p.name != "in" and (p.name.startswith(stem) or "modelsize" in p.name
                                         or p.name.startswith("." + stem)))


def _stderr_problem(verb: str, run: dict[str, Any]) -> str | None:
    rc, err = run["rc"], run["stderr"]
    lines = err.strip().splitlines()
    last = lines[-1][:300] if lines else ""
    if "Traceback" in err:
        return f"{verb}: traceback (exit {rc}): {last}"
    if rc == 0:
        return f"{verb}: exit 0 with stderr: {err.strip()[:300]}" if err.strip() else None
    if rc != 2:
        return f"{verb}: exit {rc}: {last}"
    if len(lines) != 1:
        return f"{verb}: exit 2 with {len(lines)} lines on stderr: {err.strip()[:300]}"
    if not lines[0].startswith("modelsize: "):
        return f"{verb}: exit 2, stderr not 'modelsize: ...': {last}"
    return None


class Harness:
    """Runs cases: a runner process for modelsize, a checker for this venv's frameworks and
    (when ``tf_python`` is given) one for TensorFlow's, each started once and kept."""

    def __init__(self, work: Path, tf_python: str | None = None, timeout: float = 60.0,
                 rss_limit: int = RSS_LIMIT) -> None:
        self.work = work
        self.timeout, self.rss_limit = timeout, rss_limit
        self.runner = Worker("runner")
        self.checker = Worker("check")
        self.tf = Worker("tf", tf_python) if tf_python else None
        self.unchecked: dict[str, int] = {}

    def close(self) -> None:
        for w in (self.runner, self.checker, self.tf):
            if w is not None:
                w.close()

    def __enter__(self) -> Harness:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def tflite_seed(self, root: Path) -> bool:
        """Write the TFLite seed with TensorFlow (False without a TF venv)."""
        if self.tf is None:
            return False
        root.mkdir(parents=True, exist_ok=True)
        answer = self.tf.request({"tflite_seed": str(root)}, timeout=300)
        return bool(answer.get("ok")) and (root / "model.tflite").is_file()

    def load(self, loader: str, path: Path, seed: Seed | None, original: Path | None = None
             ) -> dict[str, Any] | None:
        """The framework's answer on ``path`` (None: no framework here to ask)."""
        if loader.startswith("tf:"):
            if self.tf is None:
                self.unchecked[loader] = self.unchecked.get(loader, 0) + 1
                return None
            extra = str(path.parent / "in" / seed.extra) if seed and seed.extra else ""
            if seed and seed.extra and not Path(extra).exists():
                extra = str(seed.root / seed.extra)
            answer = self.tf.request({"loader": loader[3:], "path": str(path), "extra": extra},
                                     timeout=self.timeout)
        else:
            answer = self.checker.request(
                {"loader": loader, "path": str(path),
                 "original": str(original) if original else ""}, timeout=self.timeout)
        if "killed" in answer or "died" in answer:
            return {"ok": False, "error": f"the loader process {json.dumps(answer)}"}
        return answer

    def run(self, seed: Seed, case: Case) -> Result:
        res = Result(case)
        before = (case.folder / "in" / case.target).read_bytes()
        request = {v: case.argv(v) for v in ("inspect", "slim", "reread")}
        runs = self.runner.request(request, timeout=self.timeout)
        res.runs = runs
        if "killed" in runs or "died" in runs:
            self._confirm_fresh(res, "runner " + json.dumps(runs))
            return res
        for verb in ("inspect", "slim", "reread"):
            run = runs.get(verb)
            if run is None:
                continue
            problem = _stderr_problem(verb, run)
            if problem:
                res.problems.append(problem)
            if run["peak"] >= self.rss_limit:
                fresh = measure_fresh(case.argv(verb), self.timeout)
                if fresh["peak"] >= self.rss_limit:
                    res.problems.append(f"{verb}: peak RSS {fresh['peak']:,} B in a fresh process")
        if (case.folder / "in" / case.target).read_bytes() != before:
            res.problems.append("slim changed its input")
        slim = runs["slim"]
        if slim["rc"] == 0:
            res.outcome = "slimmed"
            self._check_output(seed, case, res)
        else:
            res.outcome = "refused" if slim["rc"] == 2 else f"exit {slim['rc']}"
            left = _leftovers(case.folder, case.output)
            if left:
                res.problems.append(f"slim exit {slim['rc']} left {left}")
        return res

    def _check_output(self, seed: Seed, case: Case, res: Result) -> None:
        out = case.output
        exists = (out.exists() or any(out.parent.glob(out.name + ".*")))
        if not exists:
            res.problems.append("slim exit 0 but no OUT")
            return
        if res.runs.get("reread", {}).get("rc") != 0:
            res.problems.append("modelsize cannot read its own output")
        original = case.input if case.input.is_dir() else None
        answer = self.load(case.variant.loader, out, seed, original)
        if answer is None or answer.get("ok"):
            return
        note = ""
        error = str(answer.get("error", ""))
        in_loader = _input_loader(seed)
        if in_loader:
            before = self.load(in_loader, case.input, seed)
            if before is not None and not before.get("ok"):
                if beyond_the_file(case.variant.loader, str(before.get("error", "")), error,
                                   case):
                    res.outcome = "kept as given"
                    res.notes.append(f"its framework refuses input and output alike: {error}")
                    return
                note = f" (the input does not load either: {before.get('error', '')[:160]})"
            elif before is not None:
                note = " (the input loads)"
        res.problems.append(f"output its framework does not load: {error}{note}")

    def _confirm_fresh(self, res: Result, what: str) -> None:
        """The runner hung, blew up or died: each command again in a fresh process."""
        case = res.case
        for verb in ("inspect", "slim"):
            if verb == "slim" and case.output.exists():
                shutil.rmtree(case.output) if case.output.is_dir() else case.output.unlink()
            fresh = measure_fresh(case.argv(verb), self.timeout)
            res.runs[verb] = fresh
            if fresh["rc"] == "rss":
                res.problems.append(f"{verb}: killed past {RSS_KILL:,} B of RSS ({what})")
            elif fresh["rc"] == "timeout":
                res.problems.append(f"{verb}: no answer in {self.timeout:.0f} s ({what})")
            elif fresh["peak"] >= self.rss_limit:
                res.problems.append(f"{verb}: peak RSS {fresh['peak']:,} B ({what})")
            else:
                problem = _stderr_problem(verb, fresh)
                if problem:
                    res.problems.append(problem)
        if not res.problems:
            res.problems.append(f"the runner failed but each command passes alone: {what}")
        res.outcome = "runner failed"


#: Refusals of a framework that lie beyond a file's structure: what only building or running
#: the model finds (an operator's arity or shapes, a graph's order or types, an operator no
#: runtime has, a layer's config), or what a newer framework may read (an ONNX IR version, a
#: torch archive version, a ggml type modelsize reads with a note). Where the input is refused
#: alike, slim kept what it was given: the case is counted "kept as given", not failed.
BEYOND_THE_FILE: dict[str, re.Pattern[str]] = {
    "onnx": re.compile(r"ShapeInferenceError|is higher than the checker|topologically sorted|"
                       r"No Op registered|Unrecognized type value case|ValidationError: Field|"
                       r"ValidationError: Node|TypeInferenceError|INVALID_GRAPH|"
                       r"NOT_IMPLEMENTED|ValidationError: Graph|Unrecognized attribute|"
                       r"Type Error: Type \(|ValidateOpsetForDomain|"
                       r"ValidationError: .*(opset|domain|attribute|input|output|type)"),
    # the interpreter crashing on a model it accepts (an operator's required input given as
    # -1, "optional"): a crash on the input as on the output is the interpreter's, not slim's
    "tf:tflite": re.compile(r"failed to prepare|Didn't find op|Encountered unresolved custom op|"
                            r"is both input \d+ and output|^the loader process \{\"died\""),
    # weights_only's allowlist is a policy, not the file: an input naming a callable it does
    # not allow (modelsize names it as unsafe, and slim's note says the output keeps it)
    "torch": re.compile(r"maximum supported version for reading|"
                       r"This file can still be loaded, to do so you have two options"),
    "tf:keras": re.compile(r"."),
    "tf:keras-weights": re.compile(r"objects could not be loaded|expects \d+ weight|"
                                   r"Layer .* weight|shape mismatch"),
    "gguf": re.compile(r"is not a valid GGMLQuantizationType"),
}
#: What is the file's structure whatever the loader: never "beyond the file".
_STRUCTURE = re.compile(r"(?i)wire format|unable to parse proto|BadZipFile|CRC|truncat|"
                        r"checksum|unable to (synchronously )?open|HDF5|invalid stored block|"
                        r"flatbuffer|Model provided has model identifier|zip")


def _normal(error: str, case: Case) -> str:
    for p in (str(case.output), str(case.input), str(case.folder)):
        error = error.replace(p, "<file>")
    return error.split("\n")[0][:300]


#: A loader that needs more memory than the checker allows (the TFLite interpreter allocating
#: a 4 GB activation, say) for input and output alike: a large model, not a broken file.
_LOADER_MEMORY = re.compile(r'the loader process \{"killed": "rss"')


def beyond_the_file(loader: str, before: str, after: str, case: Case) -> bool:
    """Whether the framework refuses input and output alike, for a reason that lies beyond
    the file's structure (:data:`BEYOND_THE_FILE`)."""
    if _LOADER_MEMORY.match(before) and _LOADER_MEMORY.match(after):
        return True
    pattern = BEYOND_THE_FILE.get(loader)
    return (pattern is not None and bool(pattern.search(after))
            and not _STRUCTURE.search(after)
            and _normal(before, case).split(":")[0] == _normal(after, case).split(":")[0])


def _input_loader(seed: Seed) -> str:
    """The loader of the seed's own format (for telling a slim bug from an input the
    framework refuses too); '' for folders of several formats."""
    return {"torch-zip": "torch", "torch-legacy": "torch", "safetensors": "safetensors",
            "npy": "npz", "npz": "npz", "npz-deflated": "npz", "pickle": "pickle",
            "gguf": "gguf", "t7": "t7", "onnx": "onnx", "onnx-external": "onnx",
            "keras": "tf:keras", "keras-deflated": "tf:keras", "keras-h5": "tf:keras",
            "keras-weights-h5": "tf:keras-weights", "tf1-checkpoint": "tf:checkpoint",
            "tf2-checkpoint": "tf:checkpoint", "tflite": "tf:tflite"}.get(seed.name, "")


def write_reproducer(res: Result, folder: Path) -> Path:
    """The mutated input and a ``case.json`` (mutation, commands, problems) under ``folder``."""
    c = res.case
    dest = folder / f"{c.seed}-{c.index:05d}"
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(c.folder / "in", dest / "in", symlinks=True)
    rel = c.input.relative_to(c.folder)
    info = {"seed": c.seed, "index": c.index, "target": c.target, "mutation": c.steps,
            "problems": res.problems, "outcome": res.outcome,
            "commands": [f"modelsize inspect {rel}",
                         f"modelsize slim {rel} -o {c.output.name} {' '.join(c.variant.args)}"],
            "loader": c.variant.loader, "runs": res.runs}
    (dest / "case.json").write_text(json.dumps(info, indent=1, default=str))
    return dest


def run_unmutated(h: Harness, seed: Seed) -> list[Result]:
    """Each variant of ``seed`` on the seed itself: the oracle's own check (all must pass)."""
    results = []
    for i, variant in enumerate(seed.variants):
        res = h.run(seed, make_case(seed, 90000 + i, None, h.work, variant))
        if not res.failed:
            shutil.rmtree(res.case.folder, ignore_errors=True)
        results.append(res)
    return results


def run_seed(h: Harness, seed: Seed, count: int, rng_seed: int, start: int = 0
             ) -> list[Result]:
    """``count`` mutants of ``seed`` (deterministic for ``rng_seed``), each removed after its
    run unless it failed."""
    rng = random.Random(f"{rng_seed}:{seed.name}:{start}")
    results = []
    for i in range(start, start + count):
        case = make_case(seed, i, rng, h.work)
        res = h.run(seed, case)
        results.append(res)
        if not res.failed:
            shutil.rmtree(case.folder, ignore_errors=True)
    return results


__all__ = ["Case", "Harness", "Result", "asdict", "make_case", "measure_fresh", "run_seed",
           "write_reproducer"]
