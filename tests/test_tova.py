"""TOVA as the paper defines it (arXiv 2401.06104), against a plain numpy reference, and its shared rows."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import decoded, random_case, random_rows, softmax, speculated
from conftest import feed as feed_rows
from veloxpatch.caches import CacheSpec
from veloxpatch.config import Budget
from veloxpatch.methods.tova import TOVACache

SCALE = 0.35
DIM = 8


# --------------------------------------------------------------------- the reference, from the paper
def tova_reference(keys: np.ndarray, queries: np.ndarray, chunks: list[int], budget: int, sink: int, window: int,
                   mode: str) -> list[np.ndarray]:
    """Kept positions, (B, kv_heads, rows), after every step.

    TOVA scores a cached token by the attention the newest query pays it (its softmax over the
    tokens it sees), averaged over all the layer's heads, and keeps the best tokens for the whole
    layer; here the sinks and the recent window stay too. Eviction follows the cache's schedule:
    after a prefill chunk in ``chunk`` mode, when a decode step leaves ``budget + headroom`` rows
    (scored by that step's last query), and, in ``end`` mode, before the first decode-sized step
    attends over a prompt left whole (scored by the prompt's last query).
    """
    batch, kv_heads = keys.shape[:2]
    group = queries.shape[1] // kv_heads
    keep = max(budget, sink + window)
    room = min(64, max(8, keep // 8))
    rows: dict = {b: [] for b in range(batch)}
    offset, newest = 0, -1
    history = []

    def choose(b: int) -> list[int]:
        seen = [r for r in rows[b] if r <= newest]
        logits = np.stack([queries[b, qh, newest] @ keys[b, qh // group, seen].T for qh in range(queries.shape[1])])
        score = dict(zip(seen, softmax(logits * SCALE).mean(axis=0)))
        protected = [p for p in rows[b] if p < sink or p >= offset - window]
        rest = sorted((p for p in rows[b] if p not in protected), key=lambda p: -score.get(p, 0.0))
        return sorted(protected + rest[: keep - len(protected)])

    for n in chunks:
        offset += n
        rows = {b: rows[b] + list(range(offset - n, offset)) for b in range(batch)}
        count = len(rows[0])
        if n <= room and count - n >= keep + room:
            rows = {b: choose(b) for b in range(batch)}
        newest = offset - 1
        if count > keep and (mode == "chunk" if n > room else count >= keep + room):
            rows = {b: choose(b) for b in range(batch)}
        history.append(np.array([[rows[b]] * kv_heads for b in range(batch)]))
    return history


# --------------------------------------------------------------------- driving the cache directly
def feed(cache: TOVACache, keys: np.ndarray, queries: np.ndarray, chunks: list[int]):
    return feed_rows(cache, keys, queries, chunks, SCALE)


def run_against_reference(case: dict, mode: str) -> list[np.ndarray]:
    cache = TOVACache(CacheSpec(Budget(tokens=case["budget"]), case["sink"], case["window"], mode=mode))
    expected = tova_reference(case["keys"], case["queries"], case["chunks"], case["budget"], case["sink"],
                              case["window"], mode)
    steps = list(feed(cache, case["keys"], case["queries"], case["chunks"]))
    for step, (got, want) in enumerate(zip(steps, expected)):
        assert got.shape == want.shape and (got == want).all(), f"step {step} ({case['chunks'][step]} tokens)"
    return steps


@pytest.mark.parametrize("seed", range(24))
def test_chunk_mode_keeps_exactly_the_references_positions(seed: int) -> None:
    run_against_reference(random_case(seed), "chunk")


@pytest.mark.parametrize("seed", range(6))
def test_end_mode_compresses_the_prompt_by_its_last_query(seed: int) -> None:
    case = random_case(100 + seed)
    case["chunks"] = np.random.default_rng(seed).integers(20, 60, size=3).tolist() + [1] * 30
    batch, kv_heads = case["keys"].shape[:2]
    case["keys"], case["queries"] = random_rows(seed, batch, kv_heads, case["queries"].shape[1] // kv_heads,
                                                sum(case["chunks"]))
    steps = run_against_reference(case, "end")
    assert steps[2].shape[-1] == sum(case["chunks"][:3]), "no prompt row goes while the prompt is read"


def test_an_end_mode_prompt_is_scored_over_the_rows_its_last_query_saw() -> None:
    """The step that compresses the prompt is already stored when the prompt's last query scores
    the rows; that query never saw the step's row. Seen, the new row would take one head's
    attention (and so its vote) away from row 5, and row 7 would be kept instead."""
    keys = np.zeros((1, 1, 41, DIM), np.float32)
    keys[0, 0, 5, 0], keys[0, 0, 7, 1], keys[0, 0, 40, 0] = 3 / SCALE, 3 / SCALE, 20 / SCALE
    queries = np.zeros((1, 2, 41, DIM), np.float32)
    queries[0, 0, 39, 0], queries[0, 1, 39, 1] = 1.5, 1.2
    cache = TOVACache(CacheSpec(Budget(tokens=2), sink=0, window=1, mode="end"))
    *_, kept = feed(cache, keys, queries, [40, 1])
    assert kept.tolist() == [[[5, 40]]]


def test_only_the_newest_query_is_remembered() -> None:
    cache = TOVACache(CacheSpec(Budget(tokens=20), 2, 4, mode="chunk"))
    keys, queries = random_rows(1, 1, 2, 2, 50)
    list(feed(cache, keys, queries, [30, 20]))
    assert (cache.memory.queries.shape == (1, 4, 1, DIM)
            and np.allclose(np.array(cache.memory.queries[:, :, 0]), queries[:, :, 49]))


# --------------------------------------------------------------------- on real models
# (the contracts every method keeps are in test_contracts.py and test_exactness.py; these are TOVA's own)
def same_rows_in_every_head(caches) -> bool:
    return all((c.store.row_positions() == c.store.row_positions()[:, :1]).all().item() for c in caches)


@pytest.mark.parametrize("mode", ["chunk", "end"])
def test_every_head_keeps_the_same_rows_while_decoding(mode: str) -> None:
    _, caches = decoded("tova", mode)
    assert same_rows_in_every_head(caches)


def test_speculative_decoding_keeps_the_rows_shared_by_the_heads() -> None:
    _, main, drafts = speculated("tova")
    assert same_rows_in_every_head(main[1:] + drafts[1:])
