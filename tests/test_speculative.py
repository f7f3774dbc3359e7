"""Speculative decoding under the shim: mlx_lm rewinds rejected draft tokens with trim_prompt_cache."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm import load, stream_generate
from mlx_lm.models.cache import KVCache, make_prompt_cache

import veloxpatch
from veloxpatch.assets import model_path
from veloxpatch.eval import tasks

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def models():
    """The shipped model and a noisy copy of it as the draft: it agrees only some of the time."""
    model, tokenizer = load(str(model_path()))
    draft, _ = load(str(model_path()))
    noisy = [(k, v + 0.5 * v.std() * mx.random.normal(v.shape, key=mx.random.key(i))) if v.ndim > 1 else (k, v)
             for i, (k, v) in enumerate(tree_flatten(draft.parameters()))]
    draft.update(tree_unflatten(noisy))
    mx.eval(draft.parameters())
    prompt, answer = tasks.passkey_example(tokenizer, 512, 2001)
    return model, draft, tokenizer, tokenizer.encode(prompt), answer


def speculate(models, witness: bool = False, **settings) -> tuple[list, list]:
    """Greedy speculative generation; returns the responses and the main + draft caches.

    With ``witness`` the first layer of each model keeps mlx_lm's own ``KVCache``, whose offset
    mlx_lm's rewind keeps right: every other cache must agree with it."""
    model, draft, tokenizer, prompt, _ = models
    veloxpatch.unpatch()
    if settings:
        veloxpatch.patch(**settings)
    main, drafts = make_prompt_cache(model), make_prompt_cache(draft)
    if witness:
        main[0], drafts[0] = KVCache(), KVCache()
    caches = main + drafts
    out = list(stream_generate(model, tokenizer, prompt, max_tokens=NEW_TOKENS, draft_model=draft,
                               prompt_cache=caches, num_draft_tokens=3))
    return out, caches


def test_with_a_big_budget_speculative_output_is_unpatched_output(models) -> None:
    plain, _ = speculate(models)
    drafted = sum(r.from_draft for r in plain)
    assert 0 < drafted < NEW_TOKENS, "the draft must disagree some of the time for the rewind to be tested"
    patched, caches = speculate(models, kv="snapkv", budget=4096, window=16)
    assert [r.token for r in patched] == [r.token for r in plain]
    assert any(type(c).__name__ == "SnapKVCache" for c in caches)


def test_with_compression_every_offset_is_the_tokens_seen(models) -> None:
    out, caches = speculate(models, witness=True, kv="snapkv", budget=128, window=16)
    layers = len(models[0].layers)
    for part in (caches[:layers], caches[layers:]):
        witness, ours = part[0], part[1:]
        assert type(witness) is KVCache and all(type(c).__name__ == "SnapKVCache" and c.evicted for c in ours)
        assert [c.offset for c in ours] == [witness.offset] * len(ours), "no drift after rewinds"
    for cache in caches[1:layers] + caches[layers + 1 :]:
        newest = cache.store.row_positions().max().item()
        assert newest == cache.offset - 1 and cache.size() < 128 + cache.schedule.headroom(128)
    assert tasks.is_correct(models[2].decode([r.token for r in out]), models[4])


def test_the_draft_can_keep_mlx_lms_own_cache(models) -> None:
    """VELOX_DRAFT_KV=none: through stream_generate without a prompt cache, and with one."""
    model, draft, tokenizer, prompt, answer = models
    veloxpatch.patch(kv="snapkv", budget=128, window=16, draft_kv="none")
    out = list(stream_generate(model, tokenizer, prompt, max_tokens=NEW_TOKENS, draft_model=draft))
    assert tasks.is_correct(tokenizer.decode([r.token for r in out]), answer)
    caches = make_prompt_cache(model) + make_prompt_cache(draft)
    list(stream_generate(model, tokenizer, prompt, max_tokens=4, draft_model=draft, prompt_cache=caches))
    main, drafts = caches[: len(model.layers)], caches[len(model.layers) :]
    assert all(type(c).__name__ == "SnapKVCache" and c.evicted for c in main)
    assert all(type(c).__name__ == "KVCache" and c.offset == main[0].offset for c in drafts)


@pytest.mark.parametrize("budgets", ["layer", "model"])
def test_rows_chosen_by_a_second_reading_survive_the_rewinds(models, budgets: str) -> None:
    """Quant keeping half the prompt's rows (each prompt read twice, the rows chosen by its own layer's share or by
    one top-k over every layer's) under speculative decoding: main and draft lists each read their prompt again
    (no witness: a list with a cache not ours is read once), every offset is the tokens seen through the rewinds
    (the prompt and the answer but its last token, as mlx_lm's own caches end), rows were dropped, and the passkey
    is still found."""
    out, caches = speculate(models, kv="quant", window=16, knobs={"quant_keep": "50%", "quant_budgets": budgets})
    layers, seen = len(models[0].layers), len(models[3]) + NEW_TOKENS - 1
    assert len(out) == NEW_TOKENS and all(type(c).__name__ == "QuantCache" for c in caches)
    assert [c.offset for c in caches] == [seen] * len(caches), "no drift after rewinds"
    for part in (caches[:layers], caches[layers:]):
        assert sum(c.size() for c in part) < 0.75 * seen * layers, [c.size() for c in part]
    assert tasks.is_correct(models[2].decode([r.token for r in out]), models[4])
