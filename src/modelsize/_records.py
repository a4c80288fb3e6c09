"""Data classes made without the :mod:`dataclasses` module, for the modules ``inspect`` imports.

``modelsize inspect`` is a short process: reading a checkpoint's metadata takes about 50 ms,
and before this module the ``dataclasses`` import (which imports ``inspect``, ``ast``, ``dis``
and ``tokenize``) and the definition of the inspect path's 17 data classes took about 30 ms
more. :func:`record` makes the same classes for a tenth of that: one compiled ``__init__`` per
class, the other methods shared.

A record is a dataclass to everything that asks: ``dataclasses.fields``, ``replace``,
``asdict``, ``astuple`` and ``is_dataclass`` work on it, and a dataclass may subclass it.
``__dataclass_fields__`` and ``__dataclass_params__`` are made on first use, from a twin made
by the ``dataclasses`` module out of the same definition (so the fields are the ones it would
make). What it supports is what the inspect path uses: ``frozen``, ``slots``, ``eq``, field
defaults and :func:`field` (``default``, ``default_factory``, ``init``, ``repr``,
``compare``, ``hash``), ``InitVar`` fields (annotated ``InitVar[...]``), ``ClassVar``
annotations and ``__post_init__``. Anything else (``order``, ``kw_only``, inheriting fields
from a base class) is refused when the class is defined, so a record never silently differs
from the dataclass it stands for; ``tests/test_records.py`` checks every record of the
package against its ``dataclasses`` twin.

One difference: assigning to a frozen record's field raises :class:`FrozenInstanceError`
from this module (an ``AttributeError``, like the ``dataclasses`` one), not
``dataclasses.FrozenInstanceError``.
"""

from __future__ import annotations

from collections.abc import Callable
from operator import attrgetter
from typing import TYPE_CHECKING, Any, TypeVar

__all__ = ["FrozenInstanceError", "field", "fields_of", "record", "replace"]

T = TypeVar("T")


class _Missing:
    __slots__ = ()

    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()


class FrozenInstanceError(AttributeError):
    """Assigning to a field of a frozen record."""


class Field:
    """What :func:`field` says about one field."""

    __slots__ = ("compare", "default", "default_factory", "hash", "init", "repr")

    def __init__(self, default: Any, default_factory: Any, init: bool, repr: bool,
                 compare: bool, hash: bool | None) -> None:
        if default is not MISSING and default_factory is not MISSING:
            raise ValueError("cannot specify both default and default_factory")
        self.default = default
        self.default_factory = default_factory
        self.init = init
        self.repr = repr
        self.compare = compare
        self.hash = hash


def _field(*, default: Any = MISSING, default_factory: Callable[[], Any] | Any = MISSING,
          init: bool = True, repr: bool = True, compare: bool = True,
          hash: bool | None = None) -> Any:
    """Like :func:`dataclasses.field` (the options records support)."""
    return Field(default, default_factory, init, repr, compare, hash)


class _Spec:
    """One field of a record, as :func:`record` understood it."""

    __slots__ = ("annotation", "field", "initvar", "name")

    def __init__(self, name: str, annotation: Any, spec: Field, initvar: bool) -> None:
        self.name = name
        self.annotation = annotation
        self.field = spec
        self.initvar = initvar


def _kind(annotation: Any) -> str:
    """``classvar``, ``initvar`` or ``field`` (annotations are strings under
    ``from __future__ import annotations``; a record module must not alias these names)."""
    text = annotation if isinstance(annotation, str) else repr(annotation)
    for prefix in ("ClassVar", "typing.ClassVar"):
        if text == prefix or text.startswith(prefix + "["):
            return "classvar"
    for prefix in ("InitVar", "dataclasses.InitVar"):
        if text == prefix or text.startswith(prefix + "["):
            return "initvar"
    return "field"


class _LazyDataclassAttr:
    """``__dataclass_fields__`` or ``__dataclass_params__``, made by ``dataclasses`` on first
    use and then stored on the class in place of this descriptor."""

    def __init__(self, owner: type, attr: str) -> None:
        self.owner = owner
        self.attr = attr

    def __get__(self, obj: object, cls: type | None = None) -> Any:
        owner = self.owner
        twin = _twin(owner)
        for attr in ("__dataclass_fields__", "__dataclass_params__"):
            type.__setattr__(owner, attr, twin.__dict__[attr])
        return owner.__dict__[self.attr]


def _twin(cls: type) -> type:
    """The dataclass the ``dataclasses`` module makes from the record's definition."""
    import dataclasses

    specs: tuple[_Spec, ...] = cls.__dict__["__record_specs__"]
    frozen, eq = cls.__dict__["__record_params__"]
    ns: dict[str, Any] = {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                          "__annotations__": {}}
    for s in specs:
        # InitVar as an object, not a string: the record's module need not import it.
        ns["__annotations__"][s.name] = dataclasses.InitVar[Any] if s.initvar else s.annotation
        f = s.field
        ns[s.name] = dataclasses.field(default=_theirs(f.default),
                                       default_factory=_theirs(f.default_factory),
                                       init=f.init, repr=f.repr, compare=f.compare,
                                       hash=f.hash)
    made: type = dataclasses.dataclass(eq=eq, frozen=frozen)(type(cls.__name__, (), ns))
    return made


def _theirs(value: Any) -> Any:
    import dataclasses

    return dataclasses.MISSING if value is MISSING else value


def _frozen_setattr(self: Any, name: str, value: Any) -> None:
    cls = type(self)
    if cls in _FROZEN or name in cls.__record_names__:
        raise FrozenInstanceError(f"cannot assign to field {name!r}")
    object.__setattr__(self, name, value)  # a subclass's own attribute


def _frozen_delattr(self: Any, name: str) -> None:
    cls = type(self)
    if cls in _FROZEN or name in cls.__record_names__:
        raise FrozenInstanceError(f"cannot delete field {name!r}")
    object.__delattr__(self, name)


#: The frozen record classes (their subclasses may add attributes of their own).
_FROZEN: set[type] = set()


def _getstate(self: Any) -> list[Any]:
    return [getattr(self, name) for name in type(self).__record_names__]


def _setstate(self: Any, state: list[Any]) -> None:
    for name, value in zip(type(self).__record_names__, state, strict=True):
        object.__setattr__(self, name, value)


def _make_init(cls_name: str, specs: tuple[_Spec, ...], frozen: bool,
               post_init: bool) -> Callable[..., None]:
    env: dict[str, Any] = {"MISSING": MISSING, "_set": object.__setattr__}
    params: list[str] = []
    body: list[str] = []
    seen_default = False
    for i, s in enumerate(specs):
        f = s.field
        if f.init:
            if f.default is not MISSING:
                env[f"_d{i}"] = f.default
                params.append(f"{s.name}=_d{i}")
                seen_default = True
                value = s.name
            elif f.default_factory is not MISSING:
                env[f"_f{i}"] = f.default_factory
                params.append(f"{s.name}=MISSING")
                seen_default = True
                value = f"_f{i}() if {s.name} is MISSING else {s.name}"
            else:
                if seen_default:
                    raise TypeError(f"{cls_name}: non-default argument {s.name!r} follows "
                                    "default argument")
                params.append(s.name)
                value = s.name
        elif f.default is not MISSING:
            env[f"_d{i}"] = f.default
            value = f"_d{i}"
        elif f.default_factory is not MISSING:
            env[f"_f{i}"] = f.default_factory
            value = f"_f{i}()"
        else:
            continue  # set by __post_init__
        if s.initvar:
            continue
        body.append(f"    _set(self, {s.name!r}, {value})\n" if frozen
                    else f"    self.{s.name} = {value}\n")
    if post_init:
        initvars = ", ".join(s.name for s in specs if s.initvar)
        body.append(f"    self.__post_init__({initvars})\n")
    source = (f"def __init__(self{', ' if params else ''}{', '.join(params)}):\n"
              + ("".join(body) or "    pass\n"))
    exec(source, env)  # the source is made here, from field names
    init: Callable[..., None] = env["__init__"]
    return init


def _make_repr(names: tuple[str, ...]) -> Callable[[Any], str]:
    def __repr__(self: Any) -> str:
        inner = ", ".join(f"{n}={getattr(self, n)!r}" for n in names)
        return f"{type(self).__qualname__}({inner})"
    return __repr__


def _tuple_getter(names: tuple[str, ...]) -> Callable[[Any], tuple[Any, ...]]:
    if len(names) > 1:
        getter: Callable[[Any], tuple[Any, ...]] = attrgetter(*names)
        return getter
    if names:
        one = attrgetter(names[0])
        return lambda self: (one(self),)
    return lambda self: ()


def _make_eq(names: tuple[str, ...]) -> Callable[[Any, Any], Any]:
    values = _tuple_getter(names)

    def __eq__(self: Any, other: Any) -> Any:
        if other.__class__ is self.__class__:
            return values(self) == values(other)
        return NotImplemented
    return __eq__


def _make_hash(names: tuple[str, ...]) -> Callable[[Any], int]:
    values = _tuple_getter(names)

    def __hash__(self: Any) -> int:
        return hash(values(self))
    return __hash__


def _record(cls: type[T] | None = None, /, *, frozen: bool = False, slots: bool = False,
           eq: bool = True) -> Any:
    """``@dataclass(frozen=..., slots=..., eq=...)`` without importing ``dataclasses``."""
    def wrap(klass: type[T]) -> type[T]:
        return _process(klass, frozen, slots, eq)
    return wrap if cls is None else wrap(cls)


def _process(cls: type[T], frozen: bool, slots: bool, eq: bool) -> type[T]:
    for base in cls.__mro__[1:-1]:
        if "__record_specs__" in base.__dict__ or "__dataclass_fields__" in base.__dict__:
            raise TypeError(f"{cls.__name__}: a record cannot inherit fields; use dataclasses")
    ns = dict(cls.__dict__)
    specs: list[_Spec] = []
    for name, annotation in ns.get("__annotations__", {}).items():
        kind = _kind(annotation)
        if kind == "classvar":
            continue
        default = ns.get(name, MISSING)
        if isinstance(default, Field):
            spec = default
        else:
            spec = Field(default, MISSING, True, True, True, None)
        if spec.default_factory is not MISSING and kind == "initvar":
            raise TypeError(f"{cls.__name__}.{name}: an InitVar cannot have a default factory")
        if isinstance(spec.default, (list, dict, set)):
            raise ValueError(f"{cls.__name__}.{name}: mutable default "
                             f"{type(spec.default).__name__}; use default_factory")
        specs.append(_Spec(name, annotation, spec, kind == "initvar"))
        # Like dataclasses: a plain default stays as the class attribute, a field() is
        # replaced by its default (or removed); a slotted class keeps none of them.
        if slots or spec.default is MISSING:
            ns.pop(name, None)
        else:
            ns[name] = spec.default
    fields = tuple(specs)
    names = tuple(s.name for s in fields if not s.initvar)
    post_init = "__post_init__" in ns
    if any(s.initvar for s in fields) and not post_init:
        raise TypeError(f"{cls.__name__}: InitVar fields need __post_init__")

    ns["__init__"] = _make_init(cls.__name__, fields, frozen, post_init)
    ns["__init__"].__qualname__ = f"{cls.__qualname__}.__init__"
    if "__repr__" not in ns:
        ns["__repr__"] = _make_repr(tuple(s.name for s in fields
                                          if not s.initvar and s.field.repr))
    compared = tuple(s.name for s in fields if not s.initvar and s.field.compare)
    if eq and "__eq__" not in ns:
        ns["__eq__"] = _make_eq(compared)
    explicit_hash = "__hash__" in cls.__dict__ and cls.__dict__["__hash__"] is not None
    if eq and frozen and not explicit_hash:
        ns["__hash__"] = _make_hash(tuple(
            s.name for s in fields if not s.initvar
            and (s.field.hash if s.field.hash is not None else s.field.compare)))
    elif eq and not frozen and not explicit_hash:
        ns["__hash__"] = None
    if frozen:
        for attr in ("__setattr__", "__delattr__"):
            if attr in cls.__dict__:
                raise TypeError(f"Cannot overwrite attribute {attr} in class {cls.__name__}")
        ns["__setattr__"] = _frozen_setattr
        ns["__delattr__"] = _frozen_delattr
    ns.setdefault("__match_args__", tuple(s.name for s in fields if s.field.init))
    ns["__record_specs__"] = fields
    ns["__record_names__"] = names
    ns["__record_params__"] = (frozen, eq)
    if slots:
        if "__slots__" in cls.__dict__:
            raise TypeError(f"{cls.__name__} already specifies __slots__")
        ns["__slots__"] = names
        ns.pop("__dict__", None)
        ns.pop("__weakref__", None)
        if frozen:
            ns["__getstate__"] = _getstate
            ns["__setstate__"] = _setstate
        made: type[T] = type(cls)(cls.__name__, cls.__bases__, ns)  # type: ignore[misc]
        made.__qualname__ = cls.__qualname__
    else:
        made = cls
        for key, value in ns.items():
            if cls.__dict__.get(key, MISSING) is not value:
                type.__setattr__(cls, key, value)
        for key in cls.__dict__.keys() - ns.keys():
            type.__delattr__(cls, key)
    if frozen:
        _FROZEN.add(made)
    for attr in ("__dataclass_fields__", "__dataclass_params__"):
        type.__setattr__(made, attr, _LazyDataclassAttr(made, attr))
    return made


def fields_of(cls: type) -> tuple[str, ...]:
    """The names of a record's stored fields, in order (no ``dataclasses`` import)."""
    names: tuple[str, ...] = cls.__dict__["__record_names__"]
    return names


def replace(obj: T, /, **changes: Any) -> T:
    """:func:`dataclasses.replace` for a record, without importing ``dataclasses``."""
    cls = type(obj)
    specs: tuple[_Spec, ...] | None = getattr(cls, "__record_specs__", None)
    if specs is None:
        import dataclasses
        return dataclasses.replace(obj, **changes)  # type: ignore[type-var]
    for s in specs:
        if not s.field.init:
            if s.name in changes:
                raise ValueError(f"field {s.name} is declared with init=False, it cannot be "
                                 "specified with replace()")
            continue
        if s.name not in changes:
            if s.initvar:
                if s.field.default is MISSING:
                    raise ValueError(f"InitVar {s.name!r} must be specified with replace()")
                continue
            changes[s.name] = getattr(obj, s.name)
    return cls(**changes)


if TYPE_CHECKING:  # type checkers know dataclasses; a record is one to them
    from dataclasses import dataclass as record
    from dataclasses import field
else:
    record = _record
    field = _field
