"""H2O as the paper defines it (arXiv 2306.14048), against a plain numpy reference, and its own state."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

import veloxpatch
from conftest import decoded, random_case, random_rows, softmax
from conftest import feed as feed_rows
from veloxpatch.caches import CacheSpec
from veloxpatch.config import Budget, TierSize
from veloxpatch.methods.h2o import H2OCache, attention_with_mass, received_mass

SCALE = 0.35


# --------------------------------------------------------------------- the reference, from the paper
def h2o_reference(keys: np.ndarray, queries: np.ndarray, chunks: list[int], budget: int, sink: int, window: int,
                  mode: str, tier: bool = False) -> tuple[list[np.ndarray], dict]:
    """Kept positions, (B, kv_heads, rows), after every step, and the final scores by (b, h) and position.

    H2O's score of a cached token is the attention probability every query has paid it since it
    was cached (each query's softmax over the tokens it sees, summed over the query heads of the
    KV head); the sinks and the recent window stay, the rest is the top of the score. Eviction
    follows the cache's schedule: after a prefill chunk in ``chunk`` mode, when a decode step
    leaves ``budget + headroom`` rows, and, in ``end`` mode, before the first decode-sized step
    attends over a prompt left whole (that step then sees only the rows kept and its own). With a lossless
    ``tier``, no row is lost: a prompt chunk, and a decode-sized step over a pending prompt, see every token so far
    (the tier's rows come back with the score they had), decode steps only the rows kept.
    """
    batch, kv_heads = keys.shape[:2]
    group = queries.shape[1] // kv_heads
    keep = max(budget, sink + window)
    room = min(64, max(8, keep // 8))
    heads = [(b, h) for b in range(batch) for h in range(kv_heads)]
    rows: dict = {bh: [] for bh in heads}
    score: dict = {bh: {} for bh in heads}
    offset = 0
    history = []

    def choose(bh: tuple[int, int]) -> list[int]:
        protected = [p for p in rows[bh] if p < sink or p >= offset - window]
        rest = sorted((p for p in rows[bh] if p not in protected), key=lambda p: -score[bh][p])
        return sorted(protected + rest[: keep - len(protected)])

    for n in chunks:
        new = list(range(offset, offset + n))
        offset += n
        for bh in heads:
            rows[bh] = rows[bh] + new
            score[bh].update({p: 0.0 for p in new})
        count = len(rows[heads[0]])
        if tier and (n > room or count - n >= keep + room):
            rows, count = {bh: list(range(offset)) for bh in heads}, offset
        chosen = {bh: choose(bh) for bh in heads} if n <= room and count - n >= keep + room else None
        for b, h in heads:
            seen = set(chosen[(b, h)]) | set(new) if chosen else set(rows[(b, h)])
            for p in new:
                visible = sorted(r for r in seen if r <= p)
                q = queries[b, h * group : (h + 1) * group, p]  # (group, d)
                probs = softmax(q @ keys[b, h, visible].T * SCALE).sum(axis=0)
                for r, mass in zip(visible, probs):
                    score[(b, h)][r] += mass
        if chosen:
            rows = chosen
        elif count > keep and (mode == "chunk" if n > room else count >= keep + room):
            rows = {bh: choose(bh) for bh in heads}
        history.append(np.array([[rows[(b, h)] for h in range(kv_heads)] for b in range(batch)]))
    return history, score


# --------------------------------------------------------------------- driving the cache directly
def feed(cache: H2OCache, keys: np.ndarray, queries: np.ndarray, chunks: list[int]):
    return feed_rows(cache, keys, queries, chunks, SCALE)


@pytest.mark.parametrize("seed", range(24))
def test_chunk_mode_keeps_exactly_the_references_positions(seed: int) -> None:
    case = random_case(seed)
    cache = H2OCache(CacheSpec(Budget(tokens=case["budget"]), case["sink"], case["window"], mode="chunk"))
    expected = h2o_reference(case["keys"], case["queries"], case["chunks"], case["budget"], case["sink"],
                             case["window"], "chunk")
    for step, (got, want) in enumerate(zip(feed(cache, case["keys"], case["queries"], case["chunks"]), expected[0])):
        assert got.shape == want.shape and (got == want).all(), f"step {step} ({case['chunks'][step]} tokens)"


@pytest.mark.parametrize("seed", range(6))
def test_end_mode_scores_the_prompt_by_its_accumulated_attention(seed: int) -> None:
    """The prompt is never compressed while it is read; the first decode step compresses it by
    the mass accumulated over the whole prompt, and sees only the rows kept."""
    case = random_case(100 + seed)
    case["chunks"] = np.random.default_rng(seed).integers(20, 60, size=3).tolist() + [1] * 30
    batch, kv_heads = case["keys"].shape[:2]
    case["keys"], case["queries"] = random_rows(seed, batch, kv_heads, case["queries"].shape[1] // kv_heads,
                                                sum(case["chunks"]))
    cache = H2OCache(CacheSpec(Budget(tokens=case["budget"]), case["sink"], case["window"], mode="end"))
    expected = h2o_reference(case["keys"], case["queries"], case["chunks"], case["budget"], case["sink"],
                             case["window"], "end")
    steps = list(feed(cache, case["keys"], case["queries"], case["chunks"]))
    assert steps[2].shape[-1] == sum(case["chunks"][:3]), "no prompt row goes while the prompt is read"
    for step, (got, want) in enumerate(zip(steps, expected[0])):
        assert got.shape == want.shape and (got == want).all(), f"step {step}"
    assert_mass_is_the_references(cache, expected[1])


def assert_mass_is_the_references(cache: H2OCache, score: dict) -> None:
    """The cache's accumulated mass of each kept row equals the reference's score of it."""
    keys, _ = cache.store.fetch()
    positions = np.array(cache.store.row_positions())
    mass = np.array(cache.policy.score(cache, keys, cache.store.row_positions(), SCALE))
    want = np.array([[[score[(b, h)][p] for p in positions[b, h]] for h in range(positions.shape[1])]
                     for b in range(positions.shape[0])])
    assert np.allclose(mass, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("mode", ["chunk", "end"])
def test_a_row_keeps_its_mass_through_a_lossless_tier_and_back(seed: int, mode: str) -> None:
    """A chat: a prompt, its answer, a second prompt, its answer. The rows a compression drops take their mass
    into the tier; the second prompt takes them back with it (queries queued before it counted over the rows they
    saw), and chooses as the reference, which loses no row and no score. Decode-sized steps are no longer than the
    window: the reference does not model a step that compresses a prompt and loses some of its own rows."""
    case = random_case(300 + seed)
    rng = np.random.default_rng(seed)
    case["chunks"] += [int(rng.integers(9, 60))] + rng.integers(1, 4, size=int(rng.integers(10, 40))).tolist()
    case["chunks"] = [n if n > 8 else min(n, case["window"]) for n in case["chunks"]]
    batch, kv_heads = case["keys"].shape[:2]
    case["keys"], case["queries"] = random_rows(300 + seed, batch, kv_heads, case["queries"].shape[1] // kv_heads,
                                                sum(case["chunks"]))
    cache = H2OCache(CacheSpec(Budget(tokens=case["budget"]), case["sink"], case["window"], mode=mode, tier=16,
                               tier_size=TierSize(None)))
    expected = h2o_reference(case["keys"], case["queries"], case["chunks"], case["budget"], case["sink"],
                             case["window"], mode, tier=True)
    for step, (got, want) in enumerate(zip(feed(cache, case["keys"], case["queries"], case["chunks"]), expected[0])):
        assert got.shape == want.shape and (got == want).all(), f"step {step} ({case['chunks'][step]} tokens)"
    assert_mass_is_the_references(cache, expected[1])
    if cache.tier.rows:
        positions = np.array(cache.tier.store.row_positions())
        want = [[[expected[1][(b, h)][p] for p in positions[b, h]] for h in range(kv_heads)] for b in range(batch)]
        assert np.allclose(np.array(cache.tier.store.columns["mass"]), np.array(want), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("seed", range(3))
def test_the_accumulated_mass_is_the_references_and_follows_the_rows(seed: int) -> None:
    case = random_case(7 + seed)
    cache = H2OCache(CacheSpec(Budget(tokens=case["budget"]), case["sink"], case["window"], mode="chunk"))
    list(feed(cache, case["keys"], case["queries"], case["chunks"]))
    _, score = h2o_reference(case["keys"], case["queries"], case["chunks"], case["budget"], case["sink"],
                             case["window"], "chunk")
    assert_mass_is_the_references(cache, score)


def test_a_rewind_before_the_next_compression_takes_the_rewound_queries_back() -> None:
    """Speculative decoding's rewind: rejected draft tokens leave no trace in the scores when no
    compression ran in between (their queries were only queued)."""
    chunks, rest = [40, 30, 1, 1], [1] * 20
    keys, queries = random_rows(3, 2, 2, 2, sum(chunks + rest))
    cache = H2OCache(CacheSpec(Budget(tokens=24), 2, 4, mode="chunk"))
    list(feed(cache, keys, queries, chunks))
    assert cache.size() + 3 < 24 + cache.schedule.headroom(24), "the draft step compresses nothing"
    draft_keys, draft_queries = random_rows(9, 2, 2, 2, 3)
    k, v = cache.update_and_fetch(mx.array(draft_keys), mx.array(draft_keys))
    cache.attend(mx.array(draft_queries), k, v, scale=SCALE)
    assert cache.trim(3) == 3 and cache.offset == 72
    got = list(feed(cache, keys, queries, rest))
    history, score = h2o_reference(keys, queries, chunks + rest, 24, 2, 4, "chunk")
    assert any(g.shape != got[0].shape or (g != got[0]).any() for g in got), "compressions came after the rewind"
    assert all((g == w).all() for g, w in zip(got, history[len(chunks):]))
    assert_mass_is_the_references(cache, score)


def test_holes_left_by_a_trim_get_no_mass_and_go_first() -> None:
    cache = H2OCache(CacheSpec(Budget(tokens=12), sink=1, window=2, mode="chunk"))
    keys, queries = random_rows(5, 1, 2, 1, 52)
    list(feed(cache, keys, queries, [40]))
    positions = cache.store.row_positions()
    assert not (positions == positions[:, :1]).all().item(), "the two heads keep different rows"
    cache.trim(30)  # back to 10 tokens: one head kept 9 rows of them, the other 8 (a hole)
    assert cache.store.holes and cache.store.columns["mass"].shape[-1] == cache.size() == 9
    list(feed(cache, keys, queries, [1] * 12))
    assert cache.offset == 22 and cache.store.columns["mass"].shape[-1] <= cache.size()
    assert (cache.store.row_positions() >= 0).all().item(), "the compression dropped the hole first"


def test_a_long_chunk_is_accounted_in_blocks_of_queries_within_their_memory(monkeypatch) -> None:
    """The probabilities of a long chunk are computed and summed a block of queries at a time: the
    same mass, without the whole (B, q_heads, n, rows) tensor ever existing."""
    keys, queries = random_rows(11, 1, 2, 4, 1024)
    positions = mx.broadcast_to(mx.arange(1024, dtype=mx.int32), (1, 2, 1024))
    args = (mx.array(queries), mx.array(keys), SCALE, positions, 0)
    whole = received_mass(*args)
    monkeypatch.setattr("veloxpatch.methods.h2o.SCORE_BYTES", 1 << 20)  # 1 MB: 32 queries of 8 heads
    mx.eval(whole)
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    blocked = received_mass(*args)
    mx.eval(blocked)
    assert mx.get_peak_memory() - before < 8 * 2**20, "far below the 32 MB of all the probabilities at once"
    assert mx.allclose(whole, blocked, rtol=1e-5).item()


# --------------------------------------------------------------------- the cache's own state
# (the contracts every method keeps, on real models, are in test_contracts.py and test_exactness.py)
@pytest.mark.parametrize("mode", ["chunk", "end"])
def test_the_mass_follows_the_rows_while_decoding(mode: str) -> None:
    _, caches = decoded("h2o", mode)
    assert all(c.store.columns["mass"].shape[-1] <= c.size() for c in caches)


def test_a_saved_cache_loads_back_with_its_mass(tmp_path) -> None:
    """Saved with the decode steps' queries still queued: the file holds the mass they add."""
    cache = H2OCache(CacheSpec(Budget(tokens=24), 2, 4, mode="chunk"))
    keys, queries = random_rows(6, 1, 2, 2, 43)
    list(feed(cache, keys, queries, [40, 1, 1, 1]))
    assert cache.log.queries is not None, "the decode steps' queries wait for the next compression"
    path = str(tmp_path / "prompt.safetensors")
    save_prompt_cache(path, [cache])
    veloxpatch.patch(kv="h2o")  # mlx_lm finds the class to load by name in its cache module
    (loaded,) = load_prompt_cache(path)
    assert type(loaded) is H2OCache and mx.array_equal(loaded.store.columns["mass"], cache.store.columns["mass"]).item()
    assert_mass_is_the_references(loaded, h2o_reference(keys, queries, [40, 1, 1, 1], 24, 2, 4, "chunk")[1])


def test_the_base_state_layout_loads_with_the_mass_restarting() -> None:
    """Caches rebuilt from the base layout (rows, positions, queries, settings; the batched
    integration does so) start their mass at zero."""
    cache = H2OCache(CacheSpec(Budget(tokens=40), 4, 8))
    keys, queries = random_rows(2, 1, 2, 2, 30)
    list(feed(cache, keys, queries, [30]))
    *rows, queries, _, meta = cache.state
    rebuilt = H2OCache.from_state((*rows, queries, meta))
    assert rebuilt.offset == 30 and rebuilt.store.columns["mass"] is None
    keys, _ = rebuilt.store.fetch()
    assert (rebuilt.policy.score(rebuilt, keys, rebuilt.store.row_positions(), SCALE) == 0).all().item()


def test_a_query_whose_rows_all_went_adds_nothing() -> None:
    """A tiny budget whose compression of an ``end`` mode prompt keeps only the newest rows: the
    first queries of that step then see no kept row; their mass is nothing, not NaN."""
    cache = H2OCache(CacheSpec(Budget(tokens=4), sink=0, window=4, mode="end"))
    keys, queries = random_rows(4, 1, 2, 2, 56)
    for _ in feed(cache, keys, queries, [40, 6] + [1] * 10):
        stored, _ = cache.store.fetch()
        assert mx.isfinite(cache.policy.score(cache, stored, cache.store.row_positions(), SCALE)).all().item()
    assert cache.offset == 56


@pytest.mark.parametrize("holes", [False, True])
def test_one_softmax_gives_mlxs_attention_and_the_received_mass(holes: bool) -> None:
    """H2O's prompt steps take their output and their score from one softmax (``attention_with_mass``): the output
    is mlx's attention (exactly, where mlx's is causal), the mass is ``received_mass``'s."""
    rng = np.random.default_rng(7)
    queries, keys, values = (mx.array(rng.standard_normal((1, h, 40, 16)).astype(np.float32)) for h in (6, 2, 2))
    positions = mx.broadcast_to(mx.arange(40, dtype=mx.int32), (1, 2, 40))
    if holes:
        positions = mx.where(mx.arange(40) == 5, -1, positions)
    first = 40 - 24  # the last 24 rows are the step's own
    out, mass = attention_with_mass(queries[:, :, first:], keys, values, SCALE, positions, first)
    assert np.allclose(np.array(mass), np.array(received_mass(queries[:, :, first:], keys, SCALE, positions, first)),
                       rtol=1e-5, atol=1e-6)
    if holes:
        visible = (positions[:, :, None, :] <= mx.arange(first, 40)[:, None]) & (positions[:, :, None, :] >= 0)
        mask = mx.repeat(visible, 3, axis=1)
    else:
        mask = "causal"
    want = mx.fast.scaled_dot_product_attention(queries[:, :, first:], keys, values, scale=SCALE, mask=mask)
    assert (mx.array_equal(out, want).item() if not holes else mx.allclose(out, want, atol=1e-6).item())
