"""Records: frozen dataclasses whose fields are checked where they are made, and their wire form.

    @dataclass(frozen=True, slots=True)
    class ExecReply(Record):
        status: str
        exit_code: int | None = None

    reply = ExecReply(status="ok")          # RecordError naming the field, the rule and the value
    ExecReply.from_wire(reply.to_wire())    # the msgpack map that travels, and back

The one way postrain declares a message: the kernel's own (core/load.py, core/lending.py) and
every role's (postrain.actors.records, the gateway's records). Configs and options are
pydantic models instead (core/options.py): they are read from TOML and name every bad field at
once, where a record is made in code and fails on its first bad field.
"""
from __future__ import annotations

import dataclasses
import functools
import numbers
import types
import typing
from typing import Any, Callable, ClassVar

from typing_extensions import Self

from .errors import PostrainError


class RecordError(PostrainError, ValueError):
    """A message that breaks its record's rules; the message names the record, the field and the fix."""


class Vector(typing.Protocol):
    """Annotation marker: a 1-D sequence (a list or tuple of numbers, a numpy array, a 1-D
    tensor), checked shallowly here (its elements are the learner's to check, by name)."""

    def __len__(self) -> int: ...


def _is_vector(value: Any) -> bool:
    return hasattr(value, "__len__") and not isinstance(value, (str, bytes, dict))


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@functools.cache
def _checker(tp: Any) -> Callable[[Any], bool]:
    """The check for annotation `tp`, built once per annotation: records are made on every message,
    and reading the annotation's origin and arguments each time was most of their cost."""
    if tp is Any:
        return lambda value: True
    if tp is Vector:
        return _is_vector
    if tp is type(None):
        return lambda value: value is None
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        arms = tuple(_checker(arm) for arm in args)
        return lambda value: any(arm(value) for arm in arms)
    if tp is bool:
        return lambda value: isinstance(value, bool)
    if tp is int:
        return _is_int
    if tp is float:
        return _is_real
    if origin in (list, tuple) or tp in (list, tuple):   # tuple[X, ...]: checked as list[X]
        # Per-token lists of numbers are checked by length only (`_check`): checking each element
        # cost ~0.4 us a token, 6.6 ms a 16-sample generate reply, on the message path.
        if not args or args[0] in (int, float):
            return lambda value: isinstance(value, (list, tuple))
        item = _checker(args[0])
        return lambda value: isinstance(value, (list, tuple)) and all(item(v) for v in value)
    if origin is dict or tp is dict:
        if not args:
            return lambda value: isinstance(value, dict)
        key, item = _checker(args[0]), _checker(args[1])
        return lambda value: isinstance(value, dict) and all(key(k) and item(v) for k, v in value.items())
    return lambda value: isinstance(value, tp)


def _describe(tp: Any) -> str:
    text = getattr(tp, "__name__", None) if typing.get_origin(tp) is None else None
    return text or str(tp).replace("typing.", "").replace(f"{__name__}.", "")


class Record:
    """Base of the records: type checks from the annotations, `to_wire` and `from_wire`.

    A subclass is a `@dataclass(frozen=True, slots=True)`; it may add `_check()` for rules
    across fields. A field may name its wire codec in metadata (`encode`, `decode`) when its
    value is a nested record or class rather than plain data."""

    __slots__ = ()
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]   # every Record is a dataclass
    #: Per record class: (field name, its check, its annotation), made at its first instance.
    _field_checks: ClassVar[dict[type, tuple[tuple[str, Callable[[Any], bool], Any], ...]]] = {}

    def __post_init__(self) -> None:
        checks = Record._field_checks.get(type(self))
        if checks is None:
            hints = typing.get_type_hints(type(self))
            checks = Record._field_checks[type(self)] = tuple(
                (f.name, _checker(hints[f.name]), hints[f.name]) for f in dataclasses.fields(self))
        for name, check, tp in checks:
            value = getattr(self, name)
            if not check(value):
                self.fail_field(name, value, f"of type {_describe(tp)}")
        self._check()

    def _check(self) -> None:
        """Rules across fields (subclasses); raise with `fail_field`."""

    def fail_field(self, name: str, value: Any, rule: str) -> typing.NoReturn:
        shown = repr(value)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise RecordError(f"{type(self).__name__}.{name} must be {rule}, got {type(value).__name__} {shown}")

    def to_wire(self) -> dict[str, Any]:
        """The dict that travels; fields that are None are left out."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            encode = f.metadata.get("encode")
            out[f.name] = encode(value) if encode else value
        return out

    @classmethod
    def from_wire(cls, data: Any) -> Self:
        """The record of a received dict; RecordError naming an unknown or missing key."""
        if isinstance(data, cls):
            return data
        if not isinstance(data, dict):
            raise RecordError(f"a {cls.__name__} travels as a dict, got {type(data).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise RecordError(f"{cls.__name__} has no field(s) {unknown}; its fields are {sorted(fields)}")
        missing = [name for name, f in fields.items() if name not in data
                   and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if missing:
            raise RecordError(f"{cls.__name__} needs field(s) {missing}; got {sorted(data)}")
        values = {}
        for name, value in data.items():
            decode = fields[name].metadata.get("decode")
            values[name] = decode(value) if decode and value is not None else value
        return cls(**values)


def codec(encode: Callable[[Any], Any], decode: Callable[[Any], Any]) -> dict[str, Any]:
    """Field metadata: how a field that is itself a record (or a list of them) goes on the wire."""
    return {"encode": encode, "decode": decode}
