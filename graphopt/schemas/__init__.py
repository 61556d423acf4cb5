"""The JSON Schemas (2020-12) of graphopt's files, and one way to validate against them."""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any

from graphopt.errors import InputError

__all__ = ["schema", "validate"]


@cache
def schema(name: str) -> dict[str, Any]:
    """The schema ``name`` ("graph", "pipeline", "report")."""
    text = resources.files("graphopt.schemas").joinpath(f"{name}.schema.json").read_text(encoding="utf-8")
    loaded: dict[str, Any] = json.loads(text)
    return loaded


def _json_path(path: Any) -> str:
    text = "$"
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else f".{part}"
    return text


def validate(data: Any, name: str, where: str) -> None:
    """Raise InputError naming the JSON path of the first violation (the deepest, most specific one)."""
    import jsonschema

    validator = jsonschema.Draft202012Validator(schema(name))
    error = jsonschema.exceptions.best_match(validator.iter_errors(data))
    if error is not None:
        raise InputError(f"{where}: {_json_path(error.absolute_path)}: {error.message}")
