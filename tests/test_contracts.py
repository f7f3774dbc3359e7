"""The cache contracts of docs/DESIGN.md under real compression."""

from __future__ import annotations

import copy
import sys

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import llama
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache, make_prompt_cache, trim_prompt_cache

import veloxpatch
from conftest import (
    EVICTING,
    assert_a_rejected_draft_leaves_no_trace,
    assert_round_trip,
    assert_within_budget,
    decoded,
    greedy,
    prefill,
    random_tokens,
    speculated,
    tiny,
)
from veloxpatch import stats
from veloxpatch.caches import CacheSpec
from veloxpatch.caches.schedule import Schedule
from veloxpatch.caches.selection import pool_rows
from veloxpatch.config import Budget
from veloxpatch.integration import compat, wrappers
from veloxpatch.methods.snapkv import SnapKVCache
from veloxpatch.methods.streamingllm import StreamingLLMCache

SCALE = 0.25


def continue_greedy(model, caches, first: int, steps: int = 6) -> list[int]:
    return greedy(model, mx.array([first]), caches, steps=steps)


@pytest.mark.parametrize("method", EVICTING)
def test_offset_counts_tokens_and_rows_stay_bounded(method: str) -> None:
    model = tiny("qwen3")
    veloxpatch.patch(compress="chunk", kv=method, budget=48, window=8)
    caches = make_prompt_cache(model)
    tokens = random_tokens(300, 3)
    prefill(model, caches, tokens, chunk=20)
    assert all(c.offset == 300 for c in caches)
    assert all(c.size() == c.target() for c in caches), "rows are compressed back to each layer's budget"
    assert sum(c.target() for c in caches) == 48 * len(caches), "per-layer budgets share the total"
    capacity = max(c.store.capacity for c in caches)
    assert capacity <= max(c.target() for c in caches) + Schedule.max_headroom + caches[0].store.step
    continue_greedy(model, caches, first=5, steps=100)
    assert all(c.offset == 300 + 100 + 1 for c in caches), "generate_step runs one token ahead"
    assert all(c.size() < c.target() + c.schedule.headroom(c.target()) for c in caches)
    assert caches[0].schedule.headroom(48) == 8


def test_physical_bytes_do_not_grow_with_context() -> None:
    model = tiny("llama")
    veloxpatch.patch(compress="chunk", kv="snapkv", budget=40, window=8)
    sizes = []
    for length in (200, 600):
        caches = make_prompt_cache(model)
        prefill(model, caches, random_tokens(length, 4), chunk=50)
        sizes.append(sum(c.nbytes for c in caches))
    assert sizes[0] == sizes[1]
    dense = sum(stats.dense_nbytes(c) for c in caches)
    assert sizes[1] < dense / 4


def test_multi_token_step_after_eviction_uses_a_mask_for_our_rows() -> None:
    """After eviction a 5-token step attends to every kept row and causally to itself."""
    cache = SnapKVCache(CacheSpec(Budget(tokens=12), mode="chunk", sink=2, window=4))
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
    cache = SnapKVCache(CacheSpec(Budget(tokens=10), mode="chunk", sink=1, window=4), kernel=1)
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
    cache = StreamingLLMCache(CacheSpec(Budget(tokens=10), mode="chunk", sink=3, window=4))
    position = mx.broadcast_to(mx.arange(50, dtype=mx.float32)[:, None], (1, 2, 50, 4))
    k, v = cache.update_and_fetch(position, position)
    cache.attend(mx.zeros((1, 2, 50, 4)), k, v, scale=SCALE)
    kept = cache.keys[0, 0, : cache.size(), 0].tolist()
    assert kept == [0, 1, 2, 43, 44, 45, 46, 47, 48, 49]


def test_pooling() -> None:
    scores = mx.array([[0.0, 0.0, 3.0, 0.0, 0.0, 6.0]])
    assert pool_rows(scores, 3, "avg").tolist() == [[0.0, 1.0, 1.0, 1.0, 2.0, 2.0]]
    assert pool_rows(scores, 3, "max").tolist() == [[0.0, 3.0, 3.0, 3.0, 6.0, 6.0]]


# non-default knobs, so that each is seen to load back
ROUND_TRIP_KNOBS = {"chunkkv": {"chunkkv_chunk": 5, "chunkkv_reuse": 2}, "pyramidkv": {"pyramidkv_beta": 3},
                    "snapkv": {"snapkv_kernel": 5}, "squeeze": {"squeeze_strength": 0.6}}


@pytest.mark.parametrize("mode", ["chunk", "end"])
@pytest.mark.parametrize("method", EVICTING)
def test_prompt_cache_file_round_trip(tmp_path, method: str, mode: str) -> None:
    """``chunk``: saved after a few decode steps (H2O's queued queries not yet accounted); ``end``:
    saved with the prompt left whole, which the loaded caches compress as they continue."""
    model = tiny("qwen3", seed=2, layers=4)
    knobs = ROUND_TRIP_KNOBS.get(method, {})
    veloxpatch.patch(compress=mode, kv=method, budget=40, window=8, knobs=knobs)
    caches = make_prompt_cache(model)
    if mode == "chunk":
        greedy(model, random_tokens(120, 12), caches, steps=4, chunk=30)
    else:
        model(random_tokens(120, 12)[None], cache=caches)
    assert all(c.evicted == (mode == "chunk") for c in caches)
    loaded = assert_round_trip(str(tmp_path / "prompt.safetensors"), model, caches)
    assert all(c.evicted for c in loaded)
    assert all(c.knob_values()[k.removeprefix(method + "_")] == v for c in loaded for k, v in knobs.items())


def test_a_file_as_mlx_lm_before_0_32_saves_it_round_trips(tmp_path, monkeypatch) -> None:
    """mlx-lm 0.28-0.31 save a cache's ``state`` as arrays only, its ``meta_state`` apart as strings, and hand both
    back to ``from_state``: faked here on any mlx-lm, with their save and load (the matrix runs the real ones)."""
    model = tiny("qwen3", seed=2, layers=4)
    monkeypatch.setattr(compat, "meta_state_apart", lambda: True)  # what patch() then tells the caches it builds
    veloxpatch.patch(kv="xkv", budget=40, window=8)  # a coordinator; its folds sit in dicts (or None) in the state
    caches = make_prompt_cache(model)
    greedy(model, random_tokens(120, 12), caches, steps=4, chunk=30)
    assert all(isinstance(a, mx.array) for c in caches for a in c.state)
    path = str(tmp_path / "prompt.safetensors")
    metadata = [[c.meta_state for c in caches], {}, [type(c).__name__ for c in caches]]
    mx.save_safetensors(path, dict(tree_flatten([c.state for c in caches])), dict(tree_flatten(metadata)))

    def load_as_before_0_32(file: str) -> list:
        arrays, metadata = mx.load(file, return_metadata=True)
        info, _, classes = tree_unflatten(list(metadata.items()))
        module = sys.modules["mlx_lm.models.cache"]
        return [getattr(module, name).from_state(state, meta)
                for name, state, meta in zip(classes, tree_unflatten(list(arrays.items())), info)]

    loaded = wrappers.load_prompt_cache(load_as_before_0_32)(path)  # as the patched load_prompt_cache does
    assert [c.meta_state for c in loaded] == [c.meta_state for c in caches]
    assert all(mx.array_equal(a, b).item() for ours, theirs in zip(loaded, caches)
               for a, b in zip(ours.state, theirs.state, strict=True))
    assert greedy(model, mx.array([7]), loaded, steps=6) == greedy(model, mx.array([7]), caches, steps=6)


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


@pytest.mark.parametrize("method", EVICTING)
def test_trim_of_the_newest_rows_after_eviction_is_exact_through_mlx_lm(method: str) -> None:
    """Speculative decoding's rewind: through mlx_lm's own gate, after evictions, exactly."""
    model = tiny("llama")
    veloxpatch.patch(compress="chunk", kv=method, budget=48, window=8)
    caches = make_prompt_cache(model)
    prefill(model, caches, random_tokens(200, 14), chunk=50)
    assert all(c.evicted and c.offset == 200 for c in caches)
    assert_a_rejected_draft_leaves_no_trace(model, caches, steps=20)  # compressions after the rewind too


@pytest.mark.parametrize("method", EVICTING)
def test_speculative_decoding_keeps_offsets_and_bounds(method: str) -> None:
    """mlx_lm's speculative decoding rewinds rejected drafts: every compressed cache, the main model's
    and the draft's, ends at the offset of mlx_lm's own cache beside it, within its budget."""
    steps, main, drafts = speculated(method)
    accepted = sum(from_draft for _, _, from_draft in steps)
    assert len(steps) == 40 and 0 < accepted < 40, "drafts are accepted and rejected"
    for caches in (main, drafts):
        assert type(caches[0]) is KVCache
        assert_within_budget(caches[1:], caches[0].offset)


@pytest.mark.parametrize("mode", ["chunk", "end"])
@pytest.mark.parametrize("method", EVICTING)
def test_both_modes_decode_within_each_layers_budget(method: str, mode: str) -> None:
    tokens, caches = decoded(method, mode)
    assert len(tokens) == 30
    assert sum(c.target() for c in caches) == 40 * len(caches), "per-layer budgets share the total"
    assert_within_budget(caches, 230)


@pytest.mark.parametrize("method,knobs,distinct", [("pyramidkv", {"pyramidkv_beta": 4}, 4),
                                                   ("squeeze", {"squeeze_strength": 0.9}, 2)])
def test_multi_token_steps_over_layers_of_uneven_sizes_attend_over_their_own_rows(monkeypatch, method: str,
                                                                                 knobs: dict, distinct: int) -> None:
    """The model builds its mask from the first layer's cache (here always as an array): layers with
    budgets of their own hold other numbers of rows, and multi-token steps must still attend over
    their own."""
    monkeypatch.setattr(llama, "create_attention_mask",
                        lambda h, cache=None, window_size=None, return_array=False:
                        create_attention_mask(h, cache, window_size, return_array=True))
    model = tiny("llama", seed=4, layers=4)
    veloxpatch.patch(kv=method, budget=40, window=8, compress="chunk", knobs=knobs)
    caches = make_prompt_cache(model)
    tokens = random_tokens(160, 5)
    prefill(model, caches, tokens[:100], chunk=50)
    for start in range(100, 160, 3):
        logits = model(tokens[None, start : start + 3], cache=caches)
        mx.eval(logits)
        assert logits.shape == (1, 3, 97)
    assert len({c.size() for c in caches}) >= distinct, "layers hold their own numbers of rows"
    assert_within_budget(caches, 160)


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
    assert all(c.size() <= 48 + c.schedule.headroom(48) for c in caches)


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
    cache = SnapKVCache(CacheSpec(Budget(tokens=12), mode="chunk", sink=2, window=4), kernel=1)
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
