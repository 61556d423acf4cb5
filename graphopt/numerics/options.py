"""What a numerics check is asked for, as one value: the CLI's check flags (``run`` and
``check`` share them), the API and the file runner build it once and hand it down."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from graphopt.errors import InputError

__all__ = ["CheckOptions"]


@dataclass(frozen=True)
class CheckOptions:
    # Values for dynamic dims, by name or as ``input[axis]`` (``--dim``), in every binding.
    dims: Mapping[str, int] = field(default_factory=dict)
    # An .npz of arrays by input name, fed as is for one binding (``--inputs``).
    inputs: Path | None = None
    # Element-wise allclose instead of the default criterion; the two go together.
    atol: float | None = None
    rtol: float | None = None
    # Bytes the check may use (None: its default, numerics/budget.py).
    memory_budget: int | None = None
    # A model the check could not verify fails the run, like a failed check (``--require-check``).
    required: bool = False
    # onnxruntime custom-op libraries registered in every session of the check (``--custom-op-library``).
    custom_op_libraries: tuple[Path, ...] = ()

    def __post_init__(self) -> None:
        if (self.atol is None) != (self.rtol is None):
            raise InputError("--atol and --rtol go together (element-wise check)")

    def arguments(self) -> dict[str, Any]:
        """The keyword arguments of check_models and check_models_isolated."""
        budget = {} if self.memory_budget is None else {"memory_budget": self.memory_budget}
        criterion = {"dims": dict(self.dims) or None, "inputs": self.inputs, "atol": self.atol, "rtol": self.rtol}
        libraries = {"custom_op_libraries": self.custom_op_libraries} if self.custom_op_libraries else {}
        return {**criterion, **budget, **libraries}
