"""The numerics check: onnxruntime runs the original and the optimized file on the same inputs.

``graphopt.check`` names both this package and the API function (Python binds a package's
attribute to a subpackage whenever that is first imported), so the package is callable:
``graphopt.check(a, b)`` is :func:`graphopt.api.check`, however often it is called and
whatever was imported in between. The names below load on first use, so importing the
package costs nothing.
"""

from __future__ import annotations

import sys
from importlib import import_module
from types import ModuleType
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


class _CallablePackage(ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from graphopt.api import check

        return check(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
