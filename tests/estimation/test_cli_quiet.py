"""``modelsize estimate`` prints its report, and no library's chatter."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")


def test_the_command_prints_the_report_and_nothing_else() -> None:
    """No library chatter on stderr (torchao's unloadable CUDA extensions, torch's pytree
    notices: transformers imports torchao's quantizer for any model when it is installed)."""
    proc = subprocess.run([sys.executable, "-m", "modelsize", "estimate", "gpt2", "--infer",
                           "--batch", "1", "--seq", "8"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert proc.stdout.startswith("gpt2: GPT-2 small")
