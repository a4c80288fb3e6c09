"""A long mutation-fuzz campaign of ``modelsize slim`` (and ``inspect``) over every format.

The engine is the CI fuzz target's (``tests/fuzz``: seeds, mutations, the harness); this runs
it for as many cases as asked and writes a reproducer of each failure (the mutated input, the
commands, what went wrong) into ``--out``::

    PYTHONPATH=src .venv/bin/python scripts/fuzz_slim.py --cases 5000 --out /tmp/fuzz-failures
        [--seed 1] [--only torch-zip,npz] [--timeout 60]

``--cases`` is the total, shared among the seeds. The TensorFlow formats (Keras loads, TF
checkpoints, TFLite) are checked in the TensorFlow venv named by ``MODELSIZE_TF_PYTHON`` (or
``.venv-tf``); without it they are still fuzzed, their outputs checked by modelsize only.
Prints one line per failure and a table of outcomes per seed.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _import_tests_package() -> None:
    """The engine lives in this checkout's ``tests`` package: import it from there (the
    script's own folder is what Python puts on the path)."""
    spec = importlib.util.spec_from_file_location(
        "tests", REPO / "tests" / "__init__.py", submodule_search_locations=[str(REPO / "tests")])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["tests"] = module
    spec.loader.exec_module(module)


def tf_python() -> str | None:
    for c in (os.environ.get("MODELSIZE_TF_PYTHON", ""), str(REPO / ".venv-tf/bin/python")):
        if c and Path(c).is_file():
            return c
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=2000, help="total cases (default 2000)")
    ap.add_argument("--seed", type=int, default=1, help="the campaign's random seed")
    ap.add_argument("--only", default="", help="comma-separated seed names")
    ap.add_argument("--out", type=Path, required=True, help="where reproducers go")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per case")
    ap.add_argument("--start", type=int, default=0, help="first case index (to resume)")
    args = ap.parse_args()

    _import_tests_package()
    from tests.fuzz import harness, seeds

    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="modelsize-fuzz-") as tmp:
        work = Path(tmp)
        all_seeds = seeds.build(work / "seeds")
        with harness.Harness(work / "cases", tf_python(), timeout=args.timeout) as h:
            if h.tflite_seed(work / "seeds" / "tflite"):
                all_seeds.append(seeds.tflite_seed(work / "seeds" / "tflite"))
            only = {s for s in args.only.split(",") if s}
            chosen = [s for s in all_seeds if not only or s.name in only]
            per_seed = max(1, args.cases // max(1, len(chosen)))
            table: dict[str, collections.Counter[str]] = {}
            t0 = time.monotonic()
            failures = 0
            worst: dict[str, tuple[int, float]] = {}
            for seed in chosen:
                counts = table.setdefault(seed.name, collections.Counter())
                for res in harness.run_unmutated(h, seed):
                    if res.failed:
                        where = harness.write_reproducer(res, args.out)
                        print(f"SEED FAILS {res.summary()}\n     -> {where}", flush=True)
                for res in harness.run_seed(h, seed, per_seed, args.seed, args.start):
                    peak, secs = worst.get(seed.name, (0, 0.0))
                    worst[seed.name] = (max(peak, res.peak), max(secs, res.seconds))
                    counts[res.outcome] += 1
                    if res.failed:
                        failures += 1
                        counts["FAILED"] += 1
                        where = harness.write_reproducer(res, args.out)
                        print(f"FAIL {res.summary()}\n     -> {where}", flush=True)
                peak, secs = worst.get(seed.name, (0, 0.0))
                print(f"{seed.name}: {dict(counts)}; largest peak RSS {peak / 2**20:.0f} MiB, "
                      f"slowest command {secs:.2f} s ({time.monotonic() - t0:.0f} s)",
                      flush=True)
            if h.unchecked:
                print(f"not checked by their framework (no TensorFlow venv): {h.unchecked}")
    print(f"{sum(sum(c.values()) - c['FAILED'] for c in table.values())} cases, "
          f"{failures} failures, {time.monotonic() - t0:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
