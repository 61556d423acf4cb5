"""The numerics check: onnxruntime runs the original and the optimized file on the same inputs.

:mod:`check` runs and compares, :mod:`inputs` and :mod:`dims` make the inputs from what the
graph says, :mod:`compare` judges an output, :mod:`budget` bounds the memory, :mod:`isolated`
runs it all in a child process. The API's ``graphopt.check(a, b)`` is a plain function of
graphopt.api built on this package. The names below load on first use, so importing the
package costs nothing.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from graphopt.numerics.check import BindingResult, CheckResult, check_models
    from graphopt.numerics.compare import OutputComparison
    from graphopt.numerics.isolated import check_models_isolated

__all__ = ["BindingResult", "CheckResult", "OutputComparison", "check_models", "check_models_isolated"]

_HOMES = {
    "BindingResult": "check",
    "CheckResult": "check",
    "check_models": "check",
    "OutputComparison": "compare",
    "check_models_isolated": "isolated",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{home}"), name)
