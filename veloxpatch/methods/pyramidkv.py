"""PyramidKV (Cai et al., arXiv 2406.02069): SnapKV's selection with budgets that shrink with depth.

Attention funnels through a model: lower layers spread it over the whole context, upper layers concentrate it on a
few tokens. So the budgets form an arithmetic sequence from the bottom layer up whose top term is ``1/beta`` of the
mean (``VELOX_PYRAMIDKV_BETA``, 20 in the paper's runs) and whose mean is ``VELOX_BUDGET``, so the list holds as many
rows as uniform SnapKV. Inside a layer this is SnapKV's policy, with another :meth:`target`. Deviations, and why:

* The sequence shapes the part of the budget above ``VELOX_SINK + VELOX_WINDOW``: every layer keeps its sink and
  recent window, as every layer of the paper keeps its last alpha tokens (the authors' code too).
* No layer is given more rows than the tokens it has seen: what a lower layer cannot use on a short context goes to
  the layers above, in proportion to their terms (the authors' code clamps the bottom term likewise).
* Budgets are integers: rounded by largest remainder, so they sum to exactly layers x budget.
* A list without a coordinator, or with one member, uses the plain budget.
"""

from __future__ import annotations

import functools

from ..caches.evicting import EvictingCache
from ..caches.spec import CacheSpec
from ..coordinators import depth_of
from ..registry import cache_class, method
from ..settings import Setting, number_range

KNOBS = (
    Setting("VELOX_PYRAMIDKV_BETA", number_range(1), "20", "a number >= 1",
            "PyramidKV: the top layer keeps 1/beta of the mean budget above sink + window (1: uniform)."),
)


@functools.lru_cache(maxsize=64)
def pyramid(layers: int, beta: float) -> tuple[float, ...]:
    """The paper's arithmetic sequence as shares of the mean, bottom layer first: the top term is
    ``1/beta``, the bottom ``2 - 1/beta``, so they average 1."""
    top = 1 / beta
    bottom = 2 - top
    return tuple(bottom + (top - bottom) * i / (layers - 1) for i in range(layers))


@method("pyramidkv", "SnapKV's selection with budgets shrinking with depth (arithmetic; mean = the budget).", KNOBS,
        composes=("snapkv",))
class PyramidKVCache(EvictingCache):
    """SnapKV's policy with a budget set by the layer's depth in its list."""

    policy_class = cache_class("snapkv").policy_class  # SnapKV's knobs reach it too (``composes``)
    budget_use = "VELOX_BUDGET is the rows it keeps per layer on average (deeper layers keep fewer)."

    def __init__(self, spec: CacheSpec, beta: float = 20.0, **snapkv_knobs: object) -> None:
        super().__init__(spec, **snapkv_knobs)
        self.beta = beta

    def knob_values(self) -> dict[str, object]:
        return {**super().knob_values(), "beta": self.beta}

    def layer_weights(self) -> tuple[tuple[float, ...], int] | None:
        """This layer's term of the pyramid over the model's served layers (the plain budget alone)."""
        depth, layers = depth_of(self)
        return None if layers < 2 or depth >= layers else (pyramid(layers, self.beta), depth)
