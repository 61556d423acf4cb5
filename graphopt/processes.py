"""Child processes that end with their parent: the check's child and the workers of a folder run.

A child left behind when graphopt ends runs on for ever: a pool worker waits for work that never
comes, a check's child computes a Loop of 2**40 iterations at 100% of a core. Two guards:

- :func:`die_with_parent`, called first thing in a child: the kernel kills the child when its
  parent dies, whatever killed the parent (SIGKILL included). Linux only (prctl
  PR_SET_PDEATHSIG); elsewhere it does nothing.
- :func:`ending_children_on_sigterm`, around the wait for children: a SIGTERM to the parent
  first ends the children, then the parent, as SIGTERM would have. A wait is a system call, so
  the handler runs at once; it is installed only for the wait, so a parent busy in C code
  (onnxruntime folding a constant) still dies of SIGTERM at once.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from multiprocessing.process import BaseProcess
from types import FrameType

__all__ = ["die_with_parent", "ending_children_on_sigterm"]

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent: int) -> None:
    """Have the kernel kill this process (SIGKILL) when ``parent``, the process that started it,
    dies; end at once when it already has. The child's SIGTERM is its default again (a forked
    child inherits the parent's handler, which C code would keep from running)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if sys.platform != "linux":
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the kernel was told: nobody would kill us
        os._exit(1)


@contextlib.contextmanager
def ending_children_on_sigterm(children: Callable[[], Iterable[BaseProcess]]) -> Iterator[None]:
    """While the block runs: a SIGTERM first sends SIGTERM to each of ``children()`` (a check's
    child dies of it; a pool worker ends its own check first), then ends this process as the
    handler before would have. Only in the main thread, where Python runs signal handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.getsignal(signal.SIGTERM)

    def end(signum: int, frame: FrameType | None) -> None:
        for child in children():
            with contextlib.suppress(OSError, ValueError):  # ended meanwhile
                child.terminate()
        signal.signal(signal.SIGTERM, before if before is not None else signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, end)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before if before is not None else signal.SIG_DFL)
