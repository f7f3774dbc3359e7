"""What is patched right now: the active config, every attribute swapped (for exact undo), each feature decided,
and per thread: whether it is inside a batched generation left to mlx_lm, and the config in force (a server
request's own while it is served, :mod:`.server`)."""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..caches import Runtime
from ..config import VeloxConfig
from ..log import once


@dataclass
class Swap:
    """One function replaced in mlx_lm: on ``owner`` (a class), or at every module-level binding of ``name``."""

    name: str
    original: Any
    replacement: Any
    owner: Any = None

    def bind(self, undo: bool = False) -> None:
        """Put the replacement where the original is (``undo``: the other way round)."""
        old, new = (self.replacement, self.original) if undo else (self.original, self.replacement)
        if self.owner is not None:
            if vars(self.owner).get(self.name) is old:
                setattr(self.owner, self.name, new)
            return
        for module in list(sys.modules.values()):
            namespace = getattr(module, "__dict__", None)
            if isinstance(namespace, dict) and namespace.get(self.name) is old:
                setattr(module, self.name, new)


@dataclass
class PatchState:
    lock: threading.RLock = field(default_factory=threading.RLock)
    config: VeloxConfig | None = None
    swaps: dict[str, Swap] = field(default_factory=dict)
    features: dict[str, str | None] = field(default_factory=dict)
    """Each feature decided since the last patch (:mod:`.features`): None when patched, else why it is off."""
    runtime: Runtime = Runtime()
    """What the integration answers the caches it builds or loads (set by ``patch``: :class:`..caches.Runtime`)."""

    @property
    def active(self) -> bool:
        return self.config is not None


STATE = PatchState()


def swap(key: str, name: str, original: Any, wrap: Callable[[Any], Any], owner: Any = None) -> None:
    """Bind ``wrap(original)`` in place of ``original``, wrapped once per patch (recorded under ``key``)."""
    if key not in STATE.swaps:
        STATE.swaps[key] = Swap(name, original, wrap(original), owner)
    STATE.swaps[key].bind()


_local = threading.local()


def in_force() -> VeloxConfig | None:
    """The config the wrappers act on, on this thread: the settings of the server request this thread is serving
    (:func:`serving`), else the process's (None when unpatched)."""
    request = getattr(_local, "request", None)
    return request if request is not None and STATE.config is not None else STATE.config


@contextlib.contextmanager
def serving(config: VeloxConfig, request: Any = None) -> Iterator[None]:
    """While one request is served on this thread, ``config`` is in force here (:func:`in_force`: the caches made,
    the probe, the draft's caches and the prompt cache's key follow it) and :func:`served` answers ``request`` (a
    server request's ticket). Other threads keep theirs."""
    previous = getattr(_local, "request", None), getattr(_local, "served", None)
    _local.request, _local.served = config, request
    try:
        yield
    finally:
        _local.request, _local.served = previous


def served() -> Any:
    """The request :func:`serving` serves on this thread (None outside one, or where it named none)."""
    return getattr(_local, "served", None)


@contextlib.contextmanager
def batched_generation() -> Iterator[None]:
    """Marks this thread as inside a batched generation left to mlx_lm (its layouts are not those veloxpatch knows):
    caches made here stay mlx_lm's, which it can batch."""
    _local.batched = getattr(_local, "batched", 0) + 1
    try:
        yield
    finally:
        _local.batched -= 1


def in_batched_generation() -> bool:
    """True inside :func:`batched_generation` on this thread (said once)."""
    if not getattr(_local, "batched", 0):
        return False
    once("batched", logging.WARNING, "mlx_lm batched generation merges caches; it runs with mlx_lm's own caches")
    return True


def same_as_process(config: VeloxConfig) -> bool:
    """Whether caches made under ``config`` are made as the process's settings make them."""
    return STATE.config is not None and config.cache_settings() == STATE.config.cache_settings()


def hand_to_batch(ticket: Any) -> None:
    """The ticket of the server request this thread is about to insert into a batch (``_is_batchable`` said yes):
    it goes with the cache list the batch gives the sequence."""
    _local.batched_ticket = ticket


def to_batch(take: bool = False) -> Any:
    """What :func:`hand_to_batch` left on this thread (None if nothing): left there (the server's prompt-cache fetch
    reads it), or once with ``take`` (the batch takes it)."""
    ticket = getattr(_local, "batched_ticket", None)
    if take:
        _local.batched_ticket = None
    return ticket
