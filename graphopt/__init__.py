"""graphopt: an ONNX graph optimizer that checks its own numerics.

import graphopt
result = graphopt.optimize("model.onnx", output="model.opt.onnx")   # the default pipeline, checked
print(result.numerics.status)                # "passed"; a failed check raises CheckFailed
graphopt.optimize(onnx_model).model          # an onnx.ModelProto in, an onnx.ModelProto out
graphopt.check("model.onnx", "model.opt.onnx")
graphopt.diff("model.onnx", "model.opt.onnx")             # what `graphopt diff` compares
graphopt.optimize_file("model.onnx", "model.opt.onnx")    # what `graphopt run model.onnx -o ...` does
graphopt.optimize_folder("models/", "optimized/", jobs=2)   # what `graphopt run models/ -o optimized/` does

The API loads on first use, so importing a leaf module (graphopt.ir, say) does not import it.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from graphopt.version import __version__

if TYPE_CHECKING:
    from graphopt.api import Result, check, diff, inspect, load, optimize, save
    from graphopt.batch import optimize_file, optimize_folder

__all__ = [
    "Result",
    "__version__",
    "check",
    "diff",
    "inspect",
    "load",
    "optimize",
    "optimize_file",
    "optimize_folder",
    "save",
]


def __getattr__(name: str) -> Any:
    if name in ("optimize_file", "optimize_folder"):
        return getattr(import_module("graphopt.batch"), name)
    if name in __all__:
        return getattr(import_module("graphopt.api"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
