"""``modelsize slim IN [-o OUT] ...``: a smaller copy, streamed, staged, verified."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Define the ``slim`` sub-command's arguments (choices come from the registries)."""
    from modelsize.slimming.cast import CASTABLE
    from modelsize.slimming.graph.onnx_slim import ExternalData
    from modelsize.slimming.plan import QUANTIZE_CHOICES, drop_choices
    from modelsize.slimming.writers import CONVERSIONS

    p.add_argument("path", metavar="IN", help="a model file, a checkpoint directory or prefix")
    p.add_argument("-o", "--output", dest="out", default=None, metavar="OUT",
                   help="where to write (default: IN's name with .slim before the extension)")
    p.add_argument("--drop", action="append", default=None, metavar="CATEGORY,...",
                   help=f"drop these ({', '.join(drop_choices())}); default without --drop, "
                   "--dedupe or --cast: everything inference does not need")
    p.add_argument("--dedupe", action="store_true",
                   help="store identical tensors once (aliases where the format has them)")
    p.add_argument("--cast", choices=[c for c in CASTABLE if c != "float64"], default=None,
                   help="narrow every wider floating tensor to this dtype")
    p.add_argument("--to", choices=["same", *CONVERSIONS, "tflite"], default="same",
                   help="output format (default: the input's)")
    p.add_argument("--quantize", choices=QUANTIZE_CHOICES, default=None,
                   help="ONNX: int8 (weight-only, per channel, DequantizeLinear), float16 "
                   "(float16 weights behind Cast), dynamic (onnxruntime's dynamic int8)")
    p.add_argument("--freeze", action="store_true",
                   help="freeze variables into constants (graph formats with variables)")
    p.add_argument("--no-graph", dest="graph", action="store_false",
                   help="ONNX: no graph passes, only initializer-level changes")
    p.add_argument("--external-data", choices=[e.value for e in ExternalData], default=None,
                   help="ONNX: where the output's tensors go: auto (default: one file when "
                   "it fits under protobuf's 2 GB limit, OUT.data beside it when not), always "
                   "(OUT.data), never (one file, or an error)")
    p.add_argument("--tolerance", type=float, default=None, metavar="REL",
                   help="graph passes: largest relative output difference accepted "
                   "(default 1e-5 exact, 1e-2 float16, 0.1 int8, 0.2 dynamic)")
    p.add_argument("--keep", action="append", default=[], metavar="GLOB",
                   help="keep entries matching GLOB whatever their category (e.g. epoch); "
                   "keeps the checkpoint's top-level layout; repeatable")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan (ONNX: the passes that would apply and what each "
                   "saves) and the predicted size, write nothing")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--html", metavar="FILE", default=None,
                   help="also write a self-contained HTML report, before/after (works offline)")
    p.add_argument("--force", action="store_true", help="replace an existing OUT")


class _Bar:
    """Bytes written of bytes planned, on a terminal's stderr, at most ten times a second."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.last = 0.0
        self.shown = False

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if not self.enabled or (now - self.last < 0.1 and done < total):
            return
        from modelsize.report.units import human_bytes

        self.last = now
        width = 30
        filled = width * done // total if total else width
        sys.stderr.write(f"\r  writing [{'#' * filled}{'.' * (width - filled)}] "
                         f"{human_bytes(done)} of {human_bytes(total)} ")
        sys.stderr.flush()
        self.shown = True

    def clear(self) -> None:
        if self.shown:
            sys.stderr.write("\r" + " " * 78 + "\r")
            sys.stderr.flush()


@contextlib.contextmanager
def _interruptible() -> Iterator[None]:
    """SIGTERM and SIGHUP end the slim like Ctrl-C: staged files are removed on the way out
    (raised where a Ctrl-C is: outside the import machinery, :class:`modelsize.cli.
    _Interrupts`)."""
    from modelsize.cli import _Interrupts

    def stop(signum: int, frame: Any) -> None:
        _Interrupts.pending, _Interrupts.finishing = True, False
        _Interrupts.raise_or_defer(frame)

    old = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        with contextlib.suppress(ValueError, OSError):  # not the main thread
            old[sig] = signal.signal(sig, stop)
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def run(args: argparse.Namespace) -> int:
    """Execute ``modelsize slim``."""
    from modelsize.report.files import check_output_file
    from modelsize.report.slim_text import render_slim
    from modelsize.slimming import slim

    check_output_file(args.html)
    if "://" in args.path:  # a URL: slimmed from a download, OUT in the current folder
        from modelsize.cli._remote import slim_url
        return slim_url(args, run)
    bar = _Bar(sys.stderr.isatty() and not args.json)
    # Passed only when given: the default (auto) is the library's own.
    layout = {} if args.external_data is None else {"external_data": args.external_data}
    try:
        with _interruptible():
            report = slim(
                args.path, args.out, drop=args.drop, dedupe=args.dedupe, cast=args.cast,
                to=args.to, keep=args.keep, dry_run=args.dry_run, force=args.force,
                progress=bar, graph=args.graph, quantize=args.quantize, freeze=args.freeze,
                tolerance=args.tolerance, **layout,
            )
    finally:
        bar.clear()
    if args.json:
        from modelsize.report.json_stream import dump

        dump(report.to_json(), sys.stdout.write)  # the tensor lists written as they are made
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render_slim(report))
    if args.html:
        from modelsize.report import html

        html.write(args.html, html.render_slim(report))
    return 0
