"""What CLI tests share: one way to invoke the command, and a pass that breaks numerics."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import onnx
from click.testing import CliRunner, Result
from onnx import TensorProto, helper, numpy_helper

from graphopt.cli import cli
from graphopt.ir import Model, Tensor
from graphopt.passes.base import Pass, PassContext, PassResult, register


def invoke(*args: str | Path) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


_PROGRESS = re.compile(r"\[ *\d+\.\ds\] ")


def mlp(path: Path, scale: float = 1.0, inputs: str = "x") -> Path:
    """A two-node model (MatMul by a constant ``scale`` matrix, then Identity) written to ``path``."""
    weight = numpy_helper.from_array(np.full((4, 4), scale, np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", [inputs, "w"], ["h"]), helper.make_node("Identity", ["h"], ["y"])],
        "mlp",
        [helper.make_tensor_value_info(inputs, TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        [weight],
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10), path)
    return path


def at_batch_one(source: Path, folder: Path) -> Path:
    """``source`` with its batch dims fixed to 1, written to ``folder`` (the fold pass prices
    a symbolic batch at several sizes, a fixed one at its size: wide_ensemble folds at 1)."""
    model = onnx.load(str(source))
    for value in [*model.graph.input, *model.graph.output]:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param == "batch":
                dim.dim_value = 1
    del model.graph.value_info[:]
    path = folder / f"{source.stem}_batch1.onnx"
    onnx.save(model, path)
    return path


def error_lines(result: Result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("graphopt: error: ")]


def one_line_error(result: Result, code: int = 2) -> str:
    """The one error line of a run that exited ``code`` (progress lines aside)."""
    assert result.exit_code == code, (result.exit_code, result.stderr)
    lines = diagnostics(result)
    assert len(lines) == 1 and lines[0].startswith("graphopt: error: "), result.stderr
    return lines[0]


def diagnostics(result: Result) -> list[str]:
    """The lines of stderr other than the progress lines a run prints as its phases start
    (``[   0.0s] load m.onnx``) when stderr is not a terminal."""
    return [line for line in result.stderr.strip().splitlines() if not _PROGRESS.match(line)]


@register
class BreaksNumerics(Pass):
    """A wrong optimization, for tests of the check, --blame and --keep-failed."""

    name = "test-breaks-numerics"
    description = "Adds one to every float initializer (a wrong optimization)"

    def run(self, model: Model, ctx: PassContext) -> PassResult:
        for value in model.graph.initializers.values():
            tensor = value.const
            if isinstance(tensor, Tensor) and tensor.numpy().dtype.kind == "f":
                value.const = Tensor.from_array(tensor.numpy() + 1, value.name)
        return PassResult(True)
