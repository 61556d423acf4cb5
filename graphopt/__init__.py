"""graphopt: an ONNX graph optimizer that checks its own numerics.

import graphopt
model = graphopt.load("model.onnx")
result = graphopt.optimize(model)            # the default pipeline
graphopt.save(result.model, "model.opt.onnx")
graphopt.check("model.onnx", "model.opt.onnx")
"""

__version__ = "0.1.0"

from graphopt import check  # the subpackage, callable as graphopt.api.check (see its docstring)
from graphopt.api import Result, load, optimize, save

__all__ = ["Result", "__version__", "check", "load", "optimize", "save"]
