"""The three replacements the shim binds into mlx_lm.

* ``make_prompt_cache``: builds mlx_lm's cache list, then swaps eligible slots for ours.
* ``scaled_dot_product_attention``: a call whose cache is ours goes to the cache (real queries,
  our mask); every other call goes to the original, arguments untouched.
* ``generate_step``: resets the coordinator of a reused cache list when a generation starts.
* ``BatchGenerator.insert``: mlx_lm's batched generation merges caches into batch caches, which
  ours cannot join, so caches made inside it stay mlx_lm's own (logged once).

Each reads the active config at call time, so re-patching with a new config needs no re-binding,
and a failure inside our code falls back to mlx_lm's own behaviour unless ``VELOX_STRICT``.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

import wrapt

from .. import builder, stats
from ..caches.base import CompressedKVCache
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
def generate_step(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    coordinator = builder.coordinator_of(kwargs.get("prompt_cache"))
    if coordinator is not None:
        coordinator.reset()
    stats.totals.generations += 1
    return wrapped(*args, **kwargs)


@wrapt.decorator
def batch_insert(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    _local.batched = getattr(_local, "batched", 0) + 1
    try:
        return wrapped(*args, **kwargs)
    finally:
        _local.batched -= 1


def _in_batched_generation() -> bool:
    if not getattr(_local, "batched", 0):
        return False
    once("batched", logging.WARNING, "mlx_lm batched generation merges caches; it runs with mlx_lm's own caches")
    return True
