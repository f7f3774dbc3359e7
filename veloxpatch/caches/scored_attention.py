"""Attention that also scores the rows it reads: a prompt's second reading (KVzip's rule, ``methods/quant.py``)
needs each query's output, to go on through the model, and the most attention any query pays each earlier row.

Queries go a block at a time (:func:`block_size`): a block's float32 logits over every row are what a second
reading holds beyond the model's own activations, so a longer prompt's blocks take fewer queries.

On mlx's CPU backend a block's cost is its exponentials, not its matmuls: mlx's ``exp`` is scalar, numpy's
vectorized (docs/results.md, "Prefill"), so there numpy (an mlx_lm dependency too) takes the softmax
(:func:`_host_block`). On a GPU, mlx computes the whole block.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np

from .masks import causal

QUERY_BLOCK = 64  # the most queries scored at once (fewer blocks: fewer calls)
SCORE_BYTES = 24 * 2**20  # the most a block's float32 logits take while QUERY_BLOCK queries or more remain to give
MIN_QUERIES = 16  # the fewest queries of a block, however many rows (fewer would cost more in calls than they save)


def block_size(q: mx.array, rows: int) -> int:
    """Queries per block for scaled queries ``q`` (B, heads, group, n, dim) over ``rows`` rows: :data:`QUERY_BLOCK`
    while their float32 logits fit :data:`SCORE_BYTES` (Qwen2.5-0.5B's 14 heads up to 7k rows), fewer beyond."""
    b, heads, group = q.shape[:3]
    return max(MIN_QUERIES, min(QUERY_BLOCK, SCORE_BYTES // (4 * b * heads * group * rows)))


def scored_attention(q: mx.array, keys: mx.array, values: mx.array, real: mx.array | None,
                     best: mx.array) -> tuple[mx.array, mx.array]:
    """Scaled queries ``q`` (B, heads, group, n, dim) of a chunk whose rows are the last n of ``keys`` and
    ``values`` (B, heads, rows, dim), over every row before them and their own up to each query; ``real``
    (B, heads, 1, 1, rows - n) marks the earlier rows that are not holes (None: all are); ``best`` (B, heads,
    scored) the scores so far of the first ``scored`` rows. The output (B, heads, group, n, dim, in ``values``'
    dtype) and ``best`` raised by the most attention each scored row got from a query of its head group."""
    size = block_size(q, keys.shape[2])
    if mx.default_device() != mx.cpu:
        return _blocks(mx, q, keys, values, real, best, size)
    on_host = (np.asarray(real) if real is not None else None, np.asarray(_float32(best)))
    out, found = _blocks(np, _float32(q), _float32(keys), _float32(values), *on_host, size)
    return mx.array(out).astype(values.dtype), mx.array(found)


def causal_on_host(queries: mx.array, keys: mx.array, values: mx.array, scale: float, size: int) -> mx.array:
    """Causal attention (the last rows the queries' own) by numpy's blocks of ``size`` queries, for a prompt
    chunk's attention on the CPU (``caches/blocks.py``): what a second reading does without the scores."""
    b, heads_q, n, dim = queries.shape
    heads = keys.shape[1]
    q = _float32((queries * scale).reshape(b, heads, heads_q // heads, n, dim))
    out, _ = _blocks(np, q, _float32(keys), _float32(values), None, np.zeros((b, heads, 0), np.float32), size)
    return mx.array(out).astype(values.dtype).reshape(b, heads_q, n, -1)


def _blocks(xp: Any, q: mx.array, keys: mx.array, values: mx.array, real: Any, best: Any, size: int) -> tuple[Any, Any]:
    """:func:`scored_attention` ``size`` queries at a time, each block by mlx (``xp`` mx: :func:`_block`) or on the
    CPU (``xp`` numpy: :func:`_host_block`, ``real``, ``best`` and the output numpy's arrays): the output and the
    scores (none where ``best`` has no column)."""
    attention: Callable[..., tuple[Any, Any]] = _block if xp is mx else _host_block
    n = q.shape[3]
    past = keys.shape[2] - n
    outs = []
    for at in range(0, n, size):
        block = q[..., at: at + size, :]
        out, probs = attention(block, keys, values, past, past + at + block.shape[3], real, best.shape[-1])
        if best.shape[-1]:
            best = xp.maximum(best, probs.max(axis=(2, 3)))
        del probs  # on the CPU a view of the block's logits buffer: freed before the next block's
        if xp is mx:
            out = out.astype(values.dtype)
            mx.eval(out, best)  # a block's float32 logits go before the next block's
        outs.append(out)
    return xp.concatenate(outs, axis=3), best


def _float32(x: mx.array) -> mx.array:
    """``x`` in float32, evaluated: the logits numpy takes the softmax of are as wide as the queries and keys (numpy
    has no bfloat16), and the scores numpy raises are read as they are."""
    x = x if x.dtype == mx.float32 else x.astype(mx.float32)
    mx.eval(x)
    return x


def _block(q: mx.array, keys: mx.array, values: mx.array, past: int, stop: int, real: mx.array | None,
           scored: int) -> tuple[mx.array, mx.array]:
    """A block of scaled queries ``q`` (B, h, group, m, d) over the rows before the chunk (all seen but the holes)
    and the chunk's own up to the block's last query (causal, ``past`` to ``stop``), by mlx under one float32
    softmax, the two parts multiplied apart (the long one needs no mask): the output, and the probabilities over
    the first ``scored`` rows."""
    m = q.shape[3]
    earlier = (keys[:, :, None, :past].swapaxes(-1, -2), values[:, :, None, :past])
    own = (keys[:, :, None, past:stop].swapaxes(-1, -2), values[:, :, None, past:stop])
    first = (q @ earlier[0]).astype(mx.float32)
    if real is not None:
        first = mx.where(real, first, -mx.inf)
    second = mx.where(causal(stop - past, m), (q @ own[0]).astype(mx.float32), -mx.inf)
    top = second.max(axis=-1, keepdims=True)  # finite: each query sees itself
    if first.shape[-1]:
        top = mx.maximum(top, first.max(axis=-1, keepdims=True))
    first, second = mx.exp(first - top), mx.exp(second - top)
    total = first.sum(axis=-1, keepdims=True) + second.sum(axis=-1, keepdims=True)
    out = (first.astype(earlier[1].dtype) @ earlier[1] + second.astype(own[1].dtype) @ own[1]) / total
    return out, first[..., :scored] / total


def _host_block(q: mx.array, keys: mx.array, values: mx.array, past: int, stop: int, real: np.ndarray | None,
                scored: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_block` on the CPU, float32: mlx multiplies the logits over every row the block sees into a buffer
    of its own (so its memory counts as mlx's), numpy takes their softmax in place in that buffer, then mlx
    multiplies it by the values (numpy multiplying would bring a second BLAS, slower here)."""
    b, heads, group, m, dim = q.shape
    logits = q.reshape(b, heads, group * m, dim) @ keys[:, :, :stop].swapaxes(-1, -2)
    mx.eval(logits)
    probs = np.asarray(logits).reshape(b, heads, group, m, stop)  # mlx's buffer, written in place
    if real is not None:
        np.copyto(probs[..., :past], -np.inf, where=~real)
    probs[..., past:][..., ~np.asarray(causal(stop - past, m))] = -np.inf
    top = probs.max(axis=-1, keepdims=True)  # finite: each query sees itself
    np.exp(np.subtract(probs, top, out=probs), out=probs)
    total = probs.sum(axis=-1, keepdims=True)
    out = (logits.reshape(b, heads, group, m, stop) @ values[:, :, None, :stop]) / mx.array(total)
    mx.eval(out)  # before the scores are normalized in the same buffer
    scores = probs[..., :scored]
    return np.asarray(out), np.divide(scores, total, out=scores)
