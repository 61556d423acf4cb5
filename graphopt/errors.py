"""The errors graphopt reports to people, each tied to an exit code (see DESIGN.md)."""

from __future__ import annotations

__all__ = [
    "MESSAGE_LIMIT",
    "CheckFailed",
    "GraphoptError",
    "InputError",
    "InvalidDocument",
    "PassError",
    "bounded",
    "one_line",
]


class GraphoptError(Exception):
    """Base class; ``exit_code`` is what the CLI returns for it."""

    exit_code = 3


class InputError(GraphoptError):
    """Bad usage or bad input: the message names the file and what is wrong (exit 2)."""

    exit_code = 2


class InvalidDocument(InputError):
    """A JSON document (a graph, a pipeline, a layout problem) that breaks its schema in one
    place or more: the message names the first, ``problems`` every one found (``graphopt validate``
    lists them)."""

    def __init__(self, problems: list[str]) -> None:
        more = f" (and {len(problems) - 1} more: `graphopt validate` lists them)" if len(problems) > 1 else ""
        super().__init__(problems[0] + more)
        self.problems = problems


class CheckFailed(GraphoptError):
    """A numerics check or a gate failed (exit 1); ``result`` is the check's result, if any."""

    exit_code = 1

    def __init__(self, message: str, result: object = None) -> None:
        super().__init__(message)
        self.result = result


class PassError(GraphoptError):
    """A pass raised; carries the pass name (exit 3 under --strict)."""

    exit_code = 3

    def __init__(self, pass_name: str, message: str) -> None:
        super().__init__(f"pass {pass_name!r} failed: {message}")
        self.pass_name = pass_name


# Longest message text shown or reported; onnxruntime can quote a million-element attribute.
MESSAGE_LIMIT = 2000


def bounded(text: str, limit: int = MESSAGE_LIMIT) -> str:
    """``text``, or its head and tail around a note of how much was left out."""
    if len(text) <= limit:
        return text
    keep = limit // 2
    return f"{text[:keep]} [... {len(text) - 2 * keep} characters elided ...] {text[-keep:]}"


# Control characters (and the Unicode line and paragraph separators) as the escapes Python
# writes for them: a file name or an op name cannot start a line of its own in a log.
_ESCAPES = {code: repr(chr(code))[1:-1] for code in [*range(0x20), *range(0x7F, 0xA0), 0x2028, 0x2029]}


def one_line(text: str, limit: int = MESSAGE_LIMIT) -> str:
    """``text`` as one bounded line: newlines and other control characters escaped."""
    return bounded(text.translate(_ESCAPES), limit)
