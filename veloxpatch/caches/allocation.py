"""Per-layer budgets: integer shares of a total that sum to it exactly (PyramidKV, SqueezeAttention).

A method that moves the budget between layers gives each layer a weight (mean 1); the layer keeps the
protected ``floor`` (sink + window) plus its share of the rest, never more rows than the tokens it has
seen (what it cannot use goes to the others), and the integer budgets sum to exactly layers x budget.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence


def spread(total: float, weights: Sequence[float], cap: float) -> list[float]:
    """``total`` split in proportion to ``weights``, no part above ``cap`` (water filling).

    What a capped part cannot hold goes to the others in proportion to their weights (evenly among
    parts of weight 0 when only those are left), so the parts sum to ``total`` when it fits.
    """
    parts = [0.0] * len(weights)
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
        for i in over:
            parts[i] = cap
        left -= cap * len(over)
        open_ = [i for i in open_ if i not in over]
    return parts


def largest_remainder(parts: Sequence[float], total: int) -> list[int]:
    """Integers within 1 of ``parts`` (which sum to ``total``) that sum to exactly ``total``: the floors,
    plus one for the parts with the largest fractions (the lower index first on a tie; fractions are
    compared to 9 decimals, so rounding noise does not decide)."""
    base = [math.floor(p + 1e-9) for p in parts]
    order = sorted(range(len(parts)), key=lambda i: round(base[i] - parts[i], 9))
    for i in order[: max(total - sum(base), 0)]:
        base[i] += 1
    return base


@functools.lru_cache(maxsize=256)
def layer_budgets(weights: tuple[float, ...], budget: int, floor: int, cap: int) -> tuple[int, ...]:
    """Rows each layer keeps: ``floor`` plus its share (``weights``, mean 1) of the rest of a mean
    ``budget``, no layer above ``cap`` (the tokens seen); they sum to layers x budget.

    With the budget at or above ``cap`` nothing needs evicting, and each layer gets the plain
    budget; below ``floor`` each gets ``floor`` (the floors do not allow the sum then).
    """
    layers = len(weights)
    free, room = budget - floor, cap - floor
    if free <= 0 or free >= room:
        return (max(budget, floor),) * layers
    parts = largest_remainder(spread(layers * free, weights, room), layers * free)
    return tuple(floor + part for part in parts)
