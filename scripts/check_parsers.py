"""Run mutated inputs through the compiled parsers built with AddressSanitizer and UBSan.

    python scripts/check_parsers.py [--cases 200000] [--seed 1] [--only pickle|headers|zip]

Builds ``src/modelsize/_pickleops.c`` and ``src/modelsize/_headers.c`` with
``-fsanitize=address,undefined`` into a copy of the package in a temporary folder, then, in a
child process preloading the sanitizer runtimes, runs both ways (compiled and Python alone):

* ``pickle``: ``--cases`` random mutations of every pickle family of
  ``tests/formats/test_pickle_compiled.py`` (protocols 0-5, persistent ids, torch checkpoints,
  the edge cases, the picklescan corpus where ``../shared`` has it);
* ``headers``: ``--cases`` random mutations of the safetensors headers of
  ``tests/formats/test_safetensors_compiled.py`` (the library's headers and the edge cases);
* ``zip``: ``--cases`` random mutations of the archives of
  ``tests/formats/test_zip_compiled.py`` (central directories and local headers, read through
  ``_headers``' zip loops).

It fails on the first sanitizer report (the child aborts) or on the first input the two ways
disagree on. Run it after changing either C file; it needs gcc and Python's headers. 200,000
pickles took 136-447 s on a 2-core machine.
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

#: Each child runs with argv: cases, seed, the folder of the sanitized package, the package.
_PRELUDE = r"""
import random, sys, time
sys.path.insert(1, sys.argv[3])
rng = random.Random(int(sys.argv[2]))
counts = {}
"""

_REPORT = r"""
print(f"{sys.argv[1]} mutated WHAT agree both ways, no sanitizer report: {counts} "
      f"({time.time() - t0:.0f} s)")
"""

_PICKLES = r"""
from modelsize.formats import _pickle
assert _pickle.__file__.startswith(sys.argv[4]), _pickle.__file__
assert _pickle._ops is not None, "the sanitized extension did not load"
from tests.formats import test_pickle_compiled as t
seeds = [p for p in t.protocol_pickles() if len(p) < 20_000]
seeds += t.persid_pickles()[:2] + [p for p in t.torch_pickles() if len(p) < 20_000]
seeds += [d for _, d in t.corpus_pickles() if len(d) < 20_000]
seeds += [d for d in t.EDGE_CASES.values() if len(d) < 20_000]
t0 = time.time()
for i in range(int(sys.argv[1])):
    data = t._mutate(rng, rng.choice(seeds))
    r = t.both(data, persistent_load=t.recording_load if i % 2 else None)
    k = "error" if "error" in r else "raised" if "raised" in r else "ok"
    counts[k] = counts.get(k, 0) + 1
"""

_HEADERS = r"""
from modelsize.formats import safetensors
assert safetensors.__file__.startswith(sys.argv[4]), safetensors.__file__
assert safetensors._scan_entries is not None, "the sanitized extension did not load"
from tests.formats import test_safetensors_compiled as t
seeds = t.mutation_seeds()
t0 = time.time()
for i in range(int(sys.argv[1])):
    raw, size = rng.choice(seeds)
    mutated = t._mutate(rng, raw)
    r = t.both(mutated, rng.choice([size, size // 2, size + 8]))
    # The scanner called directly from any position (memory safety: the results are not
    # compared; _scan_compact calls it only at the start of an entry).
    try:
        safetensors._scan_entries(mutated, rng.randrange(len(mutated) + 1), size,
                                  {b"F32": ("float32", 4), b"U8": ("uint8", 1)}, {}, [], [], [])
    except ValueError:
        pass
    k = ("bad" if "bad" in r else "error" if "error" in r
         else "json" if r["metadata"] is None else "ok")
    counts[k] = counts.get(k, 0) + 1
"""

_ZIPS = r"""
import tempfile
from pathlib import Path
from modelsize.formats import _zip
assert _zip.__file__.startswith(sys.argv[4]), _zip.__file__
assert _zip._local_headers is not None, "the sanitized extension did not load"
from tests.formats import test_zip_compiled as t
seeds = t.mutation_seeds(rng)
path = Path(tempfile.mkdtemp()) / "z.zip"
t0 = time.time()
for i in range(int(sys.argv[1])):
    path.write_bytes(t._mutate_zip(rng, rng.choice(seeds)))
    r = t.both(path)
    k = "members" if isinstance(r["membersTrue"], list) else "refused"
    counts[k] = counts.get(k, 0) + 1
    # The loops called directly on any slice, with any position and count (memory safety:
    # the results are not compared; _zip calls them only as above).
    data = path.read_bytes()
    a = rng.randrange(len(data) + 1)
    raw = data[a : a + rng.randrange(len(data) + 1)]
    q = rng.randrange(-2, len(raw) + 3)
    _zip._check_records(raw, q, rng.randrange(4))
    _zip._central_records(raw, max(q, 0), rng.randrange(-50, len(raw) + 50), rng.randrange(400),
                          rng.randrange(-5, 5), [])
    if r["directory"] and isinstance(r["directory"], list):
        infos = [_zip.Entry(*e) for e in r["directory"]]
        _zip._local_headers(raw, a, infos, rng.randrange(len(infos) + 1), len(data),
                            rng.random() < 0.5, 0x2061, [], -1)
"""

_CHILDREN = {which: (module, _PRELUDE + body + _REPORT.replace("WHAT", what))
             for which, module, body, what in (
                 ("pickle", "_pickleops", _PICKLES, "pickles"),
                 ("headers", "_headers", _HEADERS, "headers"),
                 ("zip", "_headers", _ZIPS, "archives"))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=200_000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--only", choices=sorted(_CHILDREN))
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
        # PYTHONMALLOC=malloc: every object its own allocation, so that a read past a small
        # bytes object (pymalloc would carve it out of an arena) is seen.
        env = {"PYTHONPATH": f"{tmp}:{REPO}", "LD_PRELOAD": ":".join(runtimes),
               "PYTHONMALLOC": "malloc", "ASAN_OPTIONS": "detect_leaks=0",
               "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1", "PATH": "/usr/bin:/bin"}
        for which, (module, child) in _CHILDREN.items():
            if args.only not in (None, which):
                continue
            source = REPO / "src" / "modelsize" / f"{module}.c"
            subprocess.run(
                [gcc, "-O1", "-g", "-fsanitize=address,undefined", "-fno-omit-frame-pointer",
                 "-shared", "-fPIC", f"-I{sysconfig.get_paths()['include']}", str(source),
                 "-o", str(pkg / f"{module}{suffix}")],
                check=True)
            proc = subprocess.run([sys.executable, "-c", child, str(args.cases), str(args.seed),
                                   tmp, str(pkg)], env=env, cwd=tmp)
            if proc.returncode:
                return proc.returncode
        return 0

if __name__ == "__main__":
    sys.exit(main())
