"""Attention of a long prompt chunk in blocks of queries, so its scores never take more than a bound.

On the CPU a step holds a (query heads x chunk x rows) float32 score matrix per layer (151 MB for a 512-token
chunk over 8k rows on SmolLM2-135M). Queries are independent, so a block at a time, each evaluated before the next,
gives the same output with at most ``SCORE_BYTES`` of scores alive (a block's least is ``MIN_BLOCK`` queries). There
a causal block's softmax is numpy's (:func:`.scored_attention.causal_on_host`; :mod:`.scored_attention` says why).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from .scored_attention import causal_on_host

# the most scores one block of queries may hold: mlx's CPU attention keeps about three arrays of that size alive
# (docs/results.md, "While a prompt is read")
SCORE_BYTES = 2 * 2**20
MIN_BLOCK = 32  # fewer queries at a time would cost more in calls than it saves


def attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any,
              sinks: mx.array | None) -> mx.array:
    """mlx's attention over rows whose last ``n`` are the step's own; ``mask``: None, ``"causal"`` or (..., n, rows)."""
    b, heads, n, _ = queries.shape
    rows = keys.shape[2]
    block = max(MIN_BLOCK, SCORE_BYTES // max(1, 4 * b * heads * rows))
    if block >= n:
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
    if isinstance(mask, str) and sinks is None and mx.default_device() == mx.cpu:
        return causal_on_host(queries, keys, values, scale, block)
    parts = []
    for start in range(0, n, block):
        stop = min(n, start + block)
        # "causal" is aligned to the last row: the block's queries see the rows up to their own
        seen = rows - n + stop if isinstance(mask, str) else rows
        # an array has one row per query (the block's are taken), or one row for every query (broadcast)
        part_mask = mask[..., start:stop, :] if isinstance(mask, mx.array) and mask.shape[-2] == n else mask
        part = mx.fast.scaled_dot_product_attention(queries[:, :, start:stop], keys[:, :, :seen],
                                                    values[:, :, :seen], scale=scale, mask=part_mask, sinks=sinks)
        mx.eval(part)  # left lazy, every block's scores would be alive at once
        parts.append(part)
    return mx.concatenate(parts, axis=2)
