"""With nothing to drop, a patched model generates exactly what unpatched mlx_lm generates."""

from __future__ import annotations

import functools
import logging

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

import veloxpatch
from conftest import ARCHS, greedy, random_tokens, tiny
from veloxpatch.caches import CompressedKVCache
from veloxpatch.registry import METHODS, name_of

# every method with its defaults (and snapkv with a fractional budget) on every architecture ...
# (cross-layer methods at full rank: their folds keep every dimension)
FULL = {"xkv": {"xkv_rank": "100%"},
        "minicache": {"minicache_start": 0.0, "minicache_gamma": 1.0},  # every layer paired, every token kept
        "xquant": {"xquant_bits": 16, "xquant_cl_bits": 16},  # X and deltas unquantized: K, V are the model's
        "quant": {"quant_bits": 16}}
EXACT = [(arch, method, 4096, FULL.get(method, {})) for arch in sorted(ARCHS) for method in sorted(METHODS)]
EXACT += [(arch, "snapkv", "100%", {}) for arch in sorted(ARCHS)]
EXACT += [(arch, "xkv", 4096, {}) for arch in ("gemma3_text", "llama")]  # auto rank: nothing to save, no fold
# ... and the budgets and knobs with a path of their own: per-layer budgets from a percentage (with
# the most uneven squeeze schedule), chunkkv's layer-wise index reuse
EXACT += [(arch, method, budget, knobs) for arch in ("gemma3_text", "llama", "qwen3") for method, budget, knobs in (
    ("pyramidkv", "100%", {}), ("squeeze", "100%", {"squeeze_strength": 1.0}), ("chunkkv", 4096, {"chunkkv_reuse": 2}))]


def case_id(case) -> str:
    arch, method, budget, knobs = case
    return "-".join([method, str(budget), *(f"{k}={v}" for k, v in knobs.items()), arch])


def same_model(arch: str):
    """``tiny(arch)``, the same every time: the weights ``build`` leaves (qwen2's biases) come from
    the global generator as it stands, so that is set first."""
    mx.random.seed(0)
    return tiny(arch)


@functools.cache
def mlx_lms_tokens(arch: str) -> list[int]:
    """Unpatched mlx_lm's greedy tokens for the prompt of the test below, once per architecture."""
    assert not veloxpatch.is_patched()
    return greedy(same_model(arch), random_tokens(150, 1))


@pytest.mark.parametrize("arch,method,budget,knobs", EXACT, ids=[case_id(c) for c in EXACT])
def test_full_budget_is_exact(arch: str, method: str, budget, knobs: dict) -> None:
    expected = mlx_lms_tokens(arch)
    model = same_model(arch)
    prompt = random_tokens(150, 1)  # > 4 prefill chunks
    veloxpatch.patch(kv=method, budget=budget, knobs=knobs)
    caches = make_prompt_cache(model)
    ours = [c for c in caches if isinstance(c, CompressedKVCache)]
    assert ours, "the patch must really replace the full-attention slots"
    assert all(name_of(c) == method for c in ours)
    assert greedy(model, prompt, caches) == expected
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


def test_an_apps_max_kv_size_is_said_as_why_nothing_is_compressed(records) -> None:
    """Servers pass their context limit as ``max_kv_size`` (mlx-dev-server's ``--max-kv-size``): the line says that
    this, not the model, left the list mlx_lm's, and the list stays what the app asked for."""
    model = tiny("qwen2")
    veloxpatch.patch(kv="snapkv", budget=64, log="INFO")
    assert {type(c).__name__ for c in make_prompt_cache(model, 64)} == {"RotatingKVCache"}
    assert {type(c).__name__ for c in make_prompt_cache(model)} == {"SnapKVCache"}, "without it: compressed"
    lines = [r.getMessage() for r in records if "running unpatched" in r.getMessage()]
    assert lines == ["qwen2: no plain full-attention KVCache slot: the app's max_kv_size=64 asked mlx_lm for "
                     "RotatingKVCache slots, a window of the app's own that veloxpatch leaves as it is (without "
                     "max_kv_size they would be plain KVCache slots, compressed); running unpatched"]


def test_compression_changes_nothing_until_the_budget_is_reached() -> None:
    """Under budget the cache is dense, so the tokens match up to the first eviction, which
    does come: 40 prompt tokens, a budget of 48 and 8 rows of decode headroom evict at 56."""
    model = tiny("llama")
    prompt = random_tokens(40, 2)
    expected = greedy(model, prompt, steps=30)
    veloxpatch.patch(kv="snapkv", budget=48, window=8)
    caches = make_prompt_cache(model)
    tokens = greedy(model, prompt, caches, steps=30)
    assert all(c.evicted and c.offset == 70 and c.size() < 56 for c in caches)
    assert tokens[:16] == expected[:16], "identical while every row is still held"
