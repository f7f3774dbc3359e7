"""The second reading's attention (``veloxpatch.caches.scored_attention``): its output and scores against a plain
softmax over every row a query sees, on the CPU (numpy's blocks) and by mlx's blocks (what a GPU runs), with holes
among the earlier rows, a first chunk with none before it, and half-precision inputs."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from veloxpatch.caches import scored_attention as scoring

B, HEADS, GROUP, DIM = 1, 2, 3, 16


def reference(q: mx.array, keys: mx.array, values: mx.array, real: mx.array | None,
              best: mx.array) -> tuple[np.ndarray, np.ndarray]:
    """One float64 softmax per query over the earlier rows that are not holes and the chunk's rows up to its own."""
    qs, ks, vs = (np.asarray(x.astype(mx.float32), dtype=np.float64) for x in (q, keys, values))
    n, rows = qs.shape[3], ks.shape[2]
    past = rows - n
    seen = np.arange(rows)[None] <= past + np.arange(n)[:, None]  # (n, rows)
    if real is not None:
        earlier = np.broadcast_to(np.asarray(real), (B, HEADS, 1, n, past))
        seen = seen & np.concatenate([earlier, np.ones((B, HEADS, 1, n, n), bool)], axis=-1)
    logits = np.where(seen, qs @ ks[:, :, None].swapaxes(-1, -2), -np.inf)
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    scored = best.shape[-1]
    return probs @ vs[:, :, None], np.maximum(np.asarray(best), probs[..., :scored].max(axis=(2, 3)))


def inputs(past: int, n: int, dtype: mx.Dtype, holes: bool) -> tuple[mx.array, ...]:
    mx.random.seed(past * 31 + n)
    q = mx.random.normal((B, HEADS, GROUP, n, DIM)).astype(dtype)
    keys, values = (mx.random.normal((B, HEADS, past + n, DIM)).astype(dtype) for _ in range(2))
    real = mx.random.uniform(shape=(B, HEADS, 1, 1, past)) > 0.3 if holes else None
    best = mx.random.uniform(shape=(B, HEADS, past // 2)) * 0.01  # scores left by an earlier chunk
    return q, keys, values, real, best


@pytest.mark.parametrize(("past", "n", "dtype", "holes"), [
    (150, 100, mx.float32, False),  # two blocks of queries, the second short
    (150, 100, mx.float32, True),
    (0, 70, mx.float32, False),  # the prompt's first chunk: nothing before it
    (90, 40, mx.float16, True),
])
def test_the_output_and_scores_are_a_plain_softmaxs_on_either_backend(past, n, dtype, holes, monkeypatch) -> None:
    monkeypatch.setattr(scoring, "QUERY_BLOCK", 64)  # two blocks of queries where n > 64
    q, keys, values, real, best = inputs(past, n, dtype, holes)
    want_out, want_best = reference(q, keys, values, real, best)
    tolerance = 1e-5 if dtype == mx.float32 else 2e-3
    on_cpu = scoring.scored_attention(q, keys, values, real, best)  # the suite runs on mlx's CPU: numpy's blocks
    by_mlx = scoring._blocks(mx, q, keys, values, real, best, scoring.QUERY_BLOCK)
    for out, scores in (on_cpu, by_mlx):
        assert out.dtype == dtype and out.shape == (B, HEADS, GROUP, n, DIM)
        np.testing.assert_allclose(np.asarray(out.astype(mx.float32)), want_out, atol=tolerance * 10)
        np.testing.assert_allclose(np.asarray(scores), want_best, atol=tolerance)
    if past:
        assert float(mx.max(on_cpu[1] - best)) > 0.01, "the chunk's queries raised some row's score"


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_a_long_prompt_chunks_attention_on_the_cpu_is_mlxs_own(dtype, monkeypatch) -> None:
    """``caches/blocks.py`` hands a causal chunk too long for one block to numpy on the CPU: the same output as
    mlx's attention over the whole chunk at once (grouped query heads, rows before the chunk)."""
    from veloxpatch.caches import blocks

    calls = []
    monkeypatch.setattr(blocks, "causal_on_host", lambda *a: calls.append(a) or scoring.causal_on_host(*a))
    monkeypatch.setattr(blocks, "SCORE_BYTES", 4 * 6 * 300 * 40)  # 40 queries a block
    mx.random.seed(3)
    queries = mx.random.normal((1, 6, 100, 16)).astype(dtype)
    keys, values = (mx.random.normal((1, 2, 300, 16)).astype(dtype) for _ in range(2))
    got = blocks.attention(queries, keys, values, 0.25, "causal", None)
    want = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.25, mask="causal")
    assert len(calls) == 1 and calls[0][-1] == 40
    assert got.dtype == dtype and got.shape == want.shape
    tolerance = 1e-5 if dtype == mx.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got.astype(mx.float32)), np.asarray(want.astype(mx.float32)),
                               atol=tolerance)


def test_a_long_prompts_blocks_take_fewer_queries_so_their_scores_stay_bounded() -> None:
    """Memory as mlx counts it: over 16k rows a block of 64 queries of 14 heads would hold 59 MB of float32 logits;
    blocks of fewer queries keep the second reading's extra memory near :data:`SCORE_BYTES` (the scores as wanted)."""
    mx.random.seed(5)
    q = mx.random.normal((1, 2, 7, 96, 64)) * 0.1
    keys, values = (mx.random.normal((1, 2, 16384, 64)) for _ in range(2))
    best = mx.zeros((1, 2, 16288))
    mx.eval(q, keys, values, best)
    assert scoring.block_size(q, 16384) == 27  # 24 MiB / (4 x 14 x 16384)
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    out, scores = scoring.scored_attention(q, keys, values, None, best)
    mx.eval(out, scores)
    extra = mx.get_peak_memory() - before
    assert extra < scoring.SCORE_BYTES + 20 * 2**20, extra  # a block's logits, the inputs in float32 on the host
    want_out, want_best = reference(q, keys, values, None, best)
    np.testing.assert_allclose(np.asarray(out), want_out, atol=1e-4)
    np.testing.assert_allclose(np.asarray(scores), want_best, atol=1e-5)
