"""The cache contracts of docs/DESIGN.md under real compression."""

from __future__ import annotations

import copy

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import (
    can_trim_prompt_cache, load_prompt_cache, make_prompt_cache, save_prompt_cache, trim_prompt_cache,
)

import veloxpatch
from conftest import random_tokens, tiny
from veloxpatch.caches import CompressedKVCache
from veloxpatch.caches.snapkv import SnapKVCache, pool_rows
from veloxpatch.caches.store import RowStore
from veloxpatch.caches.streamingllm import StreamingLLMCache
from veloxpatch.config import Budget

SCALE = 0.25


def prefill(model, caches, tokens: mx.array, chunk: int) -> list[int]:
    """Feed ``tokens`` in chunks; return the largest row count any layer held after a chunk."""
    peaks = []
    for start in range(0, tokens.size, chunk):
        model(tokens[None, start : start + chunk], cache=caches)
        mx.eval([c.state for c in caches])
        peaks.append(max(c.size() for c in caches))
    return peaks


def continue_greedy(model, caches, first: int, steps: int = 6) -> list[int]:
    prompt = mx.array([first])
    return [t for t, _ in generate_step(prompt, model, max_tokens=steps, prompt_cache=caches)]


@pytest.mark.parametrize("method", ["snapkv", "streamingllm"])
def test_offset_counts_tokens_and_rows_stay_bounded(method: str) -> None:
    model = tiny("qwen3")
    veloxpatch.patch(compress="chunk", kv=method, budget=48, window=8)
    caches = make_prompt_cache(model)
    tokens = random_tokens(300, 3)
    peaks = prefill(model, caches, tokens, chunk=20)
    assert all(c.offset == 300 for c in caches)
    assert max(peaks) == 48, "rows are compressed back to the budget after every chunk"
    capacity = max(c.store.capacity for c in caches)
    assert capacity <= 48 + CompressedKVCache.max_headroom + RowStore.step
    continue_greedy(model, caches, first=5, steps=100)
    assert all(c.offset == 300 + 100 + 1 for c in caches), "generate_step runs one token ahead"
    assert all(c.size() < 48 + c.headroom(48) for c in caches) and caches[0].headroom(48) == 8


def test_physical_bytes_do_not_grow_with_context() -> None:
    model = tiny("llama")
    veloxpatch.patch(compress="chunk", kv="snapkv", budget=40, window=8)
    sizes = []
    for length in (200, 600):
        caches = make_prompt_cache(model)
        prefill(model, caches, random_tokens(length, 4), chunk=50)
        sizes.append(sum(c.nbytes for c in caches))
    assert sizes[0] == sizes[1]
    dense = sum(c.dense_nbytes() for c in caches)
    assert sizes[1] < dense / 4


def test_multi_token_step_after_eviction_uses_a_mask_for_our_rows() -> None:
    """After eviction a 5-token step attends to every kept row and causally to itself."""
    cache = SnapKVCache(Budget(tokens=12), mode="chunk", sink=2, window=4)
    keys = mx.random.normal((1, 2, 30, 8), key=mx.random.key(5))
    values = mx.random.normal((1, 2, 30, 8), key=mx.random.key(6))
    queries = mx.random.normal((1, 4, 30, 8), key=mx.random.key(7))
    k, v = cache.update_and_fetch(keys, values)
    cache.attend(queries, k, v, scale=SCALE)
    assert (cache.offset, cache.size()) == (30, 12)
    mask = cache.make_mask(5, return_array=True)
    assert mask.shape == (5, 17)
    assert mask[:, :12].all().item() and not mask[0, 13].item() and mask[4, 16].item()
    assert cache.make_mask(5) == "causal" and cache.make_mask(1) is None
    new_q = mx.random.normal((1, 4, 5, 8), key=mx.random.key(8))
    new_k = mx.random.normal((1, 2, 5, 8), key=mx.random.key(9))
    new_v = mx.random.normal((1, 2, 5, 8), key=mx.random.key(10))
    kept_k, kept_v = cache.keys[..., :12, :], cache.values[..., :12, :]
    k, v = cache.update_and_fetch(new_k, new_v)
    out = cache.attend(new_q, k, v, scale=SCALE, mask=None)
    reference = mx.fast.scaled_dot_product_attention(
        new_q, mx.concatenate([kept_k, new_k], 2), mx.concatenate([kept_v, new_v], 2),
        scale=SCALE, mask=mask)
    assert mx.allclose(out, reference, atol=1e-5).item()


def test_snapkv_keeps_the_rows_the_window_attends_to() -> None:
    cache = SnapKVCache(Budget(tokens=10), mode="chunk", sink=1, window=4, kernel=1)
    d = 8
    keys = mx.random.normal((2, 2, 40, d), key=mx.random.key(11)) * 0.1
    target = mx.zeros((d,)).at[0].add(1.0)
    keys[:, :, 17, :] = target * 8
    keys[:, :, 25, :] = target * 8
    queries = mx.broadcast_to(target * 4, (2, 4, 40, d))
    k, v = cache.update_and_fetch(keys, keys)
    cache.attend(queries, k, v, scale=SCALE)
    kept = cache.keys[..., : cache.size(), 0]
    assert cache.size() == 10
    assert ((kept > 7).sum(axis=-1) == 2).all().item(), "both planted rows survive in every batch and head"


def test_streamingllm_keeps_sinks_and_the_most_recent_rows() -> None:
    cache = StreamingLLMCache(Budget(tokens=10), mode="chunk", sink=3, window=4)
    position = mx.broadcast_to(mx.arange(50, dtype=mx.float32)[:, None], (1, 2, 50, 4))
    k, v = cache.update_and_fetch(position, position)
    cache.attend(mx.zeros((1, 2, 50, 4)), k, v, scale=SCALE)
    kept = cache.keys[0, 0, : cache.size(), 0].tolist()
    assert kept == [0, 1, 2, 43, 44, 45, 46, 47, 48, 49]


def test_pooling() -> None:
    scores = mx.array([[0.0, 0.0, 3.0, 0.0, 0.0, 6.0]])
    assert pool_rows(scores, 3, "avg").tolist() == [[0.0, 1.0, 1.0, 1.0, 2.0, 2.0]]
    assert pool_rows(scores, 3, "max").tolist() == [[0.0, 3.0, 3.0, 3.0, 6.0, 6.0]]


@pytest.mark.parametrize("method", ["snapkv", "streamingllm"])
def test_prompt_cache_file_round_trip(tmp_path, method: str) -> None:
    model = tiny("qwen2")
    veloxpatch.patch(compress="chunk", kv=method, budget=40, window=8, knobs={"snapkv_kernel": 5})
    caches = make_prompt_cache(model)
    prefill(model, caches, random_tokens(120, 12), chunk=30)
    path = str(tmp_path / "prompt.safetensors")
    save_prompt_cache(path, caches)
    loaded = load_prompt_cache(path)
    assert [type(c) for c in loaded] == [type(c) for c in caches]
    assert [(c.offset, c.size(), c.evicted) for c in loaded] == [(c.offset, c.size(), c.evicted) for c in caches]
    if method == "snapkv":
        assert all(c.kernel == 5 for c in loaded)
    assert continue_greedy(model, loaded, 7) == continue_greedy(model, caches, 7)


def test_deepcopy_is_independent_and_keeps_one_coordinator() -> None:
    model = tiny("llama")
    veloxpatch.patch(compress="chunk", kv="snapkv", budget=40, window=8)
    caches = make_prompt_cache(model)
    prefill(model, caches, random_tokens(100, 13), chunk=25)
    clone = copy.deepcopy(caches)
    assert len({id(c.coordinator) for c in clone}) == 1
    assert clone[0].coordinator is not caches[0].coordinator
    first = continue_greedy(model, caches, 3)
    assert clone[0].offset == 100 and caches[0].offset > 100, "the copy does not move with the original"
    assert continue_greedy(model, clone, 3) == first


def first_layer_keys(model, tokens: mx.array) -> mx.array:
    """The first layer's keys under mlx_lm's own cache, (B, kv_heads, tokens, head_dim).

    Only the first layer's keys depend on nothing but the tokens and their positions; deeper
    layers' keys change once an earlier layer has evicted.
    """
    caches = make_prompt_cache(model)
    model(tokens[None], cache=caches)
    return caches[0].keys[..., : tokens.size, :]


def test_trim_of_the_newest_rows_after_eviction_is_exact_through_mlx_lm() -> None:
    """Speculative decoding's rewind: through mlx_lm's own gate, after evictions, exactly."""
    model = tiny("llama")
    veloxpatch.patch(compress="chunk", kv="snapkv", budget=48, window=8)
    caches = make_prompt_cache(model)
    prefill(model, caches, random_tokens(200, 14), chunk=50)
    assert all(c.evicted for c in caches)
    reference = continue_greedy(model, copy.deepcopy(caches), 9)
    model(mx.array([[9, 1, 2, 3]]), cache=caches)  # four draft tokens, then rejected
    assert can_trim_prompt_cache(caches) and trim_prompt_cache(caches, 4) == 4
    assert [c.offset for c in caches] == [200] * 3
    assert continue_greedy(model, caches, 9) == reference


def test_trim_into_evicted_history_leaves_the_compressed_cache_of_the_prefix() -> None:
    """Back to any prefix: only rows from before it remain, each exactly the key it was."""
    model = tiny("llama")
    tokens = random_tokens(260, 15)
    truth = first_layer_keys(model, tokens)
    veloxpatch.patch(compress="chunk", kv="snapkv", budget=48, window=8)
    caches = make_prompt_cache(model)
    prefill(model, caches, tokens, chunk=40)
    assert trim_prompt_cache(caches, 170) == 170
    for cache in caches:
        positions = cache.store.row_positions()
        valid = positions >= 0
        assert cache.offset == 90 and (mx.where(valid, positions, 0) < 90).all().item()
        assert valid.sum(axis=-1).min().item() > 0, "every head keeps rows of the prefix"
    positions = caches[0].store.row_positions()
    gathered = mx.take_along_axis(truth, mx.maximum(positions, 0)[..., None], axis=2)
    diff = mx.where((positions >= 0)[..., None], caches[0].keys - gathered, 0)
    assert mx.abs(diff).max().item() < 1e-4, "kept rows keep their keys and original rotation"
    generated = continue_greedy(model, caches, 3, steps=20)
    assert len(generated) == 20 and all(c.offset == 90 + 21 for c in caches)
    assert all(c.size() <= 48 + c.headroom(48) for c in caches)


def test_each_generation_resets_the_coordinator_of_a_reused_cache_list() -> None:
    model = tiny("llama")
    veloxpatch.patch(compress="chunk", kv="snapkv", budget=40, window=8)
    caches = make_prompt_cache(model)
    coordinator = caches[0].coordinator
    assert all(c.coordinator is coordinator for c in caches) and coordinator.members == caches
    for turn in range(3):  # a chat: one cache list, a generation per turn
        continue_greedy(model, caches, first=turn + 1, steps=3)
    assert coordinator.generations == 3


def test_attention_after_a_ragged_trim_sees_each_heads_own_rows_only() -> None:
    """Heads left with different numbers of rows: the holes are masked, per head, exactly."""
    cache = SnapKVCache(Budget(tokens=12), mode="chunk", sink=2, window=4, kernel=1)
    keys = mx.random.normal((1, 2, 40, 8), key=mx.random.key(20))
    queries = mx.random.normal((1, 4, 40, 8), key=mx.random.key(21))
    k, v = cache.update_and_fetch(keys, keys)
    cache.attend(queries, k, v, scale=SCALE)
    cache.trim(25)
    assert cache.store.holes, "the heads kept different rows before position 15"
    positions = cache.store.row_positions()
    new_q = mx.random.normal((1, 4, 3, 8), key=mx.random.key(22))
    new_k = mx.random.normal((1, 2, 3, 8), key=mx.random.key(23))
    k, v = cache.update_and_fetch(new_k, new_k)
    out = cache.attend(new_q, k, v, scale=SCALE)
    for head in range(2):
        rows = [i for i, p in enumerate(positions[0, head].tolist()) if p >= 0]
        kv = mx.concatenate([k[:, head : head + 1, rows], new_k[:, head : head + 1]], axis=2)
        q = new_q[:, 2 * head : 2 * head + 2]
        expected = mx.fast.scaled_dot_product_attention(q, kv, kv, scale=SCALE, mask="causal")
        assert mx.allclose(out[:, 2 * head : 2 * head + 2], expected, atol=1e-5).item()
