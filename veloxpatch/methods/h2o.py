"""H2O, the Heavy-Hitter Oracle (Zhang et al., arXiv 2306.14048): keep the rows that have received
the most attention so far.

A few tokens collect most of the attention over a whole generation (the heavy hitters); their accumulated attention is
a cheap, greedy oracle of what later tokens will need. Every query adds the attention probabilities it pays the rows
it sees (summed over the query heads that share a KV head) to a per-row accumulator, from prefill on; the mass follows
its row through compactions, trims, the tier (``VELOX_TIER``) and saving. Rows are ranked per KV head by this sum; the
sinks and the recent window are kept. In ``end`` mode the prompt's accumulated mass decides the first compression.

A prompt step takes its output and its mass from one softmax (:func:`attention_with_mass`), which keeps H2O's cost
near the other methods' (docs/results.md, "Server"). Decode steps' queries are queued and accounted in one vectorised
pass when scores are needed, when the queue outgrows the decode headroom and before saving (so a speculative rewind
takes a rejected step's queries back): until a compression nothing a query saw changes, so the sums are the same.
Deviations from the paper, and why:

* The paper evicts one row per decode step; like every method here, a cache grows ``headroom`` rows above the budget
  and then evicts the lowest-scored together, so a compaction's copy is amortised.
* The paper splits the budget between heavy hitters and recent tokens (half each); here the recent part is
  ``VELOX_WINDOW`` (with ``VELOX_SINK``) and the rest goes to heavy hitters. A larger window gives the paper's split.
* With grouped-query attention a KV head's rows are ranked by the attention of all the query heads that read them.
* Attention sinks passed to attention (``sinks``) are left out of the probabilities: they hold no row.
* A trim drops the rewound rows with their mass and the rewound tokens' queued queries; mass already accounted by a
  compression in between stays (taking it back would need a per-step log).
* The step that compresses an ``end`` mode prompt is accounted after the compaction, over the rows kept (normalised
  without its own rows that went, when it is longer than ``VELOX_WINDOW``).
* A model's own mask (e.g. a sliding window in a full-attention slot) is not reflected in the probabilities: they use
  causal visibility by position, holes masked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from ..caches import masks
from ..caches.evicting import EvictingCache, Policy
from ..caches.queries import EVERY, QueryMemory
from ..caches.scored_attention import SCORE_BYTES
from ..coordinators import members_of
from ..registry import method


def received_mass(queries: mx.array, keys: mx.array, scale: float, positions: mx.array, first: int) -> mx.array:
    """Attention probability mass each row receives from ``queries`` (B, q_heads, n, d), (B, kv_heads, rows),
    summed over the queries and the query heads of each KV head, in float32. The queries are those of tokens ``first
    .. first + n - 1``; each sees the rows of ``positions`` at or before its own, holes never."""
    return attention_with_mass(queries.astype(mx.float32), keys.astype(mx.float32), None, scale, positions, first)[1]


def attention_with_mass(queries: mx.array, keys: mx.array, values: mx.array | None, scale: float,
                        positions: mx.array, first: int) -> tuple[mx.array | None, mx.array]:
    """The attention output of ``queries`` over ``keys``/``values`` (None without ``values``) and the mass each row
    receives (as :func:`received_mass`) from one softmax, not two. The same operations as mlx's attention on the CPU
    (scaled queries, one matmul per KV head group, a precise softmax with hidden rows at -inf), so the same output. A
    block of queries at a time, each evaluated before the next so its float32 probabilities stay within
    :data:`.scored_attention.SCORE_BYTES` (the read peak: docs/results.md, "While a prompt is read")."""
    b, hq, n, d = queries.shape
    hkv, rows = keys.shape[1], keys.shape[2]
    q = (queries * scale).reshape(b, hkv, hq // hkv, n, d)
    k = mx.expand_dims(keys, 2).swapaxes(-1, -2)
    row_positions = mx.where(positions >= 0, positions, first + n)[:, :, None, None, :]  # a hole: after every query
    block = max(1, SCORE_BYTES // (4 * b * hq * rows))
    outs, total = [], mx.zeros((b, hkv, rows), mx.float32)
    for start in range(0, n, block):
        stop = min(n, start + block)
        visible = row_positions <= mx.arange(first + start, first + stop)[:, None]
        hidden = mx.where(visible, 0.0, -mx.inf).astype(q.dtype)
        probs = mx.softmax(q[..., start:stop, :] @ k + hidden, axis=-1, precise=True)
        if values is not None:
            outs.append((probs @ mx.expand_dims(values, 2)).reshape(b, hq, stop - start, values.shape[-1]))
        else:  # a queued decode query may see no row (its softmax NaN); a prompt step's sees its own
            probs = mx.where(visible, probs, 0.0)
        total = total + probs.astype(mx.float32).sum(axis=(2, 3))
        if block < n:
            mx.eval(outs[-1:], total)  # left lazy, every block's probabilities would be alive at once
    if not outs:
        return None, total
    return (outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)), total


@dataclass(eq=False)
class H2O(Policy):
    """Ranks rows by the attention they have accumulated: the store's row column ``mass`` (float32; shorter than
    the rows until the newest are accounted)."""

    remembers = 0  # no observation window: the scores come from every query (:meth:`observe`)
    logs_queries = True  # decode queries wait in the cache's log until they pass the largest headroom
    row_columns = ("mass",)

    credited: bool = field(default=False, init=False)  # this step's queries were accounted with its attention

    def score(self, cache: EvictingCache, keys: mx.array, positions: mx.array, scale: float) -> mx.array:
        self.catch_up(cache)
        return cache.store.column("mass", keys.shape[2])

    def observe(self, cache: EvictingCache, queries: mx.array, keys: mx.array, scale: float) -> None:
        """Queue this step's queries (unless its attention gave its mass already, :meth:`credit`); account them
        once they outgrow the decode headroom."""
        if self.credited:
            self.credited = False
            cache.log.end = cache.offset
            return
        cache.log.remember(queries, cache.offset, EVERY)
        assert cache.log.queries is not None, "remembered"
        if cache.log.queries.shape[2] > cache.schedule.headroom(cache.target()):
            self.catch_up(cache)

    def credit(self, cache: EvictingCache, mass: mx.array) -> None:
        """A prompt step's mass, from its own attention; the queries queued before it were accounted first."""
        cache.store.set_column("mass", cache.store.column("mass", mass.shape[-1]) + mass)
        self.credited = True

    def catch_up(self, cache: EvictingCache) -> None:
        """Add the queued queries' attention to the mass, in one pass, over the rows they saw."""
        queries, end = cache.log.queries, cache.log.end
        if queries is None:
            return
        cache.log = QueryMemory(None, end)
        keys, _ = cache.store.fetch()
        first = end - queries.shape[2]
        mass = received_mass(queries, keys, cache.scale, cache.store.row_positions(), first)
        cache.store.set_column("mass", cache.store.column("mass", keys.shape[2]) + mass)


@method("h2o", "Heavy hitters: attention accumulated over every step's queries; top-k per KV head.", policy=True)
class H2OCache(EvictingCache):
    """H2O's cache: its rows chosen by :class:`H2O`."""

    policy_class = H2O
    policy: H2O

    def _attention(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any,
                   sinks: mx.array | None, kept: mx.array | None = None) -> mx.array:
        """A prompt step over the stored rows gets its output and its mass from one softmax; any other step (within
        the decode headroom, with sinks, a model's own mask or the rows a pending compression keeps) is attended as
        every cache attends, and its queries scored later."""
        own_mask = mask is None or isinstance(mask, str) or masks.issued(mask, members_of(self))
        if queries.shape[2] <= self.schedule.headroom(self.target()) or kept is not None or sinks is not None \
                or not own_mask or keys.shape[2] != self.store.rows:
            return super()._attention(queries, keys, values, scale, mask, sinks, kept)
        self.policy.catch_up(self)
        out, mass = attention_with_mass(queries, keys, values, scale, self.store.row_positions(),
                                        self.offset - queries.shape[2])
        assert out is not None, "attended with values"
        self.policy.credit(self, mass)
        masks.forget_issued(self, members_of(self))
        return out
