"""mlx_lm's batched generation over compressed caches: every sequence keeps its own (docs/DESIGN.md, "Batched
generation"; :mod:`..caches.batch`).

While this is patched our caches have ``merge`` (:func:`batching_on`), so everything mlx_lm batches (``BatchGenerator``,
``batch_generate``, the server) runs on compressed caches, each sequence compressing as it would alone.
``insert_segments`` starts each sequence as a generation start does, makes a missing list as mlx_lm would, and copies
the lists a caller hands in (mlx_lm's merge copies rows: ``batch_generate`` promises not to touch them). Where our
caches and mlx_lm's plain ``KVCache`` meet in one generator (a caller's own list next to compressed ones), the plain
ones join batches of ours too: waiting and new ones as a :class:`_PlainMember`, a running ``BatchKVCache`` split into
its sequences' rows. mlx_lm's other caches (sliding windows, quantized, recurrent) stay in mlx_lm's own batches: the
builder leaves those slots mlx_lm's for every sequence alike. Where the installed mlx_lm differs from the layouts
:mod:`.compat` knows, batching stays mlx_lm's, on its own caches.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

import wrapt

from ..caches import CompressedKVCache
from ..caches.batch import SequenceBatch
from ..fallback import notice
from ..log import once
from . import compat
from .state import STATE, batched_generation, in_force, same_as_process, serving, to_batch
from .wrappers import ours, start_generation

FEATURE = "batched generation"
"""The feature (:mod:`.features`) this module's wrapper belongs to."""


def batching_on() -> bool:
    """Whether mlx_lm's batches may hold our caches (``CompressedKVCache.merge`` asks): a method is on, batched
    generation is patched, and its layouts are those :mod:`.compat` knows (else said once, or a StrictError)."""
    config = in_force()
    if config is None or not config.enabled or STATE.features.get(FEATURE, "undecided") is not None:
        return False
    problem = compat.layout_problem()
    if problem is not None:
        notice(f"batched generation runs on mlx_lm's own caches only: {problem}", config,
               key=f"batched layout: {problem}")
    return problem is None


@wrapt.decorator
def batch_insert_segments(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Sequences join the generator on compressed caches of their own (module doc)."""
    if not batching_on():
        with batched_generation():  # caches mlx_lm makes here stay its own: ours cannot join its batches
            return wrapped(*args, **kwargs)
    try:
        call = inspect.signature(wrapped).bind(*args, **kwargs)
    except TypeError:
        return wrapped(*args, **kwargs)  # mlx_lm reports the bad call itself
    _join(instance, call.arguments)
    return wrapped(*call.args, **call.kwargs)


def _join(generator: Any, arguments: dict[str, Any]) -> None:
    """Give ``insert_segments``' sequences cache lists of their own, ready to batch as ours (module doc)."""
    segments = arguments["segments"]
    given = list(arguments.get("caches") or [None] * len(segments))
    if len(given) != len(segments):
        return  # mlx_lm reports the mismatch itself
    ticket = to_batch(take=True)  # a server request (one sequence), with its own settings
    if ticket is not None and not same_as_process(ticket.config):
        once("batched own settings", logging.INFO,
             "a server request with settings of its own joins a batch (on caches made under its settings)")
    with serving(ticket.config) if ticket is not None else contextlib.nullcontext():
        lists = [copy.deepcopy(c) if c is not None else compat.new_sequence_caches(generator) for c in given]
    if ticket is not None or any(ours(c) for c in lists) or _holds_ours(generator):
        lists = [_members(c) for c in lists]
        seen = arguments.get("all_tokens") or [[] for _ in segments]  # the tokens each sequence's cache has seen
        for caches, parts, tokens in zip(lists, segments, seen):
            n = sum(len(part) for part in parts)  # and those it has still to read
            start_generation(caches, generator.model, n)
            _carry(caches, ticket, len(tokens) + n)
        compat.replace_waiting_caches(generator, _members)
        for batch in compat.running_caches(generator):
            batch[:] = [_split(cache) for cache in batch]
    arguments["caches"] = lists


def _carry(caches: list, ticket: Any, prompt: int) -> None:
    """A server request inserted here rides on the first cache of its list that the batch holds, and its copies (the
    lists the batch gives back): the server keys the list it stores by the request's settings and measures it."""
    holder = next((c for c in caches if isinstance(c, CompressedKVCache) or getattr(c, "batch_plain", False)), None)
    if holder is not None:
        if ticket is not None:
            ticket.batched(prompt)
        compat.carry(holder, ticket)


def _holds_ours(generator: Any) -> bool:
    """Whether sequences on our caches wait or run in ``generator``."""
    waiting = any(ours(c) for c in compat.waiting_cache_lists(generator))
    return waiting or any(isinstance(b, SequenceBatch) for batch in compat.running_caches(generator) for b in batch)


def _members(caches: Any) -> Any:
    """A sequence's list with each plain ``KVCache`` of mlx_lm's as a :class:`_PlainMember` holding its rows."""
    if not isinstance(caches, (list, tuple)):
        return caches
    plain = compat.cache_class("KVCache")
    return [_plain_member().holding(c) if type(c) is plain else c for c in caches]


def _split(batch: Any) -> Any:
    """A running ``BatchKVCache`` of mlx_lm's as a batch of ours holding each sequence's rows."""
    if type(batch) is not compat.cache_class("BatchKVCache"):
        return batch
    sequences = [batch.extract(i) for i in range(compat.batch_size(batch))]
    return SequenceBatch([_plain_member().holding(c) for c in sequences])


class _PlainMemberMixin:
    """mlx_lm's ``KVCache`` (mixed in) as a member of a batch of ours: its ``merge`` makes a
    :class:`SequenceBatch`, where it is attended with mlx's own attention over its rows."""

    batch_plain = True

    @classmethod
    def holding(cls, cache: Any) -> Any:
        """A new member holding ``cache``'s rows (new array objects: the batch's writes stay its own)."""
        return compat.kv_cache_holding(cls, cache.keys, cache.values, cache.offset)

    @classmethod
    def merge(cls, caches: list) -> SequenceBatch:
        return SequenceBatch.merge(caches)


@functools.cache
def _plain_member() -> type[Any]:
    """``_PlainMember``: the mixin on mlx_lm's ``KVCache``, made on first use (veloxpatch does not import mlx_lm)."""
    return type("_PlainMember", (_PlainMemberMixin, compat.cache_class("KVCache")),
                {"__doc__": _PlainMemberMixin.__doc__, "__module__": __name__})
