"""Records (modelsize._records) against the dataclasses they stand for."""

from __future__ import annotations

import copy
import dataclasses
import importlib
import inspect
import pickle
import pkgutil
import subprocess
import sys
from typing import ClassVar

import pytest

import modelsize.formats
from modelsize import _records
from modelsize._records import FrozenInstanceError, field, fields_of, record, replace

#: The modules whose data classes are records: what ``modelsize inspect`` imports (the
#: readers, the inventory, findings and quantization layouts).
RECORD_MODULES = ("modelsize.inventory", "modelsize.quantization", "modelsize.findings",
                  "modelsize.inspection", "modelsize.dtypes", "modelsize.formats",
                  *sorted(f"modelsize.formats.{m.name}" for m in
                          pkgutil.iter_modules(modelsize.formats.__path__)))


def _package_records() -> list[type]:
    found = []
    for name in RECORD_MODULES:
        module = importlib.import_module(name)
        assert "dataclass" not in vars(module), f"{name} defines dataclasses; make records"
        for value in vars(module).values():
            if (isinstance(value, type) and value.__module__ == name
                    and "__record_specs__" in value.__dict__):
                found.append(value)
    return found


PACKAGE_RECORDS = _package_records()


def test_the_record_modules_have_records() -> None:
    assert {cls.__module__ for cls in PACKAGE_RECORDS} >= {
        "modelsize.inventory", "modelsize.formats.safetensors", "modelsize.formats.onnx"}
    assert len(PACKAGE_RECORDS) >= 60


def _signature(cls: type) -> list[tuple[str, object, bool, object]]:
    """(name, kind, has a default, the default unless it is a factory's marker)."""
    out = []
    for p in list(inspect.signature(cls.__init__).parameters.values())[1:]:
        plain = p.default is not inspect.Parameter.empty and not (
            p.default is _records.MISSING
            or type(p.default).__name__ == "_HAS_DEFAULT_FACTORY_CLASS")
        out.append((p.name, p.kind, p.default is not inspect.Parameter.empty,
                    p.default if plain else None))
    return out


@pytest.mark.parametrize("cls", PACKAGE_RECORDS, ids=lambda c: f"{c.__module__}.{c.__name__}")
def test_package_record_matches_its_dataclass_twin(cls: type) -> None:
    twin = _records._twin(cls)
    assert _signature(cls) == _signature(twin)
    assert cls.__match_args__ == twin.__match_args__  # type: ignore[attr-defined]
    assert (cls.__hash__ is None) == (twin.__hash__ is None)
    params = twin.__dataclass_params__  # type: ignore[attr-defined]
    assert cls.__record_params__ == (params.frozen, params.eq)  # type: ignore[attr-defined]
    stored = tuple(f.name for f in dataclasses.fields(twin))
    assert fields_of(cls) == stored
    assert tuple(f.name for f in dataclasses.fields(cls)) == stored
    assert dataclasses.is_dataclass(cls)
    if "__slots__" in cls.__dict__:
        assert cls.__slots__ == stored  # type: ignore[attr-defined]
        assert "__dict__" not in cls.__dict__


# A record and a dataclass from the same definition, for behaviour side by side.

def _pair(frozen: bool, slots: bool) -> tuple[type, type]:
    def body() -> dict[str, object]:
        return {"__annotations__": {"name": "str", "shape": "tuple[int, ...]",
                                    "tags": "list[str]", "hidden": "int", "kind": "str",
                                    "total": "int", "limit": "ClassVar[int]"},
                "tags": "FACTORY", "hidden": "HIDDEN", "kind": "w", "total": "TOTAL",
                "limit": 3, "__doc__": "A sample.", "__module__": __name__}

    def post(self: object) -> None:
        object.__setattr__(self, "total", sum(self.shape))  # type: ignore[attr-defined]

    made = []
    for deco, fld in ((record, field), (dataclasses.dataclass, dataclasses.field)):
        ns = body()
        ns["tags"] = fld(default_factory=list)
        ns["hidden"] = fld(default=0, repr=False, compare=False)
        ns["total"] = fld(init=False)
        ns["__post_init__"] = post
        cls = type("Sample", (), ns)
        made.append(deco(frozen=frozen, slots=slots)(cls))  # type: ignore[operator]
    return made[0], made[1]


@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize("slots", [False, True])
def test_record_behaves_as_its_dataclass(frozen: bool, slots: bool,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    rec, dc = _pair(frozen, slots)
    monkeypatch.setattr(sys.modules[__name__], "Sample", rec, raising=False)  # for pickle
    a, b = rec("x", (2, 3)), dc("x", (2, 3))
    assert repr(a) == repr(b) == "Sample(name='x', shape=(2, 3), tags=[], kind='w', total=5)"
    assert a.tags == [] and a.tags is not rec("x", (1,)).tags
    assert a.hidden == 0 and a.total == 5 and rec.limit == 3
    assert a == rec("x", (2, 3), hidden=9) and a != rec("y", (2, 3))
    assert (a == b) is False and a.__eq__(b) is NotImplemented
    assert (rec.__hash__ is None) == (dc.__hash__ is None)
    if frozen:
        tagged = rec("x", (2, 3), ("t",))
        assert hash(tagged) == hash(rec("x", (2, 3), ("t",), hidden=4))
        assert hash(tagged) == hash(dc("x", (2, 3), ("t",)))
        with pytest.raises(FrozenInstanceError, match="cannot assign to field 'name'"):
            a.name = "z"
        with pytest.raises(AttributeError):
            del a.name
    else:
        a.name = "z"
        assert a.name == "z"
        a.name = "x"
    if slots:
        assert rec.__slots__ == ("name", "shape", "tags", "hidden", "kind", "total")
        assert not hasattr(a, "__dict__")
    else:
        assert rec.kind == "w" and "tags" not in rec.__dict__ and "total" not in rec.__dict__
    for again in (pickle.loads(pickle.dumps(a)), copy.copy(a), copy.deepcopy(a)):
        assert again == a and type(again) is rec
    assert dataclasses.asdict(a) == dataclasses.asdict(b)
    assert dataclasses.astuple(a) == dataclasses.astuple(b)
    assert [f.name for f in dataclasses.fields(a)] == [f.name for f in dataclasses.fields(b)]
    for r in (replace(a, name="q", hidden=2), dataclasses.replace(a, name="q", hidden=2)):
        assert (r.name, r.shape, r.hidden, r.total) == ("q", (2, 3), 2, 5)
    with pytest.raises(ValueError, match="init=False"):
        replace(a, total=1)
    assert inspect.signature(rec).parameters.keys() == inspect.signature(dc).parameters.keys()


def test_initvar_and_post_init() -> None:
    @record
    class Reg:
        """Items in, entries kept."""

        items: dataclasses.InitVar[list[int]]
        entries: list[int] = field(init=False)

        def __post_init__(self, items: list[int]) -> None:
            self.entries = [i * 2 for i in items]

    reg = Reg([1, 2])
    assert reg.entries == [2, 4] and not hasattr(reg, "items")
    assert [f.name for f in dataclasses.fields(reg)] == ["entries"]
    assert repr(reg) == "test_initvar_and_post_init.<locals>.Reg(entries=[2, 4])"
    assert Reg.__hash__ is None


def test_a_dataclass_may_subclass_a_record() -> None:
    @record(frozen=True)
    class Base:
        """Base."""

        a: int
        b: str = "x"

    @dataclasses.dataclass(frozen=True)
    class Child(Base):
        c: float = 1.0

    child = Child(1, "y", 2.0)
    assert (child.a, child.b, child.c) == (1, "y", 2.0)
    assert [f.name for f in dataclasses.fields(child)] == ["a", "b", "c"]
    with pytest.raises(AttributeError):
        child.a = 2  # type: ignore[misc]


def test_a_plain_subclass_of_a_frozen_record_may_add_attributes() -> None:
    @record(frozen=True)
    class Base:
        """Base."""

        a: int

    class Child(Base):
        pass

    child = Child(1)
    child.extra = 2  # type: ignore[attr-defined]
    assert child.extra == 2  # type: ignore[attr-defined]
    with pytest.raises(FrozenInstanceError):
        child.a = 3  # type: ignore[misc]


def test_what_records_refuse() -> None:
    @record
    class Base:
        """Base."""

        a: int

    with pytest.raises(TypeError, match="cannot inherit fields"):
        @record
        class Child(Base):
            b: int

    with pytest.raises(TypeError, match="non-default argument"):
        @record
        class Order:
            a: int = 1
            b: int  # type: ignore[misc]

    with pytest.raises(ValueError, match="mutable default"):
        @record
        class Mutable:
            a: list[int] = []  # type: ignore[misc]  # noqa: RUF012

    with pytest.raises(ValueError, match="both default and default_factory"):
        field(default=1, default_factory=list)

    with pytest.raises(TypeError, match="Cannot overwrite attribute __setattr__"):
        @record(frozen=True)
        class Own:
            a: int

            def __setattr__(self, name: str, value: object) -> None:
                pass


def test_classvar_is_not_a_field() -> None:
    @record
    class Counted:
        """ClassVar is skipped."""

        n: ClassVar[int] = 0
        a: int = 1

    assert fields_of(Counted) == ("a",)
    assert Counted.n == 0 and Counted().a == 1


def test_inspect_imports_neither_dataclasses_nor_inspect(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The point of records: ``modelsize inspect`` of a torch file and a safetensors file
    imports neither ``dataclasses`` nor what it imports."""
    torch = pytest.importorskip("torch")
    header = b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'
    st = tmp_path / "w.safetensors"
    st.write_bytes(len(header).to_bytes(8, "little") + header + bytes(8))
    pt = tmp_path / "w.pt"
    torch.save({"model": {"w": torch.zeros(2, 3)}, "step": 1}, pt)
    calls = "".join(f"    assert main(['inspect', {str(p)!r}{extra}]) == 0\n"
                    for p in (st, pt) for extra in ("", ", '--json'"))
    code = ("import sys, io, contextlib\nfrom modelsize.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n" + calls
            + "print(sorted({'dataclasses', 'inspect', 'ast', 'dis'} & set(sys.modules)))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"
