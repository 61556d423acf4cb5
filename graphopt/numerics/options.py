"""What a numerics check is asked for, as one value: the CLI's check flags (``run`` and
``check`` share them), the API and the file runner build it once and hand it down."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from graphopt.errors import InputError

__all__ = ["FIRST_RUN_SECONDS", "MEMORY_BUDGET_RANGE", "TIMEOUT_RANGE", "TIME_FACTOR", "CheckOptions", "check_numbers"]

# The check's time limit when none is given (check.py): the original's first run may take
# FIRST_RUN_SECONDS, and the whole check TIME_FACTOR times as long as that run took, and at least
# FIRST_RUN_SECONDS. A check runs each model at two bindings (more when the original fails at
# one), twice at the first when the original may draw random numbers, and a later binding may be
# larger than the first.
FIRST_RUN_SECONDS = 120.0
TIME_FACTOR = 20

# Bytes the check may be given: below a megabyte onnxruntime cannot even start.
MEMORY_BUDGET_RANGE = (10**6, 10**15)
# Seconds the check may be given (--check-timeout): up to a year.
TIMEOUT_RANGE = (0.0, 3.2e7)


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
    # Seconds the check may take (None: its default, proportional to the original's first run, check.py).
    timeout: float | None = None
    # A model the check could not verify fails the run, like a failed check (``--require-check``).
    required: bool = False
    # onnxruntime custom-op libraries registered in every session of the check (``--custom-op-library``).
    custom_op_libraries: tuple[Path, ...] = ()

    def __post_init__(self) -> None:
        if (self.atol is None) != (self.rtol is None):
            raise InputError("--atol and --rtol go together (element-wise check)")
        check_numbers(atol=self.atol, rtol=self.rtol, memory_budget=self.memory_budget, timeout=self.timeout)

    def arguments(self) -> dict[str, Any]:
        """The keyword arguments of check_models and check_models_isolated."""
        limits = {} if self.memory_budget is None else {"memory_budget": self.memory_budget}
        criterion = {"dims": dict(self.dims) or None, "inputs": self.inputs, "atol": self.atol, "rtol": self.rtol}
        libraries = {"custom_op_libraries": self.custom_op_libraries} if self.custom_op_libraries else {}
        return {**criterion, **limits, "timeout": self.timeout, **libraries}


def check_numbers(
    *,
    atol: float | None = None,
    rtol: float | None = None,
    memory_budget: int | None = None,
    timeout: float | None = None,
) -> None:
    """Refuse (InputError) a tolerance that is not a finite number >= 0 (NaN would pass every
    comparison), a memory budget outside MEMORY_BUDGET_RANGE, or a timeout outside TIMEOUT_RANGE
    (0 excluded)."""
    for flag, tolerance in (("--atol", atol), ("--rtol", rtol)):
        if tolerance is not None and not (isinstance(tolerance, int | float) and 0 <= tolerance < math.inf):
            raise InputError(f"{flag} {tolerance}: expected a finite number >= 0")
    low, high = MEMORY_BUDGET_RANGE
    if memory_budget is not None and not low <= memory_budget <= high:
        raise InputError(f"--check-memory {memory_budget / 1e9:g}: expected GB from {low / 1e9:g} to {high / 1e9:g}")
    first, last = TIMEOUT_RANGE
    if timeout is not None and not (isinstance(timeout, int | float) and first < timeout <= last):
        raise InputError(f"--check-timeout {timeout}: expected seconds above {first:g}, at most {last:g}")
