"""PyramidKV (arXiv 2406.02069): SnapKV's selection under budgets that shrink with depth.

The numpy reference here (budgets from the paper's arithmetic sequence, SnapKV's selection from its
paper) is shared with tests/test_squeeze.py.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from conftest import decoded
from veloxpatch.caches import CacheSpec
from veloxpatch.caches.allocation import layer_budgets
from veloxpatch.config import Budget
from veloxpatch.coordinators import Coordinator
from veloxpatch.methods.pyramidkv import PyramidKVCache, pyramid

SCALE = 0.4


# ----------------------------------------------------------------- the papers' definitions, in numpy
def paper_pyramid(layers: int, beta: float) -> np.ndarray:
    """PyramidKV's budgets as shares of the mean: top layer 1/beta, bottom 2 - 1/beta, arithmetic."""
    top = 1 / beta
    return np.linspace(2 - top, top, layers)


def reference_budgets(shares: np.ndarray, budget: int, floor: int, cap: int) -> np.ndarray:
    """Per-layer rows: floor + each layer's share of the mean budget above the floor, none above
    ``cap`` (the excess re-shared among the others by their shares), integers by largest remainder
    (lower layer first on a tie) summing to layers x budget; the plain budget when nothing is evicted."""
    layers = len(shares)
    free, room = budget - floor, cap - floor
    if free <= 0 or free >= room:
        return np.full(layers, max(budget, floor))
    parts = np.zeros(layers)
    capped = np.zeros(layers, bool)
    while True:
        left = layers * free - room * capped.sum()
        weights = np.where(capped, 0.0, shares)
        weights = weights / weights.sum() if weights.sum() > 0 else np.where(capped, 0.0, 1.0) / (~capped).sum()
        parts = np.where(capped, room, weights * left)
        if not (parts > room + 1e-9).any():
            break
        capped |= parts > room + 1e-9
    whole = np.floor(parts + 1e-9)
    extra = round(layers * free - whole.sum())
    order = np.argsort(-np.round(parts - whole, 9), kind="stable")
    whole[order[:extra]] += 1
    return (floor + whole).astype(int)


def snapkv_scores(keys, pos, queries, offset: int, sink: int, window: int, kernel: int,
                  queries_end: int | None = None) -> np.ndarray:
    """SnapKV for one batch row: the window's attention (softmax over the rows each query sees)
    summed over its queries and the query heads of each KV head, zero on the sink and window,
    averaged over ``kernel`` neighbouring rows (zero padding). keys (hkv, rows, d), pos (hkv, rows),
    queries (hq, w, d); the window queries are those of the w tokens before ``queries_end`` (default
    ``offset``: the last w tokens seen), so rows stored after them are invisible to them."""
    end = offset if queries_end is None else queries_end
    hkv, rows, _ = keys.shape
    group, w = queries.shape[0] // hkv, queries.shape[1]
    out = np.zeros((hkv, rows))
    for h in range(hkv):
        q = queries[h * group : (h + 1) * group]  # (group, w, d)
        logits = q @ keys[h].T * SCALE  # (group, w, rows)
        visible = (pos[h] >= 0) & (pos[h][None] <= (end - w + np.arange(w))[:, None])
        logits = np.where(visible[None], logits, -np.inf)
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        out[h] = (probs / probs.sum(-1, keepdims=True)).sum((0, 1))
    protected = (pos >= 0) & ((pos < sink) | (pos >= offset - window))
    out = np.where(protected, 0.0, out)
    half = kernel // 2
    padded = np.pad(out, ((0, 0), (half, half)))
    return np.stack([padded[:, i : i + rows] for i in range(kernel)]).mean(0)


def top_rows(scores: np.ndarray, pos: np.ndarray, keep: int, offset: int, sink: int, window: int) -> np.ndarray:
    """Row indexes kept per KV head: sink and window always, holes never, then the best scores."""
    protected = (pos >= 0) & ((pos < sink) | (pos >= offset - window))
    ranked = np.where(protected, np.inf, np.where(pos < 0, -np.inf, scores))
    return np.sort(np.argsort(-ranked, axis=-1, kind="stable")[..., :keep], axis=-1)


class ReferenceLayer:
    """One layer's rows under the cache contract, in numpy: what is stored, what is remembered,
    when it compresses (``chunk``: after a step longer than the headroom; before a decode-sized step
    over rows already at keep + headroom, e.g. an ``end``-mode prompt; after a decode step that
    reaches keep + headroom), with SnapKV picking."""

    def __init__(self, sink: int, window: int, mode: str, kernel: int) -> None:
        self.sink, self.window, self.mode, self.kernel = sink, window, mode, kernel
        self.keys = self.pos = self.queries = None
        self.offset = self.queries_end = 0

    def step(self, keys: np.ndarray, queries: np.ndarray, keep: int) -> None:
        self.append(keys)
        self.attend(queries, keep)

    def append(self, keys: np.ndarray) -> None:
        b, hkv, n, _ = keys.shape
        new_pos = np.broadcast_to(np.arange(self.offset, self.offset + n), (b, hkv, n))
        self.keys = keys if self.keys is None else np.concatenate([self.keys, keys], 2)
        self.pos = new_pos if self.pos is None else np.concatenate([self.pos, new_pos], 2)
        self.offset += n

    def attend(self, queries: np.ndarray, keep: int) -> None:
        n, rows = queries.shape[2], self.pos.shape[-1]
        room = min(64, max(8, keep // 8))
        # a decode-sized step over rows already due (an end-mode prompt, or a budget that shrank):
        # compressed by the window so far, before this step's queries
        pending = n <= room and rows - n >= keep + room
        if pending:
            self.compress(keep)
        self.queries = queries if self.queries is None else np.concatenate([self.queries, queries], 2)
        self.queries = self.queries[:, :, -self.window :]
        self.queries_end = self.offset
        if not pending and rows > keep and (rows >= keep + room if n <= room else self.mode == "chunk"):
            self.compress(keep)

    def compress(self, keep: int) -> None:
        index = np.stack([top_rows(snapkv_scores(self.keys[i], self.pos[i], self.queries[i], self.offset,
                                                 self.sink, self.window, self.kernel, self.queries_end),
                                   self.pos[i], keep, self.offset, self.sink, self.window)
                          for i in range(self.pos.shape[0])])
        self.keys = np.take_along_axis(self.keys, index[..., None], 2)
        self.pos = np.take_along_axis(self.pos, index, 2)


def random_config(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    sink, window = int(rng.integers(0, 4)), int(rng.integers(2, 7))
    prompt = int(rng.integers(40, 130))
    cuts = np.sort(rng.choice(np.arange(1, prompt), size=int(rng.integers(1, 6)), replace=False))
    return dict(
        rng=rng, batch=int(rng.integers(1, 3)), kv_heads=int(rng.integers(1, 3)), group=int(rng.integers(1, 4)),
        layers=int(rng.integers(2, 5)), sink=sink, window=window, budget=int(rng.integers(sink + window + 2, 41)),
        mode=["end", "chunk"][seed % 2], steps=list(np.diff([0, *cuts, prompt])) + [1] * int(rng.integers(5, 30)),
    )


def drive(caches: list, references: list, config: dict, budgets_of, step=None) -> None:
    """Feed the same random keys and queries to the caches (update_and_fetch + attend, layer by layer,
    as a model does) and to the references, and check every layer's budget, ``budgets_of(references,
    n)`` before a step of n tokens, and kept positions after each step. ``step(layer, reference, keys,
    queries, keep)`` moves a reference (by default its own ``step``)."""
    rng, dim = config["rng"], 8
    b, hkv, hq = config["batch"], config["kv_heads"], config["kv_heads"] * config["group"]
    for n in config["steps"]:
        n = int(n)
        expected = budgets_of(references, n)
        for layer, (cache, ref) in enumerate(zip(caches, references)):
            keys = rng.standard_normal((b, hkv, n, dim)).astype(np.float32) * 1.5
            queries = rng.standard_normal((b, hq, n, dim)).astype(np.float32) * 1.5
            k, v = cache.update_and_fetch(mx.array(keys), mx.array(keys))
            assert cache.target() == expected[layer], f"layer {layer} budget"
            cache.attend(mx.array(queries), k, v, scale=SCALE)
            if step is None:
                ref.step(keys.astype(np.float64), queries.astype(np.float64), int(expected[layer]))
            else:
                step(layer, ref, keys.astype(np.float64), queries.astype(np.float64), int(expected[layer]))
            got = np.array(cache.store.row_positions())
            assert got.shape == ref.pos.shape and (got == ref.pos).all(), f"layer {layer} kept other positions"


@pytest.mark.parametrize("seed", range(10))
def test_kept_positions_equal_the_numpy_reference(seed: int) -> None:
    """Random chunkings, budgets, GQA ratios, batch sizes, depths and both modes."""
    config = random_config(seed)
    beta = [20.0, 2.0, 5.0][seed % 3]
    kernel = [31, 7, 3, 1][seed % 4]
    coordinator = Coordinator("pyramidkv")
    spec = CacheSpec(Budget(tokens=config["budget"]), config["sink"], config["window"], config["mode"])
    caches = [PyramidKVCache(spec, beta=beta, kernel=kernel) for _ in range(config["layers"])]
    for cache in caches:
        coordinator.join(cache)
    references = [ReferenceLayer(config["sink"], config["window"], config["mode"], kernel) for _ in caches]
    shares = paper_pyramid(config["layers"], beta)
    floor = config["sink"] + config["window"]

    def budgets_of(refs, n):
        return reference_budgets(shares, config["budget"], floor, refs[0].offset + n)

    drive(caches, references, config, budgets_of)
    assert any(ref.pos.shape[-1] < ref.offset for ref in references), "something was evicted"


# ----------------------------------------------------------------- the budgets
@pytest.mark.parametrize("seed", range(40))
def test_budgets_are_the_papers_arithmetic_sequence(seed: int) -> None:
    rng = np.random.default_rng(seed)
    layers, floor = int(rng.integers(2, 80)), int(rng.integers(0, 80))
    budget, beta = int(rng.integers(floor + 1, floor + 3000)), float(rng.uniform(1, 40))
    got = np.array(layer_budgets(pyramid(layers, beta), budget, floor, 10**7))
    exact = floor + (budget - floor) * paper_pyramid(layers, beta)
    assert got.sum() == layers * budget, "the mean is the budget, exactly"
    assert (np.abs(got - exact) < 1).all() and (got >= floor).all()
    assert (np.diff(got) <= 0).all(), "budgets shrink with depth"
    assert (got == reference_budgets(paper_pyramid(layers, beta), budget, floor, 10**7)).all()


@pytest.mark.parametrize("seed", range(40))
def test_no_layer_gets_more_than_the_tokens_seen_and_the_sum_holds(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    layers, floor = int(rng.integers(2, 40)), int(rng.integers(0, 40))
    budget, beta = int(rng.integers(floor + 1, floor + 500)), float(rng.uniform(1, 40))
    cap = int(rng.integers(floor, floor + 2 * (budget - floor) + 2))
    got = np.array(layer_budgets(pyramid(layers, beta), budget, floor, cap))
    assert (got == reference_budgets(paper_pyramid(layers, beta), budget, floor, cap)).all()
    if budget >= cap:
        assert (got == budget).all(), "nothing to evict: the plain budget"
    else:
        assert got.sum() == layers * budget and (got <= cap).all() and (got >= floor).all()
        assert (np.diff(got) <= 0).all()


def test_targets_shrink_with_depth_and_average_the_budget_also_as_a_percentage() -> None:
    for budget in (Budget(tokens=300), Budget(fraction=0.25)):
        coordinator = Coordinator("pyramidkv")
        caches = [PyramidKVCache(CacheSpec(budget, sink=4, window=16)) for _ in range(6)]
        for cache in caches:
            coordinator.join(cache)
            cache.offset = 4000
        targets = [c.target() for c in caches]
        assert targets == sorted(targets, reverse=True) and targets[0] > targets[-1] >= 20
        assert sum(targets) == 6 * budget.resolve(4000)
    alone = PyramidKVCache(CacheSpec(Budget(tokens=300), sink=4, window=16))
    alone.offset = 4000
    assert alone.target() == 300, "without a coordinator: the plain budget"


# ----------------------------------------------------------------- on models
# (the contracts every method keeps, each layer within its own budget, are in test_contracts.py and
# test_exactness.py)
@pytest.mark.parametrize("mode", ["end", "chunk"])
def test_budgets_shrink_with_depth_while_decoding(mode: str) -> None:
    _, caches = decoded("pyramidkv", mode)
    targets = [c.target() for c in caches]
    assert targets == sorted(targets, reverse=True) and targets[0] > targets[-1] and sum(targets) == 4 * 40
