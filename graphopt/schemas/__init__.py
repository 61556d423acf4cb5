"""The JSON Schemas (2020-12) of graphopt's files, and one way to validate against them."""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any

from graphopt.errors import InvalidDocument

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


def validate(data: Any, name: str, where: str, limit: int = 50) -> None:
    """Raise InvalidDocument naming the JSON path of each violation (at most ``limit``): first
    the most specific one of the document, then the others in document order."""
    import jsonschema

    validator = jsonschema.Draft202012Validator(schema(name))
    found = list(validator.iter_errors(data))
    if not found:
        return
    places: dict[str, str] = {}
    first = jsonschema.exceptions.best_match(found)
    for error in [first, *sorted(found, key=lambda e: [str(part) for part in e.absolute_path])]:
        best = jsonschema.exceptions.best_match([error])
        place = _json_path(best.absolute_path)
        places.setdefault(place, f"{where}: {place}: {best.message}")
    raise InvalidDocument(list(places.values())[:limit])
