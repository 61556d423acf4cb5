"""What a pass is, and the registry every pass adds itself to.

A pass is a small class: a ``name``, a one-line ``description``, an ``Options`` dataclass
(each field's ``metadata["help"]`` says what it does) and ``run(model, ctx)`` that mutates
the IR in place and returns a :class:`PassResult`. Passes never see protobuf.

    @register
    class DeadCodeElimination(Pass):
        name = "dce"
        description = "Remove nodes whose outputs nothing reads"

        def run(self, model: Model, ctx: PassContext) -> PassResult: ...
"""

from __future__ import annotations

import dataclasses
import logging
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from graphopt.errors import InputError
from graphopt.ir import Model

__all__ = [
    "NoOptions",
    "Pass",
    "PassContext",
    "PassResult",
    "all_passes",
    "get_pass",
    "option_specs",
    "register",
]


@dataclass
class PassResult:
    changed: bool
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class PassContext:
    """What every pass may consult: the run's global settings."""

    independent_dims: bool = False
    logger: logging.Logger = field(default_factory=lambda: logging.getLogger("graphopt.passes"))


@dataclass
class NoOptions:
    pass


class Pass:
    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions

    def __init__(self, options: Any = None) -> None:
        self.options = options if options is not None else self.Options()

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Pass:
        """Build the pass from a config mapping; unknown or mistyped options are bad input."""
        return cls(_parse_options(cls, config))

    def run(self, model: Model, ctx: PassContext) -> PassResult:
        raise NotImplementedError


_REGISTRY: dict[str, type[Pass]] = {}
P = TypeVar("P", bound=type[Pass])


def register(cls: P) -> P:
    if not cls.name or cls.name in _REGISTRY:
        raise ValueError(f"pass name {cls.name!r} is empty or already registered")
    _REGISTRY[cls.name] = cls
    return cls


def _load_builtin_passes() -> None:
    # Importing the families runs their @register decorators.
    import graphopt.passes.cleanup
    import graphopt.passes.shapes
    import graphopt.passes.unwind  # noqa: F401


def all_passes() -> dict[str, type[Pass]]:
    _load_builtin_passes()
    return dict(_REGISTRY)


def get_pass(name: str) -> type[Pass]:
    passes = all_passes()
    if name not in passes:
        raise InputError(f"unknown pass {name!r}; known passes: {', '.join(sorted(passes))}")
    return passes[name]


@dataclass(frozen=True)
class OptionSpec:
    name: str
    type: str
    default: Any
    help: str


def _type_name(annotation: Any) -> str:
    return getattr(annotation, "__name__", str(annotation))


def option_specs(cls: type[Pass]) -> list[OptionSpec]:
    hints = typing.get_type_hints(cls.Options)
    specs = []
    for option in dataclasses.fields(cls.Options):
        default = option.default if option.default is not dataclasses.MISSING else None
        if option.default_factory is not dataclasses.MISSING:
            default = option.default_factory()
        specs.append(OptionSpec(option.name, _type_name(hints[option.name]), default, option.metadata.get("help", "")))
    return specs


def _accepts(annotation: Any, value: Any) -> bool:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_accepts(arg, value) for arg in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is list:
        (item,) = typing.get_args(annotation)
        return isinstance(value, list) and all(_accepts(item, v) for v in value)
    if isinstance(annotation, type):
        return isinstance(value, annotation)
    return True


def _parse_options(cls: type[Pass], config: Mapping[str, Any]) -> Any:
    hints = typing.get_type_hints(cls.Options)
    known = {f.name for f in dataclasses.fields(cls.Options)}
    for key, value in config.items():
        if key not in known:
            hint = (
                f"; options of {cls.name!r}: {', '.join(sorted(known))}" if known else f"; {cls.name!r} has no options"
            )
            raise InputError(f"unknown option {key!r} for pass {cls.name!r}{hint}")
        if not _accepts(hints[key], value):
            raise InputError(f"option {key!r} of pass {cls.name!r} must be {_type_name(hints[key])}, not {value!r}")
    return cls.Options(**config)
