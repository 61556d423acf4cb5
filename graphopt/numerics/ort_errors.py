"""onnxruntime's error messages as graphopt shows them: one line, without what only onnxruntime's
developers read (error codes, source lines, C++ signatures, the assertion that failed)."""

from __future__ import annotations

import re

from graphopt.errors import bounded

__all__ = ["condensed", "first_line"]


def first_line(exc: BaseException) -> str:
    """The first line of an onnxruntime error, condensed and bounded."""
    text = str(exc).strip()
    return bounded(condensed(text.splitlines()[0])) if text else type(exc).__name__


_ORT_CODE = re.compile(r"\[ONNXRuntimeError\] : \d+ : \w+ : ")
# Names the file onnxruntime was given: a staging path, never the user's.
_LOAD_FAILED = re.compile(r"Load model from .*? failed: ?")
_NODE_FAILED = re.compile(r"Non-zero status code returned while running (\S+) node\. Name:'([^']*)' Status Message: ")
_SOURCE_LINE = re.compile(r"\S+\.(?:h|cc|cpp|hpp|c):\d+ ")
# After a source line: the C++ function that raised, then the condition that did not hold.
_FUNCTION = re.compile(r"(?:[\w:<>*&]+ )*[\w:<>~{}]+\((?:[^()]|\([^()]*\))*\)(?: const)?(?: \[with [^\]]*\])? ")
_CONDITION = re.compile(r".*? was false\. ")


def condensed(message: str) -> str:
    """onnxruntime's message without what only its developers read: error codes, source
    lines, C++ signatures, the assertion that failed. What is left says what went wrong."""
    message = _LOAD_FAILED.sub("", _ORT_CODE.sub("", message))
    message = _NODE_FAILED.sub(lambda m: f"{m[1]} node {m[2]!r}: " if m[2] else f"{m[1]} node: ", message)
    while (source := _SOURCE_LINE.search(message)) is not None:
        rest = message[source.end() :]
        rest = rest[function.end() :] if (function := _FUNCTION.match(rest)) else rest
        rest = rest[condition.end() :] if (condition := _CONDITION.match(rest)) else rest
        message = message[: source.start()] + rest
    return message.strip()
