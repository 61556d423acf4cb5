"""`graphopt validate`: the file loads into the IR, and the ONNX checker accepts it."""

from __future__ import annotations

import tempfile
from pathlib import Path

import onnx

from graphopt.errors import InputError
from graphopt.io import load, save

__all__ = ["validate_file"]


def validate_file(path: Path) -> None:
    """Raise InputError with the first problem found: format, schema, graph invariants, checker."""
    # JSON schema, dangling values, cycles, duplicate names, dtypes, ops missing at the opset
    model = load(path, opaque_ops="error")
    with tempfile.TemporaryDirectory() as workdir:
        target = path
        if path.suffix.lower() == ".json":
            target = Path(workdir) / f"{path.stem}.onnx"
            save(model, target)
        try:
            onnx.checker.check_model(str(target), full_check=False)
        except onnx.checker.ValidationError as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else "rejected"
            raise InputError(f"{path}: the ONNX checker rejects it: {first}") from None
