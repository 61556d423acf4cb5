"""The ``unwind`` pass: choose tensor layouts so the model needs the fewest Transposes.

On an ONNX model it derives the layout problem (:mod:`onnx_layouts`), solves it
(:mod:`solvers`) and writes the answer (:mod:`rewrite`), but only when that leaves fewer
Transposes than the model has: a model without a layout problem comes out unchanged.
A JSON graph may carry a layout problem of its own (its ``layout`` section); the pass
solves that too and reports the solution. ``details`` holds the solution's summary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from graphopt.errors import InputError
from graphopt.ir import Model
from graphopt.layout.solution import Solution
from graphopt.layout.solvers import DEFAULT_TIME_BUDGET, SolverName, solve
from graphopt.layout.spec import problem_from_json
from graphopt.options import option
from graphopt.passes.base import Pass, PassContext, PassResult, register
from graphopt.passes.unwind.onnx_layouts import Derivation, Profile, derive
from graphopt.passes.unwind.rewrite import Plan, plan

__all__ = ["Unwind", "UnwindOptions", "solve_model"]


@dataclass
class UnwindOptions:
    solver: SolverName = option(
        "default", "layout solver: default (exact when small, else greedy with look-ahead and local search) or greedy"
    )
    time_budget: float = option(DEFAULT_TIME_BUDGET, "seconds the default solver may search")
    profile: Profile = option(
        "onnx", "layouts the target wants at Conv, pooling, MatMul, Gemm: onnx (NCHW, row-major) or nhwc"
    )
    allow_input_relayout: bool = option(
        False,
        "Let the unwind pass change the memory layout (declared shape) of graph inputs; "
        "the report says which inputs now take which axis order.",
        knob="allow_input_relayout",
    )

    def __post_init__(self) -> None:
        if self.time_budget < 0:
            raise InputError(f"the unwind time budget is {self.time_budget} seconds; give 0 or more")


@register
class Unwind(Pass, name="unwind", options=UnwindOptions):
    """Choose tensor layouts for the fewest Transposes (layout problem: unwinding)"""

    def run(self, model: Model, ctx: PassContext) -> PassResult:
        options: UnwindOptions = self.options
        relayout = options.allow_input_relayout
        details: dict[str, Any] = {}
        if "layout" in model.extensions:
            given = problem_from_json(model.extensions["layout"], "the model's layout section", "$.layout")
            details["layout_solution"] = solve(given, options.solver, options.time_budget).as_dict()
        graph = model.graph
        before = sum(1 for node in graph if node.op_type == "Transpose")
        if before == 0 and not relayout:
            return PassResult(False, details | {"transposes": [0, 0]})
        _, solution, rewrite = solve_model(model, options, ctx)
        changed = rewrite.transposes < before
        if changed:
            rewrite.apply()
        details |= {
            "objective": solution.objective,
            "upper_bound": solution.upper_bound,
            "solver": solution.solver,
            "exact": solution.exact,
            "seconds": round(solution.seconds, 6),
            "transposes": [before, rewrite.transposes if changed else before],
        }
        if changed and rewrite.relaid_inputs:
            details["relaid_inputs"] = {
                name: {"layout": list(layout), "shape": _shape_text(model, name)}
                for name, layout in rewrite.relaid_inputs.items()
            }
        return PassResult(changed, details)


def solve_model(model: Model, options: UnwindOptions, ctx: PassContext) -> tuple[Derivation, Solution, Plan]:
    """The layout problem of ``model`` (main graph), its solution, and the rewrite that would
    write it (not applied): what the pass does, and what `graphopt unwind MODEL` shows."""
    derivation = derive(model, options.profile, options.allow_input_relayout)
    solution = solve(derivation.problem, options.solver, options.time_budget)
    return derivation, solution, plan(model, derivation, derivation.sink_layouts(solution), options.profile, ctx)


def _shape_text(model: Model, name: str) -> list[Any]:
    for value in model.graph.inputs:
        if value.name == name and value.type is not None:
            shape = getattr(value.type, "shape", None)
            return [d if isinstance(d, int) or d is None else str(d) for d in shape] if shape is not None else []
    return []
