"""The ``modelsize`` command: one module per verb (parse, call the library, render).

Every :class:`~modelsize.errors.ModelSizeError` leaves through :func:`main` as one line on
stderr and its exit code (2 for bad input), never as a traceback. Each verb's module is
imported only when that verb runs (or for help), so ``inspect`` pays nothing for torch.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from modelsize import __version__
from modelsize.errors import ModelSizeError, printable

#: verb -> one-line help. Each verb is the module ``modelsize.cli.<verb>`` with
#: ``add_arguments(parser)`` and ``run(args) -> int``.
VERBS: dict[str, str] = {
    "inspect": "account for every byte of a saved model file",
    "slim": "write a smaller copy: drop what inference does not need, cast, convert",
    "diff": "two checkpoints side by side, by category and by tensor",
    "check": "fail (exit 1) when a model file breaks the rules: size, optimizer state... (CI)",
    "estimate": "exact memory a PyTorch model needs (inference, training)",
    "demo": "build example checkpoints on the spot, explain them and slim them",
}


def _verb(name: str):  # type: ignore[no-untyped-def]  # a module
    return importlib.import_module(f"modelsize.cli.{name}")


def _columns() -> int:
    """``shutil.get_terminal_size().columns`` without importing shutil (argparse imports it
    for every formatter, and it makes one per argument: 3 ms of an 0.15 s ``inspect``)."""
    try:
        columns = int(os.environ["COLUMNS"])
    except (KeyError, ValueError):
        columns = 0
    if columns <= 0:
        try:
            columns = os.get_terminal_size(sys.__stdout__.fileno()).columns  # type: ignore[union-attr]
        except (AttributeError, ValueError, OSError):
            columns = 0
    return columns or 80


class _Formatter(argparse.HelpFormatter):
    """argparse's formatter, its width found without shutil."""

    def __init__(self, prog: str, indent_increment: int = 2, max_help_position: int = 24,
                 width: int | None = None) -> None:
        super().__init__(prog, indent_increment, max_help_position,
                         _columns() - 2 if width is None else width)


class _Parser(argparse.ArgumentParser):
    """argparse with the CLI's error form: one line on stderr and exit 2 (argparse's own
    prints the whole usage first), pointing at ``--help``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        self.exit(2, f"{self.prog}: {printable(message, 300)} (see {self.prog} --help)\n")


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The argument parser. Only the verb named in ``argv`` (or every verb, for help) is
    imported to define its arguments."""
    parser = _Parser(
        prog="modelsize",
        description="Why is this model file so big, how much memory will this model need, "
        "and how to make it smaller.",
    )
    parser.add_argument("--version", action="version", version=f"modelsize {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    words = list(sys.argv[1:] if argv is None else argv)
    chosen = next((w for w in words if w in VERBS), None)
    for name, help_text in VERBS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if chosen is None or chosen == name:
            _verb(name).add_arguments(p)
        p.set_defaults(verb=name)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script.

    Everything, the parser included (building it imports the verb's module), runs inside the
    error funnel: a Ctrl-C at any point is one line, ``modelsize: interrupted``, and exit 130.
    """
    gc_was_enabled = gc.isenabled()
    if argv is None:
        _Interrupts.catch()
    try:
        parser = build_parser(argv)
        args = parser.parse_args(argv)
        # Inspecting builds many small acyclic objects: the cycle collector would only rescan
        # them (7 ms at 1,000 tensors, seconds at 20,000). Restored on the way out for
        # in-process callers.
        if args.verb in ("inspect", "slim", "diff", "check"):
            gc.disable()
        return int(_verb(args.verb).run(args))
    except KeyboardInterrupt:
        return _interrupted()
    except ModelSizeError as exc:
        if _Interrupts.pending:  # a failure a Ctrl-C caused
            return _interrupted()
        print(f"modelsize: {exc}", file=sys.stderr)
        return exc.exit_code
    except BrokenPipeError:
        return 0
    except Exception as exc:
        if _Interrupts.pending:
            return _interrupted()
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
        if argv is None:
            _Interrupts.release()


#: Loggers whose warnings say nothing about a report: transformers imports torchao's quantizer
#: for any model when torchao is installed, and torchao then logs each CUDA extension it
#: cannot load on a CPU build, and torch's pytree each Enum it registers; bitsandbytes that
#: its optional CPU kernel package is not installed (the trace runs no kernel).
QUIET_LOGGERS = ("torchao", "torch.utils._pytree", "bitsandbytes.backends.cpu.ops")


def quiet_library_logs() -> None:
    """Errors only from :data:`QUIET_LOGGERS`: for the verbs that import torch (logging is
    not imported for the others)."""
    import logging

    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


def _interrupted() -> int:
    _Interrupts.finishing = True
    print("modelsize: interrupted", file=sys.stderr)
    return 130


class _Interrupts:
    """Ctrl-C for the command (``main()`` without arguments), never lost and never a traceback
    or an abort.

    Python turns SIGINT into ``KeyboardInterrupt`` wherever the main thread is. Raised inside
    the import machinery it goes wrong three ways: torch's C start-up imports NumPy and
    clears any error that import raises (the Ctrl-C would be ignored and the command run to
    its end); importlib's module-lock callbacks print "Exception ignored in ..." and a
    traceback; and an exception thrown through torch's C++ start-up can end the process in
    ``std::terminate`` (an abort, exit -6). So the handler raises only where no import is
    under way (no frame of ``importlib._bootstrap`` on the stack). Elsewhere it notes the
    interrupt and asks again every few milliseconds (``SIGALRM``) until the import is done,
    then raises. Once the command is finishing, a Ctrl-C is the signal's default (the
    process ends, without a traceback from interpreter shutdown).
    """

    pending = False
    finishing = False
    #: How often a deferred Ctrl-C looks again for a point outside the import machinery.
    RETRY_S = 0.005

    @classmethod
    def catch(cls) -> None:
        import signal

        cls.pending = cls.finishing = False
        with contextlib.suppress(ValueError, OSError):  # not the main thread
            # An inherited SIG_IGN (a background job of a script) stays as it is.
            from modelsize import _interrupted_at_start

            if signal.getsignal(signal.SIGINT) in (signal.default_int_handler,
                                                   _interrupted_at_start):
                signal.signal(signal.SIGINT, cls._on_sigint)

    @classmethod
    def _on_sigint(cls, signum: int, frame: object) -> None:
        if cls.finishing:
            return
        cls.pending = True
        cls.raise_or_defer(frame)

    @classmethod
    def _retry(cls, signum: int, frame: object) -> None:
        if cls.pending and not cls.finishing:
            cls.raise_or_defer(frame)

    @classmethod
    def raise_or_defer(cls, frame: object) -> None:
        """Raise ``KeyboardInterrupt`` here, or as soon as no import is under way."""
        import signal

        if not _importing(frame):
            raise KeyboardInterrupt
        try:
            if signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, cls._retry):
                signal.signal(signal.SIGALRM, cls._retry)
                signal.setitimer(signal.ITIMER_REAL, cls.RETRY_S)
                return
        except (AttributeError, ValueError, OSError):  # no SIGALRM / setitimer here
            pass
        raise KeyboardInterrupt  # no way to come back: as Python would

    @classmethod
    def release(cls) -> None:
        import signal

        cls.finishing = True
        cls.pending = False
        with contextlib.suppress(ValueError, OSError):
            if signal.getsignal(signal.SIGINT) == cls._on_sigint:
                signal.signal(signal.SIGINT, signal.SIG_DFL)
        with contextlib.suppress(AttributeError, ValueError, OSError):
            if signal.getsignal(signal.SIGALRM) == cls._retry:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, signal.SIG_DFL)


def _importing(frame: object) -> bool:
    """Whether ``frame`` or a caller of it is in the import machinery (a module's code runs
    under ``importlib._bootstrap``'s frames)."""
    f = frame
    while f is not None:
        if getattr(getattr(f, "f_code", None), "co_filename", "").startswith(
                "<frozen importlib"):
            return True
        f = getattr(f, "f_back", None)
    return False


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
