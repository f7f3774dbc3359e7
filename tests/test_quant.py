"""Quant (KIVI): keys per channel in whole blocks of tokens, values per token, the window exact; what it holds,
why per channel, saving, trimming into a block, and batches."""

from __future__ import annotations

import gc

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache

import veloxpatch
from conftest import assert_a_rejected_draft_leaves_no_trace, assert_round_trip, drain, greedy, random_tokens, tiny
from veloxpatch.caches import CacheSpec
from veloxpatch.config import Budget
from veloxpatch.eval.random_model import build, config_for
from veloxpatch.methods.quant import QuantCache


def outlier_keys(tokens: int = 256, width: int = 64) -> mx.array:
    """Keys like a real model's: small values, and a few channels large in every token (Qwen2.5's key biases)."""
    mx.random.seed(3)
    keys = mx.random.normal((1, 2, tokens, width))
    return keys + mx.zeros((width,)).at[mx.array([3, 17, 40])].add(mx.array([30.0, -25.0, 20.0]))


def folded(bits: int, keys: mx.array, window: int = 8, group: int = 64) -> QuantCache:
    """A cache that has read ``keys`` (and the same as values) in one step and folded what is due."""
    cache = QuantCache(CacheSpec(Budget(tokens=64), window=window, mode="chunk"), bits=bits, group=group)
    k, v = cache.update_and_fetch(keys, keys)
    queries = mx.random.normal((1, 2, keys.shape[2], keys.shape[3]))
    cache.attend(queries, k, v, scale=0.125, mask="causal")
    return cache


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_keys_per_channel_err_far_less_than_per_token_where_channels_are_outliers(bits: int) -> None:
    keys = outlier_keys()
    cache = folded(bits, keys)
    assert cache.folds[0].end == 192 and cache.store.rows == 64, "(256 - 8) // 64 blocks folded"
    ours = cache.rows()[0]
    per_token = mx.dequantize(*mx.quantize(keys, group_size=64, bits=bits), group_size=64, bits=bits)
    error = [float(mx.abs(x - keys).mean()) for x in (ours, per_token)]
    assert error[0] < 0.3 * error[1], f"per channel {error[0]:.3f}, per token (kv_bits) {error[1]:.3f}"


def test_only_whole_blocks_older_than_the_window_fold_and_the_bytes_are_what_the_formats_take() -> None:
    cache = folded(4, outlier_keys(200), window=8, group=32)
    assert [(f.start, f.end) for f in cache.folds] == [(0, 192)], "(200 - 8) // 32 whole blocks"
    assert cache.store.rows == 8 and cache.size() == cache.offset == 200
    assert cache.store.row_positions()[0, 0].tolist() == list(range(192, 200))
    (packed, scales, biases), values = cache.folds[0].own
    assert packed.shape == (1, 2, 64, 192 * 4 // 32) and scales.shape == biases.shape == (1, 2, 64, 192 // 32)
    assert values[0].shape == (1, 2, 192, 64 * 4 // 32) and values[1].shape == (1, 2, 192, 2), "per token, groups of 32"
    folded_bytes = sum(a.nbytes for part in cache.folds[0].own for a in part)
    assert cache.nbytes == cache.store.nbytes + folded_bytes


def test_decode_tokens_fold_a_block_at_a_time_into_the_one_fold() -> None:
    model = tiny("llama", layers=2)
    veloxpatch.patch(kv="quant", window=4, compress="chunk", knobs={"quant_group": 32})
    caches = make_prompt_cache(model)
    greedy(model, random_tokens(100, 2), caches, steps=40, chunk=50)
    cache = caches[0]
    assert len(cache.folds) == 1 and cache.folds[0].end % 32 == 0
    assert cache.offset - cache.window - 32 < cache.folds[0].end <= cache.offset - cache.window
    assert cache.size() == cache.offset


@pytest.mark.parametrize(("knobs", "block"), [({}, 64), ({"quant_keep": "0.125x"}, 32), ({"quant_keep": "30%"}, 64),
                                               ({"quant_keep": "0.125x", "quant_group": 64}, 64),
                                               ({"quant_group": 128}, 128)])
def test_auto_blocks_are_32_tokens_under_a_share_of_the_bytes_else_64(knobs: dict, block: int) -> None:
    """``auto``: under a share of the bytes the exact rows past the last whole block count against it, so its blocks
    are shorter; a given size is kept whatever the share."""
    model = tiny("llama", layers=2)
    veloxpatch.patch(kv="quant", window=4, compress="chunk", knobs=knobs)
    caches = make_prompt_cache(model)
    greedy(model, random_tokens(170, 2), caches, steps=1, chunk=170)  # 166 rows due: 160 in blocks of 32, 128 of 64
    cache = caches[0]
    assert cache.group_size == cache.knob_values()["group"] == block
    assert cache.folds[0].end == (cache.offset - cache.window) // block * block


def test_trim_into_a_block_keeps_the_whole_blocks_before_and_the_rest_exact() -> None:
    model = tiny("llama", layers=4)
    veloxpatch.patch(kv="quant", window=8, compress="chunk", knobs={"quant_group": 32, "quant_bits": 3})
    caches = make_prompt_cache(model)
    greedy(model, random_tokens(200, 4), caches, steps=2, chunk=50)
    assert_a_rejected_draft_leaves_no_trace(model, caches, steps=10)
    before = caches[0].unfold(caches[0].folds[0])
    caches[0].memory.remember(mx.ones((1, 4, 4, 16)), caches[0].offset, 4)  # queries of the last 4 tokens
    for cache in caches:
        cache.trim(cache.offset - 75)
    cache = caches[0]
    assert (cache.folds[0].start, cache.folds[0].end, cache.store.rows, cache.offset) == (0, 64, 11, 75)
    assert (cache.memory.queries, cache.memory.end) == (None, 75), "the trimmed tokens' queries go too"
    after = cache.rows()
    for old, new in zip(before, after):
        assert mx.array_equal(old[..., :75, :], new), "the kept blocks as they were, the cut block's rows dequantized"
    greedy(model, mx.array([3]), caches, steps=40)  # and it goes on, folding again from 64
    assert caches[0].folds[0].end % 32 == 0 and caches[0].folds[0].end > 64


def test_a_saved_cache_loads_back_and_answers_the_same(tmp_path) -> None:
    model = tiny("qwen3", seed=2, layers=4)
    veloxpatch.patch(kv="quant", window=8, compress="chunk", knobs={"quant_group": 32, "quant_bits": 2})
    caches = make_prompt_cache(model)
    greedy(model, random_tokens(150, 7), caches, steps=3, chunk=64)
    loaded = assert_round_trip(str(tmp_path / "prompt.safetensors"), model, caches)
    assert [c.folds[0].end for c in loaded] == [c.folds[0].end for c in caches]


def test_batched_sequences_generate_what_each_does_alone() -> None:
    model = tiny("llama", layers=2)
    veloxpatch.patch(kv="quant", window=4, compress="chunk", knobs={"quant_group": 32, "quant_bits": 3})
    prompts = [random_tokens(n, seed).tolist() for n, seed in ((90, 1), (140, 2))]
    alone = [greedy(model, mx.array(p), steps=12) for p in prompts]
    gen = BatchGenerator(model, max_tokens=12, prefill_step_size=32)
    uids = gen.insert(prompts)
    assert drain(gen, uids) == alone


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("n", [1, 5])
def test_a_decode_step_over_the_held_fold_equals_attention_over_the_rebuilt_rows(bits: int, n: int) -> None:
    mx.random.seed(bits)
    cache = folded(bits, mx.random.normal((1, 2, 300, 64)), window=8, group=32)
    keys, values = cache.update_and_fetch(mx.random.normal((1, 2, n, 64)), mx.random.normal((1, 2, n, 64)))
    queries = mx.random.normal((1, 6, n, 64))
    assert cache._held_usable(queries, None, None), "a decode-sized step goes over the fold as held"
    rebuilt = cache._attention(queries, keys, values, 0.125, None if n == 1 else "causal", None)
    held = cache.attend_held(queries, 0.125)
    assert held is not None, "per-token values: the quantized matmul takes them"
    assert mx.allclose(held, rebuilt, atol=1e-5)
    assert not cache._held_usable(mx.random.normal((1, 6, 100, 64)), "causal", None), "a prompt chunk does not"


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_a_half_precision_step_multiplies_the_fold_in_float32_on_the_cpu(dtype: mx.Dtype, monkeypatch) -> None:
    """mlx's CPU quantized matmul is 10-100x slower in half precision (bench/quantized_matmul.py): the fold's
    products run in float32 there, and the step's output keeps the model's dtype and equals the rebuilt rows'."""
    mx.random.seed(9)
    cache = folded(4, mx.random.normal((1, 2, 300, 64)).astype(dtype), window=8, group=32)
    keys, values = cache.update_and_fetch(*(mx.random.normal((1, 2, 1, 64)).astype(dtype) for _ in range(2)))
    queries = mx.random.normal((1, 6, 1, 64)).astype(dtype)
    seen: list[mx.Dtype] = []
    product = mx.quantized_matmul
    monkeypatch.setattr(mx, "quantized_matmul", lambda x, *a, **k: seen.append(x.dtype) or product(x, *a, **k))
    held = cache.attend_held(queries, 0.125)
    assert held is not None and held.dtype == dtype
    assert seen == [mx.float32, mx.float32], "both products (keys, values) as float32 on the CPU"
    rebuilt = cache._attention(queries, keys, values, 0.125, None, None)
    assert mx.allclose(held.astype(mx.float32), rebuilt.astype(mx.float32), atol=2e-2)


def test_keys_the_model_changed_after_the_store_are_attended_as_given() -> None:
    mx.random.seed(5)
    cache = folded(4, mx.random.normal((1, 2, 300, 64)), window=8, group=32)
    keys, values = cache.update_and_fetch(mx.random.normal((1, 2, 1, 64)), mx.random.normal((1, 2, 1, 64)))
    changed = keys * 2  # not the keys the store handed out: the held fold would not be what the model attends
    queries = mx.random.normal((1, 6, 1, 64))
    expected = cache._attention(queries, changed, values, 0.125, None, None)
    assert mx.allclose(cache.attend(queries, changed, values, 0.125, None), expected, atol=1e-5)


def test_a_prompt_chunks_exact_rows_go_as_each_layer_folds_them() -> None:
    """Memory as mlx counts it: a long prompt chunk's exact rows leave each layer as it folds them, not when the
    model's step is evaluated, so reading it peaks well under what every layer's exact rows of it take together."""
    model = build(config_for("llama", num_hidden_layers=16, num_attention_heads=4, num_key_value_heads=4,
                             head_dim=64), 0)
    prompt = random_tokens(1024, 3)
    mx.eval(model.parameters(), prompt)
    veloxpatch.patch(kv="quant", window=8, compress="chunk")
    caches = make_prompt_cache(model)
    limit = mx.set_cache_limit(0)  # no freed buffer handed to a smaller array: what is held is what is asked for
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    mx.eval(model(prompt[None], cache=caches), [c.state for c in caches])
    peak = mx.get_peak_memory() - before
    mx.set_cache_limit(limit)
    every_layers_rows = 16 * 2 * 4 * 1024 * 64 * 4  # layers x (keys, values) x heads x tokens x dim, float32
    assert all(c.folds for c in caches), "the chunk folded in every layer"
    assert peak < 0.5 * every_layers_rows, (peak, every_layers_rows)
