"""The fuzz target for ``modelsize slim``: mutated inputs of every format slim writes.

Each seed (:mod:`tests.fuzz.seeds`: files made by the real frameworks) is first slimmed as it
is with every variant (the oracle's own check), then mutated ``MODELSIZE_FUZZ_CASES`` times in
all (default: :data:`PER_SEED` per seed, a fixed seed ``MODELSIZE_FUZZ_SEED``), and every case
must pass :mod:`tests.fuzz.harness`'s checks: exit 0 with an output modelsize reads and its
framework loads, or exit 2 with one line; no traceback, no hang, peak RSS under 1 GiB, the
input unchanged, nothing left behind a refusal. A failure's reproducer (the mutated input and
the commands) is written under the test's tmp folder and named in the message. The long
campaign is ``scripts/fuzz_slim.py``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.fuzz import harness, seeds

#: Mutants per seed in CI: 22 seeds x 20 cases (and each seed as it is) take about 20 s
#: on 2 cores.
PER_SEED = 20


def _tf_python() -> str | None:
    for c in (os.environ.get("MODELSIZE_TF_PYTHON", ""), str(REPO / ".venv-tf/bin/python")):
        if c and Path(c).is_file():
            return c
    return None


@pytest.fixture(scope="module")
def fuzz(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[harness.Harness,
                                                                     dict[str, seeds.Seed]]]:
    work = tmp_path_factory.mktemp("fuzz")
    made = seeds.build(work / "seeds")
    with harness.Harness(work / "cases", _tf_python()) as h:
        if h.tflite_seed(work / "seeds" / "tflite"):
            made.append(seeds.tflite_seed(work / "seeds" / "tflite"))
        yield h, {s.name: s for s in made}


def _count(n_seeds: int) -> int:
    total = os.environ.get("MODELSIZE_FUZZ_CASES")
    return max(1, int(total) // n_seeds) if total else PER_SEED


#: Every seed the builders can make; those whose framework is missing are skipped.
SEEDS = ["torch-zip", "torch-legacy", "safetensors", "safetensors-sharded", "npy", "npz",
         "npz-deflated", "pickle", "gguf", "t7", "onnx", "onnx-external", "keras",
         "keras-deflated", "keras-h5", "keras-weights-h5", "tf1-checkpoint", "tf2-checkpoint",
         "hf-trainer", "deepspeed", "torch-dcp", "tflite"]


@pytest.mark.parametrize("name", SEEDS)
def test_mutated_inputs_slim_or_fail_in_one_line(
        fuzz: tuple[harness.Harness, dict[str, seeds.Seed]], name: str,
        tmp_path: Path) -> None:
    h, made = fuzz
    seed = made.get(name)
    if seed is None:
        pytest.skip(f"no {name} seed here (its framework, or TensorFlow's venv, is missing)")
    results = harness.run_unmutated(h, seed)
    assert all(r.outcome == "slimmed" for r in results), [r.summary() for r in results]
    count = _count(len(SEEDS))
    results += harness.run_seed(h, seed, count, int(os.environ.get("MODELSIZE_FUZZ_SEED", "18")))
    failed = [r for r in results if r.failed]
    where = [harness.write_reproducer(r, tmp_path / "failures") for r in failed]
    assert not failed, "\n".join(f"{r.summary()}\n  reproducer: {w}"
                                 for r, w in zip(failed, where, strict=True))


def test_the_harness_sees_a_blow_up_and_a_hang(
        fuzz: tuple[harness.Harness, dict[str, seeds.Seed]], tmp_path: Path) -> None:
    """The oracle's own check: with a 1 MiB RSS limit every command is over it (measured
    again in a fresh process), and with a 1 ms timeout the runner is killed and the commands
    time out in a fresh process too."""
    _, made = fuzz
    seed = made["npy"]
    with harness.Harness(tmp_path / "rss", rss_limit=1 << 20) as h:
        res = h.run(seed, harness.make_case(seed, 0, None, h.work, seed.variants[0]))
    assert any("peak RSS" in p and "fresh process" in p for p in res.problems), res.problems
    with harness.Harness(tmp_path / "hang", timeout=0.001) as h:
        res = h.run(seed, harness.make_case(seed, 0, None, h.work, seed.variants[0]))
    assert res.outcome == "runner failed"
    assert any("no answer in" in p for p in res.problems), res.problems
