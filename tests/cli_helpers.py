"""What CLI tests share: one way to invoke the command, and a pass that breaks numerics."""

from __future__ import annotations

import re
from pathlib import Path

from click.testing import CliRunner, Result

from graphopt.cli import cli
from graphopt.ir import Model, Tensor
from graphopt.passes.base import Pass, PassContext, PassResult, register


def invoke(*args: str | Path) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


_PROGRESS = re.compile(r"\[ *\d+\.\ds\] ")


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
