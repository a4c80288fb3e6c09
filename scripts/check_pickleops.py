"""Run mutated pickles through ``modelsize._pickleops`` built with AddressSanitizer and UBSan.

    python scripts/check_pickleops.py [--cases 200000] [--seed 1]

Builds ``src/modelsize/_pickleops.c`` with ``-fsanitize=address,undefined`` into a copy of the
package in a temporary folder, then runs ``--cases`` random mutations of every pickle family of
``tests/formats/test_pickle_compiled.py`` (protocols 0-5, persistent ids, torch checkpoints, the
edge cases, the picklescan corpus where ``../shared`` has it) both ways, compiled and Python
alone, in a child process preloading the sanitizer runtimes. It fails on the first sanitizer
report (the child aborts) or on the first pickle the two ways disagree on. Run it after changing
the C file; it needs gcc and Python's headers. 200,000 cases took 136 s on a 2-core machine.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_CHILD = r"""
import random, sys, time
sys.path.insert(1, sys.argv[3])
from modelsize.formats import _pickle
assert _pickle.__file__.startswith(sys.argv[4]), _pickle.__file__
assert _pickle._ops is not None, "the sanitized extension did not load"
from tests.formats import test_pickle_compiled as t
rng = random.Random(int(sys.argv[2]))
seeds = [p for p in t.protocol_pickles() if len(p) < 20_000]
seeds += t.persid_pickles()[:2] + [p for p in t.torch_pickles() if len(p) < 20_000]
seeds += [d for _, d in t.corpus_pickles() if len(d) < 20_000]
seeds += [d for d in t.EDGE_CASES.values() if len(d) < 20_000]
counts = {}
t0 = time.time()
for i in range(int(sys.argv[1])):
    data = t._mutate(rng, rng.choice(seeds))
    r = t.both(data, persistent_load=t.recording_load if i % 2 else None)
    k = "error" if "error" in r else "raised" if "raised" in r else "ok"
    counts[k] = counts.get(k, 0) + 1
print(f"{sys.argv[1]} mutated pickles agree both ways, no sanitizer report: {counts} "
      f"({time.time() - t0:.0f} s)")
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=200_000)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    gcc = shutil.which("gcc")
    if gcc is None:
        print("needs gcc", file=sys.stderr)
        return 2
    runtimes = [subprocess.run([gcc, f"-print-file-name={lib}"], capture_output=True, text=True,
                               check=True).stdout.strip() for lib in ("libasan.so", "libubsan.so")]
    with tempfile.TemporaryDirectory() as tmp:
        pkg = Path(tmp) / "modelsize"
        shutil.copytree(REPO / "src" / "modelsize", pkg,
                        ignore=shutil.ignore_patterns("*.so", "__pycache__"))
        suffix = sysconfig.get_config_var("EXT_SUFFIX")
        source = REPO / "src" / "modelsize" / "_pickleops.c"
        subprocess.run(
            [gcc, "-O1", "-g", "-fsanitize=address,undefined", "-fno-omit-frame-pointer",
             "-shared", "-fPIC", f"-I{sysconfig.get_paths()['include']}", str(source),
             "-o", str(pkg / f"_pickleops{suffix}")],
            check=True)
        # PYTHONMALLOC=malloc: every object its own allocation, so that a read past a small
        # bytes object (pymalloc would carve it out of an arena) is seen.
        env = {"PYTHONPATH": f"{tmp}:{REPO}", "LD_PRELOAD": ":".join(runtimes),
               "PYTHONMALLOC": "malloc", "ASAN_OPTIONS": "detect_leaks=0",
               "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1", "PATH": "/usr/bin:/bin"}
        proc = subprocess.run([sys.executable, "-c", _CHILD, str(args.cases), str(args.seed), tmp,
                               str(pkg)], env=env, cwd=tmp)
        return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
