"""What a pass is, and the registry every pass adds itself to.

A pass is a small class: a ``name``, a one-line description (its docstring), an
``Options`` dataclass (each field declared with :func:`graphopt.options.option`, whose help
says what it does) and ``run(model, ctx)`` that mutates the IR in place and returns a
:class:`PassResult`. Passes never see protobuf.

    @register
    class DeadCodeElimination(Pass, name="dce", options=DceOptions):
        '''Remove nodes whose outputs nothing reads'''

        def run(self, model: Model, ctx: PassContext) -> PassResult: ...

(Setting ``name``, ``description`` and ``Options`` as class attributes works as well.)
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, cast

from graphopt.errors import InputError
from graphopt.facts import Facts, OnnxTypes
from graphopt.ir import Graph, Model, Node
from graphopt.ir.rewrite import Builder, Namer
from graphopt.options import coerce, field_types, plain, type_name
from graphopt.settings import SETTING_NAMES, Settings

if TYPE_CHECKING:  # passes reach the evaluator through the context, never by import
    from graphopt.evaluate import Evaluator

__all__ = [
    "Failure",
    "NoOptions",
    "OpsetConverter",
    "Pass",
    "PassContext",
    "PassResult",
    "all_passes",
    "get_pass",
    "option_specs",
    "register",
]


@dataclass
class Failure:
    """A part of a pass that raised and was undone alone, the pass's other work standing (one
    fuse rule's rewrite): ``error`` says what failed, ``labels`` name where for the report
    (the rule and the node), ``traceback`` is for the debug log and the fuzzers."""

    error: str
    labels: dict[str, str] = field(default_factory=dict)
    traceback: str = ""

    def as_dict(self) -> dict[str, str]:
        return {**self.labels, "error": self.error}


@dataclass
class PassResult:
    """What a pass did: whether it changed the model, its details for the report, and the
    parts of it that failed and were undone alone (a pass that raises is rolled back whole)."""

    changed: bool
    details: dict[str, Any] = field(default_factory=dict)
    failures: list[Failure] = field(default_factory=list)


T = TypeVar("T")

# What io provides: a model converted to another default-domain opset (a new model).
OpsetConverter = Callable[[Model, int], Model]


@dataclass
class PassContext:
    """What every pass may consult: the run's settings and the rewrite services.

    The services that need io or onnxruntime (onnx's own type inference, the evaluator)
    are handed in by whoever runs the pipeline (graphopt.api), so passes import neither.
    """

    settings: Settings = field(default_factory=Settings)
    onnx_types: OnnxTypes | None = None
    # Made on first use: the evaluator imports onnxruntime, which most runs never need.
    evaluator_factory: Callable[[], Evaluator] | None = None
    opset_converter: OpsetConverter | None = None
    logger: logging.Logger = field(default_factory=lambda: logging.getLogger("graphopt.passes"))
    _facts: dict[int, Facts] = field(default_factory=dict, repr=False)
    _names: dict[int, Namer] = field(default_factory=dict, repr=False)
    _state: dict[tuple[int, str], tuple[Model, Any]] = field(default_factory=dict, repr=False)

    _evaluator: Evaluator | None = field(default=None, repr=False)

    @property
    def evaluator(self) -> Evaluator | None:
        """Evaluates constant regions (graphopt.evaluate), or None when the run has none."""
        if self._evaluator is None and self.evaluator_factory is not None:
            self._evaluator = self.evaluator_factory()
        return self._evaluator

    def facts(self, model: Model) -> Facts:
        """The facts service for ``model`` (one per model object, kept across passes)."""
        found = self._facts.get(id(model))
        if found is None or found.model is not model:
            found = Facts(model, independent_dims=self.settings.independent_dims, onnx_types=self.onnx_types)
            self._facts[id(model)] = found
        return found

    def convert_opset(self, model: Model, version: int) -> None:
        """Convert ``model`` in place to default-domain opset ``version`` (onnx's version
        converter, through io); the model's facts and names start afresh. A model that
        cannot be converted is bad input (InputError naming the op)."""
        if self.opset_converter is None:
            raise RuntimeError("this pass context has no opset converter (graphopt.api.pass_context provides one)")
        converted = self.opset_converter(model, version)
        for name in vars(converted):
            setattr(model, name, getattr(converted, name))
        self._facts.pop(id(model), None)
        self._names.pop(id(model), None)

    def state(self, model: Model, key: str, make: Callable[[], T]) -> T:
        """The run's value for ``key`` on ``model``, made by ``make()`` on first use.

        Run state lives here, never on a pass object: a pipeline builds one pass instance
        per step, and a value kept on one instance would start afresh at the next step."""
        found = self._state.get((id(model), key))
        if found is None or found[0] is not model:
            found = self._state[(id(model), key)] = (model, make())
        return cast(T, found[1])

    def names(self, model: Model) -> Namer:
        """Model-wide fresh names; names handed out once are never handed out again."""
        found = self._names.get(id(model))
        if found is None:
            found = self._names[id(model)] = Namer(model)
        return found

    def builder(self, model: Model, graph: Graph, *, before: Node | None = None, tag: str = "") -> Builder:
        """A node builder for ``graph``: fresh names, output types from the facts, provenance."""
        return Builder(
            graph,
            self.names(model),
            before=before,
            tag=tag,
            provenance=self.settings.provenance,
            typer=self.facts(model).infer_node,
            opset=model.opset_in(graph),
        )


@dataclass
class NoOptions:
    pass


class Pass:
    """A pass; subclasses name themselves and their options as class keywords, and their
    docstring's first paragraph is their one-line description (see the module docstring)."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions

    def __init_subclass__(cls, *, name: str = "", options: type | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if name:
            cls.name = name
        if options is not None:
            cls.Options = options
        doc = cls.__dict__.get("__doc__")
        if doc and "description" not in cls.__dict__:
            cls.description = " ".join(doc.strip().split("\n\n")[0].split())

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
    builtin = BUILTIN_PASSES.get(cls.name)
    if not cls.name or cls.name in _REGISTRY or (builtin is not None and not cls.__module__.startswith(builtin)):
        raise ValueError(f"pass name {cls.name!r} is empty or already registered")
    hints = field_types(cls.Options)
    for option in dataclasses.fields(cls.Options):
        coerce(hints[option.name], None)  # an annotation options cannot carry raises TypeError here
    _REGISTRY[cls.name] = cls
    return cls


# The family that registers each built-in pass: a run imports only the families its
# pipeline names (a test checks this table against what the families register).
BUILTIN_PASSES = {
    "shape-infer": "graphopt.passes.shapes",
    "strip-value-info": "graphopt.passes.shapes",
    "noop": "graphopt.passes.cleanup",
    "dce": "graphopt.passes.cleanup",
    "cse": "graphopt.passes.cleanup",
    "const-cache": "graphopt.passes.constcache",
    "fuse": "graphopt.passes.fuse",
    "fold": "graphopt.passes.fold",
    "unwind": "graphopt.passes.unwind",
}


def all_passes() -> dict[str, type[Pass]]:
    for family in sorted(set(BUILTIN_PASSES.values())):
        importlib.import_module(family)  # importing a family runs its @register decorators
    return dict(_REGISTRY)


def get_pass(name: str) -> type[Pass]:
    if name not in _REGISTRY and name in BUILTIN_PASSES:
        importlib.import_module(BUILTIN_PASSES[name])
    if name not in _REGISTRY:
        raise InputError(f"unknown pass {name!r}; known passes: {', '.join(sorted(all_passes()))}")
    return _REGISTRY[name]


@dataclass(frozen=True)
class Knob:
    """A pass option reachable from the whole run: a ``graphopt run`` flag, an API keyword, a
    key of a config's ``[settings]``; it sets the option on every step of its pass."""

    name: str
    pass_name: str
    option: str
    annotation: Any
    help: str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def pass_knobs(passes: Mapping[str, type[Pass]] | None = None) -> dict[str, Knob]:
    """The knobs of ``passes`` (default: every registered pass, the built-in ones imported)."""
    found: dict[str, Knob] = {}
    for pass_name, cls in sorted((passes if passes is not None else all_passes()).items()):
        hints = field_types(cls.Options)
        for option in dataclasses.fields(cls.Options):
            name = option.metadata.get("knob") or f"{pass_name}_{option.name}".replace("-", "_")
            if name in found or name in SETTING_NAMES:
                raise ValueError(f"knob {name!r} of pass {pass_name!r} is taken")
            found[name] = Knob(name, pass_name, option.name, hints[option.name], option.metadata.get("help", ""))
    return found


@dataclass(frozen=True)
class OptionSpec:
    name: str
    type: str
    default: Any
    help: str


def option_specs(cls: type[Pass]) -> list[OptionSpec]:
    hints = field_types(cls.Options)
    specs = []
    for option in dataclasses.fields(cls.Options):
        default = option.default if option.default is not dataclasses.MISSING else None
        if option.default_factory is not dataclasses.MISSING:
            default = option.default_factory()
        specs.append(
            OptionSpec(option.name, type_name(hints[option.name]), plain(default), option.metadata.get("help", ""))
        )
    return specs


def _parse_options(cls: type[Pass], config: Mapping[str, Any]) -> Any:
    hints = field_types(cls.Options)
    known = {f.name for f in dataclasses.fields(cls.Options)}
    converted: dict[str, Any] = {}
    for key, value in config.items():
        if key not in known:
            hint = (
                f"; options of {cls.name!r}: {', '.join(sorted(known))}" if known else f"; {cls.name!r} has no options"
            )
            raise InputError(f"unknown option {key!r} for pass {cls.name!r}{hint}")
        fits, converted[key] = coerce(hints[key], value)
        if not fits:
            raise InputError(f"option {key!r} of pass {cls.name!r} must be {type_name(hints[key])}, not {value!r}")
    return cls.Options(**converted)
