"""graphopt: an ONNX graph optimizer that checks its own numerics.

import graphopt
model = graphopt.load("model.onnx")
result = graphopt.optimize(model)            # the default pipeline
graphopt.save(result.model, "model.opt.onnx")
graphopt.check("model.onnx", "model.opt.onnx")
"""

__version__ = "0.1.0"

from importlib import import_module

# The check subpackage first: imported later, it would replace the function graphopt.check.
import_module("graphopt.check")
from graphopt.api import Result, check, load, optimize, save  # noqa: E402

__all__ = ["Result", "__version__", "check", "load", "optimize", "save"]
