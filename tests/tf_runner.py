"""One TensorFlow process per test worker, reused by :func:`tests.conftest.run_in_tf`.

Each snippet used to start its own interpreter of the TensorFlow venv: importing TensorFlow
costs about 4 s, paid again by each of the suite's snippets. The runner imports what the
snippets import once and runs each snippet as ``python -c CODE ARGS`` would: ``__name__`` is
``"__main__"``, ``sys.argv`` is ``["-c", *args]``, in fresh globals, in the caller's working
folder, ``SystemExit`` gives the exit code, an exception a traceback on stderr and code 1.
Between snippets what TensorFlow and Keras keep globally is reset (Keras' layer-name
counters, TF1's default graph). A snippet that crashes or outlives its timeout ends the
runner: the next one starts a fresh one.

``MODELSIZE_TF_FRESH=1`` runs every snippet in a fresh interpreter, as before.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import time
from typing import Any

#: The runner's loop, run by the TensorFlow venv's Python. Replies go to a file descriptor of
#: their own (a snippet or TensorFlow's C++ may write to fd 1 or 2).
SERVER = r"""
import contextlib, gc, io, json, os, sys, traceback
replies = os.fdopen(int(sys.argv[1]), "w", buffering=1)
requests = sys.stdin

def reset():
    keras = sys.modules.get("keras")
    if keras is not None:
        keras.backend.clear_session()
    tf_keras = sys.modules.get("tf_keras")
    if tf_keras is not None:
        tf_keras.backend.clear_session()
    tf = sys.modules.get("tensorflow")
    if tf is not None:
        tf.compat.v1.reset_default_graph()
    gc.collect()

for line in requests:
    request = json.loads(line)
    out, err = io.StringIO(), io.StringIO()
    rc = 0
    os.chdir(request["cwd"])
    sys.argv = ["-c", *request["args"]]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            exec(compile(request["code"], "<string>", "exec"), {"__name__": "__main__"})
    except SystemExit as exc:
        code = exc.code
        rc = code if isinstance(code, int) else (0 if code is None else 1)
        if code is not None and not isinstance(code, int):
            err.write(f"{code}\n")
    except BaseException:
        err.write(traceback.format_exc())
        rc = 1
    try:
        reset()
    except BaseException:
        err.write(traceback.format_exc())
    replies.write(json.dumps({"rc": rc, "stdout": out.getvalue(), "stderr": err.getvalue()})
                  + "\n")
"""


class Runner:
    """The worker's TensorFlow process (started on first use)."""

    def __init__(self, python: str, env: dict[str, str]) -> None:
        self.python, self.env = python, env
        self.proc: subprocess.Popen[str] | None = None
        self.replies: Any = None

    def _start(self) -> None:
        read, write = os.pipe()
        self.proc = subprocess.Popen(
            [self.python, "-u", "-c", SERVER, str(write)], stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True, env=self.env,
            pass_fds=(write,))
        os.close(write)
        self.replies = os.fdopen(read, "r")

    def run(self, code: str, args: tuple[str, ...], timeout: float
            ) -> subprocess.CompletedProcess[str]:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        assert self.proc is not None and self.proc.stdin is not None
        request = {"code": code, "args": list(args), "cwd": os.getcwd()}
        argv = [self.python, "-c", code, *args]
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            self.close()
            return subprocess.CompletedProcess(argv, 1, "", "the TensorFlow runner died")
        with selectors.DefaultSelector() as sel:
            sel.register(self.replies, selectors.EVENT_READ)
            deadline = time.monotonic() + timeout
            if not sel.select(max(0.0, deadline - time.monotonic())):
                self.close()
                raise subprocess.TimeoutExpired(argv, timeout)
        line = self.replies.readline()
        if not line:  # the snippet crashed the runner
            rc = self.proc.wait()
            self.close()
            return subprocess.CompletedProcess(argv, rc or 1, "", f"the runner died ({rc})")
        reply = json.loads(line)
        return subprocess.CompletedProcess(argv, reply["rc"], reply["stdout"], reply["stderr"])

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        if self.replies is not None:
            self.replies.close()
        self.proc = self.replies = None


_RUNNERS: dict[tuple[str, str], Runner] = {}


def run(python: str, env: dict[str, str], code: str, args: tuple[str, ...],
        timeout: float) -> subprocess.CompletedProcess[str]:
    """``[python, "-c", code, *args]`` with ``env``, in this worker's runner."""
    if os.environ.get("MODELSIZE_TF_FRESH") == "1":
        return subprocess.run([python, "-c", code, *args], capture_output=True, text=True,
                              timeout=timeout, env=env)
    key = (python, json.dumps(env, sort_keys=True))
    runner = _RUNNERS.get(key)
    if runner is None:
        runner = _RUNNERS[key] = Runner(python, env)
    return runner.run(code, args, timeout)


def close_all() -> None:
    """End every runner (the test session is over)."""
    for runner in _RUNNERS.values():
        runner.close()
    _RUNNERS.clear()
