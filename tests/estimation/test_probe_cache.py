"""Kernel probes answered from the process and the disk give the estimate a real run gives.

``estimation/probe_cache.py`` keeps each probe's answer (the kernel's scratch, its output
corrections, the notes it gave) under the call and the settings; these tests run the same
estimate with the probes run for real and answered from memory and from the file, and check
that the cache stays out of the way where it cannot help (turned off, a broken file).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from modelsize.estimation import estimate, probe_cache, scratch


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(96, 96)
        self.norm = nn.LayerNorm(96)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc(x)).sum()


def _estimate() -> tuple[object, ...]:
    torch.manual_seed(0)
    est = estimate(_Net(), (torch.randn(4, 128, 96),), optimizer="adamw", device="cpu",
                   loss=lambda out, *_: out)
    return est.peak_bytes, est.categories, est.timeline, est.notes


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An empty cache folder, and nothing known to this process."""
    monkeypatch.setenv("MODELSIZE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("MODELSIZE_PROBE_CACHE", raising=False)
    monkeypatch.setattr(probe_cache, "_KNOWN", {})
    monkeypatch.setattr(probe_cache, "_LOADED", set())
    return tmp_path


def _runs(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Every real kernel run a probe makes, from now on."""
    runs: list[object] = []
    real = scratch._run

    def counted(func, *rest):  # type: ignore[no-untyped-def]
        runs.append(func)
        return real(func, *rest)

    monkeypatch.setattr(scratch, "_run", counted)
    return runs


def test_answers_from_the_disk_equal_the_real_runs(fresh: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    runs = _runs(monkeypatch)
    first = _estimate()
    assert torch.ops.aten.native_layer_norm_backward.default in runs
    files = list(fresh.glob("probes-*.json"))
    assert len(files) == 1
    entries = json.loads(files[0].read_text())
    assert any("native_layer_norm_backward" in k for k in entries)
    # a new process: nothing in memory, the file read
    monkeypatch.setattr(probe_cache, "_KNOWN", {})
    monkeypatch.setattr(probe_cache, "_LOADED", set())
    runs.clear()
    assert _estimate() == first
    assert runs == []
    # and within this process, from memory
    files[0].unlink()
    assert _estimate() == first
    assert runs == []


def test_turned_off_it_writes_nothing_and_runs_every_probe(
        fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODELSIZE_PROBE_CACHE", "0")
    runs = _runs(monkeypatch)
    first = _estimate()
    assert runs and not list(fresh.iterdir())
    monkeypatch.setattr(probe_cache, "_KNOWN", {})
    runs.clear()
    assert _estimate() == first
    assert runs


def test_a_broken_file_counts_as_empty_and_is_rewritten(
        fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runs = _runs(monkeypatch)
    first = _estimate()
    path = next(fresh.glob("probes-*.json"))
    for text in ("{not json", json.dumps({"k": [[1, "x"], [], 1]}), json.dumps([1, 2])):
        path.write_text(text)
        monkeypatch.setattr(probe_cache, "_KNOWN", {})
        monkeypatch.setattr(probe_cache, "_LOADED", set())
        runs.clear()
        assert _estimate() == first
        assert runs  # run again, not answered from the broken file
        assert any("native_layer_norm_backward" in k for k in json.loads(path.read_text()))


def test_another_thread_count_is_another_call(fresh: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    runs = _runs(monkeypatch)
    _estimate()
    threads = torch.get_num_threads()
    runs.clear()
    torch.set_num_threads(threads + 1)
    try:
        _estimate()
    finally:
        torch.set_num_threads(threads)
    assert torch.ops.aten.native_layer_norm_backward.default in runs
