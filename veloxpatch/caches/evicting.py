"""Caches that keep at most a budget of rows per layer, chosen by a policy.

An :class:`EvictingCache` is the common cache (:mod:`.base`) with three more parts: a budget per layer
(:meth:`EvictingCache.target`: the budget, never fewer than the protected sink + window; a method may set
it per layer), the compression schedule (:mod:`.schedule`: when), and a :class:`Policy` (which rows).
A method of this kind is a policy and, where it needs one, a subclass that sets the layer's budget
(PyramidKV by depth, SqueezeAttention from its coordinator); SqueezeAttention takes any method's policy
for the rows inside a layer, as kvpress's wrapper presses take an inner press.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import mlx.core as mx

from .. import stats
from .base import CompressedKVCache
from .selection import best_rows, protected


class Policy(ABC):
    """Which rows an evicting cache keeps: a score per row (:meth:`score`), or a choice of its own
    (:meth:`select`). Every hook receives the cache, so one policy object serves one cache; a copy of the cache
    (``to_quantized``) takes a shallow copy of it, so a policy replaces its state rather than changing it in
    place. Per-row state (H2O's accumulated attention) follows the store through :meth:`kept` and
    :meth:`trimmed` and is saved through :meth:`state`. A method offered as a policy (``policy=True``) takes all
    its knobs in its policy's constructor: SqueezeAttention builds it from them."""

    uses_queries: ClassVar[bool] = True  # the scores read the model's real queries
    prompt_state: ClassVar[str] = "window"  # what a prompt leaves in its cache: see CompressedKVCache.prompt_state

    def remembered(self, window: int) -> int:
        """How many recent queries its cache remembers (:mod:`.queries`): the observation window, none for a
        policy that reads no queries."""
        return window if self.uses_queries else 0

    def knob_values(self) -> dict[str, Any]:
        """The policy's knobs, saved with its cache."""
        return {}

    @abstractmethod
    def score(self, cache: EvictingCache, keys: mx.array, positions: mx.array, scale: float) -> mx.array:
        """Importance of each stored row, shape (B, kv_heads, rows); higher is kept.

        ``positions`` (B, kv_heads, rows) holds each row's original token position (-1: hole).
        """

    def select(self, cache: EvictingCache, keep: int, scale: float) -> mx.array:
        """Row indexes to keep, (B, kv_heads, keep), ascending per head: the ``keep`` best by :meth:`score`,
        sink and recent window always, holes never."""
        keys, _ = cache.store.fetch()
        positions = cache.store.row_positions()
        return best_rows(self.score(cache, keys, positions, scale), positions, cache.protected(positions), keep)

    def observe(self, cache: EvictingCache, queries: mx.array, keys: mx.array, scale: float) -> None:
        """Every step's real queries and the keys they attended, one per stored row in storage order, before
        the step compresses (H2O accumulates attention)."""

    def kept(self, cache: EvictingCache, index: mx.array) -> None:
        """The store is about to keep only rows ``index`` (B, kv_heads, keep): per-row state follows."""

    def trimmed(self, cache: EvictingCache) -> None:
        """The cache was trimmed back to its ``offset``: per-row state of the rows gone goes too."""

    @property
    def nbytes(self) -> int:
        """Bytes the policy holds besides the cache's rows and queries."""
        return 0

    def state(self, cache: EvictingCache) -> tuple[Any, ...]:
        """Arrays saved with the cache (after its queries)."""
        return ()

    def load(self, cache: EvictingCache, state: tuple[Any, ...]) -> None:
        """Restore what :meth:`state` saved (empty for a cache saved without it)."""


class EvictingCache(CompressedKVCache):
    """A per-layer cache holding at most its budget (plus decode headroom) of rows, chosen by its policy.

    ``policy_class`` is the method's policy; the method's knobs (constructor keywords) go to it."""

    policy_class: ClassVar[type[Policy]]

    def __init__(self, budget: Any, sink: int = 4, window: int = 32, mode: str = "end", **knobs: Any) -> None:
        super().__init__(budget, sink, window, mode)
        self.policy = self.make_policy(**knobs)

    def make_policy(self, **knobs: Any) -> Policy:
        """The policy picking this cache's rows, from the method's knobs."""
        return self.policy_class(**knobs)

    @classmethod
    def prompt_state(cls) -> str:
        return cls.policy_class.prompt_state

    @property
    def uses_queries(self) -> bool:
        return self.policy.uses_queries

    def knob_values(self) -> dict[str, Any]:
        return self.policy.knob_values()

    # ----------------------------------------------------------------- what a method may set
    def target(self) -> int:
        """Rows to keep now: the budget, but never fewer than the protected sink + window."""
        return max(self.budget.resolve(self.offset), self.sink + self.window)

    def observe(self, queries: mx.array, keys: mx.array, scale: float) -> None:
        """Every step's real queries and the keys they attended, before the step compresses: the policy's
        (a method reporting to its coordinator adds its own)."""
        self.policy.observe(self, queries, keys, scale)

    # ----------------------------------------------------------------- the attention route
    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any = None,
               sinks: mx.array | None = None) -> mx.array:
        """Attention of this step over our rows with our mask (and the model's, if it has one of its own),
        then compress if due (:class:`~veloxpatch.caches.schedule.Schedule`). A decode-sized step over a
        pending prompt compresses it first: the step's keys were fetched before, so the rows about to go
        are masked for it."""
        n = queries.shape[2]
        keep = self.target()
        kept = self.select(keep, scale) if self.schedule.pending(self.store.rows, n, keep) else None
        out = self._attention(queries, keys, values, scale, mask, sinks, kept)
        self.observe(queries, keys, scale)
        self.memory.remember(queries, self.offset, self.policy.remembered(self.window))
        if kept is not None:
            self.keep_rows(kept)
        elif self.schedule.due(self.store.rows, n, keep):
            self.compress(keep, scale)
        return out

    # ----------------------------------------------------------------- selection and compaction
    def select(self, keep: int, scale: float) -> mx.array:
        """The policy's choice of ``keep`` rows per KV head, (B, kv_heads, keep), ascending."""
        return self.policy.select(self, keep, scale)

    def compress(self, keep: int, scale: float) -> None:
        """Keep the rows :meth:`select` picks."""
        self.keep_rows(self.select(keep, scale))

    def keep_rows(self, index: mx.array) -> None:
        """Compact storage to the rows ``index`` (B, kv_heads, keep), ascending per head."""
        self.policy.kept(self, index)
        keep = index.shape[-1]
        self.evicted = self.evicted or keep < self.store.rows
        self.store.keep(index, self.headroom(keep))
        stats.totals.compressions += 1

    def protected(self, positions: mx.array) -> mx.array:
        """Rows never evicted: the first ``sink`` tokens and the last ``window`` tokens."""
        return protected(positions, self.sink, self.window, self.offset)

    # ----------------------------------------------------------------- the protocol, with the policy's part
    def trim(self, n: int) -> int:
        n = super().trim(n)
        self.policy.trimmed(self)
        return n

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> CompressedKVCache:
        out = super().to_quantized(group_size, bits)
        if out is not self:
            out.policy = copy.copy(self.policy)
        return out

    @property
    def nbytes(self) -> int:
        return super().nbytes + self.policy.nbytes

    def _extra_state(self) -> tuple[Any, ...]:
        return self.policy.state(self)

    def _load_extra(self, extra: tuple[Any, ...], info: dict[str, Any]) -> None:
        self.policy.load(self, extra)
