"""Quant with VELOX_QUANT_KEEP below 100%: once a prompt is read, the model reads it a second time (KVzip's score)
and each head keeps the rows that reading attends to most; what is scored, what is kept, and that the rows kept are
the first reading's."""

from __future__ import annotations

import mlx.core as mx
import mlx_lm.models.llama as llama
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import KVCache, load_prompt_cache, make_prompt_cache, save_prompt_cache

import veloxpatch
from conftest import assert_round_trip, drain, greedy, random_tokens, tiny
from veloxpatch.caches import CacheSpec
from veloxpatch.config import Budget, ConfigError
from veloxpatch.methods.quant import HOLD_BITS, QuantCache
from veloxpatch.settings import Share

PROMPT = 100  # one prompt chunk: 92 rows older than the window, of which 64 (two blocks of 32) fold


def quant_caches(model, keep: str, bits: int = 4, window: int = 8) -> list[QuantCache]:
    veloxpatch.patch(kv="quant", window=window, sink=4, compress="chunk",
                     knobs={"quant_group": 32, "quant_bits": bits, "quant_keep": keep})
    return make_prompt_cache(model)


def reference_scores(model, prompt: mx.array, monkeypatch) -> list[mx.array]:
    """Per layer (B, kv heads, rows): the most attention any query (of any head of a row's group) of the prompt read
    a second time pays each row of the first reading, with mlx_lm's own cache and attention."""
    veloxpatch.unpatch()
    seen: list[tuple[mx.array, mx.array, float]] = []
    original = llama.scaled_dot_product_attention

    def recorder(queries, keys, values, cache, scale, mask, sinks=None):
        seen.append((queries, keys, scale))
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask)

    monkeypatch.setattr(llama, "scaled_dot_product_attention", recorder)
    caches = [KVCache() for _ in model.layers]
    model(prompt[None], cache=caches)
    seen.clear()
    model(prompt[None], cache=caches)
    monkeypatch.setattr(llama, "scaled_dot_product_attention", original)
    out = []
    for queries, keys, scale in seen:
        b, hq, n, d = queries.shape
        heads, rows = keys.shape[1], keys.shape[2]
        logits = (queries * scale).reshape(b, heads, hq // heads, n, d) @ keys[:, :, None].swapaxes(-1, -2)
        causal = mx.arange(rows)[None] <= (rows - n + mx.arange(n))[:, None]
        probs = mx.softmax(mx.where(causal, logits, -mx.inf), axis=-1, precise=True)
        out.append(probs[..., : rows - n].max(axis=(2, 3)))
    return out


def test_rows_are_scored_by_the_second_reading_and_each_head_keeps_its_best(monkeypatch) -> None:
    model = tiny("llama", layers=2)
    prompt = random_tokens(PROMPT + 1, 4)
    expected = reference_scores(model, prompt[:PROMPT], monkeypatch)
    recorded: list[mx.array] = []
    stop = QuantCache.stop_rereading

    def record(self, read):
        recorded.append(self.scores)
        stop(self, read)

    monkeypatch.setattr(QuantCache, "stop_rereading", record)
    caches = quant_caches(model, "50%", bits=16)  # exact rows: the scores are the reference's
    greedy(model, prompt, caches, steps=1, chunk=PROMPT)
    assert len(recorded) == 2, "the prompt was read again once, each layer scoring its rows"
    for cache, got, want in zip(caches, recorded, expected):
        assert mx.allclose(got, want[..., :64], atol=1e-4).item(), float(mx.abs(got - want[..., :64]).max())
        (fold,) = cache.folds
        assert (fold.start, fold.end, cache.held_rows(fold)) == (0, 64, 32), "4 sinks and half of 60: one block"
        score = mx.where(mx.arange(64) < 4, mx.inf, want[..., :64])
        best = mx.sort(mx.argsort(-score, axis=-1)[..., :32], axis=-1)
        assert mx.array_equal(cache.fold_positions(fold), best).item(), "each head's 32 best rows, the sinks first"
        assert cache.store.rows == cache.offset - 64, "the second reading left no row"
        assert cache.offset == PROMPT + 2, "the prompt, and generate_step's one step ahead"


def test_keeping_every_row_reads_each_prompt_chunk_once(monkeypatch) -> None:
    model = tiny("llama", layers=2)
    calls: list[int] = []
    update = QuantCache.update_and_fetch

    def counted(self, keys, values):
        calls.append(keys.shape[2])
        return update(self, keys, values)

    monkeypatch.setattr(QuantCache, "update_and_fetch", counted)
    prompt = random_tokens(101, 5)
    for keep, readings in (("100%", 1), ("40%", 2)):
        caches = quant_caches(model, keep)
        calls.clear()  # (building the caches probed the model)
        greedy(model, prompt, caches, steps=2, chunk=80)  # 80 tokens, then 20: a step of 64 or fewer is decode-sized
        assert calls[: 2 * readings] == [80, 80] * readings, f"{keep}: two layers, the 80-token chunk {readings}x"
        assert calls[2 * readings : 2 * readings + 2] == [20, 20], "the rest of the prompt once, after the second"
        assert set(calls[2 * readings + 2 :]) == {1}, "then decode steps only"


def test_the_rows_kept_are_the_first_readings_at_their_positions() -> None:
    model = tiny("llama", layers=2)
    prompt = random_tokens(300, 6)
    every, some = quant_caches(model, "100%", bits=8), quant_caches(model, "40%", bits=8)
    greedy(model, prompt, every, steps=4, chunk=300)  # one chunk: no layer's rows depend on another's choice
    greedy(model, prompt, some, steps=4, chunk=300)
    for full, kept in zip(every, some):
        assert kept.offset == full.offset and kept.size() < full.size()
        spare = kept.store.capacity - kept.store.rows
        assert spare < kept.store.step, f"{spare} spare rows: the room the second reading took is given back"
        positions = kept.fold_positions(kept.folds[0])
        assert (positions[..., 1:] > positions[..., :-1]).all().item(), "ascending per head"
        assert (positions[..., :4] == mx.arange(4)).all().item(), "the sinks stay"
        rows = mx.take_along_axis(full.rows()[0], positions[..., None], axis=2)
        step = float(mx.abs(rows).max()) * 2 / 255  # one 8-bit level of these keys (up to ~13 here)
        assert mx.allclose(kept.unfold(kept.folds[0])[0], rows, atol=step).item(), "the same rows, rounded twice"


def test_a_trim_into_the_kept_rows_leaves_a_cache_of_the_prefix(tmp_path) -> None:
    model = tiny("llama", layers=2)
    caches = quant_caches(model, "40%")
    greedy(model, random_tokens(300, 7), caches, steps=3, chunk=128)
    loaded = assert_round_trip(str(tmp_path / "kept.safetensors"), model, caches)
    for cache in loaded:
        cache.trim(cache.offset - 150)
        (fold,) = cache.folds
        assert cache.offset == 150 and fold.end == 150 and cache.store.rows == 0
        assert (cache.fold_positions(fold) < 150).all().item() and cache.held_rows(fold) % 32 == 0
        assert cache.size() == cache.held_rows(fold)
    assert len(greedy(model, mx.array([3, 4]), loaded, steps=3)) == 3


@pytest.mark.parametrize("keep", ["0%", "101%", "40", "half"])
def test_a_bad_share_to_keep_is_refused_by_name(keep: str) -> None:
    with pytest.raises(ConfigError, match=rf"VELOX_QUANT_KEEP='{keep}' is not allowed: expected a percentage"):
        veloxpatch.patch(kv="quant", knobs={"quant_keep": keep})


@pytest.mark.parametrize("n", [1, 5])
def test_a_decode_step_over_kept_rows_equals_attention_over_them_rebuilt(n: int) -> None:
    mx.random.seed(n)
    cache = QuantCache(CacheSpec(Budget(tokens=64), window=8, mode="chunk"), bits=4, group=32, keep=Share(0.4))
    rows = mx.random.normal((1, 2, 300, 64))
    keys, values = cache.update_and_fetch(rows, rows)
    cache.attend(mx.random.normal((1, 6, 300, 64)), keys, values, 0.125, "causal")
    cache.scores = mx.random.uniform(shape=(1, 2, 288))  # as a second reading leaves them
    cache.stop_rereading(True)
    assert cache.held_rows(cache.folds[0]) == 128, "4 sinks and 40% of 284 rows: 3.7 blocks of 32, rounded to 4"
    keys, values = cache.update_and_fetch(mx.random.normal((1, 2, n, 64)), mx.random.normal((1, 2, n, 64)))
    queries = mx.random.normal((1, 6, n, 64))
    held = cache.attend_held(queries, 0.125)
    assert held is not None and cache._held_usable(queries, None, None)
    rebuilt = cache._attention(queries, keys, values, 0.125, None if n == 1 else "causal", None)
    assert mx.allclose(held, rebuilt, atol=1e-5).item()


def test_every_row_stays_while_the_prompt_is_read_and_the_share_after_it() -> None:
    model = tiny("llama", layers=2)
    caches = quant_caches(model, "35%", window=32)
    prompt = random_tokens(769, 8)
    for start in range(0, 768, 256):
        model(prompt[None, start : start + 256], cache=caches)
        assert [c.held_rows(c.folds[0]) for c in caches] == [start + 256 - 32] * 2, "every row older than the window"
    greedy(model, prompt[768:], caches, steps=1)
    for cache in caches:
        (fold,) = cache.folds
        assert fold.end == 736 and cache.held_rows(fold) == 256, "4 sinks and 35% of 732 (260), in blocks of 32"


def test_batched_sequences_keep_every_row_and_say_so(records) -> None:
    model = tiny("llama", layers=2)
    prompts = [random_tokens(n, seed).tolist() for n, seed in ((90, 1), (140, 2))]
    veloxpatch.patch(kv="quant", window=4, compress="chunk", knobs={"quant_group": 32})
    every_row = [greedy(model, mx.array(p), steps=12, chunk=100) for p in prompts]
    veloxpatch.patch(kv="quant", window=4, compress="chunk", log="INFO", knobs={"quant_group": 32, "quant_keep": "40%"})
    gen = BatchGenerator(model, max_tokens=12, prefill_step_size=100)
    assert drain(gen, gen.insert(prompts)) == every_row
    assert any("sequences generated in a batch keep every row" in r.getMessage() for r in records)


def first_reading(model, prompt: mx.array) -> list[mx.array]:
    """Per layer, the keys mlx_lm's own cache holds after reading ``prompt`` in one chunk."""
    veloxpatch.unpatch()
    caches = [KVCache() for _ in model.layers]
    model(prompt[None], cache=caches)
    return [c.keys[..., : c.offset, :] for c in caches]


def once_at(keys: mx.array, bits: int, group: int) -> mx.array:
    """``keys`` quantized per channel in blocks of ``group`` rows, once, and back."""
    parts = mx.quantize(mx.swapaxes(keys, 2, 3), group_size=group, bits=bits)
    return mx.swapaxes(mx.dequantize(*parts, group_size=group, bits=bits), 2, 3)


def key_bits(cache: QuantCache) -> list[int]:
    return [cache._key_bits(fold.own[0]) for fold in cache.folds]


def test_a_prompt_is_held_at_eight_bits_until_its_rows_are_chosen_then_quantized_once() -> None:
    model = tiny("llama", layers=2)
    prompt = random_tokens(301, 9)
    exact = first_reading(model, prompt[:300])
    caches = quant_caches(model, "40%")
    model(prompt[None, :300], cache=caches)
    assert [key_bits(c) for c in caches] == [[HOLD_BITS]] * 2, "the prompt's keys wait at 8 bits for its scores"
    greedy(model, prompt[300:], caches, steps=1)
    for cache, keys in zip(caches, exact):
        (fold,) = cache.folds
        assert key_bits(cache) == [4] and cache.held_rows(fold) < 300 - 8
        chosen = mx.take_along_axis(keys, cache.fold_positions(fold)[..., None], axis=2)
        kept_error = float(mx.abs(cache.unfold(fold)[0] - chosen).mean())
        once_error = float(mx.abs(once_at(chosen, 4, 32) - chosen).mean())
        assert kept_error < 1.05 * once_error, f"{kept_error} vs {once_error}: the rows kept rounded to 4 bits once"


def test_a_second_prompt_holds_its_own_keys_and_keeps_every_earlier_row() -> None:
    model = tiny("llama", layers=2)
    caches = quant_caches(model, "40%")
    greedy(model, random_tokens(200, 10), caches, steps=2, chunk=200)
    before = [c.fold_positions(c.folds[0]) for c in caches]
    second = random_tokens(161, 11)
    model(second[None, :160], cache=caches)
    assert [key_bits(c) for c in caches] == [[4, HOLD_BITS]] * 2, "the first turn's fold, the new prompt's"
    greedy(model, second[160:], caches, steps=1)
    for cache, earlier in zip(caches, before):
        (fold,) = cache.folds
        positions = cache.fold_positions(fold)
        assert key_bits(cache) == [4]
        assert mx.array_equal(positions[..., : earlier.shape[-1]], earlier).item(), "every earlier row stays"
        assert int((positions >= 202).sum(axis=-1).max()) < 160 - 8, "the new prompt's rows were chosen"


def test_held_keys_settle_at_four_bits_when_no_second_reading_comes(tmp_path) -> None:
    model = tiny("llama", layers=2)
    prompt = random_tokens(300, 12)
    caches = quant_caches(model, "40%")
    model(prompt[None], cache=caches)  # a prompt cache built and saved without a decode step (mlx_lm cache_prompt)
    save_prompt_cache(str(tmp_path / "held.safetensors"), caches)
    loaded, _ = load_prompt_cache(str(tmp_path / "held.safetensors"), return_metadata=True)
    assert [key_bits(c) for c in loaded] == [[HOLD_BITS]] * 2
    greedy(model, mx.array([5]), loaded, steps=2)
    assert [key_bits(c) for c in loaded] == [[4]] * 2, "settled at the first decode step, every row kept"
    assert [c.held_rows(c.folds[0]) for c in loaded] == [288] * 2
    model(prompt[None], cache=caches)
    for cache in caches:  # a trim into held keys settles them first
        cache.trim(cache.offset - 100)
        assert key_bits(cache) == [4] and cache.folds[0].end == 96 and cache.offset == 100
