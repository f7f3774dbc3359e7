"""Query memory: the most recent real queries of a layer, and the attention they pay its rows.

Query-aware methods score rows by what the latest queries attend to (SnapKV's window, TOVA's newest query); the
tokens seen when the newest attended are kept too, so a row stored after them is never counted as seen. A memory of
every query (:data:`EVERY`) queues those a policy has not accounted yet (H2O's log).
"""

from __future__ import annotations

import mlx.core as mx

from .masks import visible

EVERY = 1 << 30  # a length to remember: every query until the memory is taken


class QueryMemory:
    """The last remembered queries (B, query_heads, w, head_dim), those of tokens ``end - w .. end - 1``."""

    def __init__(self, queries: mx.array | None = None, end: int = 0) -> None:
        self.queries = queries
        self.end = end

    @property
    def nbytes(self) -> int:
        return 0 if self.queries is None else self.queries.nbytes

    def remember(self, queries: mx.array, seen: int, length: int) -> None:
        """Keep a copy of the last ``length`` queries, the newest having attended after ``seen`` tokens: a copy (a slice
        keeps the chunk's alive), scheduled at once after a chunk (lazy, every layer's whole queries would stay alive
        until the forward's end). Queries of a different width (another space when decoding) start afresh."""
        if length == 0:
            return
        old = self.queries
        if old is not None and queries.shape[2] < length and old.shape[-1] == queries.shape[-1]:
            queries = mx.concatenate([old, queries], axis=2)
        self.queries = mx.contiguous(queries[..., -length:, :])
        self.end = seen
        if queries.shape[2] > length:
            mx.async_eval(self.queries)

    def trim(self, offset: int) -> None:
        """Forget the queries of tokens at ``offset`` or later (a trim back to that prefix)."""
        if self.queries is not None and self.end > offset:
            kept = self.queries.shape[2] - (self.end - offset)
            self.queries = self.queries[..., :kept, :] if kept > 0 else None
        self.end = min(self.end, offset)

    def attention(self, keys: mx.array, positions: mx.array, scale: float) -> mx.array:
        """Attention mass each row gets from the remembered queries, (B, kv_heads, rows), summed over queries and
        the query heads of each KV head. Rows stored since get nothing; with no query remembered (after a trim,
        or a cache rebuilt without them) the newest rows score highest."""
        if self.queries is None:
            return positions.astype(mx.float32)
        b, hq, w, d = self.queries.shape
        hkv = keys.shape[1]
        q = self.queries.astype(mx.float32).reshape(b, hkv, hq // hkv, w, d) * scale
        logits = q @ mx.expand_dims(keys.astype(mx.float32), 2).swapaxes(-1, -2)
        logits = mx.where(visible(positions, w, self.end)[:, :, None], logits, -mx.inf)
        return mx.softmax(logits, axis=-1).sum(axis=(2, 3))

