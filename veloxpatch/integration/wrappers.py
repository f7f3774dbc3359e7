"""The replacements the shim binds into mlx_lm (the batched-generation ones live in :mod:`.batched`, the server's
in :mod:`.server`).

Each reads the config in force at call time, so re-patching with a new config needs no re-binding, and a failure
inside our code falls back to mlx_lm's own behaviour unless ``VELOX_STRICT``.
"""

from __future__ import annotations

import inspect
import logging
import sys
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import wrapt

from .. import builder, stats, structure
from ..caches import CompressedKVCache, blocks, window
from ..caches.batch import SequenceBatch
from ..caches.schedule import Schedule
from ..coordinators import coordinators_of
from ..cpu import cpu_backend
from ..fallback import StrictError, fall_back
from ..log import once
from ..registry import name_of
from ..settings import ConfigError
from . import layer_io, rereading
from .state import STATE, in_batched_generation, in_force

SDPA_PARAMS = ("queries", "keys", "values", "cache", "scale", "mask", "sinks")


@wrapt.decorator
def make_prompt_cache(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """mlx_lm's cache list, its eligible slots swapped for ours."""
    caches = wrapped(*args, **kwargs)
    config = in_force()
    if config is None or not config.enabled or in_batched_generation():
        return caches
    model = args[0] if args else kwargs["model"]
    try:
        if builder.candidate_slots(caches):
            layer_io.prepare(model, config)
            rereading.prepare(model, config)
        return builder.build(model, caches, config, STATE.runtime,
                             args[1] if len(args) > 1 else kwargs.get("max_kv_size"))
    # ConfigError: a setting this model cannot take, or RanksDisagree (every rank raises it, never one method per rank)
    except (StrictError, ConfigError):
        raise
    except Exception as error:  # the host app must keep running
        fall_back("building compressed caches", error, config, model=model, instead="it runs on mlx_lm's own caches")
        return caches


@wrapt.decorator
def scaled_dot_product_attention(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """A call whose cache is ours goes to the cache (real queries, our mask); any other to the original, untouched."""
    call = dict(zip(SDPA_PARAMS, args), **kwargs)
    cache = call.get("cache")
    if isinstance(cache, (CompressedKVCache, SequenceBatch)):
        return cache.attend(call["queries"], call["keys"], call["values"], scale=call["scale"], mask=call.get("mask"),
                            sinks=call.get("sinks"))
    if _in_blocks(cache, call["queries"]):
        out = blocks.attention(call["queries"], call["keys"], call["values"], call["scale"], call.get("mask"),
                               call.get("sinks"))
        window.shed(cache, out)
        return out
    return wrapped(*args, **kwargs)


def _in_blocks(cache: Any, queries: mx.array) -> bool:
    """Whether a prompt chunk over a plain cache of mlx_lm's (a sliding window, a layer the probe turned away) is
    attended in blocks of queries as ours are, with a method on, on the CPU (where mlx materialises the whole score
    matrix): the same attention in far less memory (docs/results.md, "While a prompt is read")."""
    config = in_force()
    return (queries.shape[2] > Schedule.max_headroom and config is not None and config.enabled
            and not hasattr(cache, "bits") and cpu_backend())  # a decode step stops at the first test


@wrapt.decorator
def generation_start(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """For ``generate_step`` (``prompt_cache`` is keyword-only)."""
    caches, model = kwargs.get("prompt_cache"), args[1] if len(args) > 1 else kwargs.get("model")
    try:
        _evaluate_first(caches, model)
        start_generation(caches, model, _tokens(args[0] if args else kwargs.get("prompt")))
    except Exception as error:
        fall_back("starting a generation", error, in_force(),
                  instead="it runs on its caches as they are (cross-layer state not reset)")
    return wrapped(*args, **kwargs)


@wrapt.decorator
def speculative_start(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """For ``speculative_generate_step``: the draft's caches follow ``VELOX_DRAFT_KV``, then a generation starts."""
    call = inspect.signature(wrapped).bind(*args, **kwargs)
    given = call.arguments
    try:
        _evaluate_first(given.get("prompt_cache"), given.get("model"), given.get("draft_model"))
        _draft_caches(given)
        _share_memory_plan(given)
        start_generation(given.get("prompt_cache"), given.get("model"), _tokens(given.get("prompt")))
    except ConfigError:  # the model and its draft together cannot fit VELOX_KV_MEMORY: a setting, not our fault
        raise
    except Exception as error:
        fall_back("starting a speculative generation", error, in_force(),
                  instead="it runs on its caches as they are (the draft's caches unchanged)")
    return wrapped(*call.args, **call.kwargs)


@wrapt.decorator
def load_prompt_cache(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """A restored list gets its coordinator back, and its caches what the builder gives those it builds."""
    loaded = wrapped(*args, **kwargs)
    found = ours(loaded[0] if isinstance(loaded, tuple) else loaded)
    for cache in found:  # built by from_state: given what a cache the builder built is given
        cache.runtime = STATE.runtime
        stats.track(cache)
    _adopt(found)
    return loaded


def _evaluate_first(caches: Any, *models: Any) -> None:
    """Evaluate ``models``' lazy parameters (``load(lazy=True)``) when mlx_lm is about to make their cache list
    (``caches`` is None): the first forward would evaluate them moments later, and the probe, which never evaluates
    a model, can then serve this generation rather than the next."""
    config = in_force()
    if caches is not None or config is None or not config.enabled:
        return
    for model in models:
        if model is not None and structure.unevaluated(model):
            mx.eval(model.parameters())


def start_generation(caches: Any, model: Any, prompt: int | None = None) -> None:
    """A generation starts on ``caches``: the model gets the hooks they ask for (a list loaded from a file never
    went through ``make_prompt_cache``), copies (the server deep-copies prompt caches) are counted in the statistics,
    and every coordinator, main and draft lists' alike, is reset."""
    found = ours(caches)
    if prompt:
        for cache in found:
            cache.expect_prompt(prompt)
    if model is not None and any(c.wants_layer_io for c in found):
        layer_io.install(model)
    if model is not None and any(rereading.asks(c) for c in found):
        rereading.install(model)
    _adopt(found)
    for cache in found:
        stats.track(cache, built=False)
    for coordinator in coordinators_of(found):
        coordinator.reset()
    stats.totals.generations += 1


def _tokens(prompt: Any) -> int | None:
    """A generation's prompt in tokens (an array or a list of ids), or None for anything else."""
    size = getattr(prompt, "size", None)
    return size if isinstance(size, int) else (len(prompt) if isinstance(prompt, list) else None)


def _draft_caches(arguments: dict[str, Any]) -> None:
    """With ``VELOX_DRAFT_KV=none`` the draft model keeps mlx_lm's own caches: without a prompt cache both lists
    are built as mlx_lm would (also under ``VELOX_KV_MEMORY``, whose plan the two lists then share); a given list's
    draft part has its empty compressed slots swapped for mlx_lm's (one that holds rows stays, said once)."""
    config = in_force()
    caches = arguments.get("prompt_cache")
    if config is None or (config.draft_kv != "none" and (caches is not None or not config.kv_memory)):
        return
    model, draft = arguments["model"], arguments["draft_model"]
    make = sys.modules["mlx_lm.models.cache"].make_prompt_cache
    plain = builder.mlx_caches(draft) if config.draft_kv == "none" else make(draft)
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


def _share_memory_plan(arguments: dict[str, Any]) -> None:
    """Under ``VELOX_KV_MEMORY`` a model and its draft read the same tokens into two lists, each planned for the
    whole target when built: fresh ones get one plan for both, so together they hold the target."""
    caches, first = arguments.get("prompt_cache"), len(arguments["model"].layers)
    if not isinstance(caches, (list, tuple)):
        return
    parts: list[list[Any]] = [[c for c in ours(part) if getattr(c, "memory_plan", None) is not None]  # evicting ones
                              for part in (caches[:first], caches[first:])]
    if not all(parts) or not all(c.empty() for c in parts[0] + parts[1]):
        return
    main, draft = parts[0][0].memory_plan, parts[1][0].memory_plan
    if main is draft:
        return
    plan = main.shared_with(draft)
    for cache in parts[0] + parts[1]:
        cache.memory_plan = plan
    once(f"memory plan shared {plan.setting}", logging.INFO, f"the model and its draft share {plan.describe()}")


def ours(caches: Any) -> list[CompressedKVCache]:
    """Our caches in a cache list, in list order (none for anything that is not a list)."""
    return [c for c in caches if isinstance(c, CompressedKVCache)] if isinstance(caches, (list, tuple)) else []


def _adopt(caches: list[CompressedKVCache]) -> None:
    """Give caches without a coordinator (``from_state`` builds single caches, which cannot know their list) one
    per method, shared, joined in list order."""
    orphans = [c for c in caches if c.coordinator is None]
    for method in dict.fromkeys(map(name_of, orphans)):
        members = [c for c in orphans if name_of(c) == method]
        coordinator = type(members[0]).coordinator_class(method)
        for cache in members:
            coordinator.join(cache)
