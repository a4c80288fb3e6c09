"""The ``modelsize`` command: parse arguments, call the library, render. No logic of its own.

Every :class:`~modelsize.errors.ModelSizeError` leaves through :func:`main` as one line on
stderr and its exit code (2 for bad input), never as a traceback.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from collections.abc import Sequence

from modelsize import __version__
from modelsize.errors import ModelSizeError, printable


def _inspect(args: argparse.Namespace) -> int:
    from modelsize.inspection import inspect
    from modelsize.report.text import render_inspect

    report = inspect(args.path)
    cost = None
    if args.load_cost:
        from modelsize.loadcost import measure_load_cost

        cost = measure_load_cost(report.inventory)
    if args.json:
        data = report.to_dict(top=args.top if args.top_given else None)
        if cost is not None:
            data["load_cost"] = cost.to_dict()
        print(json.dumps(data))
    else:
        sys.stdout.write(render_inspect(report, top=args.top))
        if cost is not None:
            from modelsize.report.loadcost_text import render_load_cost

            sys.stdout.write("\n" + render_load_cost(cost))
    return 0


def _diff(args: argparse.Namespace) -> int:
    from modelsize.diff import diff
    from modelsize.report.diff_text import render_diff

    result = diff(args.a, args.b)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        sys.stdout.write(render_diff(result))
    return 0


def _estimate(args: argparse.Namespace) -> int:
    from modelsize.estimate import command

    return command.run(args)


def _demo(args: argparse.Namespace) -> int:
    from modelsize.demo import run_demo

    return run_demo(args.dir, sections=args.only)


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The argument parser (sub-commands inspect, diff, estimate, demo).

    The estimate arguments are defined by :mod:`modelsize.estimate.command`; it is imported only
    when ``argv`` asks for ``estimate`` or for help, so ``inspect`` pays nothing for it.
    """
    parser = argparse.ArgumentParser(
        prog="modelsize",
        description="Why is this model file so big, how much memory will this model need, "
        "and how to make it smaller.",
    )
    parser.add_argument("--version", action="version", version=f"modelsize {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("inspect", help="account for every byte of a saved model file")
    p.add_argument("path", help="a model file, a checkpoint directory or prefix")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--top", type=int, default=None, help="largest tensors to list (default 10)")
    p.add_argument("--load-cost", action="store_true",
                   help="also measure the RAM and time of the usual ways to load it "
                   "(runs the real framework in a subprocess)")
    p.set_defaults(func=_inspect)

    p = sub.add_parser("diff", help="two checkpoints side by side, by category and by tensor")
    p.add_argument("a", help="first checkpoint")
    p.add_argument("b", help="second checkpoint")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_diff)

    p = sub.add_parser("estimate", help="exact memory a PyTorch model needs (inference, training)")
    words = list(sys.argv[1:] if argv is None else argv)
    if "estimate" in words or not words:
        from modelsize.estimate import command as estimate_command

        estimate_command.add_arguments(p)
    p.set_defaults(func=_estimate)

    p = sub.add_parser("demo", help="build example checkpoints on the spot and explain them")
    p.add_argument("--dir", default=None, help="keep the example files here (default: a temp dir)")
    p.add_argument("--only", action="append", default=None,
                   help="run only this section (inspect, estimate); repeatable")
    p.set_defaults(func=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script."""
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if getattr(args, "command", None) == "inspect":
        args.top_given = args.top is not None
        if args.top is None:
            args.top = 10
    # Inspecting builds many small acyclic objects: the cycle collector would only rescan them
    # (7 ms at 1,000 tensors, seconds at 20,000). Restored on the way out for in-process callers.
    gc_was_enabled = gc.isenabled()
    if getattr(args, "command", None) == "inspect":
        gc.disable()
    try:
        return int(args.func(args))
    except ModelSizeError as exc:
        print(f"modelsize: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("modelsize: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as exc:
        if os.environ.get("MODELSIZE_DEBUG"):
            raise
        print(
            f"modelsize: internal error: {type(exc).__name__}: {printable(str(exc))} "
            "(a modelsize bug: rerun with MODELSIZE_DEBUG=1 for the traceback and report it)",
            file=sys.stderr,
        )
        return 1
    finally:
        if gc_was_enabled:
            gc.enable()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
