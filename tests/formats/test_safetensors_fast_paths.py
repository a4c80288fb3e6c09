"""The fast paths of a safetensors listing give exactly the answers of the plain ones.

* ``classify_names`` (all names searched at once for the words that matter) answers as
  ``classify_name`` of each name.
* The duplicate probes (``inventory._FileReader.probe_groups``: each candidate told apart by
  its first bytes, read alone or in windows; only candidates whose first bytes another shares
  digested further) group exactly the candidates whose probed bytes are equal. The expected
  groups are worked out here from the file's bytes, read with plain ``open``.
* A file that shrinks between its header and the probes is one clear error.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import modelsize
from modelsize import inventory
from modelsize.categories import Category
from modelsize.errors import CorruptFileError, InputError
from modelsize.formats import safetensors as st
from modelsize.inventory import InventoryBuilder

np = pytest.importorskip("numpy")
st_numpy = pytest.importorskip("safetensors.numpy")

PROBE = 4096  # bytes probed at the start, middle and end of a large candidate (the contract)


# -- classify_names ----------------------------------------------------------------------------

_WORDS = ["model", "layers", "0", "17", "weight", "bias", "running_mean", "running_var",
          "num_batches_tracked", "position_ids", "inv_freq", "exp_avg", "exp_avg_sq", "ema",
          "model_ema", "ema_decay", "decoder_ema", "grad", "grads", "optimizer", "opt_state",
          "qweight", "scales", "g_idx", "absmax", "Weight", "RUNNING_MEAN", "EMA", "Grad",
          "shadow_params", "momentum_buffer", "swa_model", "optimum", "gradual", "lemma",
          "schema", "adopt", "freqs_cis", "masked_bias", "averaged", "\u212aey",
          "\u0130nv_freq", "\u03a3", "\u03a3\u03a3", "a\nb", "", "x/y", "tail."]


def _names(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    seps = [".", "/", "_", ""]
    return ["".join(rng.choice(_WORDS) + rng.choice(seps) for _ in range(rng.randint(1, 5)))
            for _ in range(n)]


@pytest.mark.parametrize("names", [
    ["h.0.ln_1.weight", "h.0.attn.c_attn.bias", "wte.weight"],  # no special word anywhere
    ["bn.running_mean", "conv.weight", "bn.num_batches_tracked"],  # buffer words only
    ["rotary.inv_freq", "INV_FREQ", "model.layers.0.self_attn.rotary_emb.inv_freq"],
    ["state.exp_avg", "layer.weight"],  # a special word: every name the plain way
    ["Model_EMA.weight", "x.GRAD", "a.b"],
    ["\u212a.running_mean", "\u0130nv_freq", "ema\u03a3", "\u03a3.inv_freq"],  # lower() oddities
    ["a\nrunning_mean", "running_mean\nb", "x", "weight\n", ""],
    ["q.qweight", "q.scales", "q.g_idx", "counter"],
    [],
])
def test_classify_names_answers_as_classify_name(names: list[str]) -> None:
    for floating in (True, False):
        flags = [floating if i % 3 else not floating for i in range(len(names))]
        assert st.classify_names(names, flags) == list(map(st.classify_name, names, flags))


@pytest.mark.parametrize("seed", range(20))
def test_classify_names_answers_as_classify_name_on_random_names(seed: int) -> None:
    names = _names(seed, 300)
    flags = [random.Random(seed + i).random() < 0.8 for i in range(len(names))]
    assert st.classify_names(names, flags) == list(map(st.classify_name, names, flags))
    plain = [n for n in names if not any(
        w in n.lower() for w in (*st._SPECIAL_HINTS, *st._BUFFER_NAMES))]
    assert st.classify_names(plain, [True] * len(plain)) == [(Category.WEIGHTS, ())] * len(plain)


# -- duplicate probes --------------------------------------------------------------------------


def _expected_groups(paths: list[Path], sts: list[inventory.StorageRecord]) -> list[list[str]]:
    """The groups (two or more, in the order given; a group comes where its second storage
    does) of storages whose probed bytes are equal: all of a storage up to three probes long,
    else its first, middle and last probe."""
    blobs = [p.read_bytes() for p in paths]
    by_bytes: dict[bytes, list[str]] = {}
    groups: list[list[str]] = []
    for s in sts:
        raw = blobs[s.file][s.offset : s.offset + s.nbytes]
        assert len(raw) == s.nbytes
        n = s.nbytes
        if n > 3 * PROBE:
            raw = raw[:PROBE] + raw[n // 2 : n // 2 + PROBE] + raw[-PROBE:]
        same = by_bytes.setdefault(raw, [])
        same.append(s.key)
        if len(same) == 2:
            groups.append(same)
    return groups


def _candidates(builder: InventoryBuilder) -> list[list[str]]:
    """The storages of each size (the probes take one size at a time), two or more."""
    by_size: dict[int, list[str]] = {}
    for key, s in builder._storages.items():
        by_size.setdefault(s.nbytes, []).append(key)
    return [keys for keys in by_size.values() if len(keys) > 1]


def _check_probes(paths: list[Path], builder: InventoryBuilder) -> int:
    """probe_groups of every size's storages, in file order, reversed and shuffled, against
    the groups worked out from the bytes; the number of groups."""
    groups = 0
    with inventory._FileReader(builder, builder._storages) as reader:
        for keys in _candidates(builder):
            for order in (keys, keys[::-1], random.Random(len(keys)).sample(keys, len(keys))):
                expected = _expected_groups(paths, [builder._storages[k] for k in order])
                assert reader.probe_groups(order) == expected
            groups += len(expected)
    return groups


def _variants(rng: Any, n: int, count: int) -> dict[str, Any]:
    """``count`` float32 tensors of ``n`` elements: copies, tensors that start alike and
    differ at the middle or the end, zeros, and unique ones."""
    base = rng.standard_normal(n).astype(np.float32)
    out = {}
    for i in range(count):
        x = base.copy()
        kind = i % 7
        if kind == 0:
            x[-1] = i  # the start of base, a different end
        elif kind == 2:
            x[n // 2] = i % 3  # three variants, alike but in the middle
        elif kind == 3:
            x = rng.standard_normal(n).astype(np.float32)
        elif kind == 4:
            x = np.zeros(n, np.float32)
        elif kind == 5:
            x[0] = i % 4  # four variants, different at the very start
        elif kind == 6:
            x[-1] = 1.5  # copies of one another
        out[f"t.{i}"] = x
    return out


def _write(path: Path, tensors: dict[str, Any]) -> Path:
    st_numpy.save_file(tensors, str(path))
    return path


def _accounted(*paths: Path) -> InventoryBuilder:
    builder = InventoryBuilder("safetensors", list(paths))
    for i in range(len(paths)):
        st.account_file(builder, i, f"{i}:" if len(paths) > 1 else "")
    return builder


@pytest.mark.parametrize("layout", ["dense", "spread", "large", "tiny", "middle"])
def test_probe_groups_are_the_storages_whose_probed_bytes_are_equal(
        tmp_path: Path, layout: str) -> None:
    rng = np.random.default_rng(0)
    if layout == "dense":  # small storages side by side: read in windows
        tensors = _variants(rng, 64, 700)
    elif layout == "spread":  # small storages between large ones: each read alone
        tensors = _variants(rng, 2048, 40)
        tensors.update({f"u.{i}": rng.standard_normal(9000 + i).astype(np.float32)
                        for i in range(40)})
    elif layout == "large":  # probed at their start, middle and end
        tensors = _variants(rng, 6 * PROBE, 60)
    elif layout == "tiny":  # a storage shorter than the bytes that tell storages apart
        tensors = {f"t.{i}": np.full(4, i % 50, np.float32) for i in range(3000)}
    else:  # equal probes, different bytes between them: the probes alone cannot tell
        a = rng.standard_normal(4 * PROBE).astype(np.float32)
        b = a.copy()
        b[PROBE // 4 + 5] += 1
        tensors = {"a": a, "b": b, "c": a.copy()}
    path = _write(tmp_path / "m.safetensors", tensors)
    assert _check_probes([path], _accounted(path)) > 0


def test_probe_groups_across_shards(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    tensors = _variants(rng, 64, 400)
    names = sorted(tensors)
    one = _write(tmp_path / "a.safetensors", {k: tensors[k] for k in names[::2]})
    two = _write(tmp_path / "b.safetensors", {k: tensors[k] for k in names[1::2]})
    assert _check_probes([one, two], _accounted(one, two)) > 0


def test_colliding_heads_are_told_apart_by_their_probes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Heads are compared by their hashes: where every hash collides, the CRC-32 of each
    storage's probes still separates the storages that differ."""
    rng = np.random.default_rng(2)
    tensors = {**_variants(rng, 64, 200), **_variants(rng, 5 * PROBE, 21)}
    tensors.update({f"s.{k}": v for k, v in _variants(rng, 2048, 30).items()})
    path = _write(tmp_path / "m.safetensors", tensors)
    monkeypatch.setattr(inventory, "hash", lambda _: 0, raising=False)
    assert _check_probes([path], _accounted(path)) > 0


def test_trained_weights_are_read_at_their_start_only(tmp_path: Path,
                                                      preads: list[int]) -> None:
    """24 layers of one shape whose first bytes differ (trained weights): one short read
    each, no probe of their middle or end, nothing digested."""
    rng = np.random.default_rng(3)
    path = _write(tmp_path / "m.safetensors", {
        f"h.{i}.{part}": rng.standard_normal(n).astype(np.float32)
        for i in range(24) for part, n in (("w", 8 * PROBE), ("b", 1024))})
    builder = _accounted(path)
    preads.clear()
    with inventory._FileReader(builder, builder._storages) as reader:
        for keys in _candidates(builder):
            assert reader.probe_groups(keys) == []
    assert len(preads) == 48
    assert max(preads) <= 128


def test_inspect_reports_the_duplicates_the_pure_python_path_reports(tmp_path: Path) -> None:
    """``MODELSIZE_PURE_PYTHON=1``: the same JSON, duplicates found and constants left alone."""
    rng = np.random.default_rng(4)
    w = rng.standard_normal((64, 64)).astype(np.float32)
    tensors = {"emb.weight": w, "lm_head.weight": w.copy(), "z1": np.zeros(300, np.float32),
               "z2": np.zeros(300, np.float32), **_variants(rng, 64, 50)}
    path = _write(tmp_path / "tied.safetensors", tensors)
    outs = []
    for pure in ("", "1"):
        env = {**os.environ, "MODELSIZE_PURE_PYTHON": pure}
        proc = subprocess.run([sys.executable, "-m", "modelsize", "inspect", str(path), "--json"],
                              capture_output=True, text=True, timeout=300, env=env, check=True)
        outs.append(proc.stdout)
    assert outs[0] == outs[1]
    inv = modelsize.inspect(path).inventory
    dupes = {t.name: t.duplicate_of for t in inv.tensors if t.duplicate_of}
    assert dupes["lm_head.weight"] == "emb.weight"
    assert "z2" not in dupes


# -- files that shrink under the probes --------------------------------------------------------


def _truncate_first(path: Path, keep: Callable[[int], int],
                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Cut ``path`` to ``keep(size)`` bytes just before the first probe."""
    real = inventory._FileReader.probe_groups
    done: list[bool] = []

    def probe(self: inventory._FileReader, keys: list[str]) -> list[list[str]]:
        if not done:
            os.truncate(path, keep(path.stat().st_size))
            done.append(True)
        return real(self, keys)

    monkeypatch.setattr(inventory._FileReader, "probe_groups", probe)


@pytest.mark.parametrize("layout", ["dense", "spread", "large"])
def test_storages_cut_off_between_header_and_probe_are_corrupt(
        tmp_path: Path, layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(5)
    n = {"dense": 64, "spread": 2048, "large": 6 * PROBE}[layout]
    tensors = _variants(rng, n, 40)
    if layout == "spread":
        tensors.update({f"u.{i}": rng.standard_normal(9000 + i).astype(np.float32)
                        for i in range(40)})
    path = _write(tmp_path / "m.safetensors", tensors)
    builder = _accounted(path)
    offsets = sorted(s.offset for key, s in builder._storages.items() if key.startswith("t."))
    os.truncate(path, offsets[len(offsets) // 2] + 10)  # within a candidate, the rest gone
    with pytest.raises(CorruptFileError, match=r"storage t\.\d+ ends early"):
        builder.build()


@pytest.mark.parametrize("cut", [4, 300, 5000, 10**6])
@pytest.mark.parametrize("layout", ["dense", "spread"])
def test_a_file_that_shrinks_while_inspected_is_one_clear_error(
        tmp_path: Path, cut: int, layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Cut before the probes, anywhere: a storage that ends early, or (where no probe reaches
    the bytes cut) the file changed while it was read: one line, naming the file."""
    rng = np.random.default_rng(6)
    tensors = _variants(rng, 64 if layout == "dense" else 2048, 60)
    if layout == "spread":
        tensors.update({f"u.{i}": rng.standard_normal(9000 + i).astype(np.float32)
                        for i in range(60)})
    tensors["z.last"] = rng.standard_normal(2048).astype(np.float32)
    path = _write(tmp_path / "m.safetensors", tensors)
    _truncate_first(path, lambda size: max(size - cut, 8), monkeypatch)
    with pytest.raises(InputError) as err:
        modelsize.inspect(path)
    message = str(err.value)
    assert "\n" not in message and path.name in message
    assert "ends early" in message or "changed while it was being read" in message
