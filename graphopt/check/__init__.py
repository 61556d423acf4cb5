"""The numerics check: onnxruntime runs the original and the optimized file on the same inputs.

The names below load on first use: importing this package costs nothing, so ``graphopt``
can import it up front and keep ``graphopt.check`` the API function (a subpackage imported
later would take that name on the ``graphopt`` module).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from graphopt.check.compare import OutputComparison
    from graphopt.check.isolated import check_models_isolated
    from graphopt.check.numerics import BindingResult, CheckResult, check_models

__all__ = ["BindingResult", "CheckResult", "OutputComparison", "check_models", "check_models_isolated"]

_HOMES = {
    "BindingResult": "numerics",
    "CheckResult": "numerics",
    "check_models": "numerics",
    "OutputComparison": "compare",
    "check_models_isolated": "isolated",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{home}"), name)
