"""Temporary files for atomic writes, with the permissions a plain ``open`` would give.

``tempfile.mkstemp`` creates files readable by their owner only; renamed into place they
would keep that, and a model written for a shared folder or a container image would be
unreadable to everyone else. The file is created the same way (unique, exclusive), then
given 0o666 minus the process's umask.
"""

from __future__ import annotations

import os
import tempfile
from functools import cache
from pathlib import Path

__all__ = ["temporary_file"]


@cache
def _default_mode() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def temporary_file(directory: Path, name: str) -> tuple[int, Path]:
    """A new hidden file beside ``name`` in ``directory``: its descriptor and path."""
    handle, path = tempfile.mkstemp(prefix=f".{name}.", dir=directory)
    os.fchmod(handle, _default_mode())
    return handle, Path(path)
