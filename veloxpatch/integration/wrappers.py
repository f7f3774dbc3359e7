"""The replacements the shim binds into mlx_lm.

* ``make_prompt_cache``: builds mlx_lm's cache list, then swaps eligible slots for ours.
* ``scaled_dot_product_attention``: a call whose cache is ours goes to the cache (real queries,
  our mask); every other call goes to the original, arguments untouched.
* ``generate_step`` / ``speculative_generate_step``: a generation starts on a cache list. Every
  coordinator in it resets (a server list holds main and draft caches, each with its own), caches
  that lost theirs (restored with ``from_state``) get one, and copies made without ``__init__``
  (the server deep-copies prompt caches) are counted in the statistics.
* ``load_prompt_cache``: a restored list gets its coordinator back.
* ``BatchGenerator.insert_segments`` (``insert`` goes through it): mlx_lm's batched generation
  merges caches into its batch caches, which ours cannot join, so it runs on mlx_lm's own caches
  (logged once). Caches it makes stay mlx_lm's; compressed caches a caller hands in (the server's
  prompt-cache reuse, ``batch_generate(prompt_caches=...)``) become mlx_lm's: empty or lossless
  ones as exact copies, evicted ones by re-reading the tokens they saw, which the caller gives as
  ``all_tokens`` (the server does). An evicted cache without its tokens is refused before anything
  changes: its evicted rows are gone, and a batch cache cannot hold a history with gaps, so any
  tokens it produced would be wrong.

Each reads the active config at call time, so re-patching with a new config needs no re-binding,
and a failure inside our code falls back to mlx_lm's own behaviour unless ``VELOX_STRICT``.
"""

from __future__ import annotations

import inspect
import logging
import sys
import threading
from typing import Any, Callable

import wrapt

from .. import builder, stats
from ..caches.base import CompressedKVCache
from ..coordinators import Coordinator, coordinators_of
from ..log import once
from .state import STATE

SDPA_PARAMS = ("queries", "keys", "values", "cache", "scale", "mask", "sinks")
_local = threading.local()


def fall_back(what: str, error: Exception) -> None:
    """Log the first failure (later ones would repeat it); re-raise under VELOX_STRICT."""
    config = STATE.config
    if config is not None and config.strict:
        raise error
    once("fall back", logging.ERROR, f"{what} failed ({type(error).__name__}: {error}); running unpatched mlx_lm")


@wrapt.decorator
def make_prompt_cache(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    caches = wrapped(*args, **kwargs)
    config = STATE.config
    if config is None or not config.enabled or _in_batched_generation():
        return caches
    model = args[0] if args else kwargs["model"]
    try:
        return builder.build(model, caches, config)
    except Exception as error:  # the host app must keep running
        fall_back("building compressed caches", error)
        return caches


@wrapt.decorator
def scaled_dot_product_attention(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    cache = kwargs["cache"] if "cache" in kwargs else (args[3] if len(args) > 3 else None)
    if not isinstance(cache, CompressedKVCache):
        return wrapped(*args, **kwargs)
    call = dict(zip(SDPA_PARAMS, args), **kwargs)
    return cache.attend(
        call["queries"], call["keys"], call["values"],
        scale=call["scale"], mask=call.get("mask"), sinks=call.get("sinks"),
    )


@wrapt.decorator
def generation_start(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """For ``generate_step`` and ``speculative_generate_step`` (``prompt_cache`` is keyword-only)."""
    try:
        _start_generation(kwargs.get("prompt_cache"))
    except Exception as error:
        fall_back("starting a generation", error)
    return wrapped(*args, **kwargs)


@wrapt.decorator
def speculative_start(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """For ``speculative_generate_step``: the draft model's caches follow ``VELOX_DRAFT_KV``, then a
    generation starts as for ``generate_step``."""
    call = inspect.signature(wrapped).bind(*args, **kwargs)
    try:
        _draft_caches(call.arguments)
        _start_generation(call.arguments.get("prompt_cache"))
    except Exception as error:
        fall_back("starting a speculative generation", error)
    return wrapped(*call.args, **call.kwargs)


@wrapt.decorator
def load_prompt_cache(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    loaded = wrapped(*args, **kwargs)
    _adopt(_ours(loaded[0] if isinstance(loaded, tuple) else loaded))
    return loaded


@wrapt.decorator
def batch_insert_segments(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    call = inspect.signature(wrapped).bind(*args, **kwargs)
    _local.batched = getattr(_local, "batched", 0) + 1
    try:
        _own_caches(instance, call.arguments)
        return wrapped(*call.args, **call.kwargs)
    finally:
        _local.batched -= 1


def _start_generation(caches: Any) -> None:
    ours = _ours(caches)
    _adopt(ours)
    for cache in ours:
        stats.track(cache, built=False)
    for coordinator in coordinators_of(ours):
        coordinator.reset()
    stats.totals.generations += 1


def _draft_caches(arguments: dict[str, Any]) -> None:
    """With ``VELOX_DRAFT_KV=none`` the draft model keeps mlx_lm's own caches.

    Without a prompt cache, mlx_lm would build both lists itself; we build them the same way (the
    main model's compressed). A given list's draft part (after the main model's layers) has its
    empty compressed slots swapped for mlx_lm's; one that already holds rows stays (said once).
    """
    config = STATE.config
    if config is None or config.draft_kv != "none":
        return
    model, draft = arguments["model"], arguments["draft_model"]
    make = sys.modules["mlx_lm.models.cache"].make_prompt_cache
    plain = getattr(make, "__wrapped__", make)(draft)
    caches = arguments.get("prompt_cache")
    if caches is None:
        arguments["prompt_cache"] = make(model) + plain
        return
    first = len(model.layers)
    for i, cache in enumerate(caches[first:], start=first):
        if not isinstance(cache, CompressedKVCache):
            continue
        if cache.empty():
            caches[i] = plain[i - first]
        else:
            once("draft history", logging.INFO, "a draft cache that already holds rows stays compressed")


def _ours(caches: Any) -> list[CompressedKVCache]:
    """Our caches in a cache list, in list order (none for anything that is not a list)."""
    return [c for c in caches if isinstance(c, CompressedKVCache)] if isinstance(caches, (list, tuple)) else []


def _adopt(ours: list[CompressedKVCache]) -> None:
    """Give caches without a coordinator one per method, shared, joined in list order.

    ``from_state`` (prompt-cache files) builds single caches, which cannot know their list.
    """
    orphans = [c for c in ours if c.coordinator is None]
    for method in dict.fromkeys(c.method for c in orphans):
        coordinator = Coordinator(method)
        for cache in (c for c in orphans if c.method == method):
            cache.coordinator = coordinator
            coordinator.join(cache)


def _in_batched_generation() -> bool:
    if not getattr(_local, "batched", 0):
        return False
    once("batched", logging.WARNING, "mlx_lm batched generation merges caches; it runs with mlx_lm's own caches")
    return True


def _own_caches(generator: Any, arguments: dict[str, Any]) -> None:
    """Swap the compressed caches a caller handed to ``insert_segments`` for mlx_lm's own.

    New lists only (the caller's stay as they were), written back only once every sequence is
    done, so a refusal leaves the generator and the caller untouched.
    """
    caches = arguments.get("caches")
    if not caches or not any(_ours(c) for c in caches):
        return
    segments = list(arguments["segments"])
    seen = list(arguments.get("all_tokens") or [[] for _ in segments])
    if not len(caches) == len(segments) == len(seen):
        return  # mlx_lm reports the mismatch itself
    caches = list(caches)
    for i, cache_list in enumerate(caches):
        caches[i], segments[i], seen[i] = _own_sequence(generator, cache_list, segments[i], seen[i])
    arguments.update(caches=caches, segments=segments, all_tokens=seen)


def _own_sequence(generator: Any, caches: Any, segments: list, seen: list) -> tuple[Any, list, list]:
    """One sequence's (caches, segments, all_tokens) with mlx_lm's caches in place of ours."""
    ours = _ours(caches)
    if not ours:
        return caches, segments, seen
    if all(c.empty() or (not c.evicted and c.size() == c.offset) for c in ours):
        once("batched copy", logging.INFO, "compressed caches that lost nothing join mlx_lm's batch as exact copies")
        return [_dense_copy(c) if isinstance(c, CompressedKVCache) else c for c in caches], segments, seen
    if len(seen) != ours[0].offset:
        raise ValueError(
            f"a compressed cache that has evicted rows ({ours[0].size()} kept of {ours[0].offset} tokens) cannot "
            "join mlx_lm's batched generation: pass the tokens it has seen as all_tokens (they are read again), "
            "or generate this sequence with generate / stream_generate"
        )
    once("batched reread", logging.INFO,
         "a compressed cache with evicted rows joins mlx_lm's batch by re-reading the tokens it saw")
    fresh = sys.modules["mlx_lm.models.cache"].make_prompt_cache(generator.model, generator.max_kv_size)
    first = list(segments[0]) if segments else []
    return fresh, [list(seen) + first, *segments[1:]], []


def _dense_copy(cache: CompressedKVCache) -> Any:
    """mlx_lm's ``KVCache`` holding the same rows as ``cache``, which must have lost none."""
    from mlx_lm.models.cache import KVCache

    dense = KVCache()
    if not cache.empty():
        rows = cache.size()
        dense.update_and_fetch(cache.keys[..., :rows, :], cache.values[..., :rows, :])
    return dense
