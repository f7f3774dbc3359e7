"""From (model, the cache list mlx_lm made, config) to the cache list a generation uses.

Only plain full-attention ``KVCache`` slots are candidates; every other slot (sliding-window, SSM/linear, quantized,
``CacheList``, ...) stays exactly as the model made it. Which candidates get our caches is decided by probing what
the model does with them (:mod:`veloxpatch.eligibility`); a model that fails the probe, or whose parameters the
probe would evaluate first (:data:`LAZY`), runs on mlx_lm's own caches, said once (:mod:`veloxpatch.fallback`).
"""

from __future__ import annotations

import logging
from typing import Any

from . import eligibility, ranks, stats, structure
from .caches import Runtime, make_cache
from .caches.evicting import queries_held, row_bytes_per_head
from .caches.memory import MemoryPlan, device_bytes
from .config import Memory, VeloxConfig
from .coordinators import drain_streams
from .fallback import notice
from .log import model_type, once

NO_SLOT = "no plain full-attention KVCache slot; running unpatched"
LAZY = ("its parameters are not evaluated yet, and the probe would evaluate them before the app does (the first "
        "cache list made once they are is probed); running unpatched")


def candidate_slots(caches: list[Any]) -> tuple[int, ...]:
    """The plain full-attention ``KVCache`` slots of a cache list."""
    from mlx_lm.models.cache import KVCache  # imported here, so patching before mlx_lm's import stays lazy

    return tuple(i for i, c in enumerate(caches) if type(c) is KVCache)


def mlx_caches(model: Any) -> list[Any]:
    """The cache list mlx_lm's own ``make_prompt_cache`` makes for ``model``, patched or not."""
    from mlx_lm.models.cache import make_prompt_cache

    return getattr(make_prompt_cache, "__wrapped__", make_prompt_cache)(model)


def explain(model: Any, config: VeloxConfig) -> str:
    """What ``config``'s method does on ``model``, in one line, with what ``VELOX_KV_MEMORY`` gives it (the route
    patched and the layer hooks installed: :func:`veloxpatch.integration.layer_io.prepare`)."""
    caches = mlx_caches(model)
    slots = candidate_slots(caches)
    if not slots:
        return NO_SLOT
    if unprobed_and_lazy(model, slots, config):
        return LAZY
    found = eligibility.verdict(model, caches, slots, config, whole=ranks.is_split(model))
    text = found.describe(len(slots))
    if config.kv_memory and found.slots:
        text += "; " + memory_plan(caches, found, config).describe()  # ConfigError when it cannot hold the floor
    return text


def build(model: Any, caches: list[Any], config: VeloxConfig, runtime: Runtime = Runtime(),
          max_kv_size: int | None = None) -> list[Any]:
    """Replace the slots the probe clears with compressed caches sharing one coordinator, built with ``runtime`` and
    the list's memory plan, counted in the statistics; every rank of a split model takes part in their agreement
    whatever its verdict. ``max_kv_size``: the app's, said when it is why no slot is plain."""
    name = model_type(model)
    slots = candidate_slots(caches)
    if slots and unprobed_and_lazy(model, slots, config):  # before the ranks agree: every rank's model is alike
        notice(f"{name} with {config.kv}: {LAZY}", config, key=f"{name} {config.kv} lazy", level=logging.INFO)
        return caches
    found = eligibility.Verdict(())  # every rank takes part in the agreement, slots or not
    if slots:
        split = ranks.is_split(model)
        if split:  # a step still in flight finishes first, or it and the probe's collectives would pair on the ring
            drain_streams()
        found = eligibility.verdict(model, caches, slots, config, whole=split)
    members = len({id(caches[i]) for i in found.slots})
    ready, span = ranks.agreement(model, config, bool(found.slots), members)
    if found.slots and not ready:
        found = eligibility.Verdict((), reason="another rank of this distributed run could not use it")
    if not slots:
        reason = no_slot(caches, max_kv_size)
        notice(f"{name}: {reason}", config, key=f"{name} {reason}", level=logging.INFO)
        return caches
    if not found.slots or found.left:  # said once: at WARNING where something raised (its traceback at DEBUG)
        notice(f"{name} with {config.kv}: {found.describe(len(slots))}", config, key=f"{name} {config.kv}",
               error=found.error, level=logging.INFO if found.error is None else logging.WARNING, trace=found.trace)
    if not found.slots:
        return caches
    once(f"built {name} {config.cache_settings()}", logging.INFO,
         f"{name}: {config.kv} on {len(found.slots)} of {len(caches)} cache slots ({config.described()})")
    plan = _planned(name, caches, found, config) if config.kv_memory else None
    built = eligibility.assemble(caches, found.slots, lambda: make_cache(config, memory_plan=plan, runtime=runtime),
                                 config.kv, span)
    for cache in {id(built[i]): built[i] for i in found.slots}.values():  # a cache filling several slots is one
        stats.track(cache)
    return built


def no_slot(caches: list[Any], max_kv_size: int | None) -> str:
    """Why a list has no slot of ours, in words, naming the app's ``max_kv_size`` where it made mlx_lm build
    ``RotatingKVCache`` slots (servers pass their context limit): the user learns what to change."""
    from mlx_lm.models.cache import RotatingKVCache

    if max_kv_size is None or not any(type(c) is RotatingKVCache for c in caches):
        return NO_SLOT
    return (f"{NO_SLOT.removesuffix('; running unpatched')}: the app's max_kv_size={max_kv_size} asked mlx_lm for "
            "RotatingKVCache slots, a window of the app's own that veloxpatch leaves as it is (without max_kv_size "
            "they would be plain KVCache slots, compressed); running unpatched")


def unprobed_and_lazy(model: Any, slots: tuple[int, ...], config: VeloxConfig) -> bool:
    """Whether the probe would run on ``model`` now and evaluate parameters the app has not evaluated yet."""
    return not eligibility.probed(model, slots, config) and structure.unevaluated(model)


def memory_plan(caches: list[Any], found: eligibility.Verdict, config: VeloxConfig) -> MemoryPlan:
    """``VELOX_KV_MEMORY`` as rows per layer for the slots ``found`` serves, as their caches' policy picks rows
    (ConfigError when it cannot hold the rows every layer keeps)."""
    policy = make_cache(config).policy
    served = {id(caches[i]): found.layouts[i] for i in found.slots}
    others = tuple(layout for i, layout in enumerate(found.layouts) if i not in found.slots)
    assert isinstance(config.kv_memory, Memory) and isinstance(config.tier, int), "converted by VeloxConfig"
    return MemoryPlan(config.kv_memory.resolve(device_bytes()), str(config.kv_memory), tuple(served.values()),
                      others, queries_held(policy, config.window), config.sink + config.window, config.tier,
                      row_bytes_per_head(policy))


def _planned(name: str, caches: list[Any], found: eligibility.Verdict, config: VeloxConfig) -> MemoryPlan:
    """The list's memory plan (said once at INFO; slots it cannot bound at WARNING, an error under strict)."""
    plan = memory_plan(caches, found, config)
    once(f"memory plan {name} {plan.setting}", logging.INFO, f"{name}: {plan.describe()}")
    if plan.unbounded:
        notice(f"{name}: VELOX_KV_MEMORY={plan.setting} cannot bound {plan.unbounded} cache slot(s) that stay "
               "mlx_lm's: they grow with the context", config, key=f"{name} memory unbounded")
    return plan
