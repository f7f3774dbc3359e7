"""Compression is correct under any chunking of the context (property-based)."""

from __future__ import annotations

import mlx.core as mx
from hypothesis import given, settings
from hypothesis import strategies as st

from veloxpatch.caches import CacheSpec
from veloxpatch.config import Budget
from veloxpatch.methods.snapkv import SnapKVCache
from veloxpatch.methods.streamingllm import StreamingLLMCache

HEADS, KV_HEADS, DIM = 4, 2, 8

chunkings = st.lists(st.integers(min_value=1, max_value=40), min_size=1, max_size=12)


def feed(cache, chunks: list[int], seed: int) -> mx.array:
    """Run the real update + attend path; values carry each row's position in channel 0.

    Returns the positions of the rows left, (B, kv_heads, rows).
    """
    key = mx.random.key(seed)
    seen = cache.offset
    for n in chunks:
        key, k1, k2 = mx.random.split(key, 3)
        position = mx.broadcast_to(mx.arange(seen, seen + n, dtype=mx.float32)[:, None], (2, KV_HEADS, n, DIM))
        keys = mx.random.normal((2, KV_HEADS, n, DIM), key=k1)
        queries = mx.random.normal((2, HEADS, n, DIM), key=k2)
        k, v = cache.update_and_fetch(keys, position)
        cache.attend(queries, k, v, scale=0.3)
        seen += n
        assert cache.offset == seen
        keep = cache.target()
        if n > cache.schedule.headroom(keep) and cache.schedule.mode == "chunk":
            assert cache.size() <= keep, "a prefill chunk always ends within the budget"
        if cache.schedule.mode == "chunk":
            assert cache.size() < max(keep + cache.schedule.headroom(keep), n + keep), "small steps use the headroom"
    return cache.values[..., : cache.size(), 0].astype(mx.int32)


@settings(max_examples=40, deadline=None)
@given(chunks=chunkings, budget=st.integers(min_value=6, max_value=50), seed=st.integers(0, 1000))
def test_snapkv_keeps_sinks_recent_window_and_time_order(chunks: list[int], budget: int, seed: int) -> None:
    cache = SnapKVCache(CacheSpec(Budget(tokens=budget), mode="chunk", sink=2, window=4), kernel=3)
    kept = feed(cache, chunks, seed)
    total = sum(chunks)
    assert cache.size() <= min(budget + cache.schedule.headroom(budget), total)
    if cache.size() > 1:
        assert (kept[..., 1:] > kept[..., :-1]).all().item(), "rows stay in temporal order, none twice"
    must = sorted(set(range(min(2, total))) | set(range(max(total - 4, 0), total)))
    for p in must:
        assert (kept == p).any(axis=-1).all().item(), f"position {p} (sink or recent window) was evicted"


@settings(max_examples=40, deadline=None)
@given(chunks=chunkings, budget=st.integers(min_value=5, max_value=50), seed=st.integers(0, 1000))
def test_streamingllm_is_sinks_plus_a_recent_run_under_any_chunking(chunks: list[int], budget: int, seed: int) -> None:
    cache = StreamingLLMCache(CacheSpec(Budget(tokens=budget), mode="chunk", sink=1, window=4))
    kept = feed(cache, chunks, seed)
    total, rows = sum(chunks), cache.size()
    expected = (list(range(min(1, rows))) + list(range(total - (rows - 1), total)) if rows < total
                else list(range(total)))
    assert kept[0, 0].tolist() == expected
    assert (kept == kept[:1, :1]).all().item(), "every batch row and head keeps the same positions"


@settings(max_examples=30, deadline=None)
@given(chunks=st.lists(st.integers(min_value=9, max_value=40), min_size=1, max_size=8),
       budget=st.integers(min_value=6, max_value=50), seed=st.integers(0, 1000))
def test_end_mode_keeps_the_prompt_whole_until_a_decode_step(chunks: list[int], budget: int, seed: int) -> None:
    """Prompt chunks (more tokens than the headroom of 8) never compress; the first decode step does."""
    cache = SnapKVCache(CacheSpec(Budget(tokens=budget), sink=2, window=4, mode="end"), kernel=3)
    kept = feed(cache, chunks, seed)
    total = sum(chunks)
    assert cache.size() == total and kept[0, 0].tolist() == list(range(total))
    kept = feed(cache, [1], seed + 1)
    if total + 1 >= budget + cache.schedule.headroom(budget):
        assert cache.size() == budget
        assert (kept[..., :2] == mx.array([0, 1])).all().item()
        assert (kept[..., -4:] == total + 1 - 4 + mx.arange(4)).all().item()
    else:
        assert cache.size() == total + 1
