"""The text side of graphopt's JSON graphs: pretty printing and type strings.

Types are written as strings where a string can say everything (``float32[batch, seq + 1]``,
``seq(int64[*])``, ``map(string, float32[?])``); :func:`type_text` gives that string for a
structured type (or None when only the object form can carry it) and :func:`parse_type_text`
reads it back.
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["dump", "parse_type_text", "type_text"]

# Objects and lists whose one-line form fits go on one line; the rest one item a line.
_WIDTH = 120


def dump(value: Any, indent: int = 0) -> str:
    """Pretty JSON: a list or object goes on one line when it fits, else one item a line."""
    if isinstance(value, dict):
        items = [f"{json.dumps(k, ensure_ascii=False)}: {dump(v, indent + 1)}" for k, v in value.items()]
        return _wrap("{", items, "}", indent)
    if isinstance(value, list):
        items = [dump(v, indent + 1) for v in value]
        if all(not isinstance(v, (dict, list)) for v in value):
            return "[" + ", ".join(items) + "]"
        return _wrap("[", items, "]", indent)
    return json.dumps(value, ensure_ascii=False, allow_nan=False)


def _wrap(opening: str, items: list[str], closing: str, indent: int) -> str:
    if not items:
        return opening + closing
    flat = opening + ", ".join(items) + closing
    if len(flat) + 2 * indent <= _WIDTH and "\n" not in flat:
        return flat
    pad = "  " * (indent + 1)
    return opening + "\n" + ",\n".join(pad + item for item in items) + "\n" + "  " * indent + closing


_TENSOR_TEXT = re.compile(r"([a-z0-9_]+)\[(.*)\]", re.DOTALL)
_INT_TEXT = re.compile(r"-?[0-9]+")


def type_text(structured: Any) -> str | None:
    """The string form of a structured type, or None when only the object form can say it."""
    if not isinstance(structured, dict) or "denotation" in structured:
        return None
    kind = structured["kind"]
    if kind in ("tensor", "sparse_tensor"):
        shape = structured.get("shape")
        body = "*" if shape is None else ", ".join("?" if d is None else str(d) for d in shape)
        text = f"{structured['dtype']}[{body}]"
        return text if kind == "tensor" else f"sparse {text}"
    if kind in ("sequence", "optional"):
        inner = type_text(structured["element"])
        return None if inner is None else f"{'seq' if kind == 'sequence' else 'optional'}({inner})"
    if kind == "map":
        inner = type_text(structured["value"])
        return None if inner is None else f"map({structured['key']}, {inner})"
    return None


def parse_type_text(text: str) -> dict[str, Any]:
    """Read ``float32[batch, 3]``, ``sparse ...``, ``seq(...)``, ``optional(...)``, ``map(k, ...)``."""
    text = text.strip()
    for prefix, kind in (("seq(", "sequence"), ("optional(", "optional")):
        if text.startswith(prefix) and text.endswith(")"):
            return {"kind": kind, "element": parse_type_text(text[len(prefix) : -1])}
    if text.startswith("map(") and text.endswith(")"):
        key, _, rest = text[4:-1].partition(",")
        return {"kind": "map", "key": key.strip(), "value": parse_type_text(rest)}
    kind = "tensor"
    if text.startswith("sparse "):
        kind, text = "sparse_tensor", text[len("sparse ") :].strip()
    match = _TENSOR_TEXT.fullmatch(text)
    if match is None:
        raise ValueError(f"cannot read type {text!r} (expected e.g. 'float32[batch, 3]')")
    structured: dict[str, Any] = {"kind": kind, "dtype": match.group(1)}
    body = match.group(2).strip()
    if body != "*":
        structured["shape"] = [_parse_dim_text(d) for d in _split_top_level(body)] if body else []
    return structured


def _split_top_level(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts]


def _parse_dim_text(text: str) -> int | str | None:
    if text == "?":
        return None
    return int(text) if _INT_TEXT.fullmatch(text) else text
