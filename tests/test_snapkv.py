"""SnapKV as the paper defines it (arXiv 2404.14469): prefix-only pooling, one-shot mode."""

from __future__ import annotations

import copy

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

import veloxpatch
from conftest import random_tokens, tiny
from veloxpatch.caches import CacheSpec
from veloxpatch.config import Budget
from veloxpatch.methods.snapkv import SnapKVCache


def test_the_windows_attention_to_itself_does_not_spill_into_the_rows_before_it() -> None:
    """The window attends mostly to itself and a little to row 20; one free slot must go to the
    neighbourhood of row 20, not to the rows just before the window (where pooling over
    unprotected scores would put the window's own mass)."""
    cache = SnapKVCache(CacheSpec(Budget(tokens=6), sink=1, window=4, mode="chunk"), kernel=7)
    direction = mx.zeros((8,)).at[0].add(1.0)
    keys = mx.random.normal((1, 1, 40, 8), key=mx.random.key(3)) * 0.01
    keys[:, :, 36:, :] = direction * 8
    keys[:, :, 20, :] = direction * 4
    queries = mx.broadcast_to(direction * 4, (1, 2, 40, 8))
    k, v = cache.update_and_fetch(keys, keys)
    cache.attend(queries, k, v, scale=0.25)
    kept = cache.store.row_positions()[0, 0].tolist()
    assert kept[0] == 0 and kept[-4:] == [36, 37, 38, 39]
    assert abs(kept[1] - 20) <= 3, f"kept {kept}: the free slot went to row {kept[1]}"


def test_end_mode_keeps_every_prompt_row_until_decoding_starts() -> None:
    model = tiny("llama")
    veloxpatch.patch(kv="snapkv", budget=48, window=8, compress="end")
    caches = make_prompt_cache(model)
    prompt = random_tokens(300, 40)
    for start in range(0, 299, 50):
        model(prompt[None, start : min(start + 50, 299)], cache=caches)
        assert all(c.size() == c.offset for c in caches), "no prompt row is evicted during prefill"
    model(prompt[None, 299:], cache=caches)  # the last prompt token goes down the decode path
    assert all((c.offset, c.size()) == (300, 48) for c in caches)


def test_end_mode_the_first_decode_step_already_sees_only_the_kept_rows() -> None:
    """SnapKV compresses right after the prompt: the first decode step's logits are those over
    the kept rows, not over the whole prompt (mlx_lm's generate feeds that step once the prompt
    is in)."""
    model = tiny("llama")
    veloxpatch.patch(kv="snapkv", budget=48, window=8, compress="end")
    caches = make_prompt_cache(model)
    prompt = random_tokens(300, 42)
    model(prompt[None, :299], cache=caches)
    compressed = [copy.deepcopy(c) for c in caches]
    for cache in compressed:
        cache.compress(cache.target(), model.layers[0].self_attn.scale)
    full = [KVCache() for _ in caches]
    model(prompt[None, :299], cache=full)
    step = prompt[None, 299:]
    got, over_kept, over_all = (model(step, cache=c) for c in (caches, compressed, full))
    # ``compressed`` kept one row the step does not (its window ends a token earlier), so it is close, not equal
    off_kept, off_all = (mx.abs(got - other).max().item() for other in (over_kept, over_all))
    assert off_kept < 1e-3 and off_kept < off_all / 20, (off_kept, off_all)
