"""PyTorch zip checkpoints written by real torch: every byte in the right category."""

from __future__ import annotations

import builtins
import os
import struct
import warnings
import zipfile
from pathlib import Path
from typing import Any

import pytest

from modelsize.categories import Category
from modelsize.errors import CorruptFileError
from modelsize.formats import read
from modelsize.inventory import Inventory
from tests.conftest import assert_one_line_error, by_cat, nbytes, run_cli

torch = pytest.importorskip("torch")
nn = torch.nn


def check_sum(inv: Inventory, path: Path) -> None:
    assert inv.file_bytes == path.stat().st_size == sum(inv.bytes_by_category.values())


def train_one_step(model: Any, opt: Any, inputs: Any) -> None:
    model(inputs).sum().backward()
    opt.step()


def small_net() -> Any:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.ReLU(), nn.Linear(3, 2))


class Trapped(nn.Module):
    """A user class: loading it for real imports this module and calls ``__setstate__``."""

    marker: Path | None = None

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.register_buffer("scale", torch.ones(2))
        self.last_output: Any = None

    def forward(self, x: Any) -> Any:
        self.last_output = (self.fc(x) * self.scale).detach()
        return self.last_output

    def __setstate__(self, state: dict[str, Any]) -> None:
        if Trapped.marker is not None:
            Trapped.marker.write_text("instantiated")
        super().__setstate__(state)


class Scripted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.register_buffer("offset", torch.arange(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + self.offset


class SystemCall:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


class EvalCall:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (builtins.eval, (f"open({str(self.marker)!r}, 'w')",))


class ExecCall:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (builtins.exec, (f"open({str(self.marker)!r}, 'w')",))


def test_training_checkpoint_after_adam_step(tmp_path: Path) -> None:
    model = small_net()
    opt = torch.optim.Adam(model.parameters())
    train_one_step(model, opt, torch.randn(8, 4))
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 3}, path)

    inv = read(path)
    assert inv.format == "pytorch"
    cats = by_cat(inv)
    assert cats["weights"] == nbytes(*model.parameters())
    assert cats["buffers"] == nbytes(*model.buffers())
    slots = [v for s in opt.state_dict()["state"].values() for v in s.values()]
    assert cats["optimizer_state"] == nbytes(*slots)
    assert cats["unused_storage"] == cats["duplicates"] == cats["gradients"] == 0
    check_sum(inv, path)
    names = {t.name: t for t in inv.tensors}
    assert names["optimizer.state.0.exp_avg"].category == Category.OPTIMIZER_STATE
    assert names["model.1.running_mean"].category == Category.BUFFERS
    assert names["model.0.weight"].category == Category.WEIGHTS
    assert inv.facts["optimizer"] == "Adam/AdamW"
    assert inv.unsafe_globals == ()
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo("ckpt/data/0")
    assert names["model.0.weight"].stored_nbytes == info.file_size


def test_lightning_style_checkpoint(tmp_path: Path) -> None:
    model = small_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train_one_step(model, opt, torch.randn(8, 4))
    path = tmp_path / "epoch=0.ckpt"
    torch.save(
        {
            "epoch": 0,
            "global_step": 1,
            "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
            "optimizer_states": [opt.state_dict()],
            "lr_schedulers": [],
            "hyper_parameters": {"lr": 0.1},
        },
        path,
    )
    inv = read(path)
    cats = by_cat(inv)
    buffers = [opt.state[p]["momentum_buffer"] for p in model.parameters()]
    assert cats["optimizer_state"] == nbytes(*buffers)
    assert cats["weights"] == nbytes(*model.parameters())
    assert cats["buffers"] == nbytes(*model.buffers())
    assert inv.facts["optimizer"] == "SGD with momentum"
    check_sum(inv, path)


def test_hf_state_dict_with_tied_weights(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    state = model.state_dict()
    path = tmp_path / "pytorch_model.bin"
    torch.save(state, path)

    inv = read(path)
    params = {p.data_ptr(): p for p in model.parameters()}  # tied weights appear once
    persistent = [b for n, b in model.named_buffers() if n in state]
    cats = by_cat(inv)
    assert cats["weights"] == nbytes(*params.values())
    assert cats["buffers"] == nbytes(*persistent)
    check_sum(inv, path)
    names = {t.name: t for t in inv.tensors}
    assert names["lm_head.weight"].storage == names["transformer.wte.weight"].storage
    assert names["lm_head.weight"].stored_nbytes == 0
    assert names["transformer.wte.weight"].stored_nbytes == nbytes(model.lm_head.weight)


def test_slice_of_big_tensor_leaves_unused_storage(tmp_path: Path) -> None:
    big = torch.arange(1000, dtype=torch.float32)
    path = tmp_path / "slice.pt"
    torch.save(big[:10], path)
    inv = read(path)
    cats = by_cat(inv)
    assert cats["unused_storage"] == (big.numel() - 10) * big.element_size()
    assert cats["weights"] == 10 * big.element_size()
    check_sum(inv, path)


def test_shared_storage_counts_once(tmp_path: Path) -> None:
    t = torch.randn(16)
    path = tmp_path / "shared.pt"
    torch.save({"a": t, "b": t[2:], "c": t.view(2, 8)}, path)
    inv = read(path)
    assert by_cat(inv)["weights"] == nbytes(t)
    assert len({r.storage for r in inv.tensors}) == 1
    assert [r.stored_nbytes for r in inv.tensors] == [nbytes(t), 0, 0]


def test_float64_state_dict(tmp_path: Path) -> None:
    model = small_net().double()
    path = tmp_path / "double.pt"
    torch.save(model.state_dict(), path)
    inv = read(path)
    assert by_cat(inv)["weights"] == nbytes(*model.parameters())
    assert {t.dtype for t in inv.tensors if t.category == Category.WEIGHTS} == {"float64"}
    check_sum(inv, path)


def test_grad_is_not_saved_with_its_parameter_but_grad_keys_are_gradients(tmp_path: Path) -> None:
    p = nn.Parameter(torch.randn(5, 3))
    (p * 2).sum().backward()
    assert p.grad is not None
    alone = tmp_path / "param.pt"
    torch.save(p, alone)  # torch.save keeps data and requires_grad, never .grad
    cats = by_cat(read(alone))
    assert cats["weights"] == nbytes(p)
    assert cats["gradients"] == 0

    both = tmp_path / "grads.pt"
    torch.save({"w": p, "w.grad": p.grad, "grads": {"w": p.grad * 2}}, both)
    inv = read(both)
    cats = by_cat(inv)
    assert cats["weights"] == nbytes(p)
    assert cats["gradients"] == 2 * nbytes(p.grad)
    check_sum(inv, both)


def test_ema_copy_is_tagged(tmp_path: Path) -> None:
    model = small_net()
    sd = model.state_dict()
    ema = {k: (v * 0.5 if v.is_floating_point() else v + 1) for k, v in sd.items()}
    path = tmp_path / "ema.pt"
    torch.save({"model": sd, "model_ema": ema}, path)
    inv = read(path)
    ema_records = [t for t in inv.tensors if t.name.startswith("model_ema.")]
    assert ema_records and all("ema" in t.tags for t in ema_records)
    assert all("ema" not in t.tags for t in inv.tensors if t.name.startswith("model."))
    assert by_cat(inv)["weights"] == 2 * nbytes(*model.parameters())


def test_pickled_module_with_cached_activation(tmp_path: Path) -> None:
    torch.manual_seed(0)
    net = Trapped()
    net(torch.randn(4, 3))
    path = tmp_path / "whole_model.pt"
    torch.save(net, path)

    Trapped.marker = tmp_path / "MARKER"
    try:
        inv = read(path)
        assert not Trapped.marker.exists()
        # The trap works: a real load instantiates the class and writes the marker.
        torch.load(path, weights_only=False)
        assert Trapped.marker.exists()
    finally:
        Trapped.marker = None

    cats = by_cat(inv)
    assert cats["weights"] == nbytes(*net.parameters())
    assert cats["buffers"] == nbytes(net.scale)
    assert cats["activations"] == nbytes(net.last_output)
    assert cats["graph"] > 0
    assert inv.unsafe_globals == (f"{__name__}.Trapped",)
    assert f"{__name__}.Trapped" in inv.facts["module_classes"]
    assert "torch.nn.modules.linear.Linear" in inv.facts["module_classes"]
    names = {t.name: t.category for t in inv.tensors}
    assert names == {
        "fc.weight": Category.WEIGHTS,
        "fc.bias": Category.WEIGHTS,
        "scale": Category.BUFFERS,
        "last_output": Category.ACTIVATIONS,
    }
    check_sum(inv, path)


def _scripted(path: Path) -> torch.jit.ScriptModule:
    """:class:`Scripted` saved as a TorchScript archive at ``path``."""
    with warnings.catch_warnings():
        # torch 2.13 deprecates TorchScript, but users still hold scripted archives to read.
        warnings.simplefilter("ignore", DeprecationWarning)
        scripted = torch.jit.script(Scripted())
    scripted.save(str(path))
    return scripted


def test_torchscript_archive(tmp_path: Path) -> None:
    path = tmp_path / "scripted.pt"
    scripted = _scripted(path)
    inv = read(path)
    cats = by_cat(inv)
    assert cats["weights"] == nbytes(*scripted.parameters())
    assert cats["buffers"] == nbytes(*scripted.buffers())
    assert cats["graph"] > 0
    assert inv.unsafe_globals == ()
    assert inv.facts["torchscript"] == "yes"
    check_sum(inv, path)


def test_numpy_arrays_inside_data_pkl(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    arr = np.arange(10, dtype=np.float64)
    w = torch.randn(3)
    path = tmp_path / "np.pt"
    torch.save({"w": w, "arr": arr}, path, pickle_protocol=4)
    inv = read(path)
    assert by_cat(inv)["weights"] == nbytes(w) + arr.nbytes
    assert inv.unsafe_globals == ()
    check_sum(inv, path)


@pytest.mark.parametrize(
    ("payload", "name"),
    [
        (SystemCall, f"{os.system.__module__}.system"),
        (EvalCall, "builtins.eval"),
        (ExecCall, "builtins.exec"),
    ],
)
def test_hostile_pickle_inside_a_checkpoint(
    tmp_path: Path, payload: type, name: str
) -> None:
    marker = tmp_path / "MARKER"
    path = tmp_path / "hostile.pt"
    torch.save({"weight": torch.ones(3), "config": payload(marker)}, path)
    inv = read(path)
    assert name in inv.unsafe_globals
    assert by_cat(inv)["weights"] == 12
    assert not marker.exists()
    proc = run_cli("inspect", str(path), "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert name in proc.stdout
    assert not marker.exists()


# -- corrupt and lying files ---------------------------------------------------------------


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    path = tmp_path / "model.pt"
    torch.save({"w": torch.randn(2, 3), "b": torch.zeros(2)}, path)
    return path


def rewrite(src: Path, dst: Path, change: dict[str, bytes | None]) -> None:
    """Copy a zip, replacing (bytes) or dropping (None) the named members."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            if info.filename in change:
                data = change[info.filename]
                if data is not None:
                    zout.writestr(info.filename, data)
            else:
                zout.writestr(info, zin.read(info.filename))


def expect_corrupt(path: Path, words: str) -> None:
    with pytest.raises(CorruptFileError) as exc:
        read(path)
    assert words in str(exc.value)
    assert_one_line_error(run_cli("inspect", str(path)), path)


def test_truncated_zip(saved: Path, tmp_path: Path) -> None:
    cut = tmp_path / "cut.pt"
    data = saved.read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    expect_corrupt(cut, "zip central directory unreadable")


def test_flipped_opcode_in_data_pkl(saved: Path, tmp_path: Path) -> None:
    with zipfile.ZipFile(saved) as zf:
        raw = bytearray(zf.read("model/data.pkl"))
    raw[2] = 0xFF  # the opcode right after PROTO
    # Rewritten with a matching CRC-32, as a crafted file would be: the parser must refuse it.
    bad = tmp_path / "flipped.pt"
    rewrite(saved, bad, {"model/data.pkl": bytes(raw)})
    expect_corrupt(bad, "unknown opcode")


def test_flipped_opcode_in_place_is_a_crc_error(saved: Path) -> None:
    with zipfile.ZipFile(saved) as zf:
        raw = zf.read("model/data.pkl")
    data = bytearray(saved.read_bytes())
    data[data.find(raw) + 2] = 0xFF  # damaged after writing: the CRC-32 no longer matches
    saved.write_bytes(bytes(data))
    expect_corrupt(saved, "member 'model/data.pkl' is corrupted")


def test_missing_storage_member(saved: Path, tmp_path: Path) -> None:
    bad = tmp_path / "missing.pt"
    rewrite(saved, bad, {"model/data/1": None})
    expect_corrupt(bad, "refers to storage '1' but the archive has no model/data/1")


def test_storage_member_shorter_than_declared(saved: Path, tmp_path: Path) -> None:
    bad = tmp_path / "short.pt"
    rewrite(saved, bad, {"model/data/0": b"\x00" * 20})
    expect_corrupt(bad, "should hold 6 x float32 = 24 bytes but the member holds 20")


def test_tensor_larger_than_its_storage(saved: Path, tmp_path: Path) -> None:
    with zipfile.ZipFile(saved) as zf:
        pkl = zf.read("model/data.pkl")
    shape = b"K\x02K\x03\x86"  # BININT1 2, BININT1 3, TUPLE2: the size (2, 3)
    assert pkl.count(shape) == 1
    bad = tmp_path / "lying.pt"
    rewrite(saved, bad, {"model/data.pkl": pkl.replace(shape, b"K\x09K\x03\x86")})
    expect_corrupt(bad, "reaches byte 108 of storage 'model/data/0', which holds 24")


# Found by the fuzz target (tests/fuzz): torch.load refuses these, and slim wrote them on.


@pytest.mark.parametrize("value", [b"litt\x7fe", b"", b"middle"])
def test_unknown_byteorder_is_refused(saved: Path, tmp_path: Path, value: bytes) -> None:
    bad = tmp_path / "byteorder.pt"
    rewrite(saved, bad, {"model/byteorder": value})
    with pytest.raises(ValueError, match="Unknown endianness type"):
        torch.load(bad, weights_only=True)
    expect_corrupt(bad, "model/byteorder says")


@pytest.mark.parametrize("value", [b"x3\n", b"0\n", b""])
def test_version_record_torch_cannot_read_is_refused(saved: Path, tmp_path: Path,
                                                     value: bytes) -> None:
    bad = tmp_path / "version.pt"
    rewrite(saved, bad, {"model/version": value})
    with pytest.raises(RuntimeError, match="version"):
        torch.load(bad, weights_only=True)
    expect_corrupt(bad, "model/version says")


@pytest.mark.parametrize("value", [b"1234\xbb5678", b"\xff" * 40, b"\xed\xa0\x80"],
                         ids=["one-byte", "all-ff", "surrogate"])
def test_serialization_id_that_is_not_utf8_is_refused(saved: Path, tmp_path: Path,
                                                      value: bytes) -> None:
    # torch.load reads the record into a Python str after the tensors (strict UTF-8, so a
    # UTF-8-encoded surrogate fails too); slim copied the record on, into an output torch
    # refuses as it refused the input
    bad = tmp_path / "serialization_id.pt"
    rewrite(saved, bad, {"model/.data/serialization_id": value})
    with pytest.raises(UnicodeDecodeError):
        torch.load(bad, weights_only=True)
    expect_corrupt(bad, "model/.data/serialization_id is not UTF-8 text")
    out = tmp_path / "slim.pt"
    assert_one_line_error(run_cli("slim", str(bad), "-o", str(out)), bad)
    assert not out.exists()


@pytest.mark.parametrize("value", [b"", "caf\u00e9 \u00b7 1234".encode()],
                         ids=["empty", "non-ascii"])
def test_serialization_id_of_any_utf8_text_is_read(saved: Path, tmp_path: Path,
                                                   value: bytes) -> None:
    odd = tmp_path / "serialization_id.pt"
    rewrite(saved, odd, {"model/.data/serialization_id": value})
    assert torch.load(odd, weights_only=True)["w"].shape == (2, 3)
    assert read(odd).format == "pytorch"


def test_serialization_id_of_a_torchscript_archive_is_not_read(tmp_path: Path) -> None:
    # torch.jit.load (and torch.load, which hands TorchScript archives to it) never makes the
    # record a str: any bytes load
    path = tmp_path / "scripted.pt"
    _scripted(path)
    with zipfile.ZipFile(path) as zf:
        name = next(n for n in zf.namelist() if n.endswith("/.data/serialization_id"))
    odd = tmp_path / "odd.pt"
    rewrite(path, odd, {name: b"\xff\xfe"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert isinstance(torch.jit.load(str(odd)), torch.jit.ScriptModule)
    assert read(odd).facts["torchscript"] == "yes"


def _members_changed(src: Path, dst: Path, edit: Any) -> None:
    """Copy a zip with its (name, bytes) list of members passed through ``edit``."""
    with zipfile.ZipFile(src) as zin:
        items = [(i.filename, zin.read(i.filename)) for i in zin.infolist()]
    with zipfile.ZipFile(dst, "w") as zout:
        for name, data in edit(items):
            zout.writestr(name, data)


_OUTSIDE = {  # torch takes the folder from the first member and refuses any member outside it
    "renamed": (lambda items: [("modelabyteorder" if n == "model/byteorder" else n, d)
                               for n, d in items], "'modelabyteorder' lies outside"),
    "appended": (lambda items: [*items, ("other/x", b"1")], "'other/x' lies outside"),
    "no-folder": (lambda items: [*items, ("x", b"1")], "'x' lies outside"),
    "first": (lambda items: [("other/x", b"1"), *items], "'model/data.pkl' lies outside"),
}


@pytest.mark.parametrize("case", sorted(_OUTSIDE))
def test_member_outside_the_archive_folder_is_refused(saved: Path, tmp_path: Path,
                                                      case: str) -> None:
    # found by a fuzz campaign: a member renamed out of the folder, which slim copied on
    edit, words = _OUTSIDE[case]
    bad = tmp_path / f"{case}.pt"
    _members_changed(saved, bad, edit)
    with pytest.raises(RuntimeError, match=r"not in a subdirectory|hasRecord"):
        torch.load(bad, weights_only=True)
    expect_corrupt(bad, words)


def test_members_deeper_in_the_archive_folder_are_read(saved: Path, tmp_path: Path) -> None:
    deeper = tmp_path / "deeper.pt"
    _members_changed(saved, deeper, lambda items: [*items, ("model/sub/x", b"1"),
                                                   ("model//y", b"2")])
    assert torch.load(deeper, weights_only=True)["w"].shape == (2, 3)
    assert read(deeper).format == "pytorch"


def test_data_pkl_that_calls_a_string_is_refused(saved: Path, tmp_path: Path) -> None:
    bad = tmp_path / "calls_a_str.pt"
    rewrite(saved, bad, {"model/data.pkl": b"\x80\x02X\x01\x00\x00\x00f)R."})
    with pytest.raises(TypeError, match="'str' object is not callable"):
        torch.load(bad, weights_only=False)
    expect_corrupt(bad, "model/data.pkl: its pickle fails to load (byte ")


def test_version_record_of_a_newer_torch_is_read(saved: Path, tmp_path: Path) -> None:
    newer = tmp_path / "newer.pt"
    rewrite(saved, newer, {"model/version": b"33\n"})
    with pytest.raises(RuntimeError, match="maximum supported version"):
        torch.load(newer, weights_only=True)
    assert read(newer).format == "pytorch"


def _central(data: bytearray, name: bytes) -> int:
    """Where the central directory record of member ``name`` starts."""
    at = data.find(b"PK\x01\x02")  # the records, in order
    while data[at + 46 : at + 46 + len(name)] != name:
        at = data.find(b"PK\x01\x02", at + 4)
    return at


def test_member_flagged_encrypted_is_refused(saved: Path) -> None:
    data = bytearray(saved.read_bytes())
    data[_central(data, b"model/data/0") + 8] |= 0x01  # general-purpose flags: encrypted
    saved.write_bytes(bytes(data))
    with pytest.raises(RuntimeError, match="unsupported encryption"):
        torch.load(saved, weights_only=True)
    expect_corrupt(saved, "member 'model/data/0' is marked encrypted")


def test_storage_alignment_torch_cannot_read_is_refused(saved: Path, tmp_path: Path) -> None:
    bad = tmp_path / "alignment.pt"
    rewrite(saved, bad, {"model/.storage_alignment": b"6\x7f"})
    with pytest.raises(ValueError, match="invalid literal for int"):
        torch.load(bad, weights_only=True)
    expect_corrupt(bad, "model/.storage_alignment says")


def test_storage_of_a_method_torch_cannot_read_is_refused(saved: Path) -> None:
    data = bytearray(saved.read_bytes())
    data[_central(data, b"model/data/0") + 10] = 1  # the method: 1 (shrunk) instead of 0
    saved.write_bytes(bytes(data))
    with pytest.raises(RuntimeError, match="unsupported method"):
        torch.load(saved, weights_only=True)
    expect_corrupt(saved, "member 'model/data/0' uses compression method 1")


def test_central_record_running_past_the_directory_is_refused(saved: Path) -> None:
    """The last record's name length made 65535: zipfile reads the short name and goes on,
    torch's miniz refuses the archive."""
    data = bytearray(saved.read_bytes())
    with zipfile.ZipFile(saved) as zf:
        last = zf.infolist()[-1].filename.encode()
    struct.pack_into("<H", data, _central(data, last) + 28, 0xFFFF)
    saved.write_bytes(bytes(data))
    with pytest.raises(RuntimeError, match="invalid header or archive is corrupted"):
        torch.load(saved, weights_only=True)
    expect_corrupt(saved, "declares a 65535-byte name")


def test_zip_without_data_pkl_is_not_pytorch(tmp_path: Path) -> None:
    path = tmp_path / "other.zip"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("archive/readme.txt", "hello")
    proc = run_cli("inspect", str(path))
    assert_one_line_error(proc, path)


def test_duplicates_are_found_without_reading_storages_whose_crc_differs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from modelsize import inventory

    gen = torch.Generator().manual_seed(0)
    a = torch.randn(256, generator=gen)
    tensors = {"a": a, "b": a.clone(), "c": torch.randn(256, generator=gen),
               "d": torch.randn(256, generator=gen), "step_1": torch.tensor(1.0),
               "step_2": torch.tensor(1.0)}
    path = tmp_path / "dups.pt"
    torch.save(tensors, path)
    with zipfile.ZipFile(path) as zf:  # what torch wrote: one member per storage, its CRC
        crcs = {i.filename.rsplit("/", 1)[-1]: i.CRC for i in zf.infolist()}
    read_keys: list[str] = []
    real_read = inventory._FileReader.read

    def counting(self: Any, key: str, start: int, stop: int) -> bytes:
        read_keys.append(key)
        return real_read(self, key, start, stop)

    monkeypatch.setattr(inventory._FileReader, "read", counting)
    inv = read(path)
    by_name = {t.name: t for t in inv.tensors}
    assert by_name["b"].duplicate_of == "a"
    assert by_name["c"].duplicate_of is None and by_name["d"].duplicate_of is None
    assert inv.bytes_by_category[Category.DUPLICATES] == a.nbytes
    # Only a and b share a CRC: c and d (same size, dtype, shape) are ruled out unread, and
    # one-element storages are one value repeated (never duplicates): not read either.
    assert len({crcs[k] for k in ("0", "1", "2", "3")}) == 3
    assert {k.rsplit("/", 1)[-1] for k in read_keys} == {by_name["a"].storage.rsplit("/", 1)[-1],
                                                         by_name["b"].storage.rsplit("/", 1)[-1]}


def test_close_local_headers_are_read_together_and_far_ones_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, preads: list[int]) -> None:
    """formats/_zip.py's _Window: 3,000 small tensors' headers in a few reads, a large
    tensor's data never read; the inventory is the one a read per header gives (and the one
    the compiled loop gives, which reads the window's headers, and a far header alone)."""
    from modelsize.formats import _zip

    small = {f"t{i}": torch.full((3,), float(i)) for i in range(3000)}
    path = tmp_path / "many.pt"
    torch.save({**small, "big": torch.zeros(2**20)}, path)
    compiled = read(path)
    monkeypatch.setattr(_zip, "_local_headers", None)  # the reads of the Python loop, counted
    reads = preads
    reads.clear()
    inv = read(path)
    assert [(t.name, t.nbytes, t.storage_offset) for t in inv.tensors] == \
        [(t.name, t.nbytes, t.storage_offset) for t in compiled.tensors]
    assert inv.bytes_by_category == compiled.bytes_by_category
    windowed = len(reads)
    monkeypatch.setattr(_zip, "_GAP", -1)  # every header read alone, and only it
    monkeypatch.setattr(_zip, "_HEAD", 30)
    reads.clear()
    alone = read(path)
    assert [(t.name, t.nbytes, t.storage_offset) for t in inv.tensors] == \
        [(t.name, t.nbytes, t.storage_offset) for t in alone.tensors]
    assert inv.bytes_by_category == alone.bytes_by_category
    assert len(reads) > 3000 > 100 > windowed
    assert max(reads) < 2**20 + 4096 and sum(reads) < 4 * 2**20  # not the 4 MiB tensor
