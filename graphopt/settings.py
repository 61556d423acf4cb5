"""The run's settings: declared once here, they reach the CLI, the Python API and configs.

Only what the whole run reads is a setting; a knob that one pass reads is that pass's
option (graphopt.passes.base.Knob), which reaches the same three places.

Each field is one setting. Its ``metadata["help"]`` is the help text everywhere; the CLI
derives a ``graphopt run`` option from the field (``independent_dims`` becomes
``--independent-dims``; a bool is a flag, a list a repeatable option), the Python API
takes it as a keyword of :func:`graphopt.optimize`, and a pipeline config sets it in its
``[settings]`` table. Passes read them from ``ctx.settings``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from graphopt.errors import InputError
from graphopt.options import coerce, field_types, option, type_name

__all__ = ["SETTING_NAMES", "Settings", "settings_from"]


@dataclass(frozen=True)
class Settings:
    independent_dims: bool = option(False, "Treat every occurrence of a dim name as its own variable.")
    provenance: bool = option(False, "Record in each new node's metadata the rule or pass that made it.")
    target: Literal["onnx", "ort"] = option(
        "onnx",
        "What the output runs on: 'onnx' emits standard ops only; 'ort' may also emit "
        "onnxruntime contrib ops its CPU provider implements (fuse pass).",
    )
    target_opset: int = option(
        0,
        "Default-domain opset of the output (0: the model's own). The fuse pass converts "
        "the model with onnx's version converter, lowering ops the target lacks first.",
    )
    runtime_guard: bool = option(
        True,
        "On a run of the default pipeline, load the original and the output in onnxruntime "
        "(CPU, ORT_ENABLE_ALL), count the fused kernels it forms, and undo the rewrite that cost "
        "one (--no-runtime-guard: skip it).",
    )
    tune: bool = option(
        False,
        "Time each rewrite that applied on this machine's onnxruntime, on the check's inputs, and "
        "undo those not faster beyond noise; the tuned model is kept only if not slower (--tune-level, "
        "--tune-threads, --tune-budget).",
    )
    tune_level: Literal["all", "disable"] = option(
        "all", "onnxruntime's graph optimization level --tune times at: ORT_ENABLE_ALL or ORT_DISABLE_ALL."
    )
    tune_threads: int = option(1, "onnxruntime intra-op threads --tune times with (0: onnxruntime's default).")
    tune_budget: float = option(120.0, "Seconds --tune may take; candidates left when they run out stay untimed.")
    verify: bool = field(
        default_factory=lambda: os.environ.get("GRAPHOPT_VERIFY", "") not in ("", "0"),
        metadata={
            "help": "Verify the IR after every pass; a pass that breaks it is rolled back "
            "(on with --debug, or GRAPHOPT_VERIFY=1 as the tests set it)."
        },
    )

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


SETTING_NAMES = frozenset(f.name for f in dataclasses.fields(Settings))


def settings_from(values: Mapping[str, Any], where: str = "settings") -> Settings:
    """Settings from a mapping (a config table, API keywords); unknown or mistyped is bad input."""
    hints = field_types(Settings)
    known = {f.name for f in dataclasses.fields(Settings)}
    converted: dict[str, Any] = {}
    for key, value in values.items():
        if key not in known:
            raise InputError(f"{where}: unknown setting {key!r}; settings: {', '.join(sorted(known))}")
        fits, converted[key] = coerce(hints[key], value)
        if not fits:
            raise InputError(f"{where}: setting {key!r} must be {type_name(hints[key])}, not {value!r}")
    return Settings(**converted)
