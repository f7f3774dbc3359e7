"""ChunkKV (Liu et al., arXiv 2502.00299): keep whole chunks of consecutive tokens, not single tokens.

A token's meaning lives in its neighbours, so a row kept without the rows around it is worth little. ChunkKV scores
rows as SnapKV does (the attention the last ``VELOX_WINDOW`` queries pay them, summed over the query heads of each KV
head) and keeps whole the *chunks* of ``VELOX_CHUNKKV_CHUNK`` consecutive tokens (the paper's 10) with the most summed
score. Neighbouring layers then keep very similar positions, so with ``VELOX_CHUNKKV_REUSE=N`` (the paper's
*layer-wise index reuse*) the first layer of each block of N publishes the positions it keeps, and the others keep
those rows without scoring. Deviations from the paper, and why:

* Chunks are fixed by token position (``position // chunk``), not by row index: after evictions the stored rows are
  no longer contiguous, and positions keep a chunk the same across compressions, trims and layers.
* The sink and the recent window are kept anyway and add nothing to a chunk's score, so the window's attention to
  itself does not promote the chunk it starts in.
* The budget counts rows, not chunks: the chunk the budget cuts keeps its earliest rows, so every head keeps
  exactly the budget, as every cache here does.
* Selection is per KV head, as SnapKV's (kvpress's port shares one choice per layer): chunk size 1 is exactly SnapKV
  without pooling, and GQA heads keep what their own queries need.
* Reuse applies during decode too (the paper compresses once); a follower with no usable publication in its forward
  selects on its own, said once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import mlx.core as mx

from ..caches.evicting import EvictingCache, Policy
from ..log import once
from ..registry import method
from ..settings import Setting, int_range

KNOBS = (
    Setting("VELOX_CHUNKKV_CHUNK", int_range(1, 1024), "10", "an integer in [1, 1024]",
            "ChunkKV: tokens per chunk; chunks are kept or evicted whole."),
    Setting("VELOX_CHUNKKV_REUSE", int_range(1, 1024), "1", "an integer in [1, 1024]",
            "ChunkKV: layers per index-reuse block; the block's first layer chooses the positions all of "
            "them keep (1: every layer chooses)."),
)

HOLE_LAST = 2**30


def keep_order(scores: mx.array, positions: mx.array, protected: mx.array, chunk: int, seen: int) -> mx.array:
    """(B, H, rows) int32 sort key, rows kept lowest first: protected rows, then the chunks by score, each
    chunk's earlier positions first, holes last. ``seen`` (the tokens seen) bounds the chunk ids."""
    b, h, rows = scores.shape
    valid = positions >= 0
    ids = mx.where(valid, positions // chunk, 0)
    chunks = seen // chunk + 1
    mass = mx.where(valid & ~protected, scores, 0.0)
    slots = (mx.arange(b * h, dtype=mx.int32).reshape(b, h, 1) * chunks + ids).reshape(-1)
    totals = mx.zeros((b * h * chunks,), mx.float32).at[slots].add(mass.reshape(-1)).reshape(b, h, chunks)
    rank = mx.argsort(mx.argsort(-totals, axis=-1), axis=-1).astype(mx.int32)
    key = mx.take_along_axis(rank, ids, axis=-1) * chunk + mx.where(valid, positions % chunk, 0)
    key = mx.where(protected, -1, key)
    return mx.where(valid, key, HOLE_LAST)


KEPT, TIER = "kept", "tier"  # what a leader's published choice is: its store's rows, or those and its tier's


def topic(layer: int, block: int, what: str = KEPT) -> tuple[str, int, int]:
    """The name a leader publishes its block's choice under within a forward (:meth:`Coordinator.publish`), the
    block being layers ``block * k .. block * k + block - 1``; ``what``: ``KEPT`` or ``TIER``."""
    return (f"chunkkv {what} positions", block, layer // block)


@dataclass(eq=False)
class ChunkKV(Policy):
    """Keeps the chunks of consecutive tokens the recent queries attend to most (leaders choosing for their block)."""

    chunk: int = 10
    reuse: int = 1

    def score(self, cache: EvictingCache, keys: mx.array, positions: mx.array, scale: float) -> mx.array:
        """Window attention per row; protected rows score nothing."""
        scores = cache.memory.attention(keys, positions, scale)
        return mx.where(cache.protected(positions), 0.0, scores)

    def select(self, cache: EvictingCache, keep: int, scale: float, kept: mx.array | None = None) -> mx.array:
        """A follower applies its leader's choice when it can; a leader publishes its own. The tier's choice (``kept``
        given) is shared the same way, so a follower can follow its leader when a prompt takes those rows back."""
        what = KEPT if kept is None else TIER
        if self.reuse > 1 and cache.layer % self.reuse != 0:  # a follower
            rows = self._leaders_rows(cache, keep, what)
            return rows if rows is not None else self.choose(cache, keep, scale)
        index = self.choose(cache, keep, scale)
        if self.reuse > 1 and cache.coordinator is not None:
            positions = mx.take_along_axis(cache.store.row_positions(), index, axis=-1)
            cache.coordinator.publish(topic(cache.layer, self.reuse, what), positions)
        return index

    def choose(self, cache: EvictingCache, keep: int, scale: float) -> mx.array:
        """The layer's own choice, (B, kv_heads, keep) ascending: the best whole chunks per head."""
        keys, _ = cache.store.fetch()
        positions = cache.store.row_positions()
        scores = self.score(cache, keys, positions, scale).astype(mx.float32)
        order = keep_order(scores, positions, cache.protected(positions), self.chunk, cache.offset)
        return mx.sort(mx.argpartition(order, kth=keep - 1, axis=-1)[..., :keep], axis=-1)

    def _leaders_rows(self, cache: EvictingCache, keep: int, what: str) -> mx.array | None:
        """The rows holding the positions this block's leader chose in this forward, or None (said once)."""
        chosen = None if cache.coordinator is None else cache.coordinator.latest(topic(cache.layer, self.reuse, what))
        positions = cache.store.row_positions()
        if chosen is None:
            reason = "its leader layer did not compress in this forward"
        elif tuple(chosen.shape) != (*positions.shape[:2], keep):
            reason = "its leader's choice has another shape (batch, KV heads or budget differ)"
        elif not bool(((rows := rows_of(positions, chosen, cache.offset)) >= 0).all().item()):
            reason = "its leader kept positions it does not hold"
        else:
            return rows
        once(f"chunkkv reuse: {reason}", logging.INFO,
             f"chunkkv: a follower layer chose its own chunks because {reason} (said once)")
        return None


def rows_of(positions: mx.array, wanted: mx.array, seen: int) -> mx.array:
    """Rows holding the positions ``wanted`` (B, H, k), ascending, by a lookup table by position (``seen``: the
    tokens seen); -1 where ``positions`` (B, H, rows) has none. Holes the leader kept (a trim left fewer rows than
    the budget) take the follower's own, the j-th wanted the j-th hole row, so the two layers stay alike."""
    b, h, rows = positions.shape
    index = mx.broadcast_to(mx.arange(rows, dtype=mx.int32), (b, h, rows))
    table = mx.full((b, h, seen + 1), -1, mx.int32)
    table = mx.put_along_axis(table, mx.where(positions >= 0, positions, seen), index, axis=-1)
    found = mx.take_along_axis(table, mx.where((wanted >= 0) & (wanted < seen), wanted, seen), axis=-1)
    hole = wanted < 0
    nth = mx.cumsum(hole.astype(mx.int32), axis=-1) - 1
    holes = mx.argsort(mx.where(positions < 0, index, rows + index), axis=-1).astype(mx.int32)
    own_hole = mx.take_along_axis(holes, mx.clip(nth, 0, rows - 1), axis=-1)
    enough = nth < (positions < 0).sum(axis=-1, keepdims=True)
    return mx.sort(mx.where(hole, mx.where(enough, own_hole, -1), found), axis=-1)


@method("chunkkv", "Window attention summed over chunks of consecutive tokens; whole chunks kept, per KV head.",
        KNOBS)
class ChunkKVCache(EvictingCache):
    """ChunkKV's cache: whole chunks kept (:class:`ChunkKV`); its list's coordinator carries the leaders' choices."""

    policy_class = ChunkKV
