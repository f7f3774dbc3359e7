"""Which rows a compression keeps, per KV head: the protected ones (:meth:`.evicting.EvictingCache.protected`: the
attention sinks and the recent window) whatever their scores, then the best by score; holes (position -1) go first.
"""

from __future__ import annotations

import mlx.core as mx


def best_rows(scores: mx.array, positions: mx.array, kept_anyway: mx.array, keep: int) -> mx.array:
    """Row indexes to keep, ascending per head: the best by ``scores``, ``kept_anyway`` always, holes never."""
    scores = mx.where(kept_anyway, mx.inf, scores.astype(mx.float32))
    scores = mx.where(positions < 0, -mx.inf, scores)
    order = mx.argpartition(-scores, kth=keep - 1, axis=-1)[..., :keep]
    return mx.sort(order, axis=-1)


def pool_rows(scores: mx.array, kernel: int, kind: str) -> mx.array:
    """Same-size 1-D pooling of (..., rows) scores along rows."""
    if kernel == 1:
        return scores
    half = kernel // 2
    rows = scores.shape[-1]
    widths = [(0, 0)] * (scores.ndim - 1) + [(half, half)]
    if kind == "max":
        padded = mx.pad(scores, widths, constant_values=-mx.inf)
        windows = mx.stack([padded[..., i : i + rows] for i in range(kernel)])
        return windows.max(axis=0)
    padded = mx.pad(scores, widths)
    csum = mx.cumsum(padded, axis=-1)
    csum = mx.pad(csum, [(0, 0)] * (scores.ndim - 1) + [(1, 0)])
    return (csum[..., kernel : kernel + rows] - csum[..., :rows]) / kernel
