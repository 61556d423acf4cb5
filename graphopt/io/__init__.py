"""Reading and writing models: ONNX protobuf and graphopt's JSON form."""

from __future__ import annotations

import os
from pathlib import Path

from graphopt.errors import InputError
from graphopt.ir import Model


def load(path: str | os.PathLike[str], *, independent_dims: bool = False) -> Model:
    """Load a model, choosing the format by extension (.json, else ONNX)."""
    from graphopt.io.sanity import check_model

    if Path(path).suffix.lower() == ".json":
        from graphopt.io import json_io

        model = json_io.load(path, independent_dims=independent_dims)
    else:
        from graphopt.io import onnx_io

        model = onnx_io.load(path, independent_dims=independent_dims)
    try:
        check_model(model)
    except InputError as err:
        raise InputError(f"{path}: {err}") from None
    return model


def data_files(model: Model) -> list[Path]:
    """The files other than the model file that ``model`` reads its tensors from (external
    data, JSON sidecars), in order of first use."""
    from graphopt.io.json_io import NpySource
    from graphopt.io.onnx_io import all_tensors
    from graphopt.ir import ExternalSource

    files: dict[Path, None] = {}
    for tensor in all_tensors(model):
        source = tensor.source
        if (isinstance(source, ExternalSource) and not source.inline) or isinstance(source, NpySource):
            files[source.path] = None
    return list(files)


def save(model: Model, path: str | os.PathLike[str], **options: object) -> dict[str, str]:
    """Save a model atomically, choosing the format by extension. Returns the sha256 of the
    files written, by name, where the writer hashed them on the way out (ONNX)."""
    suffix = Path(path).suffix.lower()
    if suffix == ".json":
        from graphopt.io import json_io

        json_io.save(model, path)
        return {}
    if suffix not in (".onnx", ".pb", ""):
        raise InputError(f"{path}: unknown output format {suffix!r} (use .onnx or .json)")
    from graphopt.io import onnx_io

    return onnx_io.save(model, path, **options)  # type: ignore[arg-type]


__all__ = ["data_files", "load", "save"]
