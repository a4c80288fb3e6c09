"""``modelsize slim`` of Keras files: ``.keras`` archives, legacy ``.h5`` models, ``.weights.h5``.

The inputs are the committed fixtures (Keras 3, tf_keras) and files Keras 3 writes here in
tmp; the outputs are loaded back by Keras 3 in the TensorFlow venv (one process for all of
them) and compared weight by weight with the inputs, and read by h5py, a reader we did not
write, for their structure.
"""

from __future__ import annotations

import json
import shutil
import sys
import zipfile
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

import modelsize
import modelsize.formats
from modelsize.errors import MissingDependencyError, UsageError
from modelsize.slimming.result import SlimReport
from modelsize.slimming.writers.keras import KerasH5Writer, _boxes
from tests.conftest import REPO, assert_one_line_error, run_cli, run_in_tf

FIXTURES = REPO / "tests" / "fixtures" / "keras"
MANIFEST = {c["path"]: c for c in json.loads((FIXTURES / "MANIFEST.json").read_text())["cases"]}

# -- inputs Keras 3 writes here ------------------------------------------------------------

_MAKE = r"""
import os, sys
import numpy as np, keras

out = sys.argv[1]
keras.utils.set_random_seed(0)
rng = np.random.default_rng(0)
x, y = rng.random((16, 4), dtype=np.float32), rng.random((16, 2), dtype=np.float32)

# A legacy .h5 by Keras 3, trained with Adam (the loss as an object: Keras 3 cannot read back
# its own "mse" string from a legacy training_config).
m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
                      keras.layers.BatchNormalization(), keras.layers.Dense(2)])
m.compile(optimizer="adam", loss=keras.losses.MeanSquaredError())
m.fit(x, y, epochs=2, batch_size=8, verbose=0)
m.save(os.path.join(out, "k3legacy.h5"))

# A .keras whose second layer repeats the first's weights: a duplicate.
d = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4), keras.layers.Dense(4),
                      keras.layers.Dense(2)])
d.layers[1].set_weights(d.layers[0].get_weights())
d.compile(optimizer="sgd", loss="mse")
d.save(os.path.join(out, "dup.keras"))

# bfloat16 variables: Keras keeps them in an opaque HDF5 type with a dtype attribute.
b = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, dtype="bfloat16")])
b.save(os.path.join(out, "bf16.keras"))
"""

# -- what Keras 3 makes of the outputs -----------------------------------------------------

_CHECK = r"""
import json, sys, warnings
import numpy as np, keras

def same(a, b, cast):
    if cast:
        b = [w.astype(cast).astype(w.dtype) for w in b]
    return len(a) == len(b) and all(
        x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
        for x, y in zip(a, b))

def load(path, compile):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = keras.models.load_model(path, compile=compile)
    return model, [str(w.message) for w in caught]

result = {}
for case in json.loads(sys.argv[1]):
    r = {}
    if case["how"] == "model":
        ref, before = load(case["in"], case["compile"])
        got, after = load(case["out"], case["compile"])
        r["warnings"] = [w for w in after if w not in before]
        r["compiled"] = bool(getattr(got, "compiled", False))
        a, b = got.get_weights(), ref.get_weights()
        if case["compile"]:
            r["fresh_optimizer_steps"] = int(got.optimizer.iterations.numpy())
            rows = np.ones((4,) + tuple(got.input_shape[1:]), "float32")
            got.fit(rows, np.zeros((4, got.output_shape[-1]), "float32"), verbose=0)
            r["trained"] = int(got.optimizer.iterations.numpy())
        _, r["warnings_without_compile"] = load(case["out"], False)
    else:
        ref, _ = load(case["base"], False)
        got, _ = load(case["base"], False)
        ref.load_weights(case["in"])
        got.load_weights(case["out"])
        a, b = got.get_weights(), ref.get_weights()
    r["count"] = len(a)
    r["same"] = same(a, b, case.get("cast"))
    result[case["id"]] = r
print(json.dumps(result))
"""


def _slim(src: Path, out: Path, **kw: Any) -> SlimReport:
    return modelsize.slim(src, out, **kw)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("keras_slim")


@pytest.fixture(scope="module")
def fixture_outputs(work: Path) -> dict[str, SlimReport]:
    """The committed fixtures slimmed the default way (and once cast)."""
    return {
        "legacy": _slim(FIXTURES / "legacy.h5", work / "legacy.slim.h5"),
        "weights": _slim(FIXTURES / "model.weights.h5", work / "model.slim.weights.h5"),
        "keras": _slim(FIXTURES / "model.keras", work / "model.slim.keras"),
        "deflated": _slim(FIXTURES / "model_deflated.keras", work / "deflated.slim.keras"),
        "cast": _slim(FIXTURES / "model.weights.h5", work / "cast.weights.h5",
                      drop=["optimizer_state"], cast="float16"),
    }


@pytest.fixture(scope="module")
def made(work: Path) -> Path:
    """Files Keras 3 writes (skips without the TensorFlow venv)."""
    folder = work / "made"
    folder.mkdir()
    run_in_tf(_MAKE, str(folder))
    return folder


@pytest.fixture(scope="module")
def made_outputs(made: Path, work: Path) -> dict[str, SlimReport]:
    return {
        "k3legacy": _slim(made / "k3legacy.h5", work / "k3legacy.slim.h5"),
        "dup": _slim(made / "dup.keras", work / "dup.slim.keras"),
        "bf16": _slim(made / "bf16.keras", work / "bf16.slim.keras"),
    }


@pytest.fixture(scope="module")
def keras_says(fixture_outputs: dict[str, SlimReport], made_outputs: dict[str, SlimReport],
               made: Path) -> dict[str, dict[str, Any]]:
    """Every output loaded by Keras 3 next to its input, in one TensorFlow process."""
    base = str(FIXTURES / "model.keras")

    def model(id: str, src: Path, report: SlimReport, compile: bool) -> dict[str, Any]:
        return {"id": id, "how": "model", "in": str(src), "out": str(report.target),
                "compile": compile}

    def weights(id: str, report: SlimReport, cast: str | None = None) -> dict[str, Any]:
        return {"id": id, "how": "weights", "in": str(FIXTURES / "model.weights.h5"),
                "out": str(report.target), "base": base, "cast": cast}

    f, m = fixture_outputs, made_outputs
    spec = [
        # tf_keras wrote legacy.h5: Keras 3 cannot compile its training_config (input too).
        model("legacy", FIXTURES / "legacy.h5", f["legacy"], False),
        model("k3legacy", made / "k3legacy.h5", m["k3legacy"], True),
        model("keras", FIXTURES / "model.keras", f["keras"], True),
        model("deflated", FIXTURES / "model_deflated.keras", f["deflated"], True),
        model("dup", made / "dup.keras", m["dup"], False),
        model("bf16", made / "bf16.keras", m["bf16"], False),
        weights("weights", f["weights"]),
        weights("cast", f["cast"], "float16"),
    ]
    proc = run_in_tf(_CHECK, json.dumps(spec))
    out: dict[str, dict[str, Any]] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def _datasets(f: h5py.Group) -> dict[str, h5py.Dataset]:
    found: dict[str, h5py.Dataset] = {}

    def visit(name: str, obj: Any) -> None:  # a value returned would stop the visit
        if isinstance(obj, h5py.Dataset):
            found[name] = obj

    f.visititems(visit)
    return found


def _attrs(obj: Any) -> dict[str, tuple[Any, str, tuple[int, ...] | None]]:
    out = {}
    for key in obj.attrs:
        aid = obj.attrs.get_id(key)
        value = obj.attrs[key]
        value = value.tolist() if isinstance(value, np.ndarray) else value
        out[key] = (value if not isinstance(value, h5py.Empty) else "empty", str(aid.dtype),
                    aid.shape)
    return out


# -- Keras loads every output, with the input's weights ---------------------------------------


@pytest.mark.parametrize("case", ["legacy", "k3legacy", "keras", "deflated", "dup", "bf16",
                                  "weights"])
def test_keras_loads_the_output_with_identical_weights(
    keras_says: dict[str, dict[str, Any]], case: str
) -> None:
    r = keras_says[case]
    assert r["same"], r
    assert r["count"] == {"legacy": 8, "k3legacy": 8, "dup": 6, "bf16": 2}.get(case, 11)


def test_legacy_h5_loads_compiled_with_a_fresh_optimizer(
    keras_says: dict[str, dict[str, Any]], made_outputs: dict[str, SlimReport]
) -> None:
    r = keras_says["k3legacy"]
    assert r["compiled"] and r["warnings"] == []
    assert (r["fresh_optimizer_steps"], r["trained"]) == (0, 1)
    with h5py.File(made_outputs["k3legacy"].target) as out:
        assert sorted(out) == ["model_weights"]  # optimizer_weights gone
        config = json.loads(out.attrs["training_config"])
        assert config["optimizer_config"]["class_name"] == "Adam"  # what compile() uses


def test_keras_archive_loads_compiled_and_warns_as_documented(
    keras_says: dict[str, dict[str, Any]]
) -> None:
    for case in ("keras", "deflated"):
        r = keras_says[case]
        assert r["compiled"] and (r["fresh_optimizer_steps"], r["trained"]) == (0, 1)
        assert len(r["warnings"]) == 1
        assert "Skipping variable loading for optimizer" in r["warnings"][0]
        assert "saved optimizer has 0 variables" in r["warnings"][0]
        assert r["warnings_without_compile"] == []


def test_cast_weights_load_as_the_float16_rounding(keras_says: dict[str, dict[str, Any]],
                                                   fixture_outputs: dict[str, SlimReport]) -> None:
    assert keras_says["cast"]["same"]
    with h5py.File(fixture_outputs["cast"].target) as out:
        kinds = {n: d.dtype for n, d in _datasets(out).items()}
    assert kinds["layers/dense/vars/0"] == np.float16
    assert kinds["layers/normalization/vars/2"] == np.int64  # never cast
    assert not any(n.startswith("optimizer") for n in kinds)


def test_duplicates_become_hard_links(made_outputs: dict[str, SlimReport]) -> None:
    report = made_outputs["dup"]
    assert [(k.name, k.alias_of) for k in report.kept if k.alias_of] == [
        ("layers/dense_1/vars/0", "layers/dense/vars/0")]
    with zipfile.ZipFile(report.target) as zf, zf.open("model.weights.h5") as fh, \
            h5py.File(fh) as out:
        a, b = out["layers/dense/vars/0"], out["layers/dense_1/vars/0"]
        assert h5py.h5o.get_info(a.id).addr == h5py.h5o.get_info(b.id).addr
        copy = b[()]
    with zipfile.ZipFile(report.source.path) as zf, zf.open("model.weights.h5") as fh, \
            h5py.File(fh) as src:
        assert np.array_equal(src["layers/dense_1/vars/0"][()], copy)


def test_a_duplicate_with_other_attributes_is_stored_again(tmp_path: Path) -> None:
    src = tmp_path / "attrs.weights.h5"
    values = (np.arange(12, dtype=np.float32) / 3).reshape(4, 3)
    with h5py.File(src, "w") as f:
        f.create_dataset("layers/a/vars/0", data=values)
        f.create_dataset("layers/b/vars/0", data=values).attrs["note"] = "mine"
        f.create_dataset("layers/c/vars/0", data=values)
    report = modelsize.slim(src, tmp_path / "out.weights.h5")
    assert sorted(k.name for k in report.kept if k.alias_of) == [
        "layers/b/vars/0", "layers/c/vars/0"]
    with h5py.File(report.target) as out:
        a, b, c = (out[f"layers/{x}/vars/0"] for x in "abc")
        assert (b[()].tobytes(), dict(b.attrs)) == (values.tobytes(), {"note": "mine"})
        info = h5py.h5o.get_info
        assert info(c.id).addr == info(a.id).addr != info(b.id).addr


# -- what the output holds (h5py, modelsize inspect) -----------------------------------------


@pytest.mark.parametrize("case", ["legacy", "weights", "keras", "deflated"])
def test_inspected_output_has_no_optimizer_state(fixture_outputs: dict[str, SlimReport],
                                                 case: str) -> None:
    report = fixture_outputs[case]
    source = MANIFEST[report.source.path.name]
    inv = modelsize.inspect(report.target).inventory
    by_cat = {c.value: n for c, n in inv.bytes_by_category.items()}
    assert by_cat["optimizer_state"] == 0
    if case != "deflated":  # the input's categories are compressed sizes there
        for cat in ("weights", "buffers"):
            assert by_cat[cat] == source["categories"][cat]
    assert not any(f.kind == "optimizer_state" for f in modelsize.inspect(report.target).findings)
    assert report.target.stat().st_size == report.predicted_bytes


def test_legacy_structure_and_attributes_are_the_inputs(
        fixture_outputs: dict[str, SlimReport]) -> None:
    with h5py.File(FIXTURES / "legacy.h5") as src, \
            h5py.File(fixture_outputs["legacy"].target) as out:
        assert list(out) == ["model_weights"]
        assert _attrs(out) == _attrs(src)  # model_config, training_config, versions
        assert list(out["model_weights"]) == list(src["model_weights"])
        for name, d in _datasets(src["model_weights"]).items():
            o = out["model_weights"][name]
            assert (o.dtype, o.shape, o[()].tobytes()) == (d.dtype, d.shape, d[()].tobytes())
            assert o.id.get_create_plist().get_layout() == h5py.h5d.CONTIGUOUS
        for name in ("model_weights", "model_weights/dense"):
            assert _attrs(out[name]) == _attrs(src[name])  # layer_names, weight_names


def test_keras_archive_members_are_copied(fixture_outputs: dict[str, SlimReport]) -> None:
    for case in ("keras", "deflated"):
        src_path = fixture_outputs[case].source.path
        with zipfile.ZipFile(src_path) as src, zipfile.ZipFile(
                fixture_outputs[case].target) as out:
            assert out.namelist() == src.namelist()
            # Members are copied as they are (a deflated one is never inflated: a deflate bomb
            # stays a few MB); the weights member is stored, as Keras writes it.
            assert {i.filename: i.compress_type for i in out.infolist()} == {
                i.filename: zipfile.ZIP_STORED if i.filename == "model.weights.h5"
                else i.compress_type for i in src.infolist()}
            assert out.testzip() is None
            for name in ("config.json", "metadata.json"):
                assert out.read(name) == src.read(name)
                assert out.getinfo(name).compress_size == src.getinfo(name).compress_size
            with out.open("model.weights.h5") as fh, h5py.File(fh) as h5:
                assert sorted(h5) == ["layers", "vars"]
    # A deflated input gives the same weights member as the stored one it was made from.
    with zipfile.ZipFile(fixture_outputs["keras"].target) as a, \
            zipfile.ZipFile(fixture_outputs["deflated"].target) as b:
        assert a.read("model.weights.h5") == b.read("model.weights.h5")


def test_other_members_are_copied_in_order(tmp_path: Path) -> None:
    src = tmp_path / "assets.keras"
    with zipfile.ZipFile(FIXTURES / "model.keras") as zin, zipfile.ZipFile(src, "w") as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, zin.read(info.filename))
        zout.writestr("assets/", b"")
        zout.writestr("assets/vocabulary.txt", b"a\nb\nc\n", zipfile.ZIP_DEFLATED)
    report = modelsize.slim(src, tmp_path / "assets.slim.keras")
    with zipfile.ZipFile(src) as a, zipfile.ZipFile(report.target) as b:
        assert b.namelist() == a.namelist()
        assert b.read("assets/vocabulary.txt") == b"a\nb\nc\n"
    assert report.target.stat().st_size == report.predicted_bytes


def test_large_deflated_member_streams_from_its_snapshots(tmp_path: Path) -> None:
    src = tmp_path / "big.keras"
    rng = np.random.default_rng(2)
    # Keras 3 names the groups of four Dense layers dense, dense_1, dense_2, dense_3.
    values = {f"layers/dense{f'_{i}' if i else ''}/vars/0": rng.random((300, 1000),
                                                                  dtype=np.float32)
              for i in range(4)}
    with zipfile.ZipFile(FIXTURES / "model.keras") as zin:
        metadata = zin.read("metadata.json")
    # The layers the weights hold, as Keras requires of a config (verification checks it).
    config = json.dumps({"class_name": "Sequential", "config": {"name": "big", "layers": [
        {"class_name": "Dense", "config": {"name": f"d{i}"}} for i in range(4)]}})
    weights = tmp_path / "w.h5"
    with h5py.File(weights, "w") as f:
        for name, v in values.items():
            f.create_dataset(name, data=v)
        f.create_dataset("optimizer/vars/0", data=np.ones(10, np.float32))
    with zipfile.ZipFile(src, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("metadata.json", metadata)
        z.writestr("config.json", config)
        z.write(weights, "model.weights.h5")  # 4.8 MB inflated: several restart points
    report = modelsize.slim(src, tmp_path / "big.slim.keras")
    assert [d.name for d in report.dropped] == ["optimizer/vars/0"]
    with zipfile.ZipFile(report.target) as z, z.open("model.weights.h5") as fh, \
            h5py.File(fh) as out:
        for name, v in values.items():
            assert np.array_equal(out[name][()], v)


def test_bfloat16_opaque_data_is_copied_with_its_type(made_outputs: dict[str, SlimReport]) -> None:
    report = made_outputs["bf16"]
    with zipfile.ZipFile(report.target) as zf, zf.open("model.weights.h5") as fh, \
            h5py.File(fh) as out:
        kernel = out["layers/dense/vars/0"]
        assert kernel.id.get_type().get_class() == h5py.h5t.OPAQUE
        assert (kernel.shape, kernel.attrs["dtype"]) == ((4, 3), "bfloat16")


# -- dry run, names, reproducibility --------------------------------------------------------


@pytest.mark.parametrize("name", ["legacy.h5", "legacy_weights.h5", "model.weights.h5",
                                  "model.keras", "model_deflated.keras", "layouts_latest.h5"])
def test_dry_run_predicts_the_exact_size(tmp_path: Path, name: str) -> None:
    out = tmp_path / ("out.weights.h5" if name.endswith(".h5") else "out.keras")
    dry = modelsize.slim(FIXTURES / name, out, dry_run=True)
    assert not out.exists() and list(tmp_path.iterdir()) == []
    real = modelsize.slim(FIXTURES / name, out)
    assert dry.predicted_bytes == real.predicted_bytes == out.stat().st_size


def test_default_names_keep_what_keras_loads(tmp_path: Path) -> None:
    for name in ("model.weights.h5", "legacy.h5", "model.keras"):
        shutil.copy(FIXTURES / name, tmp_path / name)
    assert modelsize.slim(tmp_path / "model.weights.h5").target.name == "model.slim.weights.h5"
    assert modelsize.slim(tmp_path / "legacy.h5").target.name == "legacy.slim.h5"
    assert modelsize.slim(tmp_path / "model.keras").target.name == "model.slim.keras"
    notes = modelsize.slim(tmp_path / "model.weights.h5", tmp_path / "w.h5").notes
    assert any("needs a name ending in .weights.h5" in n for n in notes)


def test_output_is_reproducible(tmp_path: Path) -> None:
    a = modelsize.slim(FIXTURES / "model.keras", tmp_path / "a.keras").target.read_bytes()
    b = modelsize.slim(FIXTURES / "model.keras", tmp_path / "b.keras").target.read_bytes()
    assert a == b


# -- every element lands where it belongs, whatever the chunk ---------------------------------


def test_hyperslabs_cover_exactly_the_flat_range() -> None:
    rng = np.random.default_rng(0)
    for shape in [(7,), (3, 5), (2, 3, 4), (4, 1, 6, 2), (1, 1, 1), (5, 0 + 2, 3, 2, 2)]:
        n = int(np.prod(shape))
        for _ in range(40):
            a, b = sorted(int(v) for v in rng.integers(0, n + 1, size=2))
            mark = np.zeros(shape, dtype=int)
            boxes = _boxes(shape, a, b)
            assert len(boxes) <= 2 * len(shape)
            for offset, count in boxes:
                mark[tuple(slice(o, o + c) for o, c in zip(offset, count, strict=True))] += 1
            expected = np.zeros(n, dtype=int)
            expected[a:b] = 1
            assert np.array_equal(mark.reshape(-1), expected), (shape, a, b)


def test_tiny_chunks_write_every_element(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "odd.weights.h5"
    rng = np.random.default_rng(1)
    with h5py.File(src, "w") as f:
        f.create_dataset("layers/a/vars/0", data=rng.random((3, 5, 7), dtype=np.float32))
        f.create_dataset("layers/a/vars/1", data=np.float64(2.5))
        f.create_dataset("layers/a/vars/2", data=np.arange(6, dtype=np.int16).reshape(2, 3))
        f.create_dataset("layers/b/vars/0", data=np.array([b"ab", b"cdefg", b"", b"xyz"],
                                                          dtype="S5"))
        f.create_dataset("optimizer/vars/0", data=np.ones(4, np.float32))
    monkeypatch.setattr("modelsize.slimming.source.CHUNK", 12)  # 3 floats, 2.4 strings
    out = tmp_path / "odd.slim.weights.h5"
    modelsize.slim(src, out)
    with h5py.File(src) as a, h5py.File(out) as b:
        kept = _datasets(b)
        assert sorted(kept) == [n for n in sorted(_datasets(a)) if not n.startswith("opt")]
        for name, d in kept.items():
            assert (d.dtype, d.shape) == (a[name].dtype, a[name].shape)
            assert d[()].tobytes() == a[name][()].tobytes(), name


def test_groups_attributes_links_and_user_block_are_copied(tmp_path: Path) -> None:
    src = tmp_path / "shapes.h5"
    kernel = np.arange(12, dtype=np.float32).reshape(3, 4)
    with h5py.File(src, "w", userblock_size=512) as f:
        f.attrs["model_config"] = json.dumps({"class_name": "Sequential"})
        f.attrs["keras_version"] = np.bytes_("2.21.0")
        f.attrs["layer_names"] = np.array([b"dense", b"bn"])
        f.attrs["ints"] = np.arange(3)
        f.attrs["nothing"] = h5py.Empty("f4")
        f.create_group("empty").attrs["note"] = "kept though empty"
        g = f.create_group("model_weights/dense")
        g.attrs["weight_names"] = [b"dense/kernel:0"]
        g.create_dataset("kernel:0", data=kernel).attrs["unit"] = "none"
        f["model_weights/alias"] = g["kernel:0"]  # a second name for the same dataset
        f["soft"] = h5py.SoftLink("/model_weights/dense/kernel:0")
        f.create_dataset("optimizer_weights/Adam/m/kernel:0", data=kernel * 2)
    with open(src, "r+b") as fh:
        fh.write(b"made by a test")
    out = tmp_path / "shapes.slim.h5"
    report = modelsize.slim(src, out)
    assert [d.name for d in report.dropped] == ["optimizer_weights/Adam/m/kernel:0"]
    assert out.read_bytes()[:14] == b"made by a test"
    with h5py.File(src) as a, h5py.File(out) as b:
        assert b.userblock_size == 512
        assert sorted(b) == ["empty", "model_weights", "soft"]
        assert _attrs(b) == _attrs(a)
        for name in ("empty", "model_weights/dense", "model_weights/dense/kernel:0"):
            assert _attrs(b[name]) == _attrs(a[name])
        assert np.array_equal(b["model_weights/dense/kernel:0"][()], kernel)
        info = h5py.h5o.get_info
        assert info(b["model_weights/alias"].id).addr == info(
            b["model_weights/dense/kernel:0"].id).addr
        assert b.get("soft", getlink=True).path == "/model_weights/dense/kernel:0"


# -- what the writer refuses -----------------------------------------------------------------


def test_chunked_datasets_are_refused_in_one_line(tmp_path: Path) -> None:
    proc = run_cli("slim", str(FIXTURES / "layouts.h5"), "-o", str(tmp_path / "x.h5"))
    assert_one_line_error(proc, "layouts.h5")
    assert "is stored chunked or compressed" in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_gzip_dataset_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "gz.h5"
    with h5py.File(src, "w") as f:
        f.create_dataset("w", data=np.arange(100, dtype=np.float32), compression="gzip")
        f.create_dataset("v", data=np.arange(10, dtype=np.float32))
    with pytest.raises(UsageError, match=r"gz\.h5: w is stored chunked or compressed"):
        modelsize.slim(src, tmp_path / "gz.slim.h5")


def test_cast_bfloat16_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="--cast float16"):
        modelsize.slim(FIXTURES / "model.weights.h5", tmp_path / "x.weights.h5",
                       cast="bfloat16")
    assert list(tmp_path.iterdir()) == []


def test_dropping_a_layer_variable_warns_that_keras_may_refuse(tmp_path: Path) -> None:
    report = modelsize.slim(FIXTURES / "model.keras", tmp_path / "x.keras",
                            drop=["optimizer_state", "buffers"])
    assert any("Keras loads a layer only with all its variables" in n for n in report.notes)


def test_missing_h5py_is_one_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from modelsize.slimming.core import plan_slim
    from modelsize.slimming.plan import SlimOptions

    plan = plan_slim(modelsize.formats.read(FIXTURES / "legacy.h5"), SlimOptions())
    monkeypatch.setitem(sys.modules, "h5py", None)
    with pytest.raises(MissingDependencyError, match=r"pip install 'modelsize\[keras\]'"):
        KerasH5Writer().prepare(plan, tmp_path / "x.h5")


def test_other_formats_are_not_written_as_keras(tmp_path: Path) -> None:
    from modelsize.slimming.core import plan_slim
    from modelsize.slimming.plan import SlimOptions

    plan = plan_slim(modelsize.formats.read(FIXTURES / "model.keras"), SlimOptions())
    with pytest.raises(UsageError, match="keras-h5 writer cannot write keras input"):
        KerasH5Writer().prepare(plan, tmp_path / "x.h5")


# -- legacy .h5 Keras would not load (found by the fuzz target: slim wrote them, "Verified") ----


def _legacy_copy(tmp_path: Path) -> Path:
    path = tmp_path / "legacy.h5"
    shutil.copy(FIXTURES / "legacy.h5", path)
    path.chmod(0o644)
    return path


def test_legacy_h5_whose_model_config_is_not_json_is_refused(tmp_path: Path) -> None:
    """A bit flipped in the ``model_config`` attribute: Keras's ``load_model`` fails on its
    JSON; slim copied it (exit 0) before."""
    path = _legacy_copy(tmp_path)
    data = bytearray(path.read_bytes())
    at = data.index(b'{"class_name": "Sequential"')
    data[at + 1] ^= 0x40  # '"' -> 'b': no longer a property name
    path.write_bytes(bytes(data))
    for args in ([], ["--cast", "float16"]):
        proc = run_cli("slim", str(path), "-o", str(tmp_path / "o.h5"), *args)
        assert_one_line_error(proc, path)
        assert "model_config attribute is not valid JSON" in proc.stderr
        assert not (tmp_path / "o.h5").exists()


def test_legacy_h5_missing_a_weight_its_layer_lists_is_refused(tmp_path: Path) -> None:
    """A dataset renamed (by h5py) under the name its layer's ``weight_names`` lists: Keras's
    loader looks it up by that name (KeyError)."""
    path = _legacy_copy(tmp_path)
    with h5py.File(path, "r+") as f:
        group = f["model_weights/batch_normalization/batch_normalization"]
        group.move("beta:0", "ean:0")
    proc = run_cli("slim", str(path), "-o", str(tmp_path / "o.h5"))
    assert_one_line_error(proc, path)
    assert "lists the weight batch_normalization/beta:0, which is not a dataset" in proc.stderr
    assert not (tmp_path / "o.h5").exists()


def test_dropping_a_weight_a_legacy_layer_lists_is_refused(tmp_path: Path) -> None:
    """``--drop buffers`` of a legacy .h5 wrote a file whose BatchNormalization lists moving
    statistics it no longer has: Keras's loader cannot read it. Refused, saying how to keep
    them; the optimizer state still goes."""
    with pytest.raises(UsageError, match=r"layer batch_normalization lists .*moving_mean:0 "
                       r"\(buffers\): keep it"):
        modelsize.slim(FIXTURES / "legacy.h5", tmp_path / "o.h5", drop=["buffers"])
    assert list(tmp_path.iterdir()) == []
    report = modelsize.slim(FIXTURES / "legacy.h5", tmp_path / "o.h5", drop=["optimizer_state"])
    assert report.verified


def test_float_type_h5py_cannot_read_is_refused(tmp_path: Path) -> None:
    """A float32 whose exponent bias is 2**30 (one integer changed by the fuzz target): h5py
    cannot make it a NumPy dtype, so Keras cannot load it; slim failed with an internal error
    (ValueError from h5py) before. Refused in one line, copied or rewritten."""
    src = tmp_path / "odd.weights.h5"
    odd = h5py.h5t.IEEE_F32LE.copy()
    odd.set_ebias(1 << 30)
    with h5py.File(src, "w") as f:
        h5py.h5d.create(f.id, b"w", odd, h5py.h5s.create_simple((4,)))
        f.create_dataset("v", data=np.ones(3, np.float32))
    with h5py.File(src) as f, pytest.raises(ValueError, match="Insufficient precision"):
        f["w"].dtype  # noqa: B018 - the property raises
    for args in ([], ["--cast", "float16"]):
        proc = run_cli("slim", str(src), "-o", str(tmp_path / "o.weights.h5"), *args)
        assert_one_line_error(proc, src)
        assert "w is a floating type of no IEEE layout" in proc.stderr
        assert not (tmp_path / "o.weights.h5").exists()
    inv = modelsize.inspect(src).inventory
    assert {t.name: t.dtype for t in inv.tensors} == {"w": "uint8", "v": "float32"}


def test_member_whose_crc_reads_zero_is_refused(tmp_path: Path) -> None:
    """A central CRC-32 of 0 (torch's "none recorded"): zipfile, so Keras, checks it as it is
    ("Bad CRC-32"). The loader rules let the BadZipFile escape (exit 1) before (found by the
    fuzz target); refused in one line."""
    for member in ("metadata.json", "model.weights.h5"):
        path = tmp_path / f"{member}.keras"
        shutil.copy(FIXTURES / "model.keras", path)
        path.chmod(0o644)
        data = bytearray(path.read_bytes())
        at = data.index(b"PK\x01\x02")
        while data[at + 46 : at + 46 + len(member)] != member.encode():
            at = data.index(b"PK\x01\x02", at + 4)
        data[at + 16 : at + 20] = bytes(4)  # the central directory's CRC-32
        path.write_bytes(bytes(data))
        with zipfile.ZipFile(path) as zf, pytest.raises(zipfile.BadZipFile, match="Bad CRC"):
            zf.read(member)
        for args in ([], ["--keep", "*"]):
            proc = run_cli("slim", str(path), "-o", str(tmp_path / "o.keras"), *args)
            assert_one_line_error(proc, path)
            assert not (tmp_path / "o.keras").exists()


def test_weights_member_failing_its_crc_is_refused(tmp_path: Path) -> None:
    """A byte of the stored ``model.weights.h5`` changed after writing: zipfile (so Keras)
    refuses the member ("Bad CRC-32"); slim read it in place through h5py and wrote it on
    before (found by the fuzz target)."""
    path = tmp_path / "damaged.keras"
    shutil.copy(FIXTURES / "model.keras", path)
    path.chmod(0o644)
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo("model.weights.h5")
    data = bytearray(path.read_bytes())
    data[info.header_offset + 30 + len(info.filename) + len(info.extra) + info.file_size - 8] ^= 1
    path.write_bytes(bytes(data))
    with zipfile.ZipFile(path) as zf, pytest.raises(zipfile.BadZipFile, match="Bad CRC"):
        zf.read("model.weights.h5")
    proc = run_cli("slim", str(path), "-o", str(tmp_path / "o.keras"))
    assert_one_line_error(proc, path)
    assert "model.weights.h5' is corrupted" in proc.stderr
    assert not (tmp_path / "o.keras").exists()
