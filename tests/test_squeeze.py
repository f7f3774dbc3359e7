"""SqueezeAttention (arXiv 2404.04793): layer budgets from the prompt's attention, rows by a policy."""

from __future__ import annotations

import copy
import itertools
import logging

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

import veloxpatch
from conftest import (
    assert_a_rejected_draft_leaves_no_trace,
    assert_round_trip,
    assert_within_budget,
    decoded,
    greedy,
    prefill,
    random_tokens,
    speculated,
    tiny,
)
from test_memory import SLACK, held
from test_memory import prefill as one_chunk
from test_pyramidkv import SCALE, ReferenceLayer, drive, random_config, reference_budgets
from veloxpatch import log
from veloxpatch.caches import CacheSpec
from veloxpatch.caches.allocation import layer_budgets
from veloxpatch.config import Budget, ConfigError, VeloxConfig
from veloxpatch.coordinators import Coordinator, coordinators_of
from veloxpatch.integration.state import STATE
from veloxpatch.methods.squeeze import SqueezeCache, SqueezeCoordinator, attention_change, kmeans_1d, squeeze_shares
from veloxpatch.registry import cache_class, name_of, policies


# ----------------------------------------------------------------- the paper's definitions, in numpy
def reference_groups(values: np.ndarray, groups: int) -> np.ndarray:
    """k-means by its definition: of every assignment of the values to ``groups`` non-empty groups,
    the one with the least within-group sum of squares; groups numbered by ascending mean."""
    best, labels = np.inf, None
    for assignment in itertools.product(range(groups), repeat=len(values)):
        a = np.array(assignment)
        if len(set(assignment)) < groups:
            continue
        cost = sum(((values[a == g] - values[a == g].mean()) ** 2).sum() for g in range(groups))
        if cost < best - 1e-12:
            best, labels = cost, a
    means = [values[labels == g].mean() for g in range(groups)]
    return np.argsort(np.argsort(means))[labels]


def reference_shares(importance: np.ndarray, strength: float) -> np.ndarray:
    """The paper's rule: the least important of three k-means groups keeps p = 1 - strength of the
    budget, the others share evenly what it gives up."""
    layers = len(importance)
    if strength == 0 or np.ptp(importance) == 0:
        return np.ones(layers)
    low = reference_groups(importance, min(3, layers)) == 0
    return np.where(low, 1 - strength, 1 + strength * low.sum() / (layers - low.sum()))


def reference_dispersion(keys: np.ndarray, pos: np.ndarray, queries: np.ndarray, offset: int, window: int) -> float:
    """Mean over batch, heads and the last ``window`` queries of the entropy of each query's attention
    over the rows it sees, divided by the log of their number (0 for a query seeing one row)."""
    b, hq, n, _ = queries.shape
    hkv = keys.shape[1]
    w = min(window, n)
    values = []
    for i, h, t in itertools.product(range(b), range(hq), range(n - w, n)):
        kv = h // (hq // hkv)
        seen = pos[i, kv] <= offset - n + t
        logits = keys[i, kv][seen] @ queries[i, h, t] * SCALE
        p = np.exp(logits - logits.max())
        p /= p.sum()
        values.append(-(p * np.log(np.maximum(p, 1e-30))).sum() / np.log(seen.sum()) if seen.sum() > 1 else 0.0)
    return float(np.mean(values))


def reference_change(hidden: np.ndarray, output: np.ndarray) -> float:
    """The paper's signal as an importance: 1 - the cosine similarity of each token's hidden state before
    (h) and after self-attention (h + o), averaged over the tokens and the batch."""
    before, after = hidden.astype(np.float64), (hidden + output).astype(np.float64)
    cosine = (before * after).sum(-1) / (np.linalg.norm(before, axis=-1) * np.linalg.norm(after, axis=-1))
    return float(1 - cosine.mean())


def squeeze_list(layers: int, budget, sink: int, window: int, mode: str, **knobs) -> list[SqueezeCache]:
    coordinator = SqueezeCoordinator("squeeze")
    caches = [SqueezeCache(CacheSpec(budget, sink, window, mode), **knobs) for _ in range(layers)]
    for cache in caches:
        coordinator.join(cache)
    return caches


@pytest.mark.parametrize("seed", range(10))
def test_kept_positions_and_budgets_equal_the_numpy_reference(seed: int) -> None:
    """Random chunkings, budgets, GQA ratios, batch sizes, depths, strengths and both modes: the
    reference reports each prompt chunk's dispersion, sets the shares at the first layer of the next
    forward, stops at the first decode step, and picks rows as SnapKV does."""
    config = random_config(1000 + seed)
    strength = [0.3, 0.5, 0.8, 1.0][seed % 4]
    sink, window, budget, mode = config["sink"], config["window"], config["budget"], config["mode"]
    floor, layers, room = sink + window, config["layers"], min(64, max(8, budget // 8))
    caches = squeeze_list(layers, Budget(tokens=budget), sink, window, mode, strength=strength, signal="entropy")
    references = [ReferenceLayer(sink, window, mode, caches[0].policy.kernel) for _ in caches]
    reports: list[list[float]] = [[] for _ in caches]
    shares, closed, stale = np.ones(layers), False, False

    def budgets_of(refs, n):
        nonlocal shares, stale
        if stale:
            shares, stale = reference_shares(np.array([np.mean(r) for r in reports]), strength), False
        return reference_budgets(shares, budget, floor, refs[0].offset + n)

    def step(layer, ref, keys, queries, keep):
        nonlocal closed, stale
        n = keys.shape[2]
        ref.append(keys)
        if n > room and not closed:
            reports[layer].append(reference_dispersion(ref.keys, ref.pos, queries, ref.offset, window))
            stale = True
        closed = closed or (n <= room and any(reports))
        ref.attend(queries, keep)

    drive(caches, references, config, budgets_of, step)
    coordinator = caches[0].coordinator
    if not reports[0]:  # every prompt step was decode-sized: nothing to go by, uniform budgets
        assert not coordinator.reports and [c.share for c in caches] == [None] * layers
        return
    got = [float(total / chunks) for total, chunks in (coordinator.reports[i] for i in range(layers))]
    assert np.allclose(got, [np.mean(r) for r in reports], atol=1e-5)
    assert [c.share for c in caches] == pytest.approx(list(shares))


@pytest.mark.parametrize("seed", range(30))
def test_kmeans_groups_and_shares_follow_the_papers_rule(seed: int) -> None:
    rng = np.random.default_rng(seed)
    layers = int(rng.integers(2, 8))
    importance = rng.uniform(0, 1, layers)
    groups = min(3, layers)
    assert (np.array(kmeans_1d(list(importance), groups)) == reference_groups(importance, groups)).all()
    strength = float(rng.uniform(0, 1))
    shares = np.array(squeeze_shares(list(importance), strength))
    assert np.allclose(shares, reference_shares(importance, strength)) and np.isclose(shares.sum(), layers)
    assert shares[np.argmin(importance)] == pytest.approx(1 - strength), "the most concentrated layer is squeezed"
    assert squeeze_shares(list(importance), 0.0) == (1.0,) * layers, "strength 0 is uniform"


@pytest.mark.parametrize("seed", range(30))
def test_budgets_sum_to_the_total_and_keep_the_floor(seed: int) -> None:
    rng = np.random.default_rng(50 + seed)
    layers, floor = int(rng.integers(2, 60)), int(rng.integers(0, 60))
    budget = int(rng.integers(floor + 1, floor + 3000))
    shares = squeeze_shares(list(rng.uniform(0, 1, layers)), float(rng.uniform(0, 1)))
    cap = int(rng.choice([10**7, int(rng.integers(floor, floor + 2 * (budget - floor) + 2))]))
    got = np.array(layer_budgets(shares, budget, floor, cap))
    assert (got == reference_budgets(np.array(shares), budget, floor, cap)).all()
    assert (got >= floor).all()
    if budget < cap:
        assert got.sum() == layers * budget and (got <= cap).all()
    assert layer_budgets((1.0,) * layers, budget, floor, cap) == (budget,) * layers


def test_the_importance_is_the_normalised_entropy_of_the_windows_attention() -> None:
    caches = squeeze_list(2, Budget(tokens=20), 2, 4, "end")
    rng = np.random.default_rng(3)
    keys = rng.standard_normal((2, 2, 30, 8)).astype(np.float32)
    queries = rng.standard_normal((2, 4, 30, 8)).astype(np.float32) * 2
    k, _ = caches[0].update_and_fetch(mx.array(keys), mx.array(keys))
    got = caches[0].dispersion(mx.array(queries), k, SCALE).item()
    expected = reference_dispersion(keys, np.array(caches[0].store.row_positions()), queries, 30, 4)
    assert got == pytest.approx(expected, abs=1e-5)
    flat = caches[0].dispersion(mx.zeros((2, 4, 30, 8)), k, SCALE).item()
    assert flat == pytest.approx(1.0, abs=1e-5), "uniform attention has the largest dispersion"


def test_the_cosine_importance_is_one_minus_the_similarity_before_and_after_attention() -> None:
    rng = np.random.default_rng(8)
    hidden = rng.standard_normal((2, 7, 16)).astype(np.float32)
    output = rng.standard_normal((2, 7, 16)).astype(np.float32) * 0.3
    got = attention_change(mx.array(hidden), mx.array(output)).item()
    assert got == pytest.approx(reference_change(hidden, output), abs=1e-6)
    assert attention_change(mx.array(hidden), mx.zeros((2, 7, 16))).item() == pytest.approx(0, abs=1e-6)
    assert attention_change(mx.array(hidden), mx.array(5 * output)).item() > got, "a larger change matters more"


def test_a_bad_signal_is_refused_naming_the_setting_the_value_and_the_choices() -> None:
    with pytest.raises(ConfigError, match=r"VELOX_SQUEEZE_SIGNAL='attention' is not allowed: expected one of "
                                          r"cosine, entropy"):
        VeloxConfig(kv="squeeze", knobs={"squeeze_signal": "attention"})
    assert VeloxConfig(kv="squeeze", knobs={"squeeze_signal": " Entropy "}).knobs["squeeze_signal"] == "entropy"


def test_without_the_hooks_the_cosine_signal_reports_the_entropy_one_said_once(caplog, monkeypatch) -> None:
    """Caches driven directly get no layer input/output: each prompt chunk reports its dispersion."""
    caches = squeeze_list(2, Budget(tokens=16), 2, 4, "chunk")
    logger = logging.getLogger("veloxpatch")
    monkeypatch.setattr(logger, "propagate", False)  # records reach caplog once, through its handler
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="veloxpatch")
    log._said.discard("squeeze signal")  # said once per process
    rng = np.random.default_rng(9)
    expected: list[list[float]] = [[], []]
    try:
        for n in (40, 40, 1):
            for cache, values in zip(caches, expected):
                keys = mx.array(rng.standard_normal((1, 2, n, 8)).astype(np.float32))
                queries = mx.array(rng.standard_normal((1, 2, n, 8)).astype(np.float32))
                k, v = cache.update_and_fetch(keys, keys)
                if n > 1:
                    values.append(cache.dispersion(queries, k, SCALE).item())
                cache.attend(queries, k, v, scale=SCALE)
    finally:
        logger.removeHandler(caplog.handler)
    reports = caches[0].coordinator.reports
    assert [float(total / chunks) for total, chunks in (reports[0], reports[1])] == pytest.approx(
        [np.mean(values) for values in expected], abs=1e-6)
    lines = [r.getMessage() for r in caplog.records if "entropy signal" in r.getMessage()]
    assert len(lines) == 1 and "no layer input/output reached a squeeze cache" in lines[0]


# ----------------------------------------------------------------- on models
# (the contracts every method keeps, each layer within its own budget, are in test_contracts.py and
# test_exactness.py; here the policies and the schedule)
def four_layers(arch: str = "llama", seed: int = 2):
    return tiny(arch, seed=seed, layers=4)


def spied(caches: list) -> list[list[list[np.ndarray]]]:
    """Per layer, each step's [block input, attention output] as the layer hooks hand them to the cache."""
    seen: list[list[list[np.ndarray]]] = [[] for _ in caches]
    for cache, steps in zip(caches, seen):
        def block(hidden, cache=cache, steps=steps):
            steps.append([np.array(hidden)])
            type(cache).see_block_input(cache, hidden)

        def attention(normed, output, cache=cache, steps=steps):
            steps[-1].append(np.array(output))
            type(cache).see_attention(cache, normed, output)

        cache.see_block_input, cache.see_attention = block, attention
    return seen


def test_the_cosine_signal_is_the_similarity_of_the_hidden_state_before_and_after_attention() -> None:
    """The default signal on a model: each layer reports 1 - cos(h, h + o) of every prompt chunk (the
    paper's definition, in numpy on the h and o the hooks captured); the layers whose attention changes
    the hidden state least give budget away, and the budgets still sum to layers x budget."""
    model = four_layers("qwen3")
    veloxpatch.patch(kv="squeeze", budget=40, window=8, knobs={"squeeze_strength": 0.75})
    caches = make_prompt_cache(model)
    seen = spied(caches)
    prompt = random_tokens(241, 17)
    prefill(model, caches, prompt[:240], chunk=60)
    (coordinator,) = coordinators_of(caches)
    expected = np.array([np.mean([reference_change(h, o) for h, o in steps]) for steps in seen])
    got = [float(total / chunks) for total, chunks in (coordinator.reports[i] for i in range(4))]
    assert all(len(steps) == 4 for steps in seen) and got == pytest.approx(list(expected), abs=1e-5)
    model(prompt[None, 240:], cache=caches)  # the first decode step sets the shares
    assert [c.share for c in caches] == pytest.approx(list(reference_shares(expected, 0.75)))
    assert caches[int(np.argmin(expected))].share == pytest.approx(0.25)
    assert sum(c.target() for c in caches) == 4 * 40 and all(c.block_input is None for c in caches)


def test_the_entropy_signal_reports_the_attention_dispersion_with_the_hooks_in_place() -> None:
    model = four_layers()
    veloxpatch.patch(kv="squeeze", budget=40, window=8, knobs={"squeeze_signal": "entropy"})
    caches = make_prompt_cache(model)
    assert any(swap.owner is type(model.layers[0].self_attn) for swap in STATE.swaps.values())
    reported: list[list[float]] = [[] for _ in caches]
    for cache, values in zip(caches, reported):
        def dispersion(queries, keys, scale, cache=cache, values=values):
            value = type(cache).dispersion(cache, queries, keys, scale)
            values.append(value.item())
            return value

        cache.dispersion = dispersion
    greedy(model, random_tokens(200, 18), caches, steps=4, chunk=64)
    (coordinator,) = coordinators_of(caches)
    assert [coordinator.reports[i][1] for i in range(4)] == [len(values) for values in reported]
    got = [float(total / chunks) for total, chunks in (coordinator.reports[i] for i in range(4))]
    assert got == pytest.approx([np.mean(values) for values in reported], abs=1e-6)
    assert all(c.block_input is None for c in caches) and sum(c.target() for c in caches) == 4 * 40


@pytest.mark.parametrize("signal", ["cosine", "entropy"])
def test_a_chunks_report_keeps_nothing_of_the_chunk_alive(signal: str) -> None:
    """The importance is computed at once: left lazy until the schedule reads it at the next forward, it
    kept each layer's h and o (or its queries and stored keys) alive until then."""
    model = tiny("llama", seed=1)
    tokens = random_tokens(2048, 33)
    veloxpatch.patch(kv="snapkv", budget=1 << 20, window=16)
    snapkv, _ = held(one_chunk(tokens, model), model)
    veloxpatch.patch(kv="squeeze", budget=1 << 20, window=16, knobs={"squeeze_signal": signal})
    used, caches = held(one_chunk(tokens, model), model)
    assert len(caches[0].coordinator.reports) == len(caches)
    assert used - snapkv < SLACK, f"held {used} B, snapkv {snapkv} B"


@pytest.mark.parametrize("policy", policies())
@pytest.mark.parametrize("mode", ["end", "chunk"])
def test_every_policy_decodes_within_each_layers_own_budget(policy: str, mode: str) -> None:
    tokens, caches = decoded("squeeze", mode, squeeze_policy=policy)
    assert all(isinstance(c.policy, cache_class(policy).policy_class) and name_of(c) == "squeeze" for c in caches)
    targets = [c.target() for c in caches]
    assert len(tokens) == 30 and sum(targets) == 4 * 40 and len(set(targets)) > 1
    assert_within_budget(caches, 230)


def test_the_schedule_is_set_by_the_prompt_and_frozen_while_decoding() -> None:
    model = four_layers()
    veloxpatch.patch(kv="squeeze", budget=40, window=8, compress="end", knobs={"squeeze_strength": 0.75})
    caches = make_prompt_cache(model)
    (coordinator,) = coordinators_of(caches)
    prompt = random_tokens(300, 9)
    prefill(model, caches, prompt[:299], chunk=60)
    assert len(coordinator.reports) == 4 and all(chunks == 5 for _, chunks in coordinator.reports.values())
    model(prompt[None, 299:], cache=caches)  # the first decode step: shares set, then frozen
    shares = [c.share for c in caches]
    targets = [c.target() for c in caches]
    assert sum(shares) == pytest.approx(4) and min(shares) == pytest.approx(0.25) and sum(targets) == 160
    assert [c.size() for c in caches] == targets
    for token in random_tokens(40, 10).tolist():
        model(mx.array([[token]]), cache=caches)
        assert [c.share for c in caches] == shares and [c.target() for c in caches] == targets
    model(random_tokens(30, 11)[None], cache=caches)  # a later chunk does not move the schedule
    assert [c.share for c in caches] == shares and [c.target() for c in caches] == targets


def test_strength_zero_is_uniform() -> None:
    model = four_layers()
    veloxpatch.patch(kv="squeeze", budget=40, window=8, knobs={"squeeze_strength": 0})
    caches = make_prompt_cache(model)
    greedy(model, random_tokens(200, 12), caches, steps=4, chunk=64)
    assert [c.share for c in caches] == [1.0] * 4 and [c.target() for c in caches] == [40] * 4


def test_the_schedule_uses_the_budget_set_after_an_end_mode_prefill() -> None:
    """The evaluation harness prefills once and sets each member's budget before decoding."""
    model = four_layers()
    veloxpatch.patch(kv="squeeze", budget=4096, window=8)
    caches = make_prompt_cache(model)
    prompt = random_tokens(300, 13)
    prefill(model, caches, prompt[:299], chunk=100)
    for budget in (48, 96):
        copies = copy.deepcopy(caches)
        for cache in copies:
            cache.budget = Budget(tokens=budget)
        model(prompt[None, 299:], cache=copies)
        shares = np.array([c.share for c in copies])
        expected = reference_budgets(shares, budget, 12, 300)
        assert [c.size() for c in copies] == list(expected) and expected.sum() == 4 * budget
        assert len(set(expected)) > 1


def test_a_layer_that_never_reports_gives_uniform_budgets_and_one_log_line(caplog) -> None:
    caches = squeeze_list(3, Budget(tokens=16), 2, 4, "chunk")
    logger = logging.getLogger("veloxpatch")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="veloxpatch")
    log._said.discard("squeeze partial")  # said once per process
    rng = np.random.default_rng(4)
    try:
        for n in (40, 40, 1, 1, 1):
            for layer, cache in enumerate(caches):
                keys = mx.array(rng.standard_normal((1, 2, n, 8)).astype(np.float32))
                k, v = cache.update_and_fetch(keys, keys)
                if layer != 1:  # layer 1 attends elsewhere
                    cache.attend(mx.array(rng.standard_normal((1, 2, n, 8)).astype(np.float32)), k, v, scale=SCALE)
    finally:
        logger.removeHandler(caplog.handler)
    assert [c.target() for c in caches] == [16] * 3 and [c.share for c in caches] == [None] * 3
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("squeeze:")]
    assert len(lines) == 1 and "1 of 3 layers" in lines[0]


def test_a_new_sequence_forgets_the_schedule_and_a_continued_one_keeps_it() -> None:
    model = four_layers()
    veloxpatch.patch(kv="squeeze", budget=40, window=8)
    caches = make_prompt_cache(model)
    greedy(model, random_tokens(200, 14), caches, steps=4, chunk=64)
    (coordinator,) = coordinators_of(caches)
    shares = [c.share for c in caches]
    assert None not in shares
    greedy(model, mx.array([3, 4]), caches, steps=4)  # a chat's next turn, too short to report
    assert [c.share for c in caches] == shares and not coordinator.reports
    greedy(model, random_tokens(100, 15), caches, steps=2, chunk=50)  # a long next turn reports afresh
    assert all(chunks == 2 for _, chunks in coordinator.reports.values())
    trim_prompt_cache(caches, caches[0].offset)
    model(random_tokens(5, 16)[None], cache=caches)  # a new sequence on the same list
    assert [c.share for c in caches] == [None] * 4 and [c.target() for c in caches] == [40] * 4


def test_a_rewind_keeps_the_shares_and_the_policys_own_row_state() -> None:
    model = tiny("llama", seed=1)
    veloxpatch.patch(kv="squeeze", budget=36, window=8, compress="chunk", knobs={"squeeze_policy": "h2o"})
    caches = make_prompt_cache(model)
    greedy(model, random_tokens(150, 6), caches, steps=16)
    shares = [c.share for c in caches]
    assert None not in shares
    assert all(c.size() + 4 < c.target() + c.schedule.headroom(c.target()) for c in caches), \
        "the draft compresses nothing"
    assert_a_rejected_draft_leaves_no_trace(model, caches, steps=20)  # the h2o mass followed the trim
    assert [c.share for c in caches] == shares
    assert_within_budget(caches, 166 + 21)  # 20 more tokens, generate_step one ahead


def test_speculative_decoding_keeps_every_layers_share_and_budget() -> None:
    """All the layers of each model in the list (no mlx_lm cache beside them), so the schedule is set."""
    steps, main, drafts = speculated("squeeze", witness=False)
    assert len(steps) == 40 and 0 < sum(from_draft for _, _, from_draft in steps) < 40
    for caches in (main, drafts):
        assert None not in [c.share for c in caches] and len({c.target() for c in caches}) > 1
        assert_within_budget(caches, caches[0].offset)


def test_a_restored_list_keeps_each_layers_budget_under_the_h2o_policy(tmp_path) -> None:
    """The snapkv policy is restored in test_contracts.py's round trip of every method."""
    model = four_layers("qwen3")
    veloxpatch.patch(kv="squeeze", budget=40, window=8,
                     knobs={"squeeze_policy": "h2o", "squeeze_strength": 0.6, "squeeze_signal": "entropy"})
    caches = make_prompt_cache(model)
    greedy(model, random_tokens(150, 8), caches, steps=4, chunk=50)
    loaded = assert_round_trip(str(tmp_path / "prompt.safetensors"), model, caches, steps=20)
    assert isinstance(loaded[0].coordinator, SqueezeCoordinator) and {c.signal for c in loaded} == {"entropy"}
    assert None not in [c.share for c in loaded] and len({c.target() for c in loaded}) > 1


@pytest.mark.parametrize("policy", policies())
def test_a_policy_picks_the_rows_its_own_method_picks_at_the_layers_budget(policy: str) -> None:
    """The mechanism: a squeeze cache is the policy's cache with another budget, nothing else."""
    rng = np.random.default_rng(5)
    coordinator = Coordinator("squeeze")  # shares given, no reports
    ours = [SqueezeCache(CacheSpec(Budget(tokens=30), 2, 4, "chunk"), policy=policy, share=s) for s in (1.5, 0.5)]
    for cache in ours:
        coordinator.join(cache)
    theirs = [cache_class(policy)(CacheSpec(Budget(tokens=keep), 2, 4, "chunk")) for keep in (42, 18)]
    for n in (50, 3, 30, 1, 1, 20, 1):
        for cache, plain in zip(ours, theirs):
            keys = mx.array(rng.standard_normal((2, 2, n, 8)).astype(np.float32))
            queries = mx.array(rng.standard_normal((2, 4, n, 8)).astype(np.float32))
            for c in (cache, plain):
                k, v = c.update_and_fetch(keys, keys)
                c.attend(queries, k, v, scale=SCALE)
            assert cache.target() == plain.target()
            assert (np.array(cache.store.row_positions()) == np.array(plain.store.row_positions())).all()
