"""The result cache: an unchanged model costs a digest and a copy (``--cache DIR``, ``GRAPHOPT_CACHE``).

A result is keyed by everything that decides it: the model's bytes and those of every weights
file it names, graphopt (its version and its own source, so a development checkout never
reads a result an older commit made), onnx's and onnxruntime's versions, the resolved pipeline
and settings, the check's options (with the digest of every file they name) and how the output
is written. Only a run that exited 0 is stored.

An entry is a folder ``DIR/<key>/`` holding the output's files as they were committed and
``entry.json`` (each file's sha256 and size, and the run's report). It is written in a
staging folder and renamed into place, so a reader sees a whole entry or none; each file's
digest is checked on read, and an entry that fails is removed and counts as a miss. Entries
used least recently go first when the folder grows over its limit; concurrent runs take
turns on a lock for that, never for reading or storing.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from importlib import import_module
from importlib.metadata import packages_distributions, version
from pathlib import Path
from typing import Any

from graphopt.errors import InputError
from graphopt.files import file_digest, folder_lock, remove_stale_staging, staging_folder
from graphopt.version import __version__

__all__ = ["DEFAULT_LIMIT", "CachedResult", "ResultCache"]

_log = logging.getLogger(__name__)

# The cache's size when no limit is given: room for a model repository's results, not a disk's.
DEFAULT_LIMIT = 10 * 10**9
_ENTRY = "entry.json"
# The layout of entries; a new layout makes every older entry a miss.
_FORMAT = 1


@dataclass(frozen=True)
class CachedResult:
    """A stored result: the folder of its files (the output model first) and the report it was stored with."""

    folder: Path
    files: dict[str, str]  # file name -> sha256
    model: str
    report: dict[str, Any]


@dataclass(frozen=True)
class ResultCache:
    folder: Path
    limit: int = DEFAULT_LIMIT

    def __post_init__(self) -> None:
        if self.folder.exists() and not self.folder.is_dir():
            raise InputError(f"--cache {self.folder}: not a folder")
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise InputError(f"--cache {self.folder}: cannot create it: {err.strerror or err}") from err
        if not os.access(self.folder, os.W_OK | os.X_OK):
            raise InputError(f"--cache {self.folder}: not writable")

    def key(self, inputs: Mapping[str, str], decided_by: Mapping[str, Any]) -> str:
        """The key of a model whose files have the digests ``inputs`` (the model by its name, its
        weights files by the location it names them with), optimized as ``decided_by`` says (the
        run's options that decide the output: the runner's to say)."""
        return _digest({"format": _FORMAT, "tools": _tools(), "input": dict(inputs), "run": dict(decided_by)})

    def lookup(self, key: str) -> CachedResult | None:
        """The entry of ``key`` if it is whole and its files are what was stored; a damaged one is removed."""
        folder = self.folder / key
        try:
            entry = json.loads((folder / _ENTRY).read_text(encoding="utf-8"))
            files = {str(name): str(digest) for name, digest in entry["files"].items()}
            if any(file_digest(folder / name) != digest for name, digest in files.items()):
                raise ValueError("a file's digest changed")
            os.utime(folder / _ENTRY)  # used now: the last to go when the cache is pruned
            return CachedResult(folder, files, str(entry["model"]), dict(entry["report"]))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            _log.warning("cache entry %s is damaged (%s); removed, the model runs again", folder, err)
            shutil.rmtree(folder, ignore_errors=True)
            return None

    def store(self, key: str, files: list[Path], digests: Mapping[str, str], report: dict[str, Any]) -> None:
        """Store the output ``files`` (the model first; ``digests`` by name, as written) and the run's report.
        A failure to store costs the next run its hit, never this run its result: it is logged."""
        try:
            remove_stale_staging(self.folder)
            with staging_folder(self.folder) as staging:
                for file in files:
                    shutil.copyfile(file, staging / file.name)
                named = {f.name: digests.get(f.name) or file_digest(staging / f.name) for f in files}
                entry = {"format": _FORMAT, "model": files[0].name, "files": named, "report": report}
                (staging / _ENTRY).write_text(json.dumps(entry), encoding="utf-8")
                with contextlib.suppress(FileExistsError, OSError):  # another run stored it first: theirs stays
                    staging.rename(self.folder / key)
            self.prune()
        except (OSError, InputError) as err:  # InputError: another run held the cache's lock too long
            _log.warning(
                "could not store the result in the cache %s: %s", self.folder, getattr(err, "strerror", None) or err
            )

    def prune(self) -> None:
        """Remove the entries used least recently until the cache is within its limit."""
        with folder_lock(self.folder, self.folder):
            entries = []
            for folder in self.folder.iterdir():
                with contextlib.suppress(OSError):
                    if (folder / _ENTRY).is_file():
                        size = sum(f.stat().st_size for f in folder.iterdir())
                        entries.append(((folder / _ENTRY).stat().st_mtime, size, folder))
            total = sum(size for _, size, _ in entries)
            for _, size, folder in sorted(entries):
                if total <= self.limit:
                    break
                shutil.rmtree(folder, ignore_errors=True)
                total -= size


@cache
def _tools() -> dict[str, str]:
    """graphopt's version and the digest of its own source, and the versions of onnx and onnxruntime
    (read from their metadata: importing onnxruntime would cost a cache hit most of its time)."""
    package = Path(__file__).parent
    source = hashlib.sha256()
    for file in sorted(package.rglob("*.py")):
        source.update(file.relative_to(package).as_posix().encode())
        source.update(file.read_bytes())
    return {
        "graphopt": __version__,
        "graphopt_source": source.hexdigest(),
        "onnx": _installed("onnx"),
        "onnxruntime": _installed("onnxruntime"),
    }


def _installed(module: str) -> str:
    """The distributions that provide ``module`` with their versions (onnxruntime comes as
    onnxruntime, onnxruntime-gpu, ...); the module's own version where none is known."""
    found = sorted(f"{name} {version(name)}" for name in packages_distributions().get(module, []))
    return ", ".join(found) or str(import_module(module).__version__)


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()
