"""Reading and writing models: ONNX protobuf and graphopt's JSON form."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from graphopt.errors import InputError
from graphopt.ir import GraphError, Model

if TYPE_CHECKING:
    import onnx

logger = logging.getLogger(__name__)


def load(
    path: str | os.PathLike[str],
    *,
    independent_dims: bool = False,
    opaque_ops: Literal["warn", "quiet", "error"] = "warn",
) -> Model:
    """Load a model, choosing the format by extension (.json, else ONNX).

    An op without a schema at the model's opset is kept opaque (see :mod:`graphopt.io.sanity`)
    and logged as a warning, as the sanity checks' other warnings are; ``opaque_ops`` "quiet" (a
    file loaded again) says none of them, "error" (``graphopt validate``) refuses the op.
    """
    return load_noting(path, independent_dims=independent_dims, opaque_ops=opaque_ops)[0]


def load_noting(
    path: str | os.PathLike[str],
    *,
    independent_dims: bool = False,
    opaque_ops: Literal["warn", "quiet", "error"] = "warn",
) -> tuple[Model, list[str]]:
    """:func:`load`, and the warnings the sanity checks gave (the run's report lists them)."""
    if Path(path).suffix.lower() == ".json":
        from graphopt.io import json_io

        model = json_io.load(path, independent_dims=independent_dims)
    else:
        from graphopt.io import onnx_io

        model = onnx_io.load(path, independent_dims=independent_dims)
    return _checked(model, str(path), opaque_ops)


def from_onnx(
    proto: onnx.ModelProto, *, independent_dims: bool = False, base_dir: str | os.PathLike[str] | None = None
) -> Model:
    """The IR of an in-memory ModelProto (``onnx.load(...)``), checked as :func:`load` checks
    a file; external data not loaded into it is read from ``base_dir``, the folder of the
    model file (InputError without it)."""
    import onnx

    from graphopt.io.onnx_io import from_proto

    if not isinstance(proto, onnx.ModelProto):
        raise TypeError(f"expected an onnx.ModelProto, a graphopt Model or a path, not {type(proto).__name__}")
    where = "the ModelProto"
    if not proto.HasField("graph") or proto.ir_version <= 0:
        raise InputError(f"{where}: not an ONNX model (no graph or no ir_version)")
    try:
        folder = Path(base_dir) if base_dir is not None else None
        model = from_proto(proto, independent_dims=independent_dims, base_dir=folder)
    except (InputError, GraphError) as err:
        raise InputError(f"{where}: {err}") from None
    return _checked(model, where, "warn")[0]


def _checked(model: Model, where: str, opaque_ops: Literal["warn", "quiet", "error"]) -> tuple[Model, list[str]]:
    from graphopt.io.sanity import check_model

    try:
        warnings = check_model(model, strict=opaque_ops == "error")
    except InputError as err:
        raise InputError(f"{where}: {err}") from None
    for warning in warnings if opaque_ops == "warn" else ():
        logger.warning("%s: %s", where, warning)
    return model, warnings


def data_files(model: Model) -> list[Path]:
    """The files other than the model file that ``model`` reads its tensors from (external
    data, JSON sidecars), in order of first use."""
    from graphopt.io.json_io import NpySource
    from graphopt.io.onnx_write import all_tensors
    from graphopt.ir import ExternalSource

    files: dict[Path, None] = {}
    for tensor in all_tensors(model):
        source = tensor.source
        if (isinstance(source, ExternalSource) and not source.inline) or isinstance(source, NpySource):
            files[source.path] = None
    return list(files)


def check_output_format(path: str | os.PathLike[str]) -> None:
    """Refuse (InputError) a path whose extension names no format graphopt writes."""
    suffix = Path(path).suffix.lower()
    if suffix not in (".json", ".onnx", ".pb", ""):
        raise InputError(f"{path}: unknown output format {suffix!r} (use .onnx or .json)")


def save(model: Model, path: str | os.PathLike[str], **options: object) -> dict[str, str]:
    """Save a model atomically, choosing the format by extension. Returns the sha256 of the
    files written, by name, where the writer hashed them on the way out (ONNX)."""
    check_output_format(path)
    if Path(path).suffix.lower() == ".json":
        from graphopt.io import json_write

        json_write.save(model, path, content_addressed=bool(options.get("content_addressed")))
        return {}
    from graphopt.io import onnx_write

    return onnx_write.save(model, path, **options)  # type: ignore[arg-type]


__all__ = ["check_output_format", "data_files", "from_onnx", "load", "save"]
