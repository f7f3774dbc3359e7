"""A clean stop for ``mlx_lm server``: the shim's workaround for a fault of mlx's.

mlx's Python binding keeps each thread's default random key in a C++ ``thread_local`` (``PyKeySequence``, mlx's
``python/src/random.cpp``) whose destructor takes the GIL when the OS thread ends, after ``Thread.join()`` has
returned: if the interpreter is finalizing by then, ``PyGILState_Ensure`` ends the thread with ``pthread_exit``, whose
unwinding meets the destructor's implicit ``noexcept`` ("terminate called without an active exception", SIGABRT).
``mlx_lm server``'s generation thread draws from that key and is joined just before the exit, so a stop by SIGINT
would mostly abort (``tests/test_server_exit.py``).

So once the server has joined that thread (:func:`joined`), it sleeps, the GIL free, until the thread has left the OS
too (``/proc/self/task``). Only that thread is waited for: mlx_lm starts no other, and an app's own threads are the
app's (mlx aborts them alike unpatched).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

import wrapt

LIMIT_S = 2.0
"""The longest :func:`wait_gone` waits for a joined thread to leave the OS."""
FALLBACK_S = 0.05
"""Without ``/proc/self/task``: how long :func:`wait_gone` sleeps, once."""


@wrapt.decorator
def joined(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """For ``ResponseGenerator.stop_and_join`` and ``.join``: join the generation thread, then wait for it to
    leave the OS (a private name read softly: where it is missing, nothing waits)."""
    result = wrapped(*args, **kwargs)
    thread = getattr(instance, "_generation_thread", None)
    if isinstance(thread, threading.Thread) and not thread.is_alive():
        wait_gone(thread.native_id)
    return result


def tasks() -> set[int] | None:
    """The native ids of this process's OS threads now; None where the system does not list them."""
    try:
        return {int(name) for name in os.listdir("/proc/self/task")}
    except (OSError, ValueError):
        return None


def wait_gone(native: int | None) -> bool:
    """Wait, at most :data:`LIMIT_S`, until the OS thread ``native`` (a finished Python thread's) has ended;
    whether it has (True where the system cannot say)."""
    if native is None:
        return True
    deadline = time.monotonic() + LIMIT_S
    while (present := tasks()) is not None and native in present:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.001)
    if present is None:
        time.sleep(FALLBACK_S)
    return True
