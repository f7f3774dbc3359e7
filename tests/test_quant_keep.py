"""Quant with VELOX_QUANT_KEEP below 100%: once a prompt is read, the model reads it a second time (KVzip's score)
and the layer keeps the rows that reading attends to most, one top-k over its heads (heads keep different numbers:
a ragged fold); what is scored, what is kept, that the rows kept are the first reading's, and that a ragged fold
attends, trims, saves and joins a later turn as the rows it holds."""

from __future__ import annotations

import gc

import mlx.core as mx
import mlx_lm.models.llama as llama
import numpy as np
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import KVCache, load_prompt_cache, make_prompt_cache, save_prompt_cache

import veloxpatch
from conftest import assert_round_trip, drain_with_caches, greedy, random_tokens, tiny
from veloxpatch import memo, stats
from veloxpatch.caches import CacheSpec
from veloxpatch.config import Budget, ConfigError
from veloxpatch.eval.variants import Variant
from veloxpatch.integration import rereading
from veloxpatch.methods import quant
from veloxpatch.methods.quant import HOLD_BITS, BytesShare, QuantCache, _ragged, _top_per_head, _unless_taken
from veloxpatch.settings import Share

PROMPT = 100  # one prompt chunk: 92 rows older than the window, of which 64 (two blocks of 32) fold


def quant_caches(model, keep: str, bits: int = 4, window: int = 8, pool: int = 7,
                 budgets: str = "layer") -> list[QuantCache]:
    veloxpatch.patch(kv="quant", window=window, sink=4, compress="chunk",
                     knobs={"quant_group": 32, "quant_bits": bits, "quant_keep": keep, "quant_pool": pool,
                            "quant_budgets": budgets})
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


def head_positions(cache: QuantCache, fold) -> list[np.ndarray]:
    """Each head's rows' positions, its holes (a ragged fold's padding) left out."""
    return [p[p >= 0] for p in np.array(cache.fold_positions(fold))[0]]


def pooled(score: np.ndarray, fresh: np.ndarray, width: int) -> np.ndarray:
    """Each fresh row's score the most of the fresh rows' within ``width // 2`` of it (others 0)."""
    half, rows = width // 2, score.shape[-1]
    fresh_scores = np.where(fresh, score, 0)
    out = np.stack([fresh_scores[..., max(0, i - half): i + half + 1].max(axis=-1) for i in range(rows)], axis=-1)
    return np.where(fresh, out, 0)


def headwise(score: np.ndarray, protected: np.ndarray, keep: float, group: int, pool: int = 7) -> list[np.ndarray]:
    """The rows (H, rows) of ``score`` head-wise selection keeps, per head, ascending: each fresh row's (not
    ``protected``) score pooled over ``pool`` neighbours, over its head's sum on the fresh rows, one top-k of
    ``keep`` of every head's fresh rows, each head's count (its protected rows and those chosen) rounded to whole
    blocks, at least one; its protected rows, then its best."""
    fresh = ~protected
    normed = pooled(score, fresh, pool)
    normed = normed / normed.sum(axis=-1, keepdims=True)
    top = np.argsort(-np.where(fresh, normed, -1).ravel(), kind="stable")[: round(keep * fresh.sum())]
    chosen = np.bincount(top // score.shape[1], minlength=score.shape[0])
    out = []
    for h in range(score.shape[0]):
        count = min(score.shape[1], max(group, round((chosen[h] + protected[h].sum()) / group) * group))
        out.append(np.sort(np.argsort(-np.where(protected[h], np.inf, normed[h]), kind="stable")[:count]))
    return out


def lopsided(model):
    """``model`` with its first KV head's keys six times larger and the second's a fifth (its attention peaks more
    there and spreads more here), so the heads' scores differ as a real model's do and head-wise budgets differ."""
    for layer in model.model.layers:
        weight = layer.self_attn.k_proj.weight
        half = weight.shape[0] // 2
        layer.self_attn.k_proj.weight = mx.concatenate([weight[:half] * 6, weight[half:] * 0.2])
    mx.eval(model.parameters())  # (the probe runs only on a model whose parameters are evaluated)
    return model


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
        assert (fold.start, fold.end) == (0, 64)
        best = headwise(np.array(want[0, :, :64]), np.broadcast_to(np.arange(64) < 4, (2, 64)), 0.5, 32)
        got = head_positions(cache, fold)
        assert all(np.array_equal(a, b) for a, b in zip(got, best)), "the heads' best normalized rows, sinks first"
        assert cache.store.rows == cache.offset - 64, "the second reading left no row"
        assert cache.offset == PROMPT + 2, "the prompt, and generate_step's one step ahead"


def test_keeping_every_row_reads_each_prompt_chunk_once(monkeypatch) -> None:
    model = tiny("llama", layers=2)
    calls: list[int] = []
    stored: list[int] = []
    update = QuantCache.update_and_fetch

    def counted(self, keys, values):
        calls.append(keys.shape[2])
        before = self.store.rows
        out = update(self, keys, values)
        stored.append(self.store.rows - before)
        assert out[0].shape[2] == self.size() + (0 if self.storing else keys.shape[2]), "every row, and the step's"
        return out

    monkeypatch.setattr(QuantCache, "update_and_fetch", counted)
    prompt = random_tokens(101, 5)
    lead = min(rereading.LEAD, 80)  # read again, the second chunk comes after the first's last tokens, by a call
    again = [80, 80, lead, lead, 20, 20]  # of their own (a call's activations no more than its chunk's)
    kept = [80, 80, 20, 20, 0, 0, lead, lead, 0, 0]  # a chunk read again is not stored, its lead is (then trimmed)
    for keep, reads in (("100%", [80, 80, 20, 20]), ("40%", [80, 80, 20, 20, *again])):
        caches = quant_caches(model, keep)
        calls.clear()  # (building the caches probed the model)
        stored.clear()
        greedy(model, prompt, caches, steps=2, chunk=80)  # 80 tokens, then 20 (as short as a decode step may be)
        assert calls[: len(reads)] == reads, f"{keep}: two layers, each chunk once, or twice (then led)"
        assert stored[: len(reads)] == kept[: len(reads)], f"{keep}: the rows each call stored"
        assert set(calls[len(reads) :]) == {1}, "then the prompt's last token and decode steps"


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
        full_keys, kept_keys = np.array(full.rows()[0][0]), np.array(kept.unfold(kept.folds[0])[0][0])
        for head, positions in enumerate(head_positions(kept, kept.folds[0])):
            assert (np.diff(positions) > 0).all(), "ascending per head"
            assert (positions[:4] == np.arange(4)).all(), "the sinks stay"
            rows = full_keys[head, positions]
            step = np.abs(rows).max() * 2 / 255  # one 8-bit level of these keys (up to ~13 here)
            assert np.allclose(kept_keys[head, : positions.size], rows, atol=step), "the same rows, rounded twice"


@pytest.mark.parametrize("heads", ["alike", "lopsided"])
def test_a_trim_into_the_kept_rows_leaves_a_cache_of_the_prefix(tmp_path, heads: str) -> None:
    model = tiny("llama", layers=2)
    model = lopsided(model) if heads == "lopsided" else model
    caches = quant_caches(model, "40%", pool=1 if heads == "alike" else 7)  # rows scored alone: alike heads, alike
    greedy(model, random_tokens(300, 8 if heads == "alike" else 9), caches, steps=3, chunk=150)  # counts
    assert [_ragged(c.folds[0]) for c in caches] == [heads == "lopsided"] * 2, "one own per head where they differ"
    loaded = assert_round_trip(str(tmp_path / "kept.safetensors"), model, caches)
    assert [_ragged(c.folds[0]) for c in loaded] == [heads == "lopsided"] * 2, "loaded as saved"
    for cache in loaded:
        before = head_positions(cache, cache.folds[0])
        cache.trim(cache.offset - 150)
        (fold,) = cache.folds
        assert cache.offset == 150 and fold.end == 150 and cache.store.rows == 0
        for positions, earlier in zip(head_positions(cache, fold), before):
            whole = (earlier < 150).sum() // 32 * 32
            assert np.array_equal(positions, earlier[:whole]), "each head's whole blocks before the end"
        assert cache.size() == cache.held_rows(fold) and cache.held_rows(fold) % 32 == 0
    assert len(greedy(model, mx.array([3, 4]), loaded, steps=3)) == 3


@pytest.mark.parametrize("keep", ["0%", "101%", "40", "half"])
def test_a_bad_share_to_keep_is_refused_by_name(keep: str) -> None:
    with pytest.raises(ConfigError, match=rf"VELOX_QUANT_KEEP='{keep}' is not allowed: expected a percentage"):
        veloxpatch.patch(kv="quant", knobs={"quant_keep": keep})


@pytest.mark.parametrize("keep", ["0x", "1.5x", "x", "-0.1x"])
def test_a_bad_share_of_the_bytes_is_refused_by_name(keep: str) -> None:
    with pytest.raises(ConfigError, match=rf"VELOX_QUANT_KEEP='{keep}' is not allowed: expected .* or a multiple in"):
        veloxpatch.patch(kv="quant", knobs={"quant_keep": keep})


@pytest.mark.parametrize(("share", "bits"), [(0.12, 4), (0.2, 4), (0.5, 16)])
def test_a_share_of_the_bytes_keeps_the_rows_that_make_each_layer_hold_it(tmp_path, share: float, bits: int) -> None:
    """``0.12x``: once the prompt is read each layer holds 0.12 of what the full cache would hold at 16 bits, every
    byte counted as ``usage.velox`` counts them (4-bit rows with their scales and positions, the exact rows, the
    store's room for the next rows, the sinks), and so with unquantized rows, within a block and a half (each head
    rounds to whole blocks of 32 rows, of 16 elements here, values in groups of 32 across rows). Saved and loaded, it
    stays a share of bytes."""
    model = lopsided(tiny("llama", layers=2))
    caches = quant_caches(model, f"{share}x", bits=bits, window=32)
    assert all(c.wants_rereading for c in caches)
    greedy(model, random_tokens(1025, 9), caches, steps=1, chunk=256)
    row = 32 * bits / 8 + (16 * 4 / 32 * 2 if bits < 16 else 0) + 2  # one row of one head, its scales and position
    for cache in caches:
        held = stats.held([cache])
        block = 32 * row / held["dense_kv_bytes_16bit"]  # one head's block of rows
        now = held["kv_bytes_16bit"] / held["dense_kv_bytes_16bit"]
        assert abs(now - share) <= 1.5 * block, (held, share, block)
    loaded = assert_round_trip(str(tmp_path / "share.safetensors"), model, caches)
    assert all(isinstance(c.keep, BytesShare) and c.keep == share for c in loaded)


def test_model_wise_budgets_hold_the_share_of_the_bytes_over_the_layers_not_in_each(tmp_path) -> None:
    """``0.12x`` with ``VELOX_QUANT_BUDGETS=model``: the layers hold different shares (a layer the second reading
    attends to more keeps more) and together 0.12 of the 16-bit bytes, within a block and a half per layer; saved
    and loaded (``save_prompt_cache``), they hold the same rows and answer the same."""
    model = lopsided(tiny("llama", layers=3))
    caches = quant_caches(model, "0.12x", window=32, budgets="model")
    greedy(model, random_tokens(1025, 9), caches, steps=1, chunk=256)
    held = [stats.held([cache]) for cache in caches]
    shares = [h["kv_bytes_16bit"] / h["dense_kv_bytes_16bit"] for h in held]
    row = 32 * 4 / 8 + 16 * 4 / 32 * 2 + 2  # one row of one head, its scales and position
    block = 32 * row / held[0]["dense_kv_bytes_16bit"]
    assert max(shares) - min(shares) > 2 * block, shares
    assert abs(sum(shares) / len(shares) - 0.12) <= 1.5 * block, shares
    loaded = assert_round_trip(str(tmp_path / "model-wise.safetensors"), model, caches)
    assert [c.budgets for c in loaded] == ["model"] * 3


def test_a_share_the_fixed_rows_spend_already_is_said(records) -> None:
    """A short prompt under a small share: the window and the unfinished block take most of it, and the user is told
    the prompt keeps almost none of its rows (a longer one under a larger share is not)."""
    model = tiny("llama", layers=2)
    greedy(model, random_tokens(1025, 9), quant_caches(model, "0.2x", window=32), steps=1, chunk=256)
    assert not [r for r in records if "VELOX_QUANT_KEEP" in r.getMessage()]
    greedy(model, random_tokens(200, 9), quant_caches(model, "0.12x", window=32), steps=1, chunk=256)
    (said,) = [r.getMessage() for r in records if "VELOX_QUANT_KEEP" in r.getMessage()]
    assert said.startswith("VELOX_QUANT_KEEP=0.12x: at 199 tokens the exact window")  # (the 200th is decoded)
    assert "keeps almost none of its rows" in said


def test_a_short_next_turn_is_not_said_to_keep_almost_nothing(records) -> None:
    """A question after a document under a share of the bytes keeps its own share, a few rows, while the document's
    rows keep theirs: that is the share working, not a setting to change, so nothing is said (the saved-cache flow:
    ``mlx_lm cache_prompt``, then ``generate --prompt-cache-file`` with a question, warned before)."""
    model = tiny("llama", layers=2)
    caches = quant_caches(model, "0.2x", window=32)
    greedy(model, random_tokens(1025, 9), caches, steps=1, chunk=256)
    assert any(c.folds for c in caches)
    greedy(model, random_tokens(40, 3), caches, steps=1, chunk=256)
    assert not [r for r in records if "VELOX_QUANT_KEEP" in r.getMessage()]


def test_the_process_holds_what_the_kept_rows_take_once_the_prompt_is_read_again() -> None:
    """Memory as mlx counts it (``mx.get_active_memory``), not only as the caches count it: after the second reading
    the process holds little more than the caches' bytes (nothing of the reading left: its scores, its rows, the
    prompt's chunks, every layer's candidates under model-wise budgets), and far less than with every row kept."""
    model = tiny("llama", layers=2)
    prompt = random_tokens(2049, 4)
    mx.eval(model.parameters(), prompt)
    held = {}
    limit = mx.set_cache_limit(0)  # no freed buffer handed to a smaller array: what is held is what is asked for
    for keep, budgets in (("100%", "layer"), ("0.125x", "layer"), ("0.125x", "model")):
        caches = quant_caches(model, keep, window=32, budgets=budgets)
        gc.collect()
        mx.clear_cache()
        before = mx.get_active_memory()
        greedy(model, prompt, caches, steps=1, chunk=512)
        mx.eval([c.state for c in caches])
        gc.collect()
        held[keep, budgets] = mx.get_active_memory() - before, sum(c.nbytes for c in caches)
        del caches
    mx.set_cache_limit(limit)
    every, every_bytes = held["100%", "layer"]
    assert every_bytes <= every <= every_bytes * 1.05, held
    for budgets in ("layer", "model"):
        kept, kept_bytes = held["0.125x", budgets]
        assert kept_bytes <= kept <= kept_bytes * 1.05 and kept < 0.5 * every, (budgets, held)


def test_a_share_of_the_bytes_every_row_fits_reads_each_prompt_once() -> None:
    """At 4 bits in blocks of 32 every row holds 5 of 16 bits (its scales counted): 0.35x keeps them all, 0.3x not."""
    model = tiny("llama", layers=2)
    assert not any(c.wants_rereading for c in quant_caches(model, "0.35x"))
    assert all(c.wants_rereading for c in quant_caches(model, "0.3x"))
    assert all(c.wants_rereading for c in quant_caches(model, "0.9x", bits=16)), "unquantized rows: every byte"


def test_an_eval_variant_keeps_a_share_of_the_bytes_as_one() -> None:
    """``quant[keep=0.125x]`` in `veloxpatch eval` builds caches keeping an eighth of the bytes, not of the rows, and
    its journal line keeps the ``x`` (``keep=30%`` stays the number 0.3 its earlier lines hold)."""
    variant, rows = Variant.of("quant[keep=0.125x]", 0.25), Variant.of("quant[keep=30%]", 0.25)
    assert variant.knobs == (("keep", "0.125x"),) and rows.knobs == (("keep", 0.3),)
    caches = variant.caches(tiny("llama", layers=2), 256)
    assert all(isinstance(c.keep, BytesShare) and c.keep == 0.125 for c in caches)


def read_300(budgets: str = "layer", floor: float = 0.0) -> QuantCache:
    """A cache that read 300 random rows (keys and values alike), 288 of them folded, to keep 40% of."""
    cache = QuantCache(CacheSpec(Budget(tokens=64), window=8, mode="chunk"), bits=4, group=32, keep=Share(0.4),
                       pool=1, budgets=budgets, floor=floor)  # the scores as given
    rows = mx.random.normal((1, 2, 300, 64))
    cache.read_prompt_chunk(mx.zeros((1, 300), mx.int32))
    keys, values = cache.update_and_fetch(rows, rows)
    cache.attend(mx.random.normal((1, 6, 300, 64)), keys, values, 0.125, "causal")
    return cache


def scored(caches: list[QuantCache], scores: list[mx.array]) -> None:
    """The caches' rows chosen as after a second reading that left ``scores`` (one (1, heads, rows) per layer)."""
    for cache, given in zip(caches, scores):
        cache.start_rereading()
        cache.scores = given  # as a second reading leaves them
        cache.stop_rereading(True)
    QuantCache.keep_chosen(caches)


def kept_by_scores(peaked: int, seed: int = 1) -> tuple[QuantCache, np.ndarray]:
    """:func:`read_300`'s rows kept by scores uniform in the first head and raised to the power ``peaked`` in the
    second (1: the heads alike; 8: a few of the second's rows stand out, the rest far below the first head's); and
    the scores, (heads, rows)."""
    mx.random.seed(seed)
    cache = read_300()
    uniform = mx.random.uniform(shape=(1, 2, 288))
    scores = mx.concatenate([uniform[:, :1], uniform[:, 1:] ** peaked], axis=1)
    scored([cache], [scores])
    return cache, np.array(scores[0])


def test_heads_keep_different_numbers_of_rows_their_best_normalized_and_the_layer_its_share() -> None:
    cache, score = kept_by_scores(peaked=8)
    (fold,) = cache.folds
    assert _ragged(fold), "the heads' counts differ: one own per head"
    got = head_positions(cache, fold)
    counts = [p.size for p in got]
    assert counts == [160, 64] and cache.held_rows(fold) == 160 and cache.size() == 160 + cache.store.rows
    assert abs(sum(counts) - (2 * 4 + 0.4 * 2 * 284)) <= 32, "the layer's total: the sinks and 40% of its rows"
    best = headwise(score, np.broadcast_to(np.arange(288) < 4, (2, 288)), 0.4, 32, pool=1)
    assert all(np.array_equal(a, b) for a, b in zip(got, best)), "each head's best normalized rows, sinks first"
    positions = np.array(cache.fold_positions(fold))[0]
    assert (positions[1, 64:] == -1).all(), "the shorter head padded with holes"
    keys, _ = cache.unfold(fold)
    assert keys.shape == (1, 2, 160, 64) and not mx.any(keys[0, 1, 64:]).item(), "zero rows at the holes"
    alike, _ = kept_by_scores(peaked=1)
    assert not _ragged(alike.folds[0]) and alike.held_rows(alike.folds[0]) == 128, "as many rows each: one array"


def test_model_wise_budgets_give_the_rows_to_the_layer_scored_higher_and_keep_the_models_total() -> None:
    mx.random.seed(2)
    caches = [read_300("model"), read_300("model")]
    uniform = mx.random.uniform(shape=(1, 2, 288))
    scored(caches, [uniform, uniform * 0.1])  # every row of the first layer above most of the second's
    counts = [[p.size for p in head_positions(c, c.folds[0])] for c in caches]
    assert min(counts[0]) > max(counts[1]), counts
    assert abs(sum(map(sum, counts)) - 2 * (2 * 4 + 0.4 * 2 * 284)) <= 64, "the two layers' shares in all"
    alone = [read_300("layer"), read_300("layer")]
    scored(alone, [uniform, uniform * 0.1])
    assert [[p.size for p in head_positions(c, c.folds[0])] for c in alone] == [[128, 128]] * 2, "each its own"


def kept_rows(budgets: str, scales: list[float], seed: int, floor: float = 0.0) -> list[list[int]]:
    """Rows each head keeps in layers of :func:`read_300` scored uniformly times each layer's scale."""
    mx.random.seed(seed)
    caches = [read_300(budgets, floor) for _ in scales]
    scored(caches, [mx.random.uniform(shape=(1, 2, 288)) * s for s in scales])
    return [[p.size for p in head_positions(c, c.folds[0])] for c in caches]


@pytest.mark.parametrize("scales", [[1, 0.5, 0.01, 0.01], [1, 0.3, 0.3, 0.001, 0.001, 0.001]])
@pytest.mark.parametrize("seed", [0, 1])
def test_model_wise_budgets_never_hold_more_rows_than_the_layers_own_shares(scales: list[float], seed: int) -> None:
    """Layers scored far below the others get few rows, but a head still holds a whole block in the first fold:
    the top-k shrinks until the model holds no more rows than each layer by its own share would (it held up to 6%
    more here before)."""
    model, layer = kept_rows("model", scales, seed), kept_rows("layer", scales, seed)
    assert sum(map(sum, model)) <= sum(map(sum, layer)), (model, layer)
    assert min(model[0]) > max(model[-1]), "still the layer scored higher keeps more"


def test_a_floor_keeps_each_layer_part_of_its_own_share_under_model_wise_budgets() -> None:
    """``VELOX_QUANT_FLOOR``: a layer scored far below the others keeps half its own share (in whole blocks) where
    the model-wise top-k alone leaves it a block per head; all of its share keeps what per layer keeps; the model
    never holds more than per layer."""
    scales = [1, 0.01]
    layer, alone = kept_rows("layer", scales, 3), kept_rows("model", scales, 3)
    half, whole = kept_rows("model", scales, 3, floor=0.5), kept_rows("model", scales, 3, floor=1.0)
    assert whole == layer and alone[1] == [32, 32] and layer[1] == [128, 128], (whole, layer, alone)
    assert min(half[1]) >= 64 and min(half[0]) > max(layer[0]), half
    assert sum(map(sum, half)) <= sum(map(sum, layer))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_top_k_after_a_floor_is_the_best_of_the_rows_each_head_left(seed: int) -> None:
    """The reference rule: each head's best ``taken`` rows out, then the ``total`` best of what is left, counted
    per head (fresh rows only)."""
    rng = np.random.default_rng(seed)
    layers = [(rng.random((1, 3, 50)) > 0.2, rng.random((1, 3, 50))) for _ in range(2)]
    taken = [list(rng.integers(0, 10, 3)) for _ in layers]
    left = []
    for (fresh, score), drop in zip(layers, taken):
        ranked = np.where(fresh, score, -1)[0]
        order = np.argsort(-ranked, axis=-1)
        out = ranked.copy()
        for head, k in enumerate(drop):
            out[head, order[head, :k]] = -1
        left.append(out)
    cut = np.sort(np.concatenate([x.ravel() for x in left]))[-40]
    expected = [[int((x[h] >= cut).sum()) for h in range(3)] for x in left]
    got = _top_per_head([(mx.array(f), _unless_taken(mx.array(f), mx.array(s), [int(t) for t in d]))
                         for (f, s), d in zip(layers, taken)], 40)
    assert got == expected


@pytest.mark.parametrize("peaked", [1, 8])
@pytest.mark.parametrize("n", [1, 5])
def test_a_decode_step_over_kept_rows_equals_attention_over_them_rebuilt(n: int, peaked: int) -> None:
    cache, _ = kept_by_scores(peaked)
    assert _ragged(cache.folds[0]) == (peaked > 1)
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
        counts = [p.size for p in head_positions(cache, fold)]
        assert fold.end == 736 and all(c % 32 == 0 for c in counts), "whole blocks of 32 per head"
        assert abs(sum(counts) - 2 * (4 + 0.35 * 732)) <= 32, "the layer's: 4 sinks and 35% of 732 per head"


@pytest.mark.parametrize("score", ["repeat", "snapkv", "heads"])
def test_batched_sequences_keep_the_rows_each_keeps_alone(score: str, monkeypatch) -> None:
    """mlx_lm's BatchGenerator (the server's batches): each sequence is read again alone (or scored by its own last
    queries, or by the heads' ratings a first prompt gave) at its first decode step and keeps the rows it keeps under
    generate_step, so it generates the same tokens; sequences of unequal length (right-padded steps), one of them
    still reading while the other decodes."""
    model = tiny("llama", layers=2)
    prompts = [random_tokens(n, seed).tolist() for n, seed in ((190, 1), (340, 2))]
    settings = dict(kv="quant", window=4, compress="chunk",
                    knobs={"quant_group": 32, "quant_keep": "40%", "quant_score": score})
    veloxpatch.patch(**settings)
    if score == "heads":  # a first prompt rates the heads; both runs below are chosen by the ratings
        monkeypatch.setattr(quant, "CALIBRATION_ROWS", 64)
        greedy(model, random_tokens(400, 3), make_prompt_cache(model), steps=1, chunk=100)
        assert memo.kept(rereading._ratings, model, "heads") is not None
    alone, kept = [], []
    for prompt in prompts:
        caches = make_prompt_cache(model)
        alone.append(greedy(model, mx.array(prompt), caches, steps=12, chunk=100))
        kept.append([head_positions(c, c.folds[0]) for c in caches])
    veloxpatch.patch(**settings)
    gen = BatchGenerator(model, max_tokens=12, prefill_step_size=100)
    tokens, left = drain_with_caches(gen, gen.insert(prompts))
    assert tokens == alone
    for caches, own, prompt in zip(left, kept, prompts):
        held = [head_positions(c, c.folds[0]) for c in caches if isinstance(c, QuantCache)]
        shares = [sum(map(len, layer)) / (len(layer) * len(prompt)) for layer in held]
        # model-wise budgets move rows between layers: the ratings can give one layer's best head all its rows
        assert len(held) == 2 and (max(shares) if score != "heads" else sum(shares) / 2) < 0.6
        assert all(np.array_equal(a, b) for layer, mine in zip(held, own) for a, b in zip(layer, mine))


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
    return [cache._fold_bits(fold) for fold in cache.folds]


def test_a_prompt_is_held_at_eight_bits_until_its_rows_are_chosen_then_quantized_once() -> None:
    model = tiny("llama", layers=2)
    prompt = random_tokens(301, 9)
    exact = first_reading(model, prompt[:300])
    caches = quant_caches(model, "40%", pool=1)  # rows scored alone: the heads keep as many (one array to compare)
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
        for had, has in zip(np.asarray(earlier)[0], np.asarray(positions)[0]):  # head by head, padding aside
            had = had[had >= 0]
            assert (has[: had.size] == had).all(), "every earlier row stays, first in its head"
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


def test_a_prompt_chunk_over_a_ragged_fold_attends_over_each_heads_real_rows_only() -> None:
    cache, _ = kept_by_scores(peaked=8)
    assert _ragged(cache.folds[0])
    folded_keys, folded_values = cache.unfold(cache.folds[0])
    counts = [p.size for p in head_positions(cache, cache.folds[0])]
    exact_keys, exact_values = cache.store.fetch()
    new_keys, new_values = mx.random.normal((1, 2, 100, 64)), mx.random.normal((1, 2, 100, 64))
    keys, values = cache.update_and_fetch(new_keys, new_values)  # 100 tokens: a prompt chunk, not decode-sized
    queries = mx.random.normal((1, 6, 100, 64))
    assert not cache._held_usable(queries, "causal", None)
    out = cache.attend(queries, keys, values, 0.125, "causal")
    by_hand = []
    for head, count in enumerate(counts):  # each head over its own rows, the exact ones after, causal among the new
        k = mx.concatenate([folded_keys[:, head: head + 1, :count], exact_keys[:, head: head + 1],
                            new_keys[:, head: head + 1]], axis=2)
        v = mx.concatenate([folded_values[:, head: head + 1, :count], exact_values[:, head: head + 1],
                            new_values[:, head: head + 1]], axis=2)
        by_hand.append(mx.fast.scaled_dot_product_attention(queries[:, 3 * head: 3 * head + 3], k, v, scale=0.125,
                                                             mask="causal"))
    assert mx.allclose(out, mx.concatenate(by_hand, axis=1), atol=1e-5).item()
    unmasked = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.125, mask="causal")
    assert not mx.allclose(out, unmasked, atol=1e-3).item(), "(the holes would count, unmasked)"


@pytest.mark.parametrize("bits", [4, 8])
def test_a_second_prompt_joins_a_ragged_fold_head_by_head(bits: int, monkeypatch) -> None:
    holes: list[np.ndarray] = []  # the scores the second reading gave the earlier fold's holes
    stop = QuantCache.stop_rereading

    def record(self, read):
        if self.scores is not None and _ragged(self.folds[0]):
            positions = self.fold_positions(self.folds[0])
            holes.append(np.array(self.scores[..., : positions.shape[-1]])[np.array(positions) < 0])
        stop(self, read)

    monkeypatch.setattr(QuantCache, "stop_rereading", record)
    model = lopsided(tiny("llama", layers=2))
    caches = quant_caches(model, "40%", bits=bits)
    greedy(model, random_tokens(230, 8), caches, steps=2, chunk=230)
    assert all(_ragged(c.folds[0]) for c in caches)
    before = [head_positions(c, c.folds[0]) for c in caches]
    second = random_tokens(161, 11)
    model(second[None, :160], cache=caches)
    assert [key_bits(c) for c in caches] == [[4, HOLD_BITS] if bits == 4 else [8]] * 2, "held apart below 8 bits"
    holes.clear()
    tokens = greedy(model, second[160:], caches, steps=3)
    assert len(tokens) == 3
    assert len(holes) == 2 and all(h.size and not h.any() for h in holes), "holes masked while scored"
    for cache, earlier in zip(caches, before):
        (fold,) = cache.folds
        assert key_bits(cache) == [bits]
        for positions, old in zip(head_positions(cache, fold), earlier):
            assert np.array_equal(positions[: old.size], old), "every earlier row stays in its head"
            assert (np.diff(positions) > 0).all() and (positions >= 232).sum() < 160 - 8, "the new prompt's chosen"


def test_a_chat_of_short_turns_holds_its_share_of_the_bytes() -> None:
    """A document, then turns of a 60-token prompt (as short as a decode step may be) and a 30-token answer: each
    turn is read twice too, and its rows (with the last window and answer) keep what the turn's tokens add to the
    share, so no layer holds more after a turn than after the first: 0.125 of the 16-bit bytes and the exact rows
    waiting to fold (at most the window, a block but one and the store's room). Before, such turns were read once
    and kept whole (a block per head at least): 0.141, 0.157, 0.171, 0.184 after the first four."""
    model = lopsided(tiny("llama", layers=2))
    caches = quant_caches(model, "0.125x", window=32)
    greedy(model, random_tokens(1025, 9), caches, steps=30, chunk=256)
    exact = 2 * (32 * 2 + 4)  # one exact row of both heads at 16 bits, and its positions
    shares: list[list[float]] = []
    for turn in range(4):
        greedy(model, random_tokens(60, 20 + turn), caches, steps=30, chunk=256)
        held = [stats.held([cache]) for cache in caches]
        shares.append([h["kv_bytes_16bit"] / h["dense_kv_bytes_16bit"] for h in held])
        waiting = [(32 + 31 + 8) * exact / h["dense_kv_bytes_16bit"] for h in held]
        assert all(s <= 0.125 + w for s, w in zip(shares[-1], waiting)), (turn, shares)
    assert all(last <= first for first, last in zip(shares[0], shares[-1])), shares


def chat_shares(budgets: str) -> list[float]:
    """The share of the 16-bit bytes three lopsided layers hold together after each of four short turns that follow
    a document, at ``0.125x``."""
    model = lopsided(tiny("llama", layers=3))
    caches = quant_caches(model, "0.125x", window=32, budgets=budgets)
    greedy(model, random_tokens(1025, 9), caches, steps=30, chunk=256)
    shares = []
    for turn in range(4):
        greedy(model, random_tokens(60, 20 + turn), caches, steps=30, chunk=256)
        held = [stats.held([cache]) for cache in caches]
        shares.append(sum(h["kv_bytes_16bit"] for h in held) / sum(h["dense_kv_bytes_16bit"] for h in held))
    return shares


def test_a_chat_under_model_wise_budgets_holds_what_the_layers_own_shares_hold() -> None:
    """With one top-k over every layer's rows a layer that kept more of the document has less room in a later turn
    than its part: it gives the excess back to the others (the layers' room is pooled), so after every turn the
    model holds what the layers by their own shares hold (0.146 down to 0.123 here, the window and the unfinished
    block waiting to fold). Counting each layer's room from none up, it held 0.152 down to 0.143."""
    model, layer = chat_shares("model"), chat_shares("layer")
    assert all(pooled <= own + 0.004 for pooled, own in zip(model, layer)), (model, layer)


def test_a_short_prompt_chunk_over_held_keys_attends_over_them_rebuilt() -> None:
    """A prompt chunk no longer than a decode step (a prompt's last chunk, a chat's next turn) over keys held at
    HOLD_BITS while the prompt awaits its second reading: attention over the rows rebuilt, not the quantized matmul
    at VELOX_QUANT_BITS (which cannot read them)."""
    mx.random.seed(1)
    cache = QuantCache(CacheSpec(Budget(tokens=64), window=8, mode="chunk"), bits=4, group=32, keep=Share(0.4),
                       pool=1)  # the scores as given
    for n in (300, 5):
        cache.read_prompt_chunk(mx.zeros((1, n), mx.int32))
        rows = mx.random.normal((1, 2, n, 64))
        keys, values = cache.update_and_fetch(rows, rows)
        queries = mx.random.normal((1, 6, n, 64))
        out = cache.attend(queries, keys, values, 0.125, "causal")
        reference = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.125, mask="causal")
        assert mx.allclose(out, reference, atol=1e-5).item()
        assert key_bits(cache) == [HOLD_BITS]


# --------------------------------------------------------------------- VELOX_QUANT_SCORE=expected
def expected_reference(queries: np.ndarray, keys: np.ndarray, values: np.ndarray, scale: float) -> np.ndarray:
    """Expected Attention's rule without rotation, by numpy: per KV head, the queries' mean and per-channel variance
    over the last ones, each row's logit ``scale * mu.k + scale**2 / 2 * var.k**2``, a softmax over the rows, the
    mean over the head's query heads, times the value's norm. (H, rows)"""
    hq, heads = queries.shape[1], keys.shape[1]
    out = []
    for h in range(heads):
        group = queries[0, h * hq // heads: (h + 1) * hq // heads]  # (group, n, d)
        mean, var = group.mean(axis=1), group.var(axis=1)
        logits = scale * mean @ keys[0, h].T + 0.5 * scale ** 2 * var @ (keys[0, h] ** 2).T
        probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        out.append(probs.mean(axis=0) * np.linalg.norm(values[0, h], axis=-1))
    return np.stack(out)


def one_prompt_read(score: str, monkeypatch, seed: int) -> tuple[QuantCache, mx.array, list[mx.array]]:
    """A cache (window 8, sink 4, blocks of 32, keeping half) that read one random prompt chunk of ``PROMPT`` rows
    scored by ``score``, its queries, and the list its scores go to when it stops choosing (recorded)."""
    mx.random.seed(seed)
    cache = QuantCache(CacheSpec(Budget(tokens=64), window=8, sink=4, mode="chunk"), bits=4, group=32, keep=0.5,
                       score=score)
    cache.read_prompt_chunk(mx.zeros((1, PROMPT), mx.int32))
    keys, values = mx.random.normal((1, 2, PROMPT, 64)), mx.random.normal((1, 2, PROMPT, 64))
    queries = mx.random.normal((1, 6, PROMPT, 64))
    k, v = cache.update_and_fetch(keys, values)
    cache.attend(queries, k, v, 0.125, mask="causal")
    recorded: list[mx.array] = []
    stop = QuantCache.stop_rereading
    monkeypatch.setattr(QuantCache, "stop_rereading",
                        lambda self, read: (recorded.append(self.scores), stop(self, read)))
    return cache, queries, recorded


def test_expected_scores_are_expected_attentions_rule_over_the_folded_rows(monkeypatch) -> None:
    cache, queries, recorded = one_prompt_read("expected", monkeypatch, 21)
    (fold,) = cache.folds
    held_keys, held_values = (np.array(a) for a in cache.unfold(fold))  # as held (8 bits until chosen)
    cache.score_by_queries(None)  # no rotary module: the statistics unrotated
    want = expected_reference(np.array(queries[:, :, -8:]), held_keys, held_values, 0.125)
    assert np.allclose(np.array(recorded[0][0]), want, atol=1e-5), "the window's queries, Expected Attention's rule"
    assert cache.memory.queries is None, "the queries go with the choice"
    assert cache.candidates is not None and cache.unscored == []


def test_expected_scoring_reads_each_prompt_once_and_keeps_fewer_rows(monkeypatch) -> None:
    model = tiny("llama", layers=2)
    prompt = random_tokens(PROMPT + 1, 6)
    scored: list[int] = []
    score = QuantCache.score_by_queries
    monkeypatch.setattr(QuantCache, "score_by_queries",
                        lambda self, module: (scored.append(self.layer), score(self, module)))
    monkeypatch.setattr(QuantCache, "start_rereading", lambda self: pytest.fail("no second reading"))
    veloxpatch.patch(kv="quant", window=8, sink=4, quant_group=32, quant_keep="50%", quant_score="expected")
    caches = make_prompt_cache(model)
    assert rereading.attention_modules(model)[0] is model.layers[0].self_attn, "each layer's, for its rotary module"
    tokens = greedy(model, prompt, caches, steps=3, chunk=PROMPT)
    assert len(tokens) == 3 and scored == [0, 1], "each layer scored its rows once, when the prompt was read"
    assert all(c.held_rows(c.folds[0]) < c.folds[0].end for c in caches), "the heads hold fewer rows than folded"
    veloxpatch.unpatch()


# --------------------------------------------------------------------- VELOX_QUANT_SCORE=snapkv
def snapkv_reference(queries: np.ndarray, keys: np.ndarray, sink: int, folded: int, kernel: int) -> np.ndarray:
    """SnapKV's rule by numpy over one sequence's held rows (in position order, the window's queries the last
    ones): per KV head, each window query's softmax over the rows it sees (none after it), summed over the window and
    the head's query heads, the sinks and the rows from ``folded`` on (exact, kept anyway) zeroed, then a same-size
    moving average of ``kernel`` rows (zeros past the ends). (H, rows)"""
    hq, n, heads, rows = queries.shape[1], queries.shape[2], keys.shape[1], keys.shape[2]
    future = np.arange(rows)[None] > (rows - n + np.arange(n))[:, None]  # (n, rows)
    out = []
    for h in range(heads):
        logits = queries[0, h * hq // heads: (h + 1) * hq // heads] @ keys[0, h].T  # (group, n, rows)
        logits = np.where(future, -np.inf, logits)
        probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
        summed = (probs / probs.sum(axis=-1, keepdims=True)).sum(axis=(0, 1))
        summed[:sink] = summed[folded:] = 0
        padded = np.pad(summed, kernel // 2)
        out.append(np.array([padded[i: i + kernel].mean() for i in range(rows)]))
    return np.stack(out)


def test_snapkv_scores_are_snapkvs_rule_over_the_held_rows(monkeypatch) -> None:
    cache, queries, recorded = one_prompt_read("snapkv", monkeypatch, 22)
    held = np.array(cache.rows()[0])  # the folded keys as held (8 bits until chosen), then the exact rows
    folded = cache.folded_rows()
    cache.score_by_queries(None)
    want = snapkv_reference(np.array(queries[:, :, -8:]) * 0.125, held, 4, folded, 31)[:, :folded]
    assert recorded[0].shape == (1, 2, folded)
    assert np.allclose(np.array(recorded[0][0]), want, atol=1e-5), "the window's attention, pooled, sinks zeroed"
    assert cache.memory.queries is None and cache.candidates is not None


def test_snapkv_scoring_at_16_bits_evicts_by_head_without_quantizing(monkeypatch) -> None:
    model = tiny("llama", layers=2)
    prompt = random_tokens(4 * PROMPT + 1, 7)  # 12 blocks of 32 fold: room for the heads' counts to differ
    monkeypatch.setattr(QuantCache, "start_rereading", lambda self: pytest.fail("no second reading"))
    veloxpatch.patch(kv="quant", window=8, sink=4, quant_group=32, quant_bits=16, quant_keep="40%",
                     quant_score="snapkv", quant_budgets="layer")
    caches = make_prompt_cache(model)
    tokens = greedy(model, prompt, caches, steps=3, chunk=4 * PROMPT)
    veloxpatch.unpatch()
    assert len(tokens) == 3
    for cache in caches:
        (fold,) = cache.folds
        counts = [int((p >= 0).sum()) for p in cache.fold_positions(fold)[0]]
        assert sum(counts) < 2 * fold.end and len(set(counts)) > 1, "fewer rows, heads holding different numbers"
        assert all(part.dtype == mx.float32 for part in cache.unfold(fold)), "held unquantized"


# --------------------------------------------------------------------- VELOX_QUANT_SCORE=heads
def rating_model(monkeypatch, budgets: str = "model"):
    """A random llama under ``score=heads`` (no floor), heads rated from 64 fresh rows on."""
    monkeypatch.setattr(quant, "CALIBRATION_ROWS", 64)
    veloxpatch.patch(kv="quant", window=8, sink=4, quant_group=32, quant_keep="40%", quant_score="heads",
                     quant_floor=0.0, quant_budgets=budgets)
    return tiny("llama", layers=2)


def test_the_first_prompt_long_enough_is_read_twice_and_rates_the_heads_by_their_rows_mean_score(monkeypatch) -> None:
    model = rating_model(monkeypatch)
    recorded: list[mx.array] = []
    stop = QuantCache.stop_rereading
    monkeypatch.setattr(QuantCache, "stop_rereading",
                        lambda self, read: (recorded.append(self.scores), stop(self, read)))
    greedy(model, random_tokens(PROMPT + 1, 8), make_prompt_cache(model), steps=2, chunk=PROMPT)
    assert len(recorded) == 2, "60 fresh rows a head: too few to rate"
    assert memo.kept(rereading._ratings, model, "heads") is None
    recorded.clear()
    greedy(model, random_tokens(4 * PROMPT + 1, 9), make_prompt_cache(model), steps=2, chunk=4 * PROMPT)
    rated = memo.kept(rereading._ratings, model, "heads")
    veloxpatch.unpatch()
    assert sorted(rated) == [0, 1] and len(recorded) == 2
    for layer, scores in enumerate(recorded):  # the first fold: every row's position its index, the sinks not fresh
        want = np.array(scores[0, :, 4:]).mean(axis=-1)
        assert rated[layer].shape == (2,) and np.allclose(np.array(rated[layer]), want, rtol=1e-5)


@pytest.mark.parametrize("budgets", ["model", "layer"])
def test_later_prompts_keep_the_best_rated_heads_rows_without_a_second_reading(monkeypatch, budgets: str) -> None:
    model = rating_model(monkeypatch, budgets)
    greedy(model, random_tokens(4 * PROMPT + 1, 9), make_prompt_cache(model), steps=2, chunk=4 * PROMPT)
    rated = memo.kept(rereading._ratings, model, "heads")
    monkeypatch.setattr(QuantCache, "start_rereading", lambda self: pytest.fail("no second reading"))
    caches = make_prompt_cache(model)
    greedy(model, random_tokens(4 * PROMPT + 1, 10), caches, steps=2, chunk=4 * PROMPT)
    veloxpatch.unpatch()
    held: list[dict[float, np.ndarray]] = []  # per layer, each head's fresh positions held, by its rating
    for cache in caches:
        (fold,) = cache.folds
        held.append({float(rated[cache.layer][h]): np.sort(p[p >= 4])
                     for h, p in enumerate(np.array(cache.fold_positions(fold)[0]))})
    end = caches[0].folds[0].end
    for heads in held if budgets == "layer" else [{r: p for layer in held for r, p in layer.items()}]:
        counts = [len(heads[r]) for r in sorted(heads, reverse=True)]
        assert counts == sorted(counts, reverse=True) and counts[0] > counts[-1], "the better rated, the more rows"
        for positions in heads.values():
            assert np.array_equal(positions, np.arange(end - len(positions), end)), "a head keeps its newest rows"
    assert budgets == "layer" or max(len(p) for layer in held for p in layer.values()) == end - 4, "the best: all"


@pytest.mark.parametrize("strict", [False, True])
def test_a_choice_by_the_heads_that_fails_keeps_every_row_or_raises_under_strict(monkeypatch, records,
                                                                                 strict: bool) -> None:
    model = rating_model(monkeypatch)
    greedy(model, random_tokens(4 * PROMPT + 1, 9), make_prompt_cache(model), steps=2, chunk=4 * PROMPT)
    veloxpatch.patch(kv="quant", window=8, sink=4, quant_group=32, quant_keep="40%", quant_score="heads",
                     strict=strict)

    def broken(self, rating):
        raise RuntimeError("no ratings today")

    monkeypatch.setattr(QuantCache, "score_by_heads", broken)
    caches = make_prompt_cache(model)
    if strict:
        with pytest.raises(RuntimeError, match="no ratings today"):
            greedy(model, random_tokens(4 * PROMPT + 1, 10), caches, steps=2, chunk=4 * PROMPT)
        veloxpatch.unpatch()
        return
    tokens = greedy(model, random_tokens(4 * PROMPT + 1, 10), caches, steps=2, chunk=4 * PROMPT)
    veloxpatch.unpatch()
    assert len(tokens) == 2 and any("scoring a prompt's rows by heads failed" in r.getMessage() for r in records)
    assert all(c.held_rows(c.folds[0]) == c.folds[0].end for c in caches), "every row kept"
