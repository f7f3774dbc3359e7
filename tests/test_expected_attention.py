"""Expected Attention (arXiv 2510.00636) against a numpy reference of its rule: the rotary maps, the expected
logits, and the rows a cache keeps."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.rope_utils import initialize_rope

from conftest import feed, random_rows, softmax
from veloxpatch.caches import CacheSpec
from veloxpatch.config import Budget
from veloxpatch.methods.expected_attention import ExpectedAttentionCache, expected_logits, mean_ahead, rotations

DIM, BASE, SCALE = 8, 100.0, 0.35
ROPES = {
    "plain": lambda: nn.RoPE(DIM, base=BASE),
    "traditional": lambda: nn.RoPE(DIM, traditional=True, base=BASE),
    "partial": lambda: nn.RoPE(DIM // 2, base=BASE),
    "llama3": lambda: initialize_rope(DIM, BASE, False, {"rope_type": "llama3", "factor": 8.0,
                                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                         "original_max_position_embeddings": 64}, 256),
    "yarn": lambda: initialize_rope(DIM, BASE, False, {"rope_type": "yarn", "factor": 4.0, "mscale": 1.0,
                                                       "mscale_all_dim": 0.0,
                                                       "original_max_position_embeddings": 64}, 256),
}


@pytest.mark.parametrize("kind", sorted(ROPES))
def test_rotations_are_the_modules_own_maps(kind: str) -> None:
    """``x @ rotations(...)[i]`` is the module applied to ``x`` at position ``first + i``, for every kind of rotary
    module (scaled ones too): the reference is the module itself."""
    rope = ROPES[kind]()
    x = mx.random.normal((1, 3, 5, DIM), key=mx.random.key(0))
    maps = rotations(rope, 7, 5, DIM)
    ours = mx.einsum("bhic,icj->bhij", x, maps)
    assert np.allclose(np.array(ours), np.array(rope(x, offset=7)), atol=1e-5)


def dynamic_ntk() -> nn.Module:
    """A module whose frequencies move with the position past its 32 positions (a rotation by ``a + b`` is then not
    one by ``a`` then one by ``b``)."""
    return initialize_rope(DIM, BASE, False, {"rope_type": "dynamic", "factor": 4.0}, 32)


@pytest.mark.parametrize("kind", [*sorted(ROPES), "dynamic"])
@pytest.mark.parametrize("end", [8, 40])
def test_the_mean_map_ahead_from_positions_zero_on_is_every_maps_mean(kind: str, end: int) -> None:
    """With the mean map of positions 0 .. future - 1 given, the mean map ahead of ``end`` is still the mean of the
    module's own maps there: composed where rotations compose, every map where they do not (dynamic NTK past 32)."""
    rope = dynamic_ntk() if kind == "dynamic" else ROPES[kind]()
    base = rotations(rope, 0, 16, DIM).mean(axis=0)
    direct = rotations(rope, end, 16, DIM).mean(axis=0)
    assert np.allclose(np.array(mean_ahead(rope, end, 16, DIM, base)), np.array(direct), atol=1e-5)


def rotate(x: np.ndarray, position: int) -> np.ndarray:
    """nn.RoPE's rotation (half-split pairs) of ``x`` (..., DIM) at ``position``, written from its definition."""
    half = DIM // 2
    angle = position * BASE ** (-np.arange(half) * 2.0 / DIM)
    c, s = np.cos(angle), np.sin(angle)
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * c - b * s, a * s + b * c], axis=-1)


def reference_logits(queries: np.ndarray, keys: np.ndarray, end: int, future: int) -> np.ndarray:
    """The paper's closed form, (B, kv_heads, group, rows): queries (rotated at ``end - n`` .. ``end - 1``) rotated
    back, mean and per-channel variance, the mean map of the next ``future`` positions applied to both."""
    b, hq, n, _ = queries.shape
    plain = np.stack([rotate(queries[:, :, i], -(end - n + i)) for i in range(n)], axis=2)
    mean, var = plain.mean(axis=2), plain.var(axis=2)
    ahead = np.mean([rotate(np.eye(DIM), end + t) for t in range(future)], axis=0)  # row j: e_j's image
    seen = keys @ ahead.T
    hkv = keys.shape[1]
    mean, var = mean.reshape(b, hkv, hq // hkv, DIM), var.reshape(b, hkv, hq // hkv, DIM)
    return SCALE * mean @ seen.swapaxes(-1, -2) + 0.5 * SCALE**2 * var @ (seen**2).swapaxes(-1, -2)


@pytest.mark.parametrize("seed", range(4))
def test_expected_logits_follow_the_closed_form(seed: int) -> None:
    keys, queries = random_rows(seed, 2, 2, 2, 40, DIM)
    rope, want = nn.RoPE(DIM, base=BASE), reference_logits(queries[:, :, -6:], keys, 40, 16)
    for base in (None, rotations(rope, 0, 16, DIM).mean(axis=0)):
        ours = expected_logits(mx.array(queries[:, :, -6:]), mx.array(keys), rope, 40, 16, SCALE, base)
        assert np.allclose(np.array(ours), want, atol=1e-4)


def test_without_a_rotary_module_the_statistics_stay_unrotated() -> None:
    keys, queries = random_rows(9, 1, 2, 2, 20, DIM)
    q = queries[:, :, -4:]
    mean, var = q.mean(axis=2).reshape(1, 2, 2, DIM), q.var(axis=2).reshape(1, 2, 2, DIM)
    want = SCALE * mean @ keys.swapaxes(-1, -2) + 0.5 * SCALE**2 * var @ (keys**2).swapaxes(-1, -2)
    ours = expected_logits(mx.array(q), mx.array(keys), None, 20, 16, SCALE)
    assert np.allclose(np.array(ours), want, atol=1e-4)


@pytest.mark.parametrize("seed", range(4))
def test_a_chunk_keeps_the_rows_future_queries_are_expected_to_attend(seed: int) -> None:
    """One prompt chunk over the budget: the cache keeps its sinks, its window and the best of the rest by the
    reference's score (expected attention averaged over a KV head's query heads, times the value's norm; the keys
    double as values), the window's queries giving the statistics."""
    sink, window, budget, total = 2, 6, 20, 48
    keys, queries = random_rows(seed, 1, 2, 2, total, DIM)
    cache = ExpectedAttentionCache(CacheSpec(Budget(tokens=budget), sink, window, mode="chunk"), future=32)
    attention = nn.Module()  # the cache holds it weakly, as a model holds its own
    attention.rope = nn.RoPE(DIM, base=BASE)
    cache.see_attention_input(mx.zeros((1, total, DIM)), attention)
    kept = next(iter(feed(cache, keys, queries, [total], SCALE)))
    score = softmax(reference_logits(queries[:, :, -window:], keys, total, 32)).mean(axis=2)
    score = score * np.linalg.norm(keys, axis=-1)
    for head in range(2):
        rest = np.argsort(-score[0, head, sink : total - window])[: budget - sink - window] + sink
        want = sorted([*range(sink), *rest.tolist(), *range(total - window, total)])
        assert kept[0, head].tolist() == want, f"head {head}"
