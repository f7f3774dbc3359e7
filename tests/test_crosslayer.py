"""Contracts of every cross-layer method (folds instead of evictions): physical bytes, saving, trimming."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache

import veloxpatch
from conftest import CROSS_LAYER, assert_a_rejected_draft_leaves_no_trace, greedy, random_tokens, tiny
from veloxpatch import stats

# settings that fold on a 4-layer model, with the share of the folded rows' exact bytes the folds take
SAVING = {"xkv": ({"budget": "25%"}, (0.2, 0.25)),  # rank auto: a quarter of the bytes
          "minicache": ({"knobs": {"minicache_start": 0.0}}, (0.5, 0.7)),  # one direction per pair + norms
          "xquant": ({}, (0.1, 0.2)),  # X at 4 bits in a group's first layer, 3-bit deltas: ~1/8 of K and V
          # keys at 4 bits with a float32 scale and bias per 64 tokens (5 bits), values per 32 elements (6): 11/64
          "quant": ({}, (0.17, 0.175))}  # X at 4 bits in a group's first layer, 3-bit deltas: ~1/8 of K and V
# settings that fold every layer without losing anything: the rebuilt rows are the rows
EXACT = {"xkv": {"xkv_rank": "100%"}, "minicache": {"minicache_start": 0.0, "minicache_gamma": 1.0},
         "xquant": {"xquant_bits": 16, "xquant_cl_bits": 16}, "quant": {"quant_bits": 16}}
# settings that fold every layer into groups of two
PAIRED = {"xkv": {"xkv_rank": "25%", "xkv_group": 2}, "minicache": {"minicache_start": 0.0}, "xquant": {"xquant_cl": 2}}


def own_bytes(cache) -> int:
    return sum(a.nbytes for fold in cache.folds for _, a in tree_flatten(fold.own) if isinstance(a, mx.array))


@pytest.mark.parametrize("method", CROSS_LAYER)
def test_nbytes_is_what_the_arrays_hold_and_the_process_holds_less_than_unpatched(method: str) -> None:
    model = tiny("llama", layers=4)
    prompt = random_tokens(2000, 5)
    mx.eval(prompt)
    settings, (low, high) = SAVING[method]
    held = []
    for patched in (False, True):
        mx.clear_cache()
        before = mx.get_active_memory()
        if patched:
            veloxpatch.patch(kv=method, compress="end", **settings)
        caches = make_prompt_cache(model)
        greedy(model, prompt, caches, steps=2, chunk=512)
        mx.eval([c.state for c in caches])
        mx.clear_cache()
        held.append((mx.get_active_memory() - before, sum(c.nbytes for c in caches)))
        veloxpatch.unpatch()
        if patched:
            assert all(len(c.folds) == 1 for c in caches)
            shared = {id(p): p for c in caches for p in c.shared_parts()}
            shared_bytes = sum(a.nbytes for p in shared.values() for _, a in tree_flatten(p))
            assert sum(c.nbytes for c in caches) == sum(c.store.nbytes + own_bytes(c) for c in caches) + shared_bytes
            exact = sum((f.end - f.start) * stats.dense_nbytes(c) // c.offset for c in caches for f in c.folds)
            folded = sum(c.nbytes - c.store.nbytes for c in caches)
            assert low < folded / exact <= high, f"{folded / exact:.3f} of the folded rows' bytes"
        del caches
    (vanilla, vanilla_bytes), (ours, our_bytes) = held
    assert our_bytes < 0.8 * vanilla_bytes and ours < 0.8 * vanilla, (held, "held memory drops with the cache")


@pytest.mark.parametrize("method", sorted(PAIRED))
def test_a_saved_list_loads_back_with_its_shared_parts_linked_again(tmp_path, method: str) -> None:
    model = tiny("qwen3", seed=2, layers=4)
    veloxpatch.patch(kv=method, budget="25%", window=8, compress="end", knobs=PAIRED[method])
    caches = make_prompt_cache(model)
    greedy(model, random_tokens(300, 12), caches, steps=3, chunk=100)
    assert all(len(c.folds) == 1 for c in caches)
    path = str(tmp_path / "prompt.safetensors")
    save_prompt_cache(path, caches)
    loaded = load_prompt_cache(path)
    assert [c.meta_state for c in loaded] == [c.meta_state for c in caches], "ranges, groups, settings, knobs"
    expected = greedy(model, mx.array([4]), caches, steps=5)
    assert greedy(model, mx.array([4]), loaded, steps=5) == expected
    assert loaded[0].folds[0].shared is loaded[1].folds[0].shared, "linked again on the first step"
    assert loaded[2].folds[0].shared is loaded[3].folds[0].shared is not loaded[0].folds[0].shared
    folded = [sum(c.nbytes - c.store.nbytes for c in x) for x in (loaded, caches)]  # (spare rows may differ)
    assert folded[0] == folded[1], "the shared parts count once again"


@pytest.mark.parametrize("method", CROSS_LAYER)
def test_a_rejected_draft_and_a_trim_into_a_fold_leave_a_cache_of_the_prefix(method: str) -> None:
    model = tiny("llama", layers=4)
    veloxpatch.patch(kv=method, window=8, compress="chunk", knobs=EXACT[method])
    caches = make_prompt_cache(model)
    greedy(model, random_tokens(200, 14), caches, steps=2, chunk=50)
    assert all(c.folds for c in caches)
    assert_a_rejected_draft_leaves_no_trace(model, caches, steps=10)
    cut = caches[0].folds[-1].start + 5
    for cache in caches:
        cache.trim(cache.offset - cut)
    assert all(c.offset == cut == c.size() for c in caches)
    assert all(c.store.row_positions().max().item() == cut - 1 for c in caches)
    greedy(model, mx.array([3]), caches, steps=3)  # and it goes on
