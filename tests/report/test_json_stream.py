"""The streamed JSON of ``inspect --json`` and ``slim --json``: byte for byte what
``json.dumps(report.to_dict())`` wrote before it was streamed."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import modelsize
from modelsize.report import json_stream
from modelsize.report.json_stream import Lazy, dump
from tests.conftest import run_cli

safetensors_numpy = pytest.importorskip("safetensors.numpy")


def _streamed(obj: Any) -> str:
    out = io.StringIO()
    dump(obj, out.write)
    return out.getvalue()


@pytest.mark.parametrize("count", [0, 1, json_stream.BATCH - 1, json_stream.BATCH,
                                   json_stream.BATCH + 1, 2 * json_stream.BATCH + 3])
def test_lazy_lists_across_batches(count: int) -> None:
    items = [{"name": f"t{i}", "shape": [i, 2], "x": i / 3, "none": None} for i in range(count)]
    doc = {"a": 1, "tensors": Lazy(iter(items)), "nested": {"more": Lazy(iter(range(count))),
                                                           "plain": [1, 2]}, "z": "end"}
    expected = json.dumps({"a": 1, "tensors": items,
                           "nested": {"more": list(range(count)), "plain": [1, 2]}, "z": "end"})
    assert _streamed(doc) == expected


def test_keys_and_strings_as_json_dumps_writes_them() -> None:
    names = ['q"uote', "back\\slash", "tab\tnew\nline", "ünï", "\x00\x1f", "\ud800x", "日本"]

    def doc() -> dict[Any, Any]:
        made: dict[Any, Any] = {name: Lazy(iter([name, {name: name}])) for name in names}
        made.update({7: "int key", 2.5: "float key", False: "bool key", None: "none key"})
        return made

    expected = json.dumps({**{name: [name, {name: name}] for name in names},
                           7: "int key", 2.5: "float key", False: "bool key",
                           None: "none key"})
    assert json.dumps(json_stream.materialized(doc())) == expected
    assert _streamed(doc()) == expected


def _model(path: Path) -> None:
    rng = np.random.default_rng(0)
    tensors = {f"layers.{i}.weight": rng.standard_normal((3, i + 1), dtype=np.float32)
               for i in range(40)}
    tensors["layers.0.exp_avg"] = np.zeros((3, 1), np.float32)
    tensors["naïve\"name"] = np.arange(4, dtype=np.int64)
    tensors["copy"] = tensors["layers.5.weight"].copy()
    safetensors_numpy.save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.mark.parametrize("top", [None, 0, 3, 1000])
def test_inspect_json_is_json_dumps_of_to_dict(tmp_path: Path, top: int | None) -> None:
    path = tmp_path / "m.safetensors"
    _model(path)
    report = modelsize.inspect(path)
    assert _streamed(report.to_json(top)) == json.dumps(report.to_dict(top))
    args = ["inspect", str(path), "--json"] + ([] if top is None else ["--top", str(top)])
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == json.dumps(report.to_dict(top)) + "\n"


@pytest.mark.parametrize("options", [{}, {"dedupe": True}, {"to": "npz"}])
def test_slim_json_is_json_dumps_of_to_dict(tmp_path: Path, options: dict[str, Any]) -> None:
    path = tmp_path / "m.safetensors"
    _model(path)
    report = modelsize.slim(path, tmp_path / ("o.npz" if options.get("to") else
                                              "o.safetensors"), **options)
    assert report.kept and (report.dropped or options)
    assert _streamed(report.to_json()) == json.dumps(report.to_dict())


def test_top_lists_the_largest_in_file_order_on_ties(tmp_path: Path) -> None:
    """``--top`` picks the largest without sorting every tensor: ties keep file order, as the
    stable sort did."""
    path = tmp_path / "ties.safetensors"
    sizes = [3, 7, 7, 1, 7, 3]
    safetensors_numpy.save_file({f"t{i}": np.zeros(n, np.float32) + i
                                 for i, n in enumerate(sizes)}, str(path))
    report = modelsize.inspect(path)
    order = [t.name for t in report.inventory.tensors]
    expected = sorted(order, key=lambda name: -sizes[int(name[1:])] * 4)
    for n in range(len(sizes) + 2):
        assert [t.name for t in report.largest(n)] == expected[:n]
