"""ChunkKV (arXiv 2502.00299): whole chunks kept per KV head, and layer-wise index reuse."""

from __future__ import annotations

from collections import defaultdict

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

import veloxpatch
from conftest import (
    assert_a_rejected_draft_leaves_no_trace,
    assert_within_budget,
    decoded,
    greedy,
    prefill,
    random_tokens,
    tiny,
)
from veloxpatch.caches import CacheSpec
from veloxpatch.config import Budget
from veloxpatch.coordinators import Coordinator
from veloxpatch.methods import chunkkv
from veloxpatch.methods.chunkkv import ChunkKVCache, topic
from veloxpatch.methods.snapkv import SnapKVCache

SCALE = 0.35


def four_layers():
    """A llama of four layers: two reuse blocks of two."""
    return tiny("llama", seed=3, layers=4)


def positions(cache) -> list:
    return cache.store.row_positions().tolist()


# ----------------------------------------------------------------- the paper's selection, in numpy
def window_scores(keys: np.ndarray, pos: np.ndarray, queries: np.ndarray, offset: int, scale: float) -> np.ndarray:
    """Attention each row of one KV head gets from the observation window: softmax of each window
    query over the rows it can see (not a hole, not later than itself), summed over the window and
    the query heads sharing the KV head. ``queries``: (group, w, d)."""
    w = queries.shape[1]
    total = np.zeros(pos.shape[0])
    for query_head in queries:
        for t, q in enumerate(query_head):
            visible = (pos >= 0) & (pos <= offset - w + t)
            logits = keys @ q * scale
            weights = np.where(visible, np.exp(logits - logits[visible].max()), 0.0)
            total += weights / weights.sum()
    return total


def reference_kept(keys, pos, queries, offset: int, keep: int, sink: int, window: int, chunk: int) -> list[int]:
    """Positions one KV head keeps: the sink and recent window always; then chunks (tokens
    ``position // chunk``) by the summed window attention of their other rows, best first, whole,
    until ``keep`` rows are held; the chunk that does not fit gives its earliest rows."""
    scores = window_scores(keys, pos, queries, offset, SCALE)
    protected = (pos >= 0) & ((pos < sink) | (pos >= offset - window))
    kept = set(pos[protected].tolist())
    candidates = (pos >= 0) & ~protected
    chunk_score: dict[int, float] = defaultdict(float)
    for row in np.flatnonzero(candidates):
        chunk_score[int(pos[row]) // chunk] += scores[row]
    free = keep - len(kept)
    for c in sorted(chunk_score, key=lambda c: -chunk_score[c]):
        rows = sorted(int(p) for p in pos[candidates] if p // chunk == c)
        kept.update(rows[:free])
        free -= min(free, len(rows))
    return sorted(kept)


@pytest.mark.parametrize("seed", range(10))
def test_kept_positions_equal_a_numpy_reference_of_the_paper(seed: int) -> None:
    """Random chunk sizes, budgets, GQA ratios, batch sizes and step lengths (prefill chunks and
    decode steps), with speculative-style trims that leave holes, through update_and_fetch + attend."""
    rng = np.random.default_rng(seed)
    chunk, kv_heads, ratio, batch = (int(rng.choice(c)) for c in ([1, 2, 3, 5, 10, 16], [1, 2, 3], [1, 2, 4], [1, 2]))
    sink, window = int(rng.integers(0, 5)), int(rng.integers(1, 9))
    budget = int(rng.integers(sink + window, sink + window + 40))
    cache = ChunkKVCache(CacheSpec(Budget(tokens=budget), sink, window, "chunk"), chunk=chunk)
    compressions = 0
    for _ in range(12):
        n = int(rng.choice([1, 3, int(rng.integers(9, 70)), int(rng.integers(9, 70))]))
        keys = mx.array(rng.normal(size=(batch, kv_heads, n, 8)).astype(np.float32))
        queries = mx.array(rng.normal(size=(batch, kv_heads * ratio, n, 8)).astype(np.float32))
        k, v = cache.update_and_fetch(keys, keys)
        before, stored = np.array(cache.store.row_positions()), np.array(k, dtype=np.float64)
        cache.attend(queries, k, v, scale=SCALE)
        after = np.array(cache.store.row_positions())
        if after.shape[-1] == before.shape[-1]:
            assert (after == before).all()
            continue
        compressions += 1
        assert after.shape[-1] == cache.target()
        window_q = np.array(cache.memory.queries, dtype=np.float64)
        for b in range(batch):
            for h in range(kv_heads):
                expected = reference_kept(stored[b, h], before[b, h], window_q[b, h * ratio : (h + 1) * ratio],
                                          cache.offset, cache.target(), sink, window, chunk)
                assert sorted(p for p in after[b, h].tolist() if p >= 0) == expected, (seed, b, h)
        if rng.random() < 0.4:
            cache.trim(int(rng.integers(1, 6)))
    assert compressions >= 2


@pytest.mark.parametrize("seed", range(4))
def test_chunks_of_one_token_keep_what_snapkv_without_pooling_keeps(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    kv_heads, ratio, batch = 2, int(rng.choice([1, 2, 4])), int(rng.choice([1, 2]))
    ours = ChunkKVCache(CacheSpec(Budget(tokens=30), sink=2, window=6, mode="chunk"), chunk=1)
    snap = SnapKVCache(CacheSpec(Budget(tokens=30), sink=2, window=6, mode="chunk"), kernel=1)
    for _ in range(8):
        n = int(rng.choice([2, int(rng.integers(9, 50))]))
        keys = mx.array(rng.normal(size=(batch, kv_heads, n, 8)).astype(np.float32))
        queries = mx.array(rng.normal(size=(batch, kv_heads * ratio, n, 8)).astype(np.float32))
        for cache in (ours, snap):
            k, v = cache.update_and_fetch(keys, keys)
            cache.attend(queries, k, v, scale=SCALE)
        assert positions(ours) == positions(snap)
    assert ours.evicted


def test_the_chunk_the_budget_cuts_keeps_its_earliest_rows() -> None:
    """One query direction: rows 20..29 (chunk 2) matter most, then rows 40..49 (chunk 4); with
    room for 15 free rows the first chunk is whole and the second gives 40..44."""
    cache = ChunkKVCache(CacheSpec(Budget(tokens=21), sink=2, window=4, mode="chunk"), chunk=10)
    direction = mx.zeros((8,)).at[0].add(1.0)
    keys = mx.random.normal((1, 1, 64, 8), key=mx.random.key(1)) * 0.01
    keys[:, :, 20:30, :] = direction * 3
    keys[:, :, 40:50, :] = direction * 2
    queries = mx.broadcast_to(direction * 2, (1, 1, 64, 8))
    k, v = cache.update_and_fetch(keys, keys)
    cache.attend(queries, k, v, scale=1.0)
    assert positions(cache)[0][0] == [0, 1, *range(20, 30), *range(40, 45), 60, 61, 62, 63]


# ----------------------------------------------------------------- the cache contracts with index reuse
# (every method's contracts, chunkkv's without reuse, are in test_contracts.py and test_exactness.py)
def followers_keep_their_leaders_rows(caches) -> bool:
    """Blocks of two: layer 1 keeps layer 0's positions, layer 3 layer 2's."""
    return positions(caches[1]) == positions(caches[0]) and positions(caches[3]) == positions(caches[2])


@pytest.mark.parametrize("mode", ["chunk", "end"])
def test_both_modes_decode_within_the_budget_with_index_reuse(mode: str) -> None:
    tokens, caches = decoded("chunkkv", mode, chunkkv_reuse=2)
    assert len(tokens) == 30 and followers_keep_their_leaders_rows(caches)
    assert_within_budget(caches, 230)


def test_a_capped_tier_takes_the_leaders_next_best_chunks_in_every_layer_of_its_block() -> None:
    """The default tier holds three budgets: past them, a follower tiers the positions its leader tiered (and
    scores nothing), so a later prompt taking the tier back finds the leader's choice in every layer."""
    model = four_layers()
    veloxpatch.patch(kv="chunkkv", budget=48, window=8, compress="chunk", tier="16", tier_size="1x",
                     knobs={"chunkkv_reuse": 2})
    caches = make_prompt_cache(model)
    prefill(model, caches, random_tokens(400, 16), chunk=50)

    def tiered(cache) -> list:
        return sorted(cache.tier.store.row_positions()[0, 0].tolist())

    assert all(c.tier.rows == 48 for c in caches)
    assert tiered(caches[1]) == tiered(caches[0]) and tiered(caches[3]) == tiered(caches[2])
    assert followers_keep_their_leaders_rows(caches)


def test_a_rewind_after_eviction_is_exact_and_followers_stay_with_their_leader(monkeypatch) -> None:
    """A deep rewind leaves fewer rows than the budget, holes included: the leader keeps some holes
    at its next compression and its followers keep as many of their own, not falling back."""
    said = []
    monkeypatch.setattr(chunkkv, "once", lambda *args: said.append(args))
    model = four_layers()
    veloxpatch.patch(kv="chunkkv", budget=48, window=8, compress="chunk", knobs={"chunkkv_reuse": 2})
    caches = make_prompt_cache(model)
    prefill(model, caches, random_tokens(200, 14), chunk=50)
    assert_a_rejected_draft_leaves_no_trace(model, caches, steps=6)
    assert trim_prompt_cache(caches, 120) == 120  # back into evicted history
    offset = caches[0].offset
    greedy(model, mx.array([4]), caches, steps=40)
    assert all(c.offset == offset + 41 and c.size() <= 48 + c.schedule.headroom(48) for c in caches)
    assert followers_keep_their_leaders_rows(caches)
    assert not said


# ----------------------------------------------------------------- layer-wise index reuse
@pytest.mark.parametrize("mode", ["chunk", "end"])
def test_followers_keep_their_leaders_positions_after_every_compression(mode: str) -> None:
    model = four_layers()
    veloxpatch.patch(kv="chunkkv", budget=40, window=8, compress=mode, knobs={"chunkkv_reuse": 2})
    caches = make_prompt_cache(model)
    prompt = random_tokens(160, 5)
    for start in range(0, 159, 40):  # prefill: in chunk mode every chunk compresses
        model(prompt[None, start : min(start + 40, 159)], cache=caches)
        assert followers_keep_their_leaders_rows(caches)
    sizes = set()
    for _ in generate_step(prompt[159:], model, max_tokens=40, prompt_cache=caches):
        sizes.add(caches[0].size())
        assert followers_keep_their_leaders_rows(caches)
    assert 40 in sizes and all(c.evicted for c in caches), "decode compressed"
    assert positions(caches[2]) != positions(caches[0]), "each block has its own leader"


def count_scoring(monkeypatch) -> dict[int, int]:
    """Window-attention calls per layer (the cost reuse saves)."""
    calls: dict[int, int] = defaultdict(int)
    original = chunkkv.ChunkKV.score

    def counted(self, cache, *args):
        calls[cache.layer] += 1
        return original(self, cache, *args)

    monkeypatch.setattr(chunkkv.ChunkKV, "score", counted)
    return calls


def test_followers_do_not_score(monkeypatch) -> None:
    calls = count_scoring(monkeypatch)
    said = []
    monkeypatch.setattr(chunkkv, "once", lambda *args: said.append(args))
    model = four_layers()
    veloxpatch.patch(kv="chunkkv", budget=40, window=8, compress="chunk", knobs={"chunkkv_reuse": 2})
    caches = make_prompt_cache(model)
    calls.clear()  # the eligibility probe scored too
    greedy(model, random_tokens(150, 6), caches, steps=30, chunk=50)
    assert calls[0] == calls[2] > 3 and calls[1] == calls[3] == 0
    assert not said, "no follower had to fall back"


def test_reuse_one_is_every_layer_choosing_for_itself(monkeypatch) -> None:
    calls = count_scoring(monkeypatch)
    model = four_layers()
    prompt = random_tokens(150, 7)
    runs = []
    def own(self, cache, keep: int, scale: float, kept=None) -> mx.array:  # the store's choice, and the tier's
        return self.choose(cache, keep, scale)

    for select in (chunkkv.ChunkKV.select, own):
        monkeypatch.setattr(chunkkv.ChunkKV, "select", select)
        veloxpatch.patch(kv="chunkkv", budget=40, window=8, compress="chunk", knobs={"chunkkv_reuse": 1})
        caches = make_prompt_cache(model)
        calls.clear()
        tokens = greedy(model, prompt, caches, steps=30, chunk=50)
        runs.append((tokens, [positions(c) for c in caches], dict(calls)))
        assert not caches[0].coordinator.published, "nothing is published without reuse"
    assert runs[0] == runs[1]
    assert all(runs[0][2][layer] > 3 for layer in range(4))


def test_a_follower_without_a_usable_choice_selects_itself_and_says_so(monkeypatch) -> None:
    said = []
    monkeypatch.setattr(chunkkv, "once", lambda key, level, message: said.append(message))
    coordinator = Coordinator("chunkkv")
    leader, follower, last = (ChunkKVCache(CacheSpec(Budget(tokens=20), 2, 4, "chunk"), chunk=5, reuse=3)
                              for _ in range(3))
    for cache in (leader, follower, last):
        coordinator.join(cache)
    keys = mx.random.normal((1, 2, 60, 8), key=mx.random.key(8))
    queries = mx.random.normal((1, 4, 60, 8), key=mx.random.key(9))
    for cache in (leader, follower, last):
        cache.update_and_fetch(keys, keys)
        cache.memory.remember(queries, cache.offset, cache.window)

    def select(cache: ChunkKVCache) -> mx.array:
        return cache.policy.select(cache, 20, SCALE)

    own = follower.policy.choose(follower, 20, SCALE)
    assert (select(follower) == own).all().item() and "did not compress" in said[-1]
    select(last)
    assert len(said) == 2 and "did not compress" in said[-1], "a follower's own choice is not published"
    coordinator.publish(topic(0, 3), mx.zeros((1, 1, 20), mx.int32))  # another number of KV heads
    assert (select(follower) == own).all().item() and "another shape" in said[-1]
    coordinator.publish(topic(0, 3), mx.broadcast_to(mx.arange(40, 60, dtype=mx.int32), (1, 2, 20)) + 5)
    assert (select(follower) == own).all().item() and "does not hold" in said[-1]
    mine = mx.broadcast_to(mx.arange(30, 50, dtype=mx.int32), (1, 2, 20))
    coordinator.publish(topic(0, 3), mine)
    assert (select(follower) == mine).all().item() and (select(last) == mine).all().item()
    assert len(said) == 4
    assert (select(leader) == leader.policy.choose(leader, 20, SCALE)).all().item()
    assert (coordinator.latest(topic(2, 3)) == mx.take_along_axis(leader.store.row_positions(),
                                                           leader.policy.choose(leader, 20, SCALE),
                                                           axis=-1)).all().item(), "the leader publishes"


def test_two_cache_lists_never_see_each_others_choices(monkeypatch) -> None:
    """Two generations interleaved step by step: each list's followers follow their own leader."""
    said = []
    monkeypatch.setattr(chunkkv, "once", lambda *args: said.append(args))
    model = four_layers()
    veloxpatch.patch(kv="chunkkv", budget=40, window=8, compress="chunk", knobs={"chunkkv_reuse": 2})
    lists = [make_prompt_cache(model) for _ in range(2)]
    assert lists[0][0].coordinator is not lists[1][0].coordinator
    runs = [generate_step(random_tokens(150, 20 + i), model, max_tokens=30, prefill_step_size=50, prompt_cache=c)
            for i, c in enumerate(lists)]
    for _ in range(30):
        for run in runs:
            next(run)
            for caches in (c for c in lists if not c[0].empty()):
                assert followers_keep_their_leaders_rows(caches)
    assert positions(lists[0][1]) != positions(lists[1][1])
    assert not said
