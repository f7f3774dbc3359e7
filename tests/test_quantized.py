"""Eviction and quantization together: ``to_quantized`` and mlx_lm's ``kv_bits`` on our caches."""

from __future__ import annotations

import logging

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache

import veloxpatch
from conftest import random_tokens, tiny
from veloxpatch.eval.random_model import build, config_for


@pytest.fixture(scope="module")
def model():
    """head_dim 32: the smallest mlx quantizes with group size 32."""
    return build(config_for("llama", hidden_size=128, intermediate_size=192), seed=2)


def prefilled(model, tokens: int = 200) -> list:
    caches = make_prompt_cache(model)
    prompt = random_tokens(tokens, 50)
    for start in range(0, tokens, 50):
        model(prompt[None, start : start + 50], cache=caches)
    return caches


def next_logits(model, caches: list) -> mx.array:
    return model(mx.array([[7]]), cache=caches)[0, -1]


def test_to_quantized_keeps_the_rows_in_fewer_bytes_and_attends_the_same(model) -> None:
    veloxpatch.patch(kv="snapkv", budget=64, window=8, tier="off")
    caches = prefilled(model)
    quantized = [c.to_quantized(group_size=32, bits=8) for c in caches]
    assert [type(q) for q in quantized] == [type(c) for c in caches]
    assert all(q.store.bits == 8 and q.offset == c.offset for q, c in zip(quantized, caches))
    assert all((q.store.row_positions() == c.store.row_positions()).all().item() for q, c in zip(quantized, caches))
    assert sum(q.nbytes for q in quantized) < 0.45 * sum(c.nbytes for c in caches)  # float32 rows -> 8 bits
    assert quantized[0].coordinator.members == quantized, "the list's coordinator follows the swap"
    for q, c in zip(quantized, caches):  # attention reads exactly the stored 8-bit rows
        roundtrip = mx.dequantize(*mx.quantize(c.keys, group_size=32, bits=8), group_size=32, bits=8)
        assert mx.array_equal(q.keys, roundtrip).item()
    dense, packed = next_logits(model, caches), next_logits(model, quantized)
    assert (mx.linalg.norm(packed - dense) / mx.linalg.norm(dense)).item() < 0.1
    assert quantized[0].to_quantized(group_size=32, bits=8) is quantized[0]


@pytest.mark.parametrize("bits", [8, 4])
def test_kv_bits_in_generate_step_stores_our_rows_quantized(model, bits: int) -> None:
    veloxpatch.patch(kv="snapkv", budget=64, window=8, tier="off")
    sizes = {}
    for kv_bits in (None, bits):
        caches = make_prompt_cache(model)
        tokens = [t for t, _ in generate_step(random_tokens(300, 51), model, max_tokens=20, prompt_cache=caches,
                                              kv_bits=kv_bits, kv_group_size=32, quantized_kv_start=0)]
        assert len(tokens) == 20
        assert all(c.store.bits == kv_bits and c.size() < 64 + c.schedule.headroom(64) for c in caches)
        sizes[kv_bits] = sum(c.nbytes for c in caches)
    assert sizes[bits] < sizes[None] * (0.45 if bits == 8 else 0.3)


def test_kv_bits_reach_the_exact_rows_of_a_folding_cache_and_its_folds_keep_their_bits(model) -> None:
    """``quant`` under an app's ``kv_bits=8``: the rows it holds exact (the window, an unfinished block) go to 8 bits,
    its folded rows stay at ``VELOX_QUANT_BITS`` (4), and it still generates (docs/how-it-works.md)."""
    veloxpatch.patch(kv="quant", window=8)
    caches = make_prompt_cache(model)
    tokens = [t for t, _ in generate_step(random_tokens(300, 51), model, max_tokens=10, prompt_cache=caches,
                                          kv_bits=8, kv_group_size=32, quantized_kv_start=0)]
    assert len(tokens) == 10
    assert all(c.store.bits == 8 and c.folds and c._fold_bits(c.folds[0]) == 4 for c in caches)


def test_a_quantized_cache_saves_and_loads_back(model, tmp_path) -> None:
    veloxpatch.patch(kv="streamingllm", budget=64, window=8, tier="off")
    caches = [c.to_quantized(group_size=32, bits=4) for c in prefilled(model)]
    path = str(tmp_path / "q.safetensors")
    save_prompt_cache(path, caches)
    loaded = load_prompt_cache(path)
    assert all(c.store.bits == 4 for c in loaded)
    assert mx.array_equal(next_logits(model, loaded), next_logits(model, caches)).item()


def test_a_format_mlx_cannot_store_is_refused_once_and_the_cache_stays(caplog) -> None:
    veloxpatch.patch(kv="snapkv", budget=64, window=8, tier="off")
    caches = prefilled(tiny("llama"))  # head_dim 16: no group of 32 fits
    with caplog.at_level(logging.WARNING, logger="veloxpatch"):
        again = [c.to_quantized(group_size=32, bits=8) for c in caches]
    assert again == caches and all(c.store.bits is None for c in caches)
    assert sum("not honoured" in r.message for r in caplog.records) == 1
