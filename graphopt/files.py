"""The file system side of writing results: temporary files, staging folders, the commit.

- :func:`temporary_file`: ``tempfile.mkstemp`` creates files readable by their owner only;
  renamed into place they would keep that, and a model written for a shared folder or a
  container image would be unreadable to everyone else. The file is created the same way
  (unique, exclusive), then given 0o666 minus the process's umask.
- :func:`staging_folder`: a private ``.graphopt-*`` folder beside the destination, named
  after its owner (host and process id) from the moment it exists, so that the next run
  into that folder can remove what a killed run left behind. :func:`scratch_folder` is one in
  the system's temporary folder, for the runtime guard's child processes: they die with
  graphopt (SIGKILL, no cleanup of their own), and the next one removes what they left.
- :func:`folder_lock`: an exclusive ``flock`` on the destination folder for the commit, so
  two runs writing the same output take turns instead of mixing their files; the kernel
  drops the lock when its holder dies, so a killed run never blocks the next one.
- :func:`commit`: rename staged files into place in order, all or none: a destination that
  exists is first hard-linked into the staging folder and put back if a later rename fails.
  Each new file keeps the permissions of the file it replaces (a read-only model stays
  read-only).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import logging
import os
import shutil
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from functools import cache
from pathlib import Path
from typing import Any, BinaryIO

from graphopt.errors import InputError

__all__ = [
    "HashingFile",
    "atomic_write",
    "LOCK_TIMEOUT",
    "STAGING_PREFIX",
    "commit",
    "file_digest",
    "folder_lock",
    "is_staging",
    "not_regular",
    "remove_stale_staging",
    "scratch_folder",
    "staging_folder",
    "temporary_file",
    "unwritable_kind",
]

_log = logging.getLogger(__name__)

STAGING_PREFIX = ".graphopt-"
# Seconds a run waits for another run's commit into the same folder before giving up.
LOCK_TIMEOUT = 60.0
# The file naming the owner of a staging folder of an earlier version: "<host> <pid>".
_OWNER = "owner"
# A staging folder of an earlier version without an owner file is stale once it is this old.
_UNMARKED_STALE_SECONDS = 3600.0
# The staging folders of this process that are in use, and the lock that makes a folder's creation and its entry
# here one step for the sweeps of other threads (a sweep between them took a thread's new folder for a dead run's).
_LIVE: set[Path] = set()
_LIVE_LOCK = threading.RLock()


@cache
def _default_mode() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def temporary_file(directory: Path) -> tuple[int, Path]:
    """A new hidden file in ``directory``: its descriptor and path. It is named as a staging
    folder is, after its owner, so that a run killed while writing it (a copy of a 400 MB
    tokenizer, a report) leaves nothing the next run into that folder keeps."""
    handle, path = tempfile.mkstemp(prefix=_owned_prefix(), suffix=".tmp", dir=directory)
    os.fchmod(handle, _default_mode())
    return handle, Path(path)


_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def not_regular(path: Path) -> str | None:
    """What ``path`` (links followed) is when it exists and is not a regular file, e.g. "a
    FIFO"; None for a regular file or nothing. Opening a FIFO blocks, replacing a device
    node replaces it for the whole system: neither is ever an input's data or an output."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return None
    return next((kind for test, kind in _KINDS if test(mode)), None if stat.S_ISREG(mode) else "not a file")


# Kernel and device file systems: a file written there is not a file (/proc, /sys), or
# replaces a device node or a link such as /dev/stdout for the whole system (/dev; its
# shm is an ordinary memory-backed folder).
_SYSTEM_FOLDERS = (Path("/dev"), Path("/proc"), Path("/sys"))
_ORDINARY_IN_SYSTEM = (Path("/dev/shm"),)


def unwritable_kind(path: Path) -> str | None:
    """Why ``path`` may not be an output of graphopt, e.g. "a FIFO", "in /proc"; None when
    it is absent or a regular file outside the system's device and kernel folders."""
    special = not_regular(path)
    if special is not None:
        return f"not a regular file: {special}"
    for folder in (path.absolute().parent, path.absolute().parent.resolve()):
        if any(folder.is_relative_to(ordinary) for ordinary in _ORDINARY_IN_SYSTEM):
            continue
        for system in _SYSTEM_FOLDERS:
            if folder.is_relative_to(system):
                return f"in {system}, a device or kernel folder"
    return None


def is_staging(path: Path) -> bool:
    """Whether ``path`` lies in a staging folder (folder discovery must not take its files as models)."""
    return any(part.startswith(STAGING_PREFIX) for part in path.parts)


@contextlib.contextmanager
def staging_folder(folder: Path) -> Iterator[Path]:
    """A new private staging folder in ``folder``, marked with its owner and removed when
    the block ends; stale ones of dead runs in ``folder`` are removed first."""
    with _LIVE_LOCK:
        remove_stale_staging(folder)
        staging = Path(tempfile.mkdtemp(prefix=_owned_prefix(), dir=folder)).resolve()
        _LIVE.add(staging)  # another model of this process must not take it for stale
    try:
        yield staging
    finally:
        _LIVE.discard(staging)
        shutil.rmtree(staging, ignore_errors=True)


def scratch_folder() -> contextlib.AbstractContextManager[Path]:
    """A :func:`staging_folder` in the system's temporary folder: the work files of a process
    that may be killed before its own cleanup runs (a census's child, killed with graphopt)."""
    return staging_folder(Path(tempfile.gettempdir()))


def _fresh_lock_in_child() -> None:
    """A forked child's own lock: another thread may have held the parent's at the fork, and
    the child, which has no such thread, would wait for it for ever."""
    global _LIVE_LOCK
    _LIVE_LOCK = threading.RLock()


os.register_at_fork(after_in_child=_fresh_lock_in_child)


def _owned_prefix() -> str:
    """How the name of a staging folder or temporary file of this process begins, so that it
    is owned from its first moment: "<prefix><host tag>-<pid>-" (a random part follows)."""
    return f"{STAGING_PREFIX}{_host_tag()}-{os.getpid()}-"


def remove_stale_staging(folder: Path) -> None:
    """Remove the staging folders and temporary files in ``folder`` whose run is dead (only
    names graphopt gives them, never a user's file)."""
    with _LIVE_LOCK, contextlib.suppress(OSError):
        for candidate in folder.iterdir():
            if not candidate.name.startswith(STAGING_PREFIX) or not _is_stale(candidate):
                continue
            _log.info("removing %s, left by a graphopt run that is gone", candidate)
            if candidate.is_dir() and not candidate.is_symlink():
                shutil.rmtree(candidate, ignore_errors=True)
            elif candidate.is_file() and not candidate.is_symlink():
                candidate.unlink(missing_ok=True)


@cache
def _host_tag() -> str:
    """This machine in a staging folder's name: 8 hex digits of its host name's sha256."""
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def _owner(staging: Path) -> tuple[bool, str] | None:
    """Whether the staging folder's run was on this machine, and its pid; None if unknown."""
    tag, _, rest = staging.name.removeprefix(STAGING_PREFIX).partition("-")
    pid, _, _ = rest.partition("-")
    if len(tag) == 8 and pid.isdigit():
        return tag == _host_tag(), pid
    try:  # a folder of an earlier version: its owner file
        host, _, pid = (staging / _OWNER).read_text(encoding="utf-8").strip().partition(" ")
    except (OSError, UnicodeDecodeError):
        return None
    return host == socket.gethostname(), pid


def _is_stale(staging: Path) -> bool:
    owner = _owner(staging)
    if not staging.is_dir() and (owner is None or not staging.name.endswith(".tmp")):
        return False  # a file is graphopt's only when its whole name says so
    if owner is None:
        with contextlib.suppress(OSError):
            return time.time() - staging.stat().st_mtime > _UNMARKED_STALE_SECONDS
        return False
    here, pid = owner
    if not here or not pid.isdigit():
        return False  # another machine's run (a shared folder): its liveness cannot be seen from here
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, owned by someone else
        return False
    # A dead run's pid, reused by this process (a temporary file of this process is in use).
    return int(pid) == os.getpid() and staging.is_dir() and staging.resolve() not in _LIVE


@contextlib.contextmanager
def folder_lock(folder: Path, what: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``folder``; wait up to :data:`LOCK_TIMEOUT` seconds for it.

    Raises InputError naming ``what`` when another run keeps the folder locked that long.
    """
    handle = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        deadline = time.monotonic() + LOCK_TIMEOUT
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise InputError(
                        f"{what}: another graphopt run is writing into {folder} (waited {LOCK_TIMEOUT:g} s); "
                        "run again when it is done"
                    ) from None
                time.sleep(0.05)
        yield
    finally:
        os.close(handle)  # closing the descriptor releases the lock


def commit(moves: Sequence[tuple[Path, Path]], backups: Path, withdrawn: Collection[Path] = ()) -> None:
    """Rename each staged file onto its target, in order, all or none.

    A target that exists is hard-linked (or copied) into ``backups`` first and its
    permissions given to the file replacing it; if a rename fails, the targets renamed so
    far are put back as they were and the error is raised. The targets in ``withdrawn``
    are removed (backed up) before the first rename: a file that describes another (a
    report, its model) is never seen beside the other's new version, even by a kill.
    """
    saved: list[tuple[Path, Path]] = []
    done: list[Path] = []
    modes: dict[Path, int] = {}

    def back_up(target: Path) -> None:
        backup = backups / f"previous-{len(saved)}"
        try:
            os.link(target, backup)
        except OSError:  # no hard links on this file system
            shutil.copy2(target, backup)
        saved.append((backup, target))
        modes[target] = target.stat().st_mode & 0o7777

    try:
        for target in withdrawn:
            if target.is_file():
                back_up(target)
                os.unlink(target)
        for staged, target in moves:
            if target.is_file():
                back_up(target)
            if target in modes:
                os.chmod(staged, modes[target])
            os.replace(staged, target)
            done.append(target)
    except BaseException:
        restored = {target for _, target in saved}
        for target in done:
            if target not in restored:
                target.unlink(missing_ok=True)
        for backup, target in saved:
            os.replace(backup, target)
        raise


def file_digest(path: Path) -> str:
    """The sha256 of the file at ``path``, read in chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


class HashingFile(io.RawIOBase):
    """A write-only file that also hashes what goes through it (with no file: hashes only)."""

    def __init__(self, out: BinaryIO | None = None) -> None:
        self.out = out
        self.digest = hashlib.sha256()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.digest.update(data)
        if self.out is not None:
            self.out.write(data)
        return len(data)


def atomic_write(path: Path, write: Callable[[BinaryIO], object]) -> str:
    """Write through ``write`` into a temporary file, rename it to ``path``; return its sha256.
    What a killed run left in that folder goes first."""
    remove_stale_staging(path.parent)
    handle, tmp = temporary_file(path.parent)
    try:
        with os.fdopen(handle, "wb") as out:
            hashing = HashingFile(out)
            write(hashing)  # type: ignore[arg-type]
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return hashing.digest.hexdigest()
