"""Checkpoint folders read remotely: a TensorFlow SavedModel, TF1 checkpoints with their
``.meta``, TF2 checkpoints (their object graph lies in a data shard), DeepSpeed and
``torch.distributed.checkpoint`` folders, as ``hf://`` repositories on the loopback Hub and,
where a file names the folder, over a plain URL: the report equals the local one, the data
files are sized (only what the reader reads of them fetched, and the duplicate search's
samples), in a few requests."""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from modelsize import formats
from modelsize.remote import read_remote
from tests.loopback_hub import serve
from tests.test_remote_formats import _summary

FIXTURES = Path(__file__).parent / "fixtures"
KIB, MIB = 1024, 2**20

#: repository -> the fixture folder it holds
REPOS = {
    "org/saved": "tensorflow/saved_model",
    "org/tf1": "tensorflow/tf1",
    "org/tf2": "tensorflow/tf2_keras3",
    "org/ds-zero2": "deepspeed/zero2_tied",
    "org/ds-zero3": "deepspeed/zero3",
    "org/ds-bf16": "deepspeed/bf16_nozero",
    "org/dcp": "torch_dcp/layouts",
    "org/dcp-ranks": "torch_dcp/two_ranks",
}


def _big_dcp(folder: Path, n: int = 8) -> None:
    """A ``dcp.save`` of ``n`` random 1 MiB tensors and a step counter (one data file)."""
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    state = {"model": {f"w{i}": torch.randn(256, 1024) for i in range(n)}, "step": 3}
    with warnings.catch_warnings():
        # "torch.distributed is disabled ... assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(folder))


def _big_deepspeed(folder: Path, n: int = 8) -> None:
    """DeepSpeed's layout (``latest``, ``global_step1/mp_rank_00_model_states.pt``, as
    ``engine.save_checkpoint`` names them) around a ``torch.save`` of ``n`` random 1 MiB
    tensors under ``module``; an older tag beside it."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    for tag in ("global_step1", "global_step2"):
        (folder / tag).mkdir(parents=True)
        torch.save({"module": {f"w{i}": torch.randn(256, 1024) for i in range(n)},
                    "optimizer": None, "ds_version": "0.14.0"},
                   folder / tag / "mp_rank_00_model_states.pt")
    (folder / "latest").write_text("global_step2")


@pytest.fixture(scope="module")
def repos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hub")
    for repo, fixture in REPOS.items():
        shutil.copytree(FIXTURES / fixture, root / repo)
    _big_dcp(root / "org" / "dcp-big")
    _big_deepspeed(root / "org" / "ds-big")
    return root


@pytest.fixture(scope="module")
def served(repos: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One loopback Hub for the module (stopping one takes half a second)."""
    with serve(repos) as handler, pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_ENDPOINT", handler.endpoint)  # type: ignore[attr-defined]
        mp.setenv("HF_HUB_CACHE", str(tmp_path_factory.mktemp("cache")))
        mp.delenv("HF_TOKEN", raising=False)
        yield handler


@pytest.fixture()
def hub(served: Any) -> Any:
    """The module's Hub, its log cleared."""
    del served.log[:]
    return served


def _fetched(hub: Any, suffix: str) -> list[int]:
    """The body bytes of each request for a path ending with ``suffix``."""
    return [n for p, n in hub.log if p.endswith(suffix)]


def _remote(url: str) -> tuple[dict[str, Any], Any]:
    inventory, stats, _ = read_remote(url)
    return _summary(inventory), stats


def _local(path: Path) -> dict[str, Any]:
    return _summary(formats.read(path))


# -- hf://ORG/REPO: the folder is the repository ---------------------------------------------

FOLDERS = [
    # (repository, the most requests its headers may take: the listing included, the
    # duplicate search's samples apart)
    ("org/saved", 3),  # the listing; variables.index; the object graph in its data shard
    ("org/tf1", 5),  # the listing; checkpoint (the state file), .index; the .meta: its
    # first blocks, then past its graph to its collections
    ("org/tf2", 4),  # the listing; checkpoint, .index; the object graph in its data shard
    ("org/ds-zero2", 8),  # the listing; latest; 3 torch zips (first bytes, then headers)
    ("org/ds-zero3", 11),  # 4 torch zips
    ("org/ds-bf16", 4),
    ("org/dcp", 6),  # the listing; .metadata; each data file's items in one request
    ("org/dcp-ranks", 4),
]


@pytest.mark.parametrize(("repo", "most"), FOLDERS, ids=[f[0] for f in FOLDERS])
def test_a_checkpoint_folder_repository_is_its_local_report(hub: Any, repos: Path, repo: str,
                                                            most: int) -> None:
    got, stats = _remote(f"hf://{repo}")
    assert got == _local(repos / repo)
    assert stats.requests == len(hub.log) <= most + stats.duplicates.requests


def test_a_saved_model_repository_sizes_its_graph(hub: Any, repos: Path) -> None:
    got, _ = _remote("hf://org/saved")
    assert got == _local(repos / "org/saved")
    # the reader only sizes the graph and the fingerprint: not a byte of them asked for
    assert not [p for p, _ in hub.log if p.endswith(".pb")]
    assert _fetched(hub, "variables.index") == [986]


def test_a_deepspeed_repository_reads_the_tag_latest_names(hub: Any, repos: Path) -> None:
    got, stats = _remote("hf://org/ds-big")
    assert got == _local(repos / "org/ds-big")
    assert got["tensor_count"] == 8
    assert not [p for p, _ in hub.log if "global_step1/" in p]  # the older tag: listed only
    data = (repos / "org/ds-big/global_step2/mp_rank_00_model_states.pt").stat().st_size
    assert data > 8 * MIB
    # its first 64 KiB, its end and each storage's local header; the samples
    assert stats.fetched - stats.duplicates.fetched < 128 * KIB
    assert stats.requests - stats.duplicates.requests <= 2 + 3 + 8


def test_a_dcp_repository_reads_its_items_headers_not_their_tensors(
        hub: Any, repos: Path) -> None:
    got, stats = _remote("hf://org/dcp-big")
    assert got == _local(repos / "org/dcp-big")
    assert got["tensor_count"] == 8
    data = _fetched(hub, "__0_0.distcp")
    assert (repos / "org/dcp-big/__0_0.distcp").stat().st_size > 8 * MIB
    # both ends of each of the 9 items (the step's and 8 tensors'): the end of one and the
    # start of the next in one request; then the duplicate search's samples
    assert sum(data) - stats.duplicates.fetched < 9 * 4 * KIB + 4 * KIB
    assert len(data) - stats.duplicates.requests <= 9 + 1
    assert stats.requests - stats.duplicates.requests <= 2 + 9 + 1


# -- a plain URL: the file that names the folder -----------------------------------------------

def _resolve(hub: Any, repo: str, name: str) -> str:
    return f"{hub.endpoint}/{repo}/resolve/main/{name}"


def test_a_saved_model_by_the_url_of_its_graph(hub: Any, repos: Path) -> None:
    inventory, stats, _ = read_remote(_resolve(hub, "org/saved", "saved_model.pb"))
    assert _summary(inventory) == _local(repos / "org/saved/saved_model.pb")
    assert any("cannot be listed" in n and "assets/" in n for n in inventory.notes)
    # the graph's size; fingerprint.pb's; keras_metadata.pb (none: 404); the index; the
    # data shard's size, its object graph
    assert stats.requests - stats.duplicates.requests <= 6
    assert _fetched(hub, "saved_model.pb") == [1]
    assert len(_fetched(hub, "keras_metadata.pb")) == 1
    assert not _fetched(hub, "variables.meta")  # a SavedModel's checkpoint is object-based


@pytest.mark.parametrize(("repo", "name"), [("org/tf1", "model.ckpt.index"),
                                            ("org/tf2", "ckpt-1.index")])
def test_a_checkpoint_by_the_url_of_its_index(hub: Any, repos: Path, repo: str,
                                              name: str) -> None:
    got, stats = _remote(_resolve(hub, repo, name))
    assert got == _local(repos / repo / name)
    # the index; TF1: the .meta's first block, its collections past the graph, the data
    # shard's size; TF2: the data shard's size, its object graph (no .meta asked for)
    assert stats.requests - stats.duplicates.requests <= 4


def test_a_dcp_checkpoint_by_the_url_of_its_metadata(hub: Any, repos: Path) -> None:
    got, stats = _remote(_resolve(hub, "org/dcp", ".metadata"))
    assert got == _local(repos / "org/dcp/.metadata")
    # .metadata; each of the 4 data files' first 16 KiB with its size (no listing); the one
    # of 18 KiB once more, for its last items
    assert stats.requests - stats.duplicates.requests <= 1 + 4 + 1


# -- a TF1 checkpoint whose .meta is mostly graph: its collections only ------------------------

_BIG_META = """
import sys
import numpy as np
import tensorflow as tf
tf.compat.v1.disable_eager_execution()
with tf.Graph().as_default():
    table = tf.constant(np.arange(1 << 20, dtype=np.float32))  # 4 MiB inside the graph
    w = tf.compat.v1.get_variable("w", [64, 64])
    b = tf.compat.v1.get_variable("b", [64], trainable=False)
    loss = tf.reduce_sum(w) + tf.reduce_sum(b) + tf.reduce_sum(table)
    step = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
    with tf.compat.v1.Session() as s:
        s.run(tf.compat.v1.global_variables_initializer())
        tf.compat.v1.train.Saver().save(s, sys.argv[1] + "/model.ckpt")
"""


@pytest.fixture(scope="module")
def big_meta(repos: Path) -> Path:
    """org/tf1-graph: a TF1 Saver checkpoint whose .meta holds a 4 MiB constant."""
    from tests.conftest import run_in_tf

    folder = repos / "org" / "tf1-graph"
    folder.mkdir()
    run_in_tf(_BIG_META, str(folder), timeout=300)
    return folder


def test_a_big_meta_is_read_by_its_collections_not_its_graph(hub: Any, big_meta: Path) -> None:
    meta = (big_meta / "model.ckpt.meta").stat().st_size
    assert meta > 4 * MIB
    for url in ("hf://org/tf1-graph", _resolve(hub, "org/tf1-graph", "model.ckpt.index")):
        del hub.log[:]
        got, _ = _remote(url)
        local = big_meta if url.startswith("hf://") else big_meta / "model.ckpt.index"
        assert got == _local(local)
        # the .meta's trainable_variables collection made b a buffer (64 float32)
        assert got["bytes_by_category"]["buffers"] == 64 * 4
        fetched = _fetched(hub, "model.ckpt.meta")
        # its first block; past the graph, its collections (and what the read-ahead adds)
        assert sum(fetched) < 128 * KIB and len(fetched) <= 3


@pytest.mark.parametrize(("repo", "name", "most"), [
    ("org/saved", "saved_model.pb", 4),  # the listing; the index; the object graph
    ("org/tf1", "model.ckpt.index", 4),  # the listing; the index; the .meta's two reads
    ("org/dcp", ".metadata", 6),  # the listing; .metadata; each data file in one
])
def test_the_file_that_names_a_folder_by_its_hf_path(hub: Any, repos: Path, repo: str,
                                                      name: str, most: int) -> None:
    got, stats = _remote(f"hf://{repo}/{name}")
    assert got == _local(repos / repo / name)
    # sizes from the listing: no request to learn one
    assert stats.requests - stats.duplicates.requests <= most
    assert not [n for _, n in hub.log if n == 1]
