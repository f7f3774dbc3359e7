"""From (model, the cache list mlx_lm made, config) to the cache list a generation uses.

Only plain full-attention ``KVCache`` slots are replaced. Sliding-window, SSM/linear, quantized,
``CacheList`` and any other slot stays exactly as the model made it. A model whose attention does
not go through ``mlx_lm.models.base.scaled_dot_product_attention`` cannot reach our caches, so it
is left alone entirely.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from .caches import make_cache
from .config import VeloxConfig
from .coordinators import Coordinator
from .log import log, once

ROUTED_NAME = "scaled_dot_product_attention"
_route_checked: dict[type, bool] = {}


def uses_routed_attention(model: Any) -> bool:
    """True if some module defining the model's layers calls attention via mlx_lm's base.

    mlx_lm's model files import ``scaled_dot_product_attention`` by name from ``models.base``;
    those are the calls the shim can route. Cached per model class.
    """
    kind = type(model)
    if kind not in _route_checked:
        names = {type(m).__module__ for _, m in model.named_modules()}
        _route_checked[kind] = any(hasattr(sys.modules.get(n), ROUTED_NAME) for n in names)
    return _route_checked[kind]


def build(model: Any, caches: list[Any], config: VeloxConfig) -> list[Any]:
    """Replace the eligible slots of ``caches`` with compressed caches sharing one coordinator."""
    from mlx_lm.models.cache import KVCache  # here, so patching before mlx_lm's import stays lazy

    slots = [i for i, c in enumerate(caches) if type(c) is KVCache]
    model_name = type(model).__module__
    if not slots:
        once(model_name, logging.INFO, f"{model_name}: no plain full-attention KVCache slot; running unpatched")
        return caches
    if not uses_routed_attention(model):
        once(model_name, logging.INFO, f"{model_name}: attention does not use mlx_lm's routed function; running unpatched")
        return caches
    coordinator = Coordinator(config.kv)
    out = list(caches)
    for i in slots:
        cache = make_cache(config)
        cache.coordinator = coordinator
        coordinator.join(cache)
        out[i] = cache
    log.debug("%s: %s on %d of %d cache slots", model_name, config.kv, len(slots), len(caches))
    return out


def coordinator_of(caches: Any) -> Coordinator | None:
    """The coordinator of a cache list built here, or None for any other list."""
    for cache in caches if isinstance(caches, (list, tuple)) else ():
        found = getattr(cache, "coordinator", None)
        if isinstance(found, Coordinator):
            return found
    return None
