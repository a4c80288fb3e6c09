"""Hostile sizes: every reproducer of issue 18 item 7 through ``inspect`` and ``slim``.

The reproducers (``tests/formats/hostile_sizes.py``: a 63 MiB ``config.json`` of nested lists,
a 960 MiB ``data.pkl``, a 99 MB safetensors header, a 99 MB index, 1.2M tensors, an ``.npz`` of
200k members, 4 GiB deflate bombs in a ``.keras``...) are written into a temporary folder
(sparse or streamed: about 1.5 GB of disk, a few seconds), then each is run through

* ``modelsize inspect FILE`` (the text report: ``--json`` lists every tensor, a JSON document
  as large as the header it describes) and
* ``modelsize slim FILE -o OUT --force``,

each in a fresh process, and the exit code, the seconds (wall and CPU: the machine may be
shared), the peak RSS (the process's own ``VmHWM``) and the load average when it ended are
printed. The target: every run answers (exit 0, or exit 2 with one line) within 20 s and
1 GiB.

    python benchmarks/hostile.py [--scale 1.0] [--only NAME] [--timeout 120] [--write]

``--write`` records the table in RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import runpy
import sys
import tempfile
from pathlib import Path

from _results import write_section

REPO = Path(__file__).resolve().parents[1]
#: The generators and the measuring helper, shared with the tests (run from their file: the
#: tests folder is not a package on this script's path).
_GEN = runpy.run_path(str(REPO / "tests" / "formats" / "hostile_sizes.py"))
REPRODUCERS = _GEN["REPRODUCERS"]
measure = _GEN["measure"]
TARGET_S, TARGET_RSS = 20.0, 1 << 30


def _verdict(run: object) -> str:
    rc, stderr = run.returncode, run.stderr.strip()  # type: ignore[attr-defined]
    if run.timed_out:  # type: ignore[attr-defined]
        return "no answer"
    if rc == 0:
        return "ok"
    last = stderr.splitlines()[-1] if stderr else ""
    return f"exit {rc}: {last[:110]}"


def _children_cpu() -> float:
    """CPU seconds (user and system) of the child processes waited for so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--only", action="append", choices=sorted(REPRODUCERS))
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--write", action="store_true", help="record the table in RESULTS.md")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="modelsize-hostile-") as tmp:
        folder = Path(tmp)
        for name, (make, _what) in REPRODUCERS.items():
            if args.only and name not in args.only:
                continue
            path = make(folder, args.scale)
            out = folder / f"{name}.out{''.join(path.suffixes[-1:])}"
            for verb, argv in (
                ("inspect", [str(path)]),
                ("slim", [str(path), "-o", str(out), "--force"]),
            ):
                before = _children_cpu()
                run = measure([verb, *argv], args.timeout)
                cpu = _children_cpu() - before
                load = os.getloadavg()[0]
                ok = (not run.timed_out and run.seconds < TARGET_S and run.maxrss < TARGET_RSS
                      and run.returncode in (0, 2))
                row = (name, verb, run.seconds, cpu, run.maxrss / (1 << 20), load,
                       _verdict(run), ok)
                rows.append(row)
                print(f"{name:26} {verb:8} {run.seconds:7.1f} s {cpu:7.1f} s cpu "
                      f"{row[4]:8.0f} MiB  load {load:4.2f}  {'PASS' if ok else 'FAIL'}  "
                      f"{row[6]}", flush=True)
            for p in folder.iterdir():  # one case's files at a time: they are large
                if p.is_dir():
                    for q in p.iterdir():
                        q.unlink()
                    p.rmdir()
                else:
                    p.unlink()
    if args.write:
        loads = [r[5] for r in rows]
        lines = [
            f"`python benchmarks/hostile.py --scale {args.scale}` on {platform.machine()} "
            f"({os.cpu_count()} CPUs), Python {platform.python_version()}: wall and CPU "
            "seconds and peak RSS of each process, and the 1-minute load average when it "
            f"ended ({min(loads, default=0):.2f} to {max(loads, default=0):.2f} during the "
            "run: the machine was shared); target under 20 s and 1 GiB, exit 0 or one line "
            "and exit 2.",
            "",
            "| case | verb | seconds | CPU seconds | peak RSS (MiB) | load | result "
            "| within target |",
            "|---|---|---:|---:|---:|---:|---|---|",
        ]
        lines += [f"| {n} | {v} | {s:.1f} | {c:.1f} | {r:.0f} | {ld:.2f} | {w} | "
                  f"{'yes' if ok else 'NO'} |" for n, v, s, c, r, ld, w, ok in rows]
        write_section("hostile", "## Hostile sizes (issue 18 item 7)\n\n" + "\n".join(lines))
    return 0 if all(r[-1] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
