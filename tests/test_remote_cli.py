"""``check`` and ``diff`` read a plain ``ORG/REPO`` as the Hub's repository, as ``inspect``
does, unless a local path has that name."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save

from modelsize.cli import main
from tests.loopback_hub import serve


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """org/tied: an embedding and its copy as the head (a duplicate); org/untied: the same
    names, the head its own tensor."""
    root = tmp_path_factory.mktemp("hub")
    torch.manual_seed(0)
    emb = torch.randn(64, 32)
    for repo, head in (("tied", emb.clone()), ("untied", torch.randn(64, 32))):
        (root / "org" / repo).mkdir(parents=True)
        (root / "org" / repo / "model.safetensors").write_bytes(
            save({"embed.weight": emb, "lm_head.weight": head}))
    with serve(root) as hub:
        yield hub


@pytest.fixture()
def hub(server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    server.log.clear()
    return server


def test_check_org_repo_reads_the_hub_repository(hub: Any, capsys: Any) -> None:
    assert main(["check", "org/tied", "org/untied", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert [f["path"] for f in data["files"]] == ["hf://org/tied", "hf://org/untied"]
    tied, untied = data["files"]
    assert [v["rule"] for v in tied["violations"]] == ["duplicates"]
    assert "hf://org/tied" in tied["violations"][0]["action"]
    assert untied["violations"] == []


def test_check_a_local_folder_of_that_name_wins(hub: Any, tmp_path: Path) -> None:
    local = tmp_path / "org" / "tied"
    local.mkdir(parents=True)
    (local / "model.safetensors").write_bytes(save({"w": torch.randn(4, 4)}))
    assert main(["check", "org/tied"]) == 0
    assert hub.log == []  # nothing asked of the Hub


def test_diff_org_repo_against_org_repo(hub: Any, capsys: Any) -> None:
    assert main(["diff", "org/untied", "org/tied", "--json"]) == 0
    out = capsys.readouterr().out
    data = json.loads(out)
    assert "modelsize-remote-" not in out  # no temporary mirror named
    assert (data["a"]["path"], data["b"]["path"]) == ("hf://org/untied", "hf://org/tied")
    assert data["bytes_by_category"]["duplicates"] == {"a": 0, "b": 64 * 32 * 4,
                                                       "delta": 64 * 32 * 4}
