"""Where a model may read tensor data from: onnx's rules for external data locations.

A location is a relative path inside the model's folder: not absolute, no ``..``, not a
symbolic link (onnx's loader refuses links even inside the folder), not resolving outside
the folder through a linked sub-folder, and a regular file this process can read. A model
from an untrusted source cannot make graphopt copy /etc/passwd into its output's weights.
The same rules hold for the .npy sidecars of graphopt's JSON form.
"""

from __future__ import annotations

from pathlib import Path

from graphopt.errors import InputError
from graphopt.files import not_regular

__all__ = ["external_file"]


def external_file(base_dir: Path, location: str, what: str) -> Path:
    """The file ``location`` names beside the model, or InputError saying why it may not be
    read; ``what`` starts the message, e.g. "tensor 'w': external data file"."""
    if not location:
        raise InputError(f"{what} has no location")
    relative = Path(location)
    if relative.is_absolute():
        raise InputError(f"{what} {location!r} leaves the model's folder (an absolute path)")
    if ".." in relative.parts:
        raise InputError(f"{what} {location!r} leaves the model's folder")
    file = base_dir / relative
    try:
        if file.is_symlink():
            raise InputError(f"{what} {str(file)!r} is a symbolic link (onnx reads only regular files there)")
        special = not_regular(file)
        if special is not None:
            raise InputError(f"{what} {str(file)!r} is not a regular file but {special}")
        if not file.is_file():
            raise InputError(f"{what} {str(file)!r} is missing")
        if not file.resolve().is_relative_to(base_dir.resolve()):
            raise InputError(f"{what} {str(file)!r} leaves the model's folder (through a linked folder)")
        with file.open("rb"):
            pass
    except OSError as err:  # a name too long for the file system, a loop of links, no permission
        raise InputError(f"{what} {location!r} cannot be read ({err.strerror or err})") from None
    return file
