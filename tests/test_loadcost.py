"""``inspect --load-cost``: ways to load a file, each measured in a subprocess.

Files are tiny and no timing or memory value is asserted beyond being measured and
non-negative: the point is which ways run, which are skipped and why.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from modelsize.formats import read
from modelsize.loadcost import LoadCost, WayResult, WayStatus, measure_load_cost
from modelsize.report.loadcost_text import render_load_cost
from tests.conftest import REPO, run_cli

np = pytest.importorskip("numpy")


class Payload:
    """A class a pickle must import from this test module: loading it runs foreign code."""


def _npy(tmp_path: Path) -> Path:
    path = tmp_path / "a.npy"
    np.save(path, np.arange(1000, dtype=np.float32))
    return path


def test_numpy_ways_are_measured(tmp_path: Path) -> None:
    cost = measure_load_cost(read(_npy(tmp_path)))
    assert [w.way for w in cost.ways] == ["numpy.load", "numpy.load(mmap_mode='r')"]
    for w in cost.ways:
        assert w.status is WayStatus.MEASURED, w.note
        assert w.peak_rss_bytes is not None and w.peak_rss_bytes >= 0
        assert w.seconds is not None and w.seconds >= 0
        assert w.total_peak_rss_bytes is not None and w.total_peak_rss_bytes >= w.peak_rss_bytes
    assert cost.cheapest is not None and cost.cheapest.way in {w.way for w in cost.ways}
    assert [i.framework for i in cost.imports] == ["numpy"]
    out = cost.to_dict()
    json.dumps(out)
    assert out["cheapest"] == cost.cheapest.way
    assert out["import_cost"][0]["peak_rss_bytes"] > 0


def test_one_child_per_way_and_the_import_cost_from_the_first(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from modelsize import loadcost

    children: list[str] = []
    run = loadcost._run_child

    def counted(imports: str, load: str, *rest: object) -> object:
        children.append(load)
        return run(imports, load, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(loadcost, "_run_child", counted)
    cost = measure_load_cost(read(_npy(tmp_path)))
    assert len(children) == 2 and all(children)  # no child that only imports
    (imp,) = cost.imports
    assert imp.peak_rss_bytes > 0 and imp.seconds > 0
    assert all(w.total_peak_rss_bytes is not None and w.total_peak_rss_bytes >= imp.peak_rss_bytes
               for w in cost.ways)


def test_a_framework_that_prints_on_import_still_gives_its_import_cost(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dataclasses import replace

    from modelsize import loadcost

    plan = loadcost._plan
    monkeypatch.setattr(loadcost, "_plan", lambda inv: (
        [replace(w, imports=w.imports + "\nprint('a banner')") for w in plan(inv)[0]],
        *plan(inv)[1:]))
    cost = measure_load_cost(read(_npy(tmp_path)))
    assert [w.status for w in cost.ways] == [WayStatus.MEASURED] * 2
    (imp,) = cost.imports
    assert imp.peak_rss_bytes > 0


def test_a_framework_that_fails_to_import_is_one_failure_per_way(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dataclasses import replace

    from modelsize import loadcost

    plan = loadcost._plan

    def broken(inv: object) -> object:
        ways, paths, notes = plan(inv)  # type: ignore[arg-type]
        return [replace(w, imports="import numpy\nraise ImportError('no numpy here')")
                for w in ways], paths, notes

    monkeypatch.setattr(loadcost, "_plan", broken)
    children: list[str] = []
    run = loadcost._run_child
    monkeypatch.setattr(loadcost, "_run_child",
                        lambda i, load, *rest: children.append(load) or run(i, load, *rest))
    cost = measure_load_cost(read(_npy(tmp_path)))
    assert len(children) == 1  # the second way is not tried again
    assert [w.status for w in cost.ways] == [WayStatus.FAILED] * 2
    assert all(w.note == "importing numpy failed: ImportError: no numpy here" for w in cost.ways)
    assert cost.imports == ()


def test_torch_ways(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    path = tmp_path / "m.pt"
    torch.save({"w": torch.zeros(16, 16)}, path)
    cost = measure_load_cost(read(path), ways=["torch.load()", "torch.load(mmap=True)"])
    assert {w.way: w.status for w in cost.ways} == {
        "torch.load()": WayStatus.MEASURED, "torch.load(mmap=True)": WayStatus.MEASURED}
    assert "memory-mapped" in cost.ways[1].note


def test_unrestricted_unpickling_is_never_run_on_unsafe_files(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    path = tmp_path / "obj.pt"
    torch.save({"w": torch.zeros(2), "obj": Payload()}, path)
    inv = read(path)
    assert inv.unsafe_globals
    cost = measure_load_cost(inv, ways=["torch.load(weights_only=False)"])
    (way,) = cost.ways
    assert way.status is WayStatus.SKIPPED
    assert "unrestricted unpickler" in way.note and "Payload" in way.note


def test_missing_framework_is_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "numpy" else real(name, *a))
    cost = measure_load_cost(read(_npy(tmp_path)))
    assert {w.status for w in cost.ways} == {WayStatus.SKIPPED}
    assert all(w.note == "numpy is not installed" for w in cost.ways)
    assert cost.cheapest is None


def test_failures_are_reported_not_raised() -> None:
    pytest.importorskip("torch")
    inv = read(REPO / "tests" / "fixtures" / "deepspeed" / "zero1")
    cost = measure_load_cost(inv, ways=["torch.load(weights_only=True)"])
    (way,) = cost.ways
    # DeepSpeed pickles its own classes, which weights_only refuses.
    assert way.status is WayStatus.FAILED
    assert way.note
    assert any("DeepSpeed" in n for n in cost.notes)


def test_legacy_torch_files_cannot_map(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    path = tmp_path / "old.pt"
    torch.save({"w": torch.zeros(2)}, path, _use_new_zipfile_serialization=False)
    cost = measure_load_cost(read(path), ways=[])
    assert cost.ways == ()
    assert any("mmap" in n for n in cost.notes)


def test_formats_without_ways_say_so() -> None:
    cost = measure_load_cost(read(REPO / "tests" / "fixtures" / "gguf" / "tiny.gguf"))
    assert cost.ways == () and cost.notes


def test_the_unsafe_loader_is_never_recommended(tmp_path: Path) -> None:
    """The summary named torch.load(weights_only=False) "fastest" (issue 18, smaller ones)."""
    torch = pytest.importorskip("torch")
    path = tmp_path / "m.pt"
    torch.save({"w": torch.zeros(16, 16)}, path)
    cost = measure_load_cost(read(path), ways=["torch.load(weights_only=True)",
                                                "torch.load(weights_only=False)"])
    flags = {w.way: (w.status, w.unsafe) for w in cost.ways}
    assert flags == {"torch.load(weights_only=True)": (WayStatus.MEASURED, False),
                     "torch.load(weights_only=False)": (WayStatus.MEASURED, True)}
    assert cost.cheapest is not None and cost.cheapest.way == "torch.load(weights_only=True)"
    assert cost.fastest is not None and cost.fastest.way == "torch.load(weights_only=True)"
    out = cost.to_dict()
    assert "weights_only=False" not in f"{out['cheapest']} {out['fastest']}"
    assert [w["unsafe"] for w in out["ways"]] == [False, True]
    # Rendered, even when the unsafe way measured fastest and cheapest
    fake = LoadCost(Path("m.pt"), "pytorch", 100, (
        WayResult("torch.load(weights_only=True)", "torch", WayStatus.MEASURED, 2 << 20, 0.5),
        WayResult("torch.load(weights_only=False)", "torch", WayStatus.MEASURED, 1 << 20, 0.1,
                  unsafe=True),
    ))
    text = render_load_cost(fake)
    (row,) = [ln for ln in text.splitlines() if ln.startswith("  torch.load(weights_only=False)")]
    assert "UNSAFE" in row
    summary = text[text.index("Cheapest"):]
    assert "weights_only=False" not in summary and "fastest" not in summary
    only_unsafe = LoadCost(Path("m.pt"), "pytorch", 100, fake.ways[1:])
    assert only_unsafe.cheapest is None
    assert "No safe way" in render_load_cost(only_unsafe)


@pytest.mark.parametrize(("version", "unsafe"), [("2.5.1+cu121", True), ("2.6.0", False),
                                                 ("2.13.0+cpu", False), ("1.13.1", True)])
def test_plain_torch_load_is_unsafe_before_torch_2_6(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version: str, unsafe: bool) -> None:
    import importlib.metadata

    pytest.importorskip("torch")
    import torch

    path = tmp_path / "m.pt"
    torch.save({"w": torch.zeros(2)}, path)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: version)
    cost = measure_load_cost(read(path), ways=["torch.load()"],
                             timeout=0.001)  # the flag is decided before the child runs
    (way,) = cost.ways
    assert way.unsafe is unsafe


def test_render() -> None:
    cost = LoadCost(Path("m.pt"), "pytorch", 100, (
        WayResult("torch.load()", "torch", WayStatus.MEASURED, 2 << 20, 0.5, 300 << 20, 2.0),
        WayResult("torch.load(mmap=True)", "torch", WayStatus.MEASURED, 1 << 20, 0.7,
                  299 << 20, 2.1, "memory-mapped"),
        WayResult("torch.load(weights_only=False)", "torch", WayStatus.SKIPPED,
                  note="not run: unsafe"),
    ))
    text = render_load_cost(cost)
    assert "Cheapest: torch.load(mmap=True) (1 MiB" in text  # binary units
    assert "fastest: torch.load() (500 ms)" in text
    assert "skipped: not run: unsafe" in text


def test_cli(tmp_path: Path) -> None:
    path = _npy(tmp_path)
    proc = run_cli("inspect", str(path), "--load-cost", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert [w["way"] for w in out["load_cost"]["ways"]] == [
        "numpy.load", "numpy.load(mmap_mode='r')"]
    text = run_cli("inspect", str(path), "--load-cost")
    assert text.returncode == 0 and "What loading costs" in text.stdout
