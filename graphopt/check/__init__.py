"""The numerics check: onnxruntime runs the original and the optimized file on the same inputs."""

from graphopt.check.compare import OutputComparison
from graphopt.check.isolated import check_models_isolated
from graphopt.check.numerics import BindingResult, CheckResult, check_models

__all__ = ["BindingResult", "CheckResult", "OutputComparison", "check_models", "check_models_isolated"]
