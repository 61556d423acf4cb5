"""graphopt: an ONNX graph optimizer that checks its own numerics.

import graphopt
model = graphopt.load("model.onnx")
result = graphopt.optimize(model)            # the default pipeline
graphopt.save(result.model, "model.opt.onnx")
graphopt.check("model.onnx", "model.opt.onnx")
graphopt.optimize_folder("models/", "optimized/", jobs=2)   # what `graphopt run models/ -o optimized/` does

The API loads on first use, so importing a leaf module (graphopt.ir, say) does not import it.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from graphopt.version import __version__

if TYPE_CHECKING:
    from graphopt.api import Result, check, load, optimize, save
    from graphopt.batch import optimize_folder

__all__ = ["Result", "__version__", "check", "load", "optimize", "optimize_folder", "save"]


def __getattr__(name: str) -> Any:
    if name == "optimize_folder":
        return import_module("graphopt.batch").optimize_folder
    if name in __all__:
        return getattr(import_module("graphopt.api"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
