"""PyramidKV (Cai et al., arXiv 2406.02069): SnapKV's selection with budgets that shrink with depth.

Attention funnels through a model: lower layers spread it over the whole context, upper layers
concentrate it on a few tokens (pyramidal information funneling). So lower layers get more rows and
upper layers fewer: the budgets form an arithmetic sequence whose last (top) term is ``1/beta`` of the
mean (``VELOX_PYRAMIDKV_BETA``, the paper's beta, 20 in its runs) and whose first (bottom) term is what
keeps the mean at the configured budget, so the list holds as many rows as uniform SnapKV at the same
``VELOX_BUDGET`` (tokens or a percentage: the mean is ``budget.resolve(offset)``). Inside a layer the
rows are chosen exactly as SnapKV chooses them: this is :class:`SnapKVCache` with another
:meth:`target`.

Where this deviates from the paper, and why:

* The sequence shapes the evictable part of the budget, above ``VELOX_SINK + VELOX_WINDOW``: every
  layer keeps its sink and recent window, as every layer of the paper keeps its last alpha tokens
  (the authors' code also builds the sequence on the budget without the window). So no layer's
  budget is below sink + window.
* No layer is given more rows than the tokens it has seen: the rows a lower layer cannot use on a
  short context go to the layers above, in proportion to their terms (the authors' code clamps the
  bottom term to the prompt length for the same reason). A budget at or above the context evicts
  nothing anywhere, as with a uniform budget.
* Budgets are integers: rounded by largest remainder, so they sum to exactly layers x budget.
* A list without a coordinator, or with one member, uses the plain budget.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

from ..config import Setting
from . import method
from .snapkv import SnapKVCache


def _beta(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value >= 1):
        raise ValueError(text)
    return value


KNOBS = (
    Setting("VELOX_PYRAMIDKV_BETA", _beta, "20", "a number >= 1",
            "PyramidKV: the top layer keeps 1/beta of the mean budget above sink + window (1: uniform).",
            method="pyramidkv"),
)


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


@functools.lru_cache(maxsize=64)
def pyramid(layers: int, beta: float) -> tuple[float, ...]:
    """The paper's arithmetic sequence as shares of the mean, bottom layer first: the top term is
    ``1/beta``, the bottom ``2 - 1/beta``, so they average 1."""
    top = 1 / beta
    bottom = 2 - top
    return tuple(bottom + (top - bottom) * i / (layers - 1) for i in range(layers))


@method("pyramidkv", "SnapKV's selection with budgets shrinking with depth (arithmetic; mean = the budget).", KNOBS)
class PyramidKVCache(SnapKVCache):
    """SnapKV with a budget set by the layer's depth in its list."""

    def __init__(self, budget, sink: int = 4, window: int = 32, mode: str = "end", beta: float = 20.0,
                 kernel: int = 31, pool: str = "avg") -> None:
        super().__init__(budget, sink, window, mode, kernel, pool)
        self.beta = beta

    def knob_values(self) -> dict[str, object]:
        return {**super().knob_values(), "beta": self.beta}

    def target(self) -> int:
        """This layer's term of the pyramid over the model's served layers (the plain budget alone)."""
        depth, layers = self._depth()
        budget = self.budget.resolve(self.offset)
        floor = self.sink + self.window
        if layers < 2 or depth >= layers:
            return max(budget, floor)
        return layer_budgets(pyramid(layers, self.beta), budget, floor, self.offset)[depth]
