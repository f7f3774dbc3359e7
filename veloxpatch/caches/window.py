"""Freeing what a sliding-window layer of mlx_lm's own can no longer see, once a prompt chunk has attended.

mlx_lm's ``RotatingKVCache`` keeps all ``max_size - 1 + n`` rows of a prompt chunk until the next step trims them:
between two chunks it holds twice its window (docs/results.md, "While a prompt is read"). After the chunk's
attention, its rows past the window are dropped here, in a copy (a slice would keep the buffer alive), leaving the
cache exactly as its next update would (mlx_lm's mask depends on ``offset`` alone).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx


def shed(cache: Any, out: mx.array) -> None:
    """Once the chunk's attention ``out`` is evaluated (lazy, it would keep the rows alive), drop the rows of a
    ``RotatingKVCache`` in temporal order that no later step attends; any other cache is left alone."""
    counters = [getattr(cache, name, None) for name in ("max_size", "keep", "_idx", "offset")]
    if not all(type(c) is int for c in counters) or not isinstance(getattr(cache, "keys", None), mx.array):
        return  # not one sequence's rotating cache (mlx_lm's batched one counts in arrays)
    rows = cache.keys.shape[2]
    if rows <= cache.max_size or cache._idx != rows or cache.offset < rows:
        return
    mx.eval(out)
    tail = cache.max_size - cache.keep

    def cut(v: mx.array) -> mx.array:
        return mx.concatenate([v[..., : cache.keep, :], v[..., rows - tail :, :]], axis=2)

    cache.keys, cache.values = cut(cache.keys), cut(cache.values)
    cache._idx = cache.max_size
    mx.eval(cache.keys, cache.values)
