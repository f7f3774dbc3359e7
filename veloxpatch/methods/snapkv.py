"""SnapKV (Li et al., 2404.14469): keep the rows the most recent queries attend to.

The last ``VELOX_WINDOW`` queries (the observation window) already look at what the next tokens will need; their
attention, summed over the window and the query heads sharing a KV head and pooled over neighbouring rows (so a kept
token keeps its context), ranks the rows per KV head. The paper compresses once, after the prompt
(``VELOX_COMPRESS=end``); with ``chunk`` it also runs between prefill chunks so memory stays bounded during the
prompt, and either way every few decode steps (``headroom``), so memory stays bounded over the whole generation.

Deviation: the pooling kernel defaults to 31 rows, not the paper's 7. Tokenizers that spell a number one digit per
token (SmolLM2's, Qwen's) split a fact over a dozen rows; a narrow kernel keeps its best digits and drops the rest
(docs/results.md, "Methods compared: SmolLM2-135M"). ``VELOX_SNAPKV_KERNEL=7`` gives the paper's setting back.

Head-wise budgets (AdaKV: one top-k over a layer's heads) are not here: this cache holds every head's rows in one
array, so a head keeping more would make every head hold as many. ``VELOX_KV=quant`` with ``VELOX_QUANT_SCORE=snapkv``
chooses by this rule with head-wise (or model-wise) budgets and holds each head's rows apart, quantized or, at
``VELOX_QUANT_BITS=16``, not (docs/results.md, "Head-wise budgets for SnapKV's rule").
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ..caches.evicting import EvictingCache, Policy
from ..caches.queries import QueryMemory
from ..caches.selection import pool_rows
from ..registry import method
from ..settings import Setting, choice, odd_kernel

KNOBS = (
    Setting("VELOX_SNAPKV_KERNEL", odd_kernel, "31", "an odd integer in [1, 63]",
            "SnapKV (and pyramidkv, squeeze with the snapkv policy): width of the pooling over neighbouring "
            "rows' scores."),
    Setting("VELOX_SNAPKV_POOL", choice(("avg", "max")), "avg", "one of avg, max",
            "SnapKV: how scores are pooled over the kernel (average or maximum)."),
)


@dataclass(eq=False)
class SnapKV(Policy):
    """Ranks rows by the pooled attention the recent window of queries pays them."""

    kernel: int = 31
    pool: str = "avg"

    def score(self, cache: EvictingCache, keys: mx.array, positions: mx.array, scale: float) -> mx.array:
        """Pooled attention of the window over the prefix (:meth:`rank`)."""
        return self.rank(cache.memory, keys, positions, scale, cache.protected(positions))

    def rank(self, memory: QueryMemory, keys: mx.array, positions: mx.array, scale: float,
             kept_anyway: mx.array) -> mx.array:
        """The attention ``memory``'s queries pay rows ``keys`` at ``positions``, pooled: this policy's score, and
        ``quant``'s under ``VELOX_QUANT_SCORE=snapkv``. Rows ``kept_anyway`` score zero before pooling, so the
        window's attention to itself does not spill into the rows just before it."""
        scores = mx.where(kept_anyway, 0.0, memory.attention(keys, positions, scale))
        return pool_rows(scores, self.kernel, self.pool)


@method("snapkv", "Observation-window attention of the real queries, pooled; top-k per KV head.", KNOBS, policy=True)
class SnapKVCache(EvictingCache):
    """SnapKV's cache: its rows chosen by :class:`SnapKV`."""

    policy_class = SnapKV
