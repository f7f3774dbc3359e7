"""What a cache is built from, whole: a :class:`CacheSpec` and its method's knobs, nothing set after.

Two things reach a cache later, unknown when it is made: a loaded list's :class:`Runtime` (``load_prompt_cache``'s
wrapper), and the memory plan a model shares with its speculative draft (``integration.wrappers``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from ..config import Budget, TierSize, VeloxConfig
from ..registry import METHODS, knob_settings
from .memory import MemoryPlan


@dataclass(frozen=True)
class Runtime:
    """What only the integration knows, asked when it matters (so it follows ``unpatch``); by default no to both."""

    batching: Callable[[], bool] = lambda: False
    """Whether mlx_lm's batches may hold our caches now: ``merge`` is there only then (integration.batched)."""
    meta_apart: Callable[[], bool] = lambda: False
    """Whether mlx_lm saves ``meta_state`` apart and only arrays of ``state`` (before mlx-lm 0.32)."""


@dataclass(frozen=True)
class CacheSpec:
    """Everything a cache is built with besides its method's knobs."""

    budget: Budget
    sink: int = 4  # the first tokens never evicted
    window: int = 32  # the last tokens never evicted (and the queries remembered)
    mode: str = "end"  # when to compress (VELOX_COMPRESS, :mod:`.schedule`)
    tier: int = 0  # the bits the rows a compression drops are kept at (VELOX_TIER; 16 unquantized), 0: lost
    tier_size: TierSize = TierSize()  # the most rows the tier holds (VELOX_TIER_SIZE)
    memory_plan: MemoryPlan | None = None  # VELOX_KV_MEMORY as rows per layer for the list, or None
    runtime: Runtime = Runtime()  # the integration's answers


def make_cache(config: VeloxConfig, **changes: Any) -> Any:
    """A fresh cache of the configured method: the spec ``config`` gives, with ``changes`` (``memory_plan``,
    ``runtime``, sizes), and its knobs (those of methods it builds on too)."""
    assert isinstance(config.budget, Budget) and isinstance(config.tier, int), "converted by VeloxConfig"
    assert isinstance(config.tier_size, TierSize), "converted by VeloxConfig"
    spec = CacheSpec(config.budget, config.sink, config.window, config.compress, config.tier, config.tier_size)
    knobs = {short: config.knobs[knob.key] for short, knob in knob_settings(config.kv, config.knobs).items()}
    return METHODS[config.kv].cls(replace(spec, **changes), **knobs)
