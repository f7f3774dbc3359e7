"""The second tier (VELOX_TIER): rows a compression drops kept at low bits, read by prompt chunks, taken back by a
prompt's selection; and the contracts (trim, save/load, speculative rewind, bytes) with it."""

from __future__ import annotations

import gc

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

import veloxpatch
from conftest import (
    EVICTING,
    assert_a_rejected_draft_leaves_no_trace,
    assert_round_trip,
    greedy,
    prefill,
    random_tokens,
    tiny,
)
from veloxpatch.caches import CacheSpec
from veloxpatch.caches.store import RowStore
from veloxpatch.config import Budget, ConfigError, TierSize, VeloxConfig
from veloxpatch.eval.random_model import build, config_for
from veloxpatch.methods.snapkv import SnapKVCache

SCALE = 0.25


def wide() -> object:
    """A random llama whose head_dim (32) mlx can quantize in groups of 32."""
    return build(config_for("llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=256), 3)


def every_position_once(cache) -> bool:
    """Whether the store and the tier together hold each token seen exactly once, per head."""
    held = mx.concatenate([cache.store.row_positions(), cache.tier.store.row_positions()], axis=-1)
    held = mx.sort(mx.where(held < 0, 2**30, held), axis=-1)[..., : cache.offset]
    return bool(mx.array_equal(held, mx.broadcast_to(mx.arange(cache.offset), held.shape)).item())


@pytest.mark.parametrize("method", EVICTING)
@pytest.mark.parametrize("mode", ["end", "chunk"])
def test_a_lossless_tier_loses_no_token_and_decoding_stays_within_the_budget(method: str, mode: str) -> None:
    model = tiny("qwen3", seed=2, layers=4)
    veloxpatch.patch(kv=method, budget=40, window=8, compress=mode, tier="16", tier_size="all")
    caches = make_prompt_cache(model)
    greedy(model, random_tokens(200, 41), caches, steps=30, chunk=64)
    assert all(c.tier is not None and c.tier.rows > 0 and every_position_once(c) for c in caches)
    assert all(c.size() < c.target() + c.schedule.headroom(c.target()) for c in caches), "decoding runs over the budget"


def test_reading_in_chunks_over_a_lossless_tier_is_reading_with_the_full_cache() -> None:
    """Each prompt chunk takes the tier's rows back and attends over every row: the logits are mlx_lm's."""
    model = tiny("llama", seed=1)
    tokens = random_tokens(300, 5)

    def chunk_logits() -> list[mx.array]:
        caches = make_prompt_cache(model)
        return [model(tokens[None, s : s + 100], cache=caches) for s in range(0, 300, 100)]

    expected = chunk_logits()
    veloxpatch.patch(kv="snapkv", budget=48, window=8, compress="chunk", tier="16", tier_size="all")
    got = chunk_logits()
    for want, have in zip(expected, got):
        assert (mx.abs(want - have).max() / mx.abs(want).max()).item() < 1e-4


def test_a_four_bit_tier_reads_as_close_as_mlx_lms_four_bit_cache_in_far_fewer_bytes() -> None:
    """The last prompt chunk's output against the full cache's: a 4-bit tier (the budget exact, the rest at 4 bits)
    errs no more than mlx_lm's own 4-bit KV cache (every row at 4 bits) does, give or take a tenth."""
    from mlx_lm.generate import maybe_quantize_kv_cache

    model = wide()
    tokens = random_tokens(1024, 6)

    def last_chunk(quantize=None) -> tuple[mx.array, list]:
        caches = make_prompt_cache(model)
        for start in range(0, tokens.size - 128, 128):
            model(tokens[None, start : min(start + 128, tokens.size - 129)], cache=caches)
            if quantize:
                quantize(caches)
        return model(tokens[None, -129:], cache=caches)[:, -1], caches

    expected, full = last_chunk()
    dense = sum(c.nbytes for c in full)

    def error(got: mx.array) -> float:
        return (mx.linalg.norm(got - expected) / mx.linalg.norm(expected)).item()

    theirs, _ = last_chunk(lambda caches: maybe_quantize_kv_cache(caches, 0, 32, 4))
    veloxpatch.patch(kv="snapkv", budget=128, window=16, compress="chunk", tier="4", tier_size="all")
    ours, caches = last_chunk()
    assert all(c.tier.store.bits == 4 and c.tier.store.group_size == 32 for c in caches)
    assert error(ours) < 1.1 * error(theirs), (error(ours), error(theirs))
    tier_bytes = sum(c.tier.store.nbytes for c in caches)
    assert sum(c.nbytes for c in caches) < 0.45 * dense and tier_bytes < 0.25 * dense


def planted(rows: int, at: tuple[int, ...], d: int = 8) -> mx.array:
    """Keys (1, 2, rows, d) of small noise, with a strong key along axis i at position ``at[i]``."""
    keys = mx.random.normal((1, 2, rows, d), key=mx.random.key(11)) * 0.1
    for axis, position in enumerate(at):
        keys[:, :, position, :] = mx.zeros((d,)).at[axis].add(8.0)
    return keys


def asking(axis: int, n: int, d: int = 8) -> mx.array:
    """Queries (1, 4, n, d) that all look along ``axis``."""
    return mx.broadcast_to(mx.zeros((d,)).at[axis].add(4.0), (1, 4, n, d))


def step(cache, keys: mx.array, queries: mx.array) -> None:
    k, v = cache.update_and_fetch(keys, keys)
    cache.attend(queries, k, v, scale=SCALE)


@pytest.mark.parametrize("tier", [0, 16])
def test_a_new_prompt_takes_back_the_rows_its_question_needs(tier: int) -> None:
    """A row the first question did not need goes to the tier; the next prompt's question brings it back."""
    cache = SnapKVCache(CacheSpec(Budget(tokens=12), sink=1, window=4, tier=tier), kernel=1)
    prompt = planted(80, at=(17, 40))
    step(cache, prompt, asking(0, 80))  # the document, and a question about the row at 17
    step(cache, mx.random.normal((1, 2, 1, 8), key=mx.random.key(3)) * 0.1, asking(0, 1))  # its first answer step
    kept = cache.store.row_positions()[0, 0].tolist()
    assert 17 in kept and 40 not in kept
    step(cache, mx.random.normal((1, 2, 70, 8), key=mx.random.key(4)) * 0.1, asking(1, 70))  # the next question
    step(cache, mx.random.normal((1, 2, 1, 8), key=mx.random.key(5)) * 0.1, asking(1, 1))
    kept = cache.store.row_positions()[0, 0].tolist()
    assert (40 in kept) == bool(tier), kept


def test_a_tier_holds_its_size_in_budgets_the_best_dropped_rows_by_the_methods_score() -> None:
    """Twenty rows that the question scores in order of their strength: the budget keeps the seven best (beside
    the sink and the window), a tier of one budget (12 rows) the next twelve; the weakest is lost with the noise."""
    positions = [10 + 8 * i for i in range(20)]
    keys = mx.random.normal((1, 2, 200, 8), key=mx.random.key(12)) * 0.1
    for i, position in enumerate(positions):
        keys[:, :, position, :] = mx.zeros((8,)).at[0].add(2.0 + 0.2 * i)
    cache = SnapKVCache(CacheSpec(Budget(tokens=12), sink=1, window=4, mode="chunk", tier=16, tier_size=TierSize(1.0)),
                        kernel=1)
    step(cache, keys, asking(0, 200))
    stored, tiered = (sorted(set(p[0, 0].tolist()) - {-1})
                      for p in (cache.store.row_positions(), cache.tier.store.row_positions()))
    assert stored == [0, *positions[13:], *range(196, 200)] and tiered == positions[1:13], (stored, tiered)


@pytest.mark.parametrize("size", ["1x", "3x"])
def test_the_default_tier_stays_within_its_budgets_while_a_long_prompt_is_read_and_decoded(size: str) -> None:
    model = tiny("qwen3", seed=2, layers=4)
    veloxpatch.patch(kv="snapkv", budget=40, window=8, tier="16", tier_size=size)
    caches = make_prompt_cache(model)
    greedy(model, random_tokens(600, 42), caches, steps=30, chunk=64)
    cap = TierSize.parse(size).rows(40)
    assert all(c.tier.rows == cap for c in caches), [c.tier.rows for c in caches]
    held = [mx.concatenate([c.store.row_positions(), c.tier.store.row_positions()], axis=-1) for c in caches]
    assert all(len(set(h[0, 0].tolist()) - {-1}) == c.size() + cap for h, c in zip(held, caches)), "a row held twice"


def test_trim_forgets_the_tiers_rows_of_the_rewound_tokens_and_a_rejected_draft_leaves_no_trace() -> None:
    model = tiny("llama")
    veloxpatch.patch(kv="snapkv", budget=48, window=8, compress="chunk", tier="16", tier_size="all")
    caches = make_prompt_cache(model)
    prefill(model, caches, random_tokens(200, 14), chunk=50)
    assert all(c.tier.rows == 200 - 48 for c in caches)
    assert_a_rejected_draft_leaves_no_trace(model, caches, steps=20)
    offsets = [c.offset for c in caches]
    for cache in caches:
        assert cache.trim(60) == 60 and cache.tier.store.row_positions().max().item() < cache.offset == offsets[0] - 60
        assert every_position_once(cache)


def test_a_list_with_a_tier_saves_and_loads_back(tmp_path) -> None:
    model = wide()
    veloxpatch.patch(kv="h2o", budget=48, window=8, compress="chunk", tier="4")
    caches = make_prompt_cache(model)
    greedy(model, random_tokens(200, 8), caches, steps=10, chunk=64)
    loaded = assert_round_trip(str(tmp_path / "tier.safetensors"), model, caches)
    assert all(c.tier.store.bits == 4 and c.tier.rows == o.tier.rows for c, o in zip(loaded, caches))
    masses = [(c.tier.store.columns["mass"], o.tier.store.columns["mass"]) for c, o in zip(loaded, caches)]
    assert all(mx.array_equal(c, o).item() for c, o in masses), "H2O's mass"
    for cache in loaded:
        cache.trim(cache.offset - 110)
        assert cache.tier.store.columns["mass"].shape[-1] == cache.tier.rows > 0
        assert cache.tier.store.row_positions().max().item() < 110


def test_a_tier_its_head_dim_keeps_unquantized_saves_and_loads_back_so(tmp_path) -> None:
    """No group of 32 or 64 divides a head_dim of 16: the 4-bit tier keeps its rows as they are, and a loaded one
    too (it was loaded as 4-bit, and the next rows it took raised in mx.quantize)."""
    model = tiny("llama")
    veloxpatch.patch(kv="snapkv", budget=48, window=8, compress="chunk", tier="4", tier_size="all")
    caches = make_prompt_cache(model)
    greedy(model, random_tokens(200, 8), caches, steps=10, chunk=64)
    assert all(c.tier.store.bits is None and c.tier.store.fetch()[0].shape[-1] == 16 for c in caches)
    loaded = assert_round_trip(str(tmp_path / "tier.safetensors"), model, caches)
    greedy(model, random_tokens(100, 9), loaded, steps=2, chunk=64)  # takes the tier back, then gives rows to it
    assert all(c.tier.store.bits is None and every_position_once(c) for c in loaded)


@pytest.mark.parametrize("method", EVICTING)
def test_a_cache_rebuilt_from_the_base_layout_keeps_an_empty_tier(method: str) -> None:
    """What a batch gives back (rows, positions, queries, settings; integration/batched.py) loads with the tier
    setting and no tier rows: it raised ValueError, so a sequence with a tier could not leave a batch."""
    model = tiny("llama")
    veloxpatch.patch(kv=method, budget=48, window=8, compress="chunk", tier="4")
    caches = make_prompt_cache(model)
    prefill(model, caches, random_tokens(200, 15), chunk=50)
    for cache in caches:
        *rows, queries = cache.state[:4]
        rebuilt = type(cache).from_state((*rows, queries, cache.meta_state))
        assert rebuilt.tier is not None and rebuilt.tier.rows == 0 and rebuilt.size() == cache.size()


def test_the_process_holds_what_the_caches_say_far_below_the_full_cache() -> None:
    model = wide()
    tokens = random_tokens(2048, 9)

    def held(**settings) -> tuple[int, list]:
        if settings:
            veloxpatch.patch(**settings)
        gc.collect()
        before = mx.get_active_memory()
        caches = make_prompt_cache(model)
        prefill(model, caches, tokens, chunk=256)
        mx.eval([c.state for c in caches])
        gc.collect()
        return mx.get_active_memory() - before, caches

    vanilla, _ = held()
    used, caches = held(kv="snapkv", budget=128, window=16, compress="chunk", tier="2")
    assert used <= sum(c.nbytes for c in caches) + 65536 * len(caches)
    assert used < 0.35 * vanilla, f"held {used} B, the full cache {vanilla} B"


def test_taking_a_tier_back_makes_at_most_two_copies_of_a_half_beyond_what_it_leaves() -> None:
    """A store of 2048 rows takes back a tier of 6144 8-bit rows (one head of 256, Gemma 3 270M's global layers):
    the whole context at full precision is what it leaves, and the peak on the way may exceed that by at most two
    copies of one half (keys or values). Decoded rows, their join and the gather evaluated together exceeded it
    by three."""
    store, tier = RowStore(), RowStore(8, 64, step=1)
    store.append(mx.random.normal((1, 1, 2048, 256)), mx.random.normal((1, 1, 2048, 256)), 0)
    later = mx.broadcast_to(mx.arange(2048, 8192, dtype=mx.int32), (1, 1, 6144))
    tier.merge(mx.random.normal((1, 1, 6144, 256)), mx.random.normal((1, 1, 6144, 256)), later)
    mx.eval(store.keys, store.values, store.positions, tier.keys, tier.values, tier.positions)
    gc.collect()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    store.take_in(tier, spare=512)
    rise, left = mx.get_peak_memory() - before, mx.get_active_memory() - before
    half = store.keys[0].nbytes
    assert store.rows == 8192 and store.row_positions()[0, 0].tolist() == list(range(8192))
    assert rise <= left + 2 * half, f"peaked {rise / 2**20:.1f} MiB over the start, left {left / 2**20:.1f}"


def test_the_tier_setting_names_what_it_allows() -> None:
    assert VeloxConfig(tier="off").tier == 0 and VeloxConfig(tier=4).tier == 4
    with pytest.raises(ConfigError, match=r"VELOX_TIER='5' is not allowed: expected off, or one of 2, 3, 4, 8, 16"):
        VeloxConfig(tier="5")
    assert VeloxConfig().tier_size == TierSize(3.0) and VeloxConfig(tier_size="ALL").tier_size.rows(40) is None
    assert (VeloxConfig(tier_size="0.5").tier_size.rows(40) == 20
            and str(VeloxConfig(tier_size="1.5x").tier_size) == "1.5x")
    for bad in ("0x", "-1x", "nanx", "two"):
        with pytest.raises(ConfigError, match=rf"VELOX_TIER_SIZE='{bad}' is not allowed: expected a multiple of the "
                                              r"budget \(`3x`, `0.5x`\) or `all`"):
            VeloxConfig(tier_size=bad)


def test_a_row_column_follows_its_rows_through_compaction_trim_and_merge() -> None:
    """The store's row columns (a policy's per-row state): shorter than the rows until set (zeros past its end),
    gathered by a compaction, cut by a trim, merged in time order with rows taken in, and counted in its bytes."""
    store = RowStore(step=4)
    rows = mx.arange(2 * 6 * 2, dtype=mx.float32).reshape(1, 2, 6, 2)
    store.append(rows, rows, 0)
    store.columns = {"mass": None}
    assert (store.column("mass") == 0).all().item()
    before = store.nbytes
    store.set_column("mass", mx.broadcast_to(mx.arange(4, dtype=mx.float32), (1, 2, 4)))
    assert store.nbytes == before + 2 * 4 * 4 and store.column("mass")[0, 0].tolist() == [0, 1, 2, 3, 0, 0]
    store.keep(mx.broadcast_to(mx.array([1, 3, 4, 5], mx.uint32), (1, 2, 4)), spare=2)
    assert store.columns["mass"][0, 1].tolist() == [1, 3, 0, 0]
    store.trim_to(4)  # positions 1 and 3 stay
    assert store.rows == 2 and store.columns["mass"][0, 0].tolist() == [1, 3]
    other = RowStore(step=1)
    other.append(rows[..., :1, :], rows[..., :1, :], 0)
    other.append(rows[..., 2:3, :], rows[..., 2:3, :], 2)
    other.columns = {"mass": mx.full((1, 2, 2), 7.0)}
    store.take_in(other)
    assert store.row_positions()[0, 0].tolist() == [0, 1, 2, 3]
    assert store.columns["mass"][0, 0].tolist() == [7, 1, 7, 3]
