"""Per-layer budgets: integer shares of a total that sum to it exactly (PyramidKV, SqueezeAttention).

Each layer has a weight (mean 1) and keeps the protected ``floor`` plus its share of the rest, never more than the
tokens seen (the rest goes to the others).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence


def spread(total: float, weights: Sequence[float], cap: float) -> list[float]:
    """``total`` split in proportion to ``weights``, no part above ``cap`` (water filling)."""
    parts = [cap] * len(weights)  # what the parts over the cap keep
    open_ = list(range(len(weights)))
    left = total
    while open_:
        weight = sum(weights[i] for i in open_)
        share = {i: (weights[i] / weight if weight > 0 else 1 / len(open_)) * left for i in open_}
        over = [i for i in open_ if share[i] > cap]
        if not over:
            for i in open_:
                parts[i] = max(share[i], 0.0)
            break
        left -= cap * len(over)
        open_ = [i for i in open_ if i not in over]
    return parts


def largest_remainder(parts: Sequence[float], total: int) -> list[int]:
    """Integers within 1 of ``parts`` summing to ``total`` (fractions compared to 9 decimals: noise does not decide)."""
    base = [math.floor(p + 1e-9) for p in parts]
    order = sorted(range(len(parts)), key=lambda i: round(base[i] - parts[i], 9))
    for i in order[: max(total - sum(base), 0)]:
        base[i] += 1
    return base


@functools.lru_cache(maxsize=256)
def layer_budgets(weights: tuple[float, ...], budget: int, floor: int, cap: int) -> tuple[int, ...]:
    """Rows each layer keeps: ``floor`` plus its share of the rest of a mean ``budget``, no layer above ``cap``. At
    or above ``cap`` nothing needs evicting (each gets the budget); below ``floor`` each gets ``floor``."""
    layers = len(weights)
    free, room = budget - floor, cap - floor
    if free <= 0 or free >= room:
        return (max(budget, floor),) * layers
    parts = largest_remainder(spread(layers * free, weights, room), layers * free)
    return tuple(floor + part for part in parts)
