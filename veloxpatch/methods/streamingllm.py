"""StreamingLLM (Xiao et al., 2309.17453): attention sinks plus a window of recent tokens.

The first ``VELOX_SINK`` tokens soak up attention mass that would otherwise destabilise the softmax once early context
is dropped, so they stay; of the rest only the most recent survive. It needs no queries, so it is the cheapest method
and the baseline every query-aware one must beat.
"""

from __future__ import annotations

import mlx.core as mx

from ..caches.evicting import EvictingCache, Policy
from ..registry import method


class Recency(Policy):
    """Keeps the sink rows and the most recent rows; recency is the only score."""

    uses_queries = False

    def score(self, cache: EvictingCache, keys: mx.array, positions: mx.array, scale: float) -> mx.array:
        return positions.astype(mx.float32)


@method("streamingllm", "Attention sinks + most recent tokens (no scoring; cheapest).", policy=True)
class StreamingLLMCache(EvictingCache):
    """StreamingLLM's cache: sinks and the most recent rows (:class:`Recency`)."""

    policy_class = Recency
