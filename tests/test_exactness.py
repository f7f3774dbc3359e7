"""With nothing to drop, a patched model generates exactly what unpatched mlx_lm generates."""

from __future__ import annotations

import logging
import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

import veloxpatch
from conftest import ARCHS, random_tokens, tiny
from veloxpatch.caches import CompressedKVCache


def greedy(model, prompt: mx.array, steps: int = 12, chunk: int = 32) -> list[int]:
    return [t for t, _ in generate_step(prompt, model, max_tokens=steps, prefill_step_size=chunk)]


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("method,budget", [("snapkv", 4096), ("snapkv", "100%"), ("streamingllm", 4096)])
def test_full_budget_is_exact(arch: str, method: str, budget) -> None:
    model = tiny(arch)
    prompt = random_tokens(150, 1)  # > 4 prefill chunks
    expected = greedy(model, prompt)
    veloxpatch.patch(kv=method, budget=budget)
    caches = make_prompt_cache(model)
    ours = [c for c in caches if isinstance(c, CompressedKVCache)]
    assert ours, "the patch must really replace the full-attention slots"
    assert greedy(model, prompt) == expected
    veloxpatch.unpatch()
    assert greedy(model, prompt) == expected


@pytest.mark.parametrize("arch,other", [("gemma3_text", "RotatingKVCache"), ("lfm2", "ArraysCache")])
def test_only_full_attention_slots_are_replaced(arch: str, other: str) -> None:
    model = tiny(arch)
    vanilla = [type(c).__name__ for c in make_prompt_cache(model)]
    veloxpatch.patch(kv="snapkv", budget=64)
    patched = [type(c).__name__ for c in make_prompt_cache(model)]
    assert vanilla == [other, "KVCache", other, "KVCache"]
    assert patched == [other, "SnapKVCache", other, "SnapKVCache"]


def test_a_model_with_no_replaceable_slot_runs_unpatched_with_one_log_line(caplog) -> None:
    model = tiny("qwen2")  # no make_cache of its own, so mlx_lm honours max_kv_size
    veloxpatch.patch(kv="snapkv", budget=64, log="INFO")
    logger = logging.getLogger("veloxpatch")
    logger.addHandler(caplog.handler)
    try:
        for _ in range(3):  # max_kv_size asks mlx_lm for RotatingKVCache slots: the user's choice stands
            assert {type(c).__name__ for c in make_prompt_cache(model, max_kv_size=64)} == {"RotatingKVCache"}
    finally:
        logger.removeHandler(caplog.handler)
    lines = [r.getMessage() for r in caplog.records if "running unpatched" in r.getMessage()]
    assert len(lines) == 1 and "no plain full-attention KVCache slot" in lines[0]


def test_compression_changes_nothing_until_the_budget_is_reached() -> None:
    """Under budget the cache is dense, so the tokens match up to the first eviction, which
    does come: 40 prompt tokens, a budget of 48 and 8 rows of decode headroom evict at 56."""
    model = tiny("llama")
    prompt = random_tokens(40, 2)
    expected = greedy(model, prompt, steps=30)
    veloxpatch.patch(kv="snapkv", budget=48, window=8)
    caches = make_prompt_cache(model)
    tokens = [t for t, _ in generate_step(prompt, model, max_tokens=30, prefill_step_size=32, prompt_cache=caches)]
    assert all(c.evicted and c.offset == 70 and c.size() < 56 for c in caches)
    assert tokens[:16] == expected[:16], "identical while every row is still held"
