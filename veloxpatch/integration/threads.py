"""A clean exit for a process whose threads used mlx: the shim's workaround for a fault of mlx's.

mlx's Python binding keeps each thread's default random key in a C++ ``thread_local`` (``PyKeySequence``, mlx's
``python/src/random.cpp``) whose destructor takes the GIL when the OS thread ends, after ``Thread.join()`` has
returned: if the interpreter is finalizing by then, ``PyGILState_Ensure`` ends the thread with ``pthread_exit``, whose
unwinding meets the destructor's implicit ``noexcept`` ("terminate called without an active exception", SIGABRT).
``mlx_lm server``'s generation thread draws from that key and is joined just before the exit, so a stop by SIGINT
would mostly abort (``tests/test_server_exit.py``: four lines of mlx).

While patched, :func:`track` (around ``threading.Thread.start``) notes each started thread (the patch notes those
already running), and :func:`wait_for_exits`, an ``atexit`` handler (run after the interpreter has joined its
non-daemon threads, before it finalizes), sleeps, the GIL free, until every noted thread finished in Python has left
the OS too (``/proc/self/task``). A daemon thread still running at exit cannot be helped this way (mlx_lm's server's
HTTP handler threads never draw from the key).
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import wrapt

LIMIT_S = 2.0
"""The longest :func:`wait_for_exits` waits for finished threads to leave the OS."""
FALLBACK_S = 0.05
"""Without ``/proc/self/task``: how long :func:`wait_for_exits` sleeps, once, when a noted thread has finished."""
PRUNE_AT = 256
"""Noted threads kept before those already gone from the OS are forgotten (a server starts one per request)."""
TASKS = "/proc/self/task"

_noted: dict[int, weakref.ref[threading.Thread]] = {}
_lock = threading.Lock()


@wrapt.decorator
def track(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """For ``threading.Thread.start``: start the thread, then note it for :func:`wait_for_exits`."""
    started = wrapped(*args, **kwargs)
    note(instance if isinstance(instance, threading.Thread) else args[0])
    return started


def note(thread: threading.Thread) -> None:
    """Remember ``thread`` (by its native id) until it has left the OS."""
    native = getattr(thread, "native_id", None)
    if native is None:
        return
    with _lock:
        if len(_noted) >= PRUNE_AT:
            _prune()
        _noted[native] = weakref.ref(thread)


def finished() -> list[int]:
    """The native ids of noted threads that are done in Python (their OS thread may still be ending)."""
    with _lock:
        return [native for native, ref in _noted.items() if (thread := ref()) is None or not thread.is_alive()]


def tasks() -> set[int] | None:
    """The native ids of this process's OS threads now; None where the system does not list them."""
    try:
        return {int(name) for name in os.listdir(TASKS)}
    except (OSError, ValueError):
        return None


def wait_for_exits() -> list[int]:
    """Wait, at most :data:`LIMIT_S`, until every noted thread finished in Python has ended in the OS too;
    the native ids of those still there (none, normally)."""
    waiting = finished()
    if not waiting:
        return []
    deadline = time.monotonic() + LIMIT_S
    while True:
        present = tasks()
        if present is None:
            time.sleep(FALLBACK_S)
            return []
        waiting = [native for native in waiting if native in present]
        if not waiting or time.monotonic() >= deadline:
            return waiting
        time.sleep(0.001)


def _prune() -> None:
    """Forget noted threads that are gone from the OS (all finished ones where the OS does not say); holds
    ``_lock``."""
    present = tasks()
    for native, ref in list(_noted.items()):
        thread = ref()
        done = thread is None or not thread.is_alive()
        if done and (present is None or native not in present):
            del _noted[native]
