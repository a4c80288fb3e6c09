"""Duplicate tensors of a remote file, compared by sampled ranges fetched by range requests
(:mod:`modelsize.remote_duplicates`), against a loopback server."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save

from modelsize import formats
from modelsize.cli import main
from modelsize.remote import inspect_remote, read_remote
from modelsize.remote_duplicates import MAX_BYTES, PROBE
from tests.loopback_hub import serve

KIB = 1024


def _write(path: Path, tensors: dict[str, torch.Tensor]) -> list[str]:
    """Save ``tensors`` with safetensors; return their names in the order of their offsets
    (read from the header here, not by modelsize)."""
    path.write_bytes(save(tensors))
    raw = path.read_bytes()
    (n,) = struct.unpack_from("<Q", raw)
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    return sorted(header, key=lambda k: header[k]["data_offsets"][0])


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """org/dups/model.safetensors: six 1 MiB float32 tensors of one shape, of which b is a
    copy of a and f differs from e in its first element only; a pair of equal 1 KiB biases;
    a pair of equal all-ones norms (constant: never reported). org/budget/model.safetensors:
    a tied pair and forty different tensors of another shape."""
    root = tmp_path_factory.mktemp("hub")
    torch.manual_seed(0)
    a, e, bias = torch.randn(512, 512), torch.randn(512, 512), torch.randn(256)
    f = e.clone()
    f[0, 0] += 1
    (root / "org/dups").mkdir(parents=True)
    order = _write(root / "org/dups/model.safetensors", {
        "a": a, "b": a.clone(), "c": torch.randn(512, 512), "d": torch.randn(512, 512),
        "e": e, "f": f, "bias1": bias, "bias2": bias.clone(),
        "norm1": torch.ones(300), "norm2": torch.ones(300)})
    # the layout the counts below assume: safetensors orders tensors by name
    assert order == ["a", "b", "bias1", "bias2", "c", "d", "e", "f", "norm1", "norm2"]
    emb = torch.randn(128, 256)
    (root / "org/budget").mkdir(parents=True)
    _write(root / "org/budget/model.safetensors", {
        "emb": emb, "head": emb.clone(),
        **{f"layer{i:02d}": torch.randn(64, 256) for i in range(40)}})
    with serve(root) as server:
        yield server


def _local_duplicates(path: Path) -> dict[str, str | None]:
    return {t.name: t.duplicate_of for t in formats.read(path).tensors
            if t.duplicate_of is not None or t.category == "duplicates"}


def _remote_duplicates(inventory: Any) -> dict[str, str | None]:
    return {t.name: t.duplicate_of for t in inventory.tensors
            if t.duplicate_of is not None or t.category == "duplicates"}


def test_the_copy_is_found_by_samples_and_the_others_are_not(hub: Any) -> None:
    url = f"{hub.endpoint}/org/dups/resolve/main/model.safetensors"
    hub.log.clear()
    inventory, stats, _ = read_remote(url)
    local = _local_duplicates(hub.root / "org/dups/model.safetensors")
    assert local == {"b": "a", "bias2": "bias1"}  # read whole, locally
    assert _remote_duplicates(inventory) == local
    # The requests after the header's (one, the first 64 KiB): the middle 1 KiB of a..f (6),
    # the biases whole (2 KiB, adjacent: 1), the norms whole (2,400 bytes, adjacent: 1); then
    # for a, b and e, f (equal middles) their first and last 1 KiB: a's first is in the first
    # 64 KiB fetched already (read from the mirror), a's last and b's first are adjacent (one
    # request), so are e's last and f's first: 5 requests, 7 KiB.
    samples = hub.log[1:]
    assert len(samples) == 8 + 5 == stats.duplicates.requests
    assert sum(n for _, n in samples) == 6 * KIB + 2 * KIB + 2 * 1200 + 7 * KIB == (
        stats.duplicates.fetched) == 17_760
    assert stats.fetched == sum(n for _, n in hub.log) == 65_536 + 17_760
    assert stats.duplicates.to_dict()["found"] == 2
    assert any("comparing samples" in note for note in inventory.notes)


def test_the_report_says_the_comparison_was_by_samples(hub: Any, capsys: Any) -> None:
    url = f"{hub.endpoint}/org/dups/resolve/main/model.safetensors"
    report = inspect_remote(url)
    text = report.text()
    assert "duplicate tensors compared by samples" in text
    assert f"the first, middle and last {PROBE:,} bytes of each" in text
    assert "duplicates" in report.to_dict()["bytes_by_category"]
    assert report.to_dict()["remote"]["duplicates"]["method"] == "samples"
    # check, which forbids duplicates, flags the copy
    assert main(["check", url]) == 1
    assert "duplicates" in capsys.readouterr().out


def test_a_group_past_the_budget_is_left_uncompared_and_counted(hub: Any) -> None:
    url = f"{hub.endpoint}/org/budget/resolve/main/model.safetensors"
    hub.log.clear()
    inventory, stats, _ = read_remote(url)
    assert _remote_duplicates(inventory) == {"head": "emb"}
    dups = stats.duplicates
    # a small file's budget: 16 requests; the pair takes 2 (middles) + 2 (emb's first KiB is
    # in the first 64 KiB fetched; emb's last and head's first are adjacent; head's last),
    # the forty would take 40: left uncompared
    assert (dups.compared, dups.groups, dups.skipped, dups.skipped_groups) == (2, 1, 40, 1)
    assert len(hub.log) - 1 == dups.requests == 4 <= 16
    assert sum(n for _, n in hub.log[1:]) == dups.fetched == 5 * KIB < MAX_BYTES
    assert "40 candidates in 1 group not compared" in inspect_remote(url).text()
