"""Caches that keep at most a budget of rows per layer, chosen by a policy.

An :class:`EvictingCache` adds to the common cache (:mod:`.base`) a budget per layer, the compression schedule
(:mod:`.schedule`: when) and a :class:`Policy` (which rows). A method of this kind is a policy and, where needed, a
subclass that sets the layer's budget; SqueezeAttention takes any method's policy, as kvpress's wrapper presses do.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from dataclasses import fields, is_dataclass
from typing import Any, ClassVar

import mlx.core as mx

from .. import stats
from ..config import TierSize
from .allocation import layer_budgets
from .base import CompressedKVCache
from .masks import marked
from .queries import QueryMemory
from .schedule import Schedule
from .selection import best_rows
from .spec import CacheSpec
from .tier import Tier


class Policy(ABC):
    """Which rows an evicting cache keeps, and nothing else. One policy serves one cache, and a copy of the cache takes
    a shallow copy, so a policy replaces its state rather than changing it in place; per-row state is a row column of
    the store (:attr:`row_columns`). A method offered as a policy takes all its knobs in its policy's constructor
    (a dataclass's fields, :meth:`knob_values`)."""

    uses_queries: ClassVar[bool] = True  # the scores read the model's real queries
    remembers: ClassVar[int | None] = None  # recent queries its cache remembers (:mod:`.queries`); None: the window
    logs_queries: ClassVar[bool] = False  # it queues queries in the cache's log (every query, :data:`.queries.EVERY`)
    row_columns: ClassVar[tuple[str, ...]] = ()  # float32 per-row state, by name: row columns of the store

    def knob_values(self) -> dict[str, Any]:
        """The policy's knobs, saved with its cache: a dataclass policy's constructor fields (its knobs)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.init} if is_dataclass(self) else {}

    @abstractmethod
    def score(self, cache: EvictingCache, keys: mx.array, positions: mx.array, scale: float) -> mx.array:
        """Importance of each stored row, (B, kv_heads, rows); higher is kept. ``positions``: -1 is a hole."""

    def select(self, cache: EvictingCache, keep: int, scale: float, kept: mx.array | None = None) -> mx.array:
        """Row indexes to keep, ascending: the best by :meth:`score`, always the protected rows or those ``kept`` marks
        (a capped tier takes the best of the rows the store drops)."""
        keys, _ = cache.store.fetch()
        positions = cache.store.row_positions()
        anyway = cache.protected(positions) if kept is None else kept
        return best_rows(self.score(cache, keys, positions, scale), positions, anyway, keep)

    def observe(self, cache: EvictingCache, queries: mx.array, keys: mx.array, scale: float) -> None:
        """Every step's real queries and the keys they attended, before the step compresses."""

    def catch_up(self, cache: EvictingCache) -> None:
        """Bring the row columns up to date with every query observed, before they are saved or merged."""


def remembered(policy: Policy, window: int) -> int:
    """How many recent queries a cache with ``policy`` remembers (its own number, else the window)."""
    if not policy.uses_queries:
        return 0
    return window if policy.remembers is None else policy.remembers


def queries_held(policy: Policy, window: int) -> int:
    """The most queries a cache with ``policy`` holds between steps (``VELOX_KV_MEMORY`` counts them)."""
    return Schedule.max_headroom + 1 if policy.logs_queries else remembered(policy, window)


def row_bytes_per_head(policy: Policy) -> int:
    """Bytes a cache with ``policy`` keeps per stored row and KV head besides the row (its float32 row columns)."""
    return 4 * len(policy.row_columns)


class Snapshot:
    """An evicting cache as its last prompt left it (after the first decode-sized step that follows it). It shares
    the cache's arrays (a store writes in place only past its rows, a compaction makes new ones), so it costs
    nothing until decoding compacts. The server deep-copies a cached prompt before trimming it, so it stays whole."""

    def __init__(self, cache: EvictingCache) -> None:
        self.offset, self.evicted = cache.offset, cache.evicted
        self.store, self.memory, self.policy = copy.copy(cache.store), copy.copy(cache.memory), copy.copy(cache.policy)
        self.log = copy.copy(cache.log)

    def restore(self, cache: EvictingCache) -> None:
        """Put the cache back as the prompt left it; the snapshot is used up (they share arrays again). A tier is
        rebuilt as the prompt left it rather than copied (it is most of what a cache holds): without a memory target
        nothing seen since is lost, only moved, so it is every row held now from before the prompt's end that the
        snapshot's store does not hold (rows of the store now are tiered again)."""
        if cache.tier is not None:
            kept = self.store.row_positions()
            seen = marked((*kept.shape[:2], self.offset + 1), mx.where(kept < 0, self.offset, kept))

            def then(positions: mx.array) -> mx.array:  # the positions of rows the prompt's tier held; -1 elsewhere
                inside = (positions >= 0) & (positions < self.offset)
                stored = mx.take_along_axis(seen, mx.where(inside, positions, self.offset), axis=-1)
                return mx.where(inside & ~stored, positions, -1)

            tier = Tier(cache.tier.bits)
            if cache.tier.rows:
                keys, values, positions = cache.tier.store.state
                tier.load((keys, values, then(positions)), cache.tier.store.group_size)
                tier.store.columns = cache.tier.store.columns
            if cache.store.rows:
                tier.take(*cache.store.fetch(), then(cache.store.row_positions()), cache.store.full_columns())
            cache.tier = tier
        cache.offset, cache.evicted = self.offset, self.evicted
        cache.store, cache.memory, cache.policy, cache.log = self.store, self.memory, self.policy, self.log
        cache.snapshot = None

    def nbytes(self, cache: EvictingCache) -> int:
        """Bytes it holds that the cache does not (its queries, rows and log once the cache has moved past them)."""
        held = 0 if self.memory.queries is cache.memory.queries else self.memory.nbytes
        if self.store.keys is not cache.store.keys:
            held += self.store.nbytes + self.log.nbytes
        return held


class EvictingCache(CompressedKVCache):
    """A per-layer cache of at most its budget (plus headroom) of rows, chosen by ``policy_class`` (the knobs')."""

    policy_class: ClassVar[type[Policy]]
    bounds_memory = True

    def __init__(self, spec: CacheSpec, **knobs: Any) -> None:
        super().__init__(spec)
        self.policy = self.make_policy(**knobs)
        self.uses_queries = self.policy.uses_queries
        self.store.columns = dict.fromkeys(self.policy.row_columns)
        self.log = QueryMemory()  # queries the policy has not accounted yet (``logs_queries``)
        self.tier = Tier(spec.tier) if spec.tier else None  # where dropped rows go (VELOX_TIER), or None: lost
        self.tier_size = spec.tier_size  # the most rows the tier holds (VELOX_TIER_SIZE)
        self.memory_plan = spec.memory_plan  # VELOX_KV_MEMORY as rows per layer, or None
        self.scale = 1.0  # the attention's scale, seen at every step (a capped tier ranks what it takes by score)
        self.took_back = False  # this step took the tier's rows back into the store (evaluated after it)
        self.prompt_open = False  # a prompt chunk came since the last decode-sized step
        self.snapshot: Snapshot | None = None  # this cache as its last prompt left it (restored by a trim back into it)

    def make_policy(self, **knobs: Any) -> Policy:
        """The policy picking this cache's rows, from the method's knobs."""
        return self.policy_class(**knobs)

    def knob_values(self) -> dict[str, Any]:
        return self.policy.knob_values()

    # ----------------------------------------------------------------- what a method may set
    def target(self) -> int:
        """Rows to keep now: the budget (this layer's part of the list's, where :meth:`layer_weights` moves it between
        layers), but never fewer than the protected sink + window."""
        budget, floor = self.budget_rows(), self.sink + self.window
        weighted = self.layer_weights()
        if weighted is None:
            return max(budget, floor)
        weights, index = weighted
        return layer_budgets(weights, budget, floor, self.offset)[index]

    def layer_weights(self) -> tuple[tuple[float, ...], int] | None:
        """Each layer's weight (mean 1) in the budget above sink + window, and this layer's index; None: the plain
        budget (:func:`.allocation.layer_budgets`)."""
        return None

    def budget_rows(self) -> int:
        """The budget's rows after the tokens seen, or ``VELOX_KV_MEMORY``'s where that is stricter."""
        rows = self.budget.resolve(self.offset)
        return rows if self.memory_plan is None else min(rows, self.memory_plan.keep_cap(self.batch))

    @property
    def batch(self) -> int:
        """Sequences in this cache (1 before the first step)."""
        return 1 if self.store.keys is None else self.store.keys[0].shape[0]

    def _over_limit(self, chunk: bool, keep: int) -> int | None:
        """After a prompt chunk left uncompressed: the rows to compress to where ``VELOX_KV_MEMORY`` is passed."""
        if self.memory_plan is None or not chunk:
            return None
        rows = max(self.memory_plan.keep_cap(self.batch), keep)
        return rows if self.store.rows > rows else None

    def observe(self, queries: mx.array, keys: mx.array, scale: float) -> None:
        """:meth:`Policy.observe`, which a kind of cache may extend."""
        self.policy.observe(self, queries, keys, scale)

    # ----------------------------------------------------------------- the tier
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Store and fetch the step's rows, after the tier's where it takes them back (:meth:`_takes_back`): it
        attends over the whole context, and the compression after it chooses among every row."""
        self.took_back = self._takes_back(keys.shape[2])
        if self.took_back:
            self._take_back(keys, values)
        return super().update_and_fetch(keys, values)

    def rows_before(self, n: int) -> int:
        """The stored rows, and the tier's where the step takes them back (a model applying the mask it asked for
        itself, as multi-head latent attention does, needs it as wide as the keys)."""
        return self.size() + (self.tier.rows if self.tier is not None and self._takes_back(n) else 0)

    def _takes_back(self, n: int) -> bool:
        """Whether a step of ``n`` tokens, not stored yet, takes the tier's rows back: it has some, and the step is a
        prompt chunk or arrives over a pending prompt."""
        if self.tier is None or not self.tier.rows:
            return False
        self.offset += n
        try:
            keep = self.target()
            return self._prompt_chunk(n, keep) or self.schedule.pending(self.store.rows + n, n, keep)
        finally:
            self.offset -= n

    def _prompt_chunk(self, n: int, keep: int) -> bool:
        """Whether the step is longer than the headroom, or before the end of an announced prompt."""
        return n > self.schedule.headroom(keep) or self.before_prompt_end(0)

    def _take_back(self, keys: mx.array, values: mx.array) -> None:
        """The tier's rows back into the store in time order, with room for the step's rows, evaluated first (lazy, the
        forward so far would be computed on top of the whole context); not across ranks, where receiving the previous
        rank's send before a coordinator's collectives would deadlock them."""
        assert self.tier is not None, "taken back from a tier with rows"
        if self.coordinator is None or not self.coordinator.span.split:
            mx.eval(keys, values)
        rows = self.tier.drain()
        self.policy.catch_up(self)
        self.store.take_in(rows, spare=keys.shape[2])

    # ----------------------------------------------------------------- the attention route
    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any = None,
               sinks: mx.array | None = None) -> mx.array:
        """Attention of this step, then compress if due (:class:`.schedule.Schedule`). A decode-sized step over a
        pending prompt compresses it first: its keys were fetched before, so the rows about to go are masked."""
        n = queries.shape[2]
        self.scale = scale
        keep = self.target()
        chunk = self._prompt_chunk(n, keep)
        pending = not chunk and self.schedule.pending(self.store.rows, n, keep)
        kept = self.policy.select(self, keep, scale) if pending else None
        out = self._attention(queries, keys, values, scale, mask, sinks, kept)
        self.observe(queries, keys, scale)
        self.memory.remember(queries, self.offset, remembered(self.policy, self.window))
        if kept is not None:
            self.keep_rows(kept)
        elif self.schedule.due(self.store.rows, keep, chunk):
            self.compress(keep, scale)
        elif (capped := self._over_limit(chunk, keep)) is not None:
            self.compress(capped, scale)
        if self.took_back:
            self._evaluate_kept(out)
        if chunk:
            self.prompt_open = True
        elif self._prompt_read() or self.prompt_open:  # the announced end asked first, so it is forgotten once read
            self.prompt_open = False  # (under VELOX_KV_MEMORY the target wins: no snapshot, whose queries it skips)
            self.snapshot = None if self.memory_plan is not None else Snapshot(self)
        return out

    def _prompt_read(self) -> bool:
        """Whether this step read the last token of the prompt :meth:`expect_prompt` announced (said once)."""
        read = self.prompt_end is not None and self.offset >= self.prompt_end
        if read:
            self.prompt_end = None
        return read

    def _evaluate_kept(self, out: mx.array) -> None:
        """After a step that took the tier back: evaluate what this layer keeps, so the whole context at full
        precision is freed before the next layer takes its own back (else every layer's would be alive at once)."""
        self.took_back = False
        assert self.tier is not None, "after a step that took the tier back"
        mx.eval(out, [(s.keys, s.values, s.positions) for s in (self.store, self.tier.store)])

    # ----------------------------------------------------------------- selection and compaction
    def compress(self, keep: int, scale: float) -> None:
        """Keep the policy's choice of ``keep`` rows per KV head."""
        self.keep_rows(self.policy.select(self, keep, scale))

    def keep_rows(self, index: mx.array) -> None:
        """Compact storage to the rows ``index`` (B, kv_heads, keep), ascending; the rows that go go to the tier."""
        if self.tier is not None:
            self._to_tier(index)
        keep = index.shape[-1]
        self.evicted = self.evicted or keep < self.store.rows
        self.store.keep(index, self.schedule.headroom(keep))
        stats.count(self, "compressions")

    def _to_tier(self, index: mx.array) -> None:
        """Hand the rows not in ``index`` to the tier, the policy's best where they do not all fit."""
        assert self.tier is not None, "called with a tier only"
        positions = self.store.row_positions()
        keys, values = self.store.fetch()
        kept = marked(positions.shape, index)
        dropped = self.store.rows - index.shape[-1]
        # the most rows the tier may hold: VELOX_KV_MEMORY's share at the mean budget (by each layer's own, the tiers
        # would take the bytes a smaller budget frees in every layer at once), else the bytes of VELOX_TIER_SIZE
        # budgets of the rows kept, or every row
        if self.memory_plan is not None:
            most = self.memory_plan.tier_rows(self.budget_rows(), self.batch)
        else:
            rows = self.tier_size.rows(index.shape[-1])
            most = self.offset if rows is None else self.tier.rows_like(rows, keys)
        room = min(dropped, most - self.tier.rows)
        if 0 < room < dropped:
            kept = kept | ~marked(positions.shape, self.policy.select(self, index.shape[-1] + room, self.scale, kept))
        gone = mx.argsort(kept.astype(mx.int32), axis=-1)[..., : max(room, 0)]
        if gone.shape[-1]:
            self.tier.take(keys, values, mx.take_along_axis(positions, gone, axis=-1),
                           self.store.full_columns(gone), index=gone)

    def protected(self, positions: mx.array) -> mx.array:
        """Rows never evicted: the first ``sink`` tokens and the last ``window`` tokens (holes never)."""
        return (positions >= 0) & ((positions < self.sink) | (positions >= self.offset - self.window))

    # ----------------------------------------------------------------- the protocol, with the policy's part
    def cut_to(self, prefix: int) -> None:
        """A trim back into the last prompt starts from its :class:`Snapshot`, so the server's prompt-cache reuse
        answers a repeated request as it answered the first time."""
        if self.snapshot is not None and prefix < self.snapshot.offset:
            self.snapshot.restore(self)
        super().cut_to(prefix)
        self.log.trim(prefix)
        if self.tier is not None:
            self.tier.store.trim_to(prefix)

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> EvictingCache:
        """The base's quantized copy (the tier keeps its own format), with a policy, log and tier of its own."""
        out = super().to_quantized(group_size, bits)
        if out is not self:
            out.policy, out.tier, out.snapshot = copy.copy(self.policy), copy.deepcopy(self.tier), None
            out.log = copy.copy(self.log)
        return out

    @property
    def nbytes(self) -> int:
        held = 0 if self.snapshot is None else self.snapshot.nbytes(self)
        return super().nbytes + self.log.nbytes + (0 if self.tier is None else self.tier.store.nbytes) + held

    def _meta(self) -> dict[str, Any]:
        if self.tier is None:
            return super()._meta()
        return {**super()._meta(), "tier_bits": self.tier.bits, "tier_group": self.tier.store.group_size,
                "tier_size": str(self.tier_size)}

    def _extra_state(self) -> tuple[Any, ...]:
        """The row columns (None for an empty cache), then the tier's rows (None while it is empty)."""
        self.policy.catch_up(self)
        columns = tuple(None if self.empty() else self.store.column(name) for name in self.policy.row_columns)
        return columns if self.tier is None else (*columns, self.tier.state)

    def _load_extra(self, extra: tuple[Any, ...], info: dict[str, Any]) -> None:
        """The row columns and the tier's rows; a cache rebuilt from the base layout alone (a batch's) starts empty."""
        names = self.policy.row_columns
        if "tier_bits" in info:
            self.tier, self.tier_size = Tier(info["tier_bits"]), TierSize.parse(info.get("tier_size", "all"))
            if extra:
                self.tier.load(extra[-1], info["tier_group"], names)
                extra = extra[:-1]
        self.store.columns = {name: extra[i] if i < len(extra) else None for i, name in enumerate(names)}
