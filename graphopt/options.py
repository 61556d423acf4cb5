"""Typed options: validate a value from a config, the CLI or the API against its annotation.

Pass options and run settings are dataclass fields, declared with :func:`option`. A value is checked against the field's
annotation and converted where the annotation asks for it (an Enum from its value); an
annotation this module does not know is a programming error, raised as TypeError, so a
new option type cannot silently accept anything.
"""

from __future__ import annotations

import copy
import enum
import functools
import types
import typing
from dataclasses import field
from typing import Any

__all__ = ["coerce", "field_types", "option", "plain", "type_name"]

_MISMATCH = object()


@functools.cache
def field_types(options_class: type) -> dict[str, Any]:
    """The annotations of an options dataclass, evaluated once: every pipeline step parses its options against
    them, and evaluating the string annotations again was a tenth of a small model's optimization time."""
    return typing.get_type_hints(options_class)


def type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(annotation))
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " | ".join(repr(m.value) for m in annotation)
    return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")


def plain(value: Any) -> Any:
    """An option value as JSON sees it (an Enum by its value), for listings and reports."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


def coerce(annotation: Any, value: Any) -> tuple[bool, Any]:
    """``(True, converted)`` when ``value`` fits ``annotation``, else ``(False, None)``."""
    converted = _coerce(annotation, value)
    return (False, None) if converted is _MISMATCH else (True, converted)


def _coerce(annotation: Any, value: Any) -> Any:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            converted = _coerce(arg, value)
            if converted is not _MISMATCH:
                return converted
        return _MISMATCH
    if origin is typing.Literal:
        return value if any(value == a and type(value) is type(a) for a in args) else _MISMATCH
    if origin is list:
        (item,) = args
        if not isinstance(value, (list, tuple)):
            return _MISMATCH
        items = [_coerce(item, v) for v in value]
        return _MISMATCH if any(i is _MISMATCH for i in items) else items
    if origin is dict:
        key_type, value_type = args
        if not isinstance(value, dict):
            return _MISMATCH
        pairs = [(_coerce(key_type, k), _coerce(value_type, v)) for k, v in value.items()]
        return _MISMATCH if any(_MISMATCH in pair for pair in pairs) else dict(pairs)
    if annotation is type(None):
        return None if value is None else _MISMATCH
    if annotation is bool:
        return value if isinstance(value, bool) else _MISMATCH
    if annotation is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else _MISMATCH
    if annotation is float:
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else _MISMATCH
    if annotation is str:
        return value if isinstance(value, str) else _MISMATCH
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        if isinstance(value, annotation):
            return value
        for member in annotation:
            if member.value == value:
                return member
        return _MISMATCH
    raise TypeError(
        f"options of type {annotation!r} are not supported; use bool, int, float, str, Literal, Enum, list or dict"
    )


def option(default: Any, help: str, *, knob: str = "") -> Any:
    """A dataclass field for a run setting or a pass option: its default and its help text.

    A pass option is also a knob of the run (a ``graphopt run`` flag, a keyword of
    :func:`graphopt.optimize`, a key of a config's ``[settings]``), named ``<pass>_<option>``
    unless ``knob`` names it. A list or dict default is copied for each instance.
    """
    metadata = {"help": help, "knob": knob}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return field(default=default, metadata=metadata)
