"""TOVA, Token Omission Via Attention (Oren et al., arXiv 2401.06104): keep the rows the newest query attends to most.

The paper reads a decoder as a multi-state RNN whose states are the KV rows; bounding the states turns it into a
finite one, and the policy that works best is the plainest: when the cache is over its size, drop the rows the
current query pays the least attention, averaged over the layer's heads. Here the score is the newest remembered
query's attention over the rows it saw, averaged over all query heads, and every KV head keeps the same rows (as the
authors' code does), so a row index names the same token in every head. Deviations from the paper, and why:

* The paper evicts one row per decode step; like every method here, a cache grows ``headroom`` rows above the budget
  and then evicts them together, so a compaction's copy is amortised.
* The paper protects nothing (the newest token's high self-attention keeps it). The base keeps the first
  ``VELOX_SINK`` tokens and the last ``VELOX_WINDOW`` tokens whatever their scores; ``VELOX_SINK=0`` and
  ``VELOX_WINDOW=1`` give the paper's policy, the newest token aside.
* Only the newest query is remembered (``VELOX_WINDOW`` is just the protected window here). In ``end`` mode the prompt
  is compressed by its last token's attention, as the authors' code does once the prompt has been read; ``chunk``
  uses each chunk's last token.
* Attention sinks passed to attention (``sinks``, an extra logit per head) are left out of the probabilities: they
  hold no row.
"""

from __future__ import annotations

import mlx.core as mx

from ..caches.evicting import EvictingCache, Policy
from ..registry import method


class TOVA(Policy):
    """Ranks rows by the newest query's attention, the same ranking for every head of the layer."""

    remembers = 1  # the newest query; the memory's ``end`` says what it saw (a prompt compressed in ``end`` mode is
    # scored by it when the next step's rows are already stored)

    def score(self, cache: EvictingCache, keys: mx.array, positions: mx.array, scale: float) -> mx.array:
        """Mean over all query heads of the newest query's attention over the rows it saw; recency with no
        query to go by (a trim took it back, or the cache was rebuilt without one)."""
        memory = cache.memory
        if memory.queries is None:
            return positions.astype(mx.float32)
        mean = memory.attention(keys, positions, scale).sum(axis=1) / memory.queries.shape[1]
        if cache.coordinator is not None:
            mean = cache.coordinator.head_mean(mean)  # over every head of the layer, on a model split by heads
        return mx.broadcast_to(mean[:, None], positions.shape)

    def select(self, cache: EvictingCache, keep: int, scale: float, kept: mx.array | None = None) -> mx.array:
        """One set of rows for every KV head: the scores, protection and holes are the same in
        every head, so the first head's choice is every head's (the tier's choice is the base's)."""
        index = super().select(cache, keep, scale, kept)
        return index if kept is not None else mx.broadcast_to(index[:, :1], index.shape)


@method("tova", "The newest query's attention averaged over heads; one set of rows per layer.", policy=True)
class TOVACache(EvictingCache):
    """TOVA's cache: one set of rows per layer, chosen by :class:`TOVA`."""

    policy_class = TOVA
