"""MiniCache: the merge against the paper's definition, pairs, the pair's fan-in and fan-out, attention error,
physical bytes, saving, trimming, knobs."""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np
import pytest

from conftest import KVCacheRoute, count_joints, feed_layers
from veloxpatch.caches import CacheSpec
from veloxpatch.caches.crosslayer import Fold
from veloxpatch.config import Budget, ConfigError, from_env
from veloxpatch.coordinators import Coordinator
from veloxpatch.methods.minicache import MIN_FOLD, MiniCacheCache

SCALE = 0.25


def mini_list(layers: int, start: float = 0.5, t: float = 0.6, gamma: float = 0.05, window: int = 4,
              mode: str = "end") -> list[MiniCacheCache]:
    coordinator = Coordinator("minicache")
    caches = [MiniCacheCache(CacheSpec(Budget(tokens=64), 0, window, mode), start=start, t=t, gamma=gamma)
              for _ in range(layers)]
    for cache in caches:
        coordinator.join(cache)
    return caches


def pair_rows(tokens: int, dissimilar: list[int], heads: int = 2, dim: int = 16, seed: int = 0,
              noise: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """Two layers' rows (1, heads, tokens, dim): the second is the first with a little noise and its own
    scale, except at the tokens ``dissimilar``, where it points (nearly) the opposite way."""
    rng = np.random.default_rng(seed)
    first = rng.standard_normal((1, heads, tokens, dim))
    second = first * rng.uniform(0.5, 2.0, (1, heads, tokens, 1)) + noise * rng.standard_normal(first.shape)
    second[:, :, dissimilar] = -first[:, :, dissimilar] + noise * rng.standard_normal((1, heads, len(dissimilar), dim))
    return first.astype(np.float32), second.astype(np.float32)


def paper_merge(first: np.ndarray, second: np.ndarray, t: float, gamma: float) -> tuple[np.ndarray, ...]:
    """The paper's definition in plain numpy (float64): SLERP of the unit vectors, each layer's norm times
    the merged direction, and the tokens whose angular distance Omega / pi lies in the top gamma of the
    head's range kept exact in both layers. Returns both layers' rebuilt rows and the kept mask."""
    a, b = first.astype(np.float64), second.astype(np.float64)
    norm_a, norm_b = np.linalg.norm(a, axis=-1, keepdims=True), np.linalg.norm(b, axis=-1, keepdims=True)
    unit_a, unit_b = a / norm_a, b / norm_b
    omega = np.arccos(np.clip((unit_a * unit_b).sum(-1, keepdims=True), -1, 1))
    merged = (np.sin((1 - t) * omega) * unit_a + np.sin(t * omega) * unit_b) / np.sin(omega)
    distance = omega[..., 0] / np.pi
    high, low = distance.max(-1, keepdims=True), distance.min(-1, keepdims=True)
    kept = distance > high - gamma * (high - low)
    rebuilt_a = np.where(kept[..., None], a, norm_a * merged)
    rebuilt_b = np.where(kept[..., None], b, norm_b * merged)
    return rebuilt_a, rebuilt_b, kept


def rebuild(cache: MiniCacheCache, owns: list, shared: dict, tokens: int) -> list[tuple[mx.array, mx.array]]:
    return [cache.unfold(Fold(0, tokens, own, shared, (0, 1))) for own in owns]


def test_the_merge_matches_the_papers_definition() -> None:
    keys = pair_rows(48, dissimilar=[3, 17, 40], seed=1)
    values = pair_rows(48, dissimilar=[5, 30], seed=2)
    cache = MiniCacheCache(CacheSpec(Budget(tokens=64), 0, 4), t=0.6, gamma=0.05)
    owns, shared = cache.joint([(mx.array(keys[0]), mx.array(values[0])), (mx.array(keys[1]), mx.array(values[1]))])
    got = rebuild(cache, owns, shared, 48)
    for x, rows, dissimilar in ((0, keys, [3, 17, 40]), (1, values, [5, 30])):
        rebuilt_a, rebuilt_b, kept = paper_merge(*rows, t=0.6, gamma=0.05)
        assert [np.flatnonzero(kept[0, h]).tolist() for h in range(2)] == [dissimilar] * 2, "the dissimilar pairs"
        np.testing.assert_allclose(np.array(got[0][x]), rebuilt_a, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(np.array(got[1][x]), rebuilt_b, rtol=1e-4, atol=1e-5)
        for layer in (0, 1):  # the retained tokens come back bit for bit
            assert np.array_equal(np.array(got[layer][x])[:, :, dissimilar], rows[layer][:, :, dissimilar])
    name = "k"
    assert owns[0][name + "i"].tolist() == owns[1][name + "i"].tolist() == [[[3, 17, 40]] * 2]
    assert np.allclose(np.linalg.norm(np.array(shared["k"]), axis=-1), 1, atol=1e-5), "unit directions"
    assert set(shared) == {"k", "v"} and set(owns[0]) == {"kn", "ki", "kr", "vn", "vi", "vr"}


def test_gamma_one_keeps_every_row_exactly_and_gamma_zero_merges_every_token() -> None:
    first, second = pair_rows(40, dissimilar=[7], seed=3)
    parts = [(mx.array(first), mx.array(first)), (mx.array(second), mx.array(second))]
    cache = MiniCacheCache(CacheSpec(Budget(tokens=64), 0, 4), gamma=1.0)
    got = rebuild(cache, *cache.joint(parts), 40)
    assert np.array_equal(np.array(got[0][0]), first) and np.array_equal(np.array(got[1][1]), second)
    cache.gamma = 0.0
    owns, shared = cache.joint(parts)
    assert owns[0]["ki"].shape == (1, 2, 0) and owns[0]["kr"].shape == (1, 2, 0, 16), "nothing retained"
    rebuilt_a, _, _ = paper_merge(first, second, t=0.6, gamma=0.0)  # (token 7, nearly opposite, is ill-conditioned)
    np.testing.assert_allclose(np.array(rebuild(cache, owns, shared, 40)[0][0]), rebuilt_a, rtol=1e-4, atol=2e-4)


def test_heads_keep_different_numbers_of_tokens_padded_to_the_most() -> None:
    first, second = pair_rows(40, dissimilar=[], seed=4)
    second[:, 0, [2, 9]] = -first[:, 0, [2, 9]]  # head 0: two distant pairs; head 1: its own most distant one
    cache = MiniCacheCache(CacheSpec(Budget(tokens=64), 0, 4))
    owns, shared = cache.joint([(mx.array(first), mx.array(first)), (mx.array(second), mx.array(second))])
    rebuilt_a, rebuilt_b, kept = paper_merge(first, second, t=0.6, gamma=0.05)
    one = np.flatnonzero(kept[0, 1]).tolist()
    assert len(one) == 1, "head 1 keeps just its most distant token"
    assert owns[0]["ki"].tolist()[0] == [[2, 9], one + [40]], "padded with the fold's length"
    got = rebuild(cache, owns, shared, 40)
    np.testing.assert_allclose(np.array(got[0][0]), rebuilt_a, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.array(got[1][0]), rebuilt_b, rtol=1e-4, atol=1e-5)


def test_the_rotary_embedding_leaves_the_merge_unchanged() -> None:
    """Both layers' keys at a position get the same rotation: same angles and norms, so the same tokens are
    retained, and merging the rotated keys gives the rotation of the merged unrotated keys."""
    first, second = pair_rows(64, dissimilar=[5, 50], seed=5)
    cache = MiniCacheCache(CacheSpec(Budget(tokens=64), 0, 4))

    def rotate(x) -> mx.array:  # positions 3 .. 66
        return mx.fast.rope(mx.array(x), 16, traditional=False, base=10000.0, scale=1.0, offset=3)

    plain = cache.joint([(mx.array(first),) * 2, (mx.array(second),) * 2])
    rotated = cache.joint([(rotate(first),) * 2, (rotate(second),) * 2])
    for name in ("kn", "ki"):
        np.testing.assert_allclose(np.array(rotated[0][0][name]), np.array(plain[0][0][name]), rtol=1e-5)
    np.testing.assert_allclose(np.array(rotated[1]["k"]), np.array(rotate(np.array(plain[1]["k"]))), atol=1e-5)
    np.testing.assert_allclose(np.array(rebuild(cache, *rotated, 64)[1][0]),
                               np.array(rotate(np.array(rebuild(cache, *plain, 64)[1][0]))), atol=1e-4)


@pytest.mark.parametrize("layers,start,groups", [
    (4, 0.5, [(0,), (1,), (2, 3), (2, 3)]),
    (5, 0.5, [(0,), (1,), (2, 3), (2, 3), (4,)]),
    (5, 0.0, [(0, 1), (0, 1), (2, 3), (2, 3), (4,)]),
    (6, 0.34, [(0,), (1,), (2, 3), (2, 3), (4, 5), (4, 5)]),
    (3, 1.0, [(0,), (1,), (2,)]),
])
def test_pairs_start_at_the_start_fraction_and_an_unpaired_layer_never_folds(layers, start, groups) -> None:
    caches = mini_list(layers, start=start)
    assert [c.group() for c in caches] == groups
    assert [c.min_fold() for c in caches] == [MIN_FOLD if len(g) == 2 else 1 for g in groups]


def similar_rows(layers: int, tokens: int, heads: int = 2, dim: int = 16, noise: float = 0.05,
                 seed: int = 0) -> list[tuple[mx.array, mx.array]]:
    """Keys and values of ``layers`` layers that differ by a little noise and a per-token scale."""
    rng = np.random.default_rng(seed)
    keys, values = rng.standard_normal((2, 1, heads, tokens, dim))
    out = []
    for _ in range(layers):
        scale = rng.uniform(0.5, 2.0, (2, 1, heads, tokens, 1))
        k, v = (x * s + noise * rng.standard_normal(x.shape) for x, s in zip((keys, values), scale))
        out.append((mx.array(k.astype(np.float32)), mx.array(v.astype(np.float32))))
    return out


def test_the_first_layer_contributes_the_second_completes_and_both_hold_the_same_directions(monkeypatch) -> None:
    calls = count_joints(monkeypatch, MiniCacheCache)
    caches = mini_list(layers=5, start=0.0)
    seen = {}

    def look(layer: int) -> None:  # right after each layer's attention in the first decode step
        if caches[0].offset == 151 and layer not in seen:
            seen[layer] = (len(caches[layer].pending), len(caches[layer].folds), caches[layer].store.rows)

    # a 150-token prompt (end mode), two decode steps
    feed_layers(caches, similar_rows(5, 160), [80, 70, 1, 1], between=look)
    assert seen[0] == (1, 0, 151), "the first layer contributed and still holds its rows exactly"
    assert seen[1] == (0, 1, 4), "the second completed the pair and folded at once"
    assert seen[4] == (0, 0, 151), "the last, odd layer has no partner"
    assert calls == [2, 2], "pairs (0, 1) and (2, 3) merge once each"
    assert [len(c.folds) for c in caches] == [1, 1, 1, 1, 0]
    assert all((c.folds[0].start, c.folds[0].end) == (0, 147) for c in caches[:4])
    assert caches[0].folds[0].shared is caches[1].folds[0].shared, "fan-out: the identical object"
    assert caches[2].folds[0].shared is caches[3].folds[0].shared is not caches[0].folds[0].shared
    assert caches[0].folds[0].own is not caches[1].folds[0].own
    assert [c.folds[0].group for c in caches[:4]] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert caches[4].size() == caches[4].store.rows == 152
    caches[0].coordinator.reset()
    assert caches[0].coordinator.joint(("fold", (0, 1), 0, 147)) is None, "a new generation starts empty"


def test_a_pair_whose_partner_never_contributes_folds_each_layer_alone(monkeypatch, caplog) -> None:
    caches = mini_list(layers=2, start=0.0)
    monkeypatch.setattr(caches[1], "_fold_if_due", lambda n: None)  # a layer that differs: it never folds
    rows = similar_rows(2, 120)
    with caplog.at_level(logging.INFO, logger="veloxpatch"):
        feed_layers(caches, rows, [100, 1, 1])
    assert [len(c.folds) for c in caches] == [1, 0] and caches[0].folds[0].group == (0,)
    assert "did not fold rows 0-97 with the others" in caplog.text
    keys, _ = caches[0].unfold(caches[0].folds[0])  # its own directions: the rows, up to rounding
    np.testing.assert_allclose(np.array(keys), np.array(rows[0][0][..., :97, :]), rtol=1e-5, atol=1e-5)


def test_layers_of_different_shapes_keep_their_own_directions() -> None:
    first, second = pair_rows(40, dissimilar=[], heads=2), pair_rows(40, dissimilar=[], heads=4)[1]
    cache = MiniCacheCache(CacheSpec(Budget(tokens=64), 0, 4))
    owns, shared = cache.joint([(mx.array(first[0]),) * 2, (mx.array(second),) * 2])
    got = rebuild(cache, owns, shared, 40)
    assert "kd" not in owns[0] and owns[1]["kd"].shape == (1, 4, 40, 16)
    np.testing.assert_allclose(np.array(got[0][0]), first[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(got[1][1]), second, rtol=1e-5, atol=1e-5)


def attention_errors(noise: float) -> list[float]:
    """Relative error of each layer's attention output, merged (every layer paired) against exact, one decode
    step after a 290-token prompt whose layers' rows differ by ``noise`` (and a per-token scale)."""
    rows = similar_rows(4, 300, noise=noise)
    exact = feed_layers([KVCacheRoute() for _ in rows], rows, [200, 90, 1, 1])
    caches = mini_list(layers=4, start=0.0)
    ours = feed_layers(caches, rows, [200, 90, 1, 1])
    assert all(len(c.folds) == 1 and c.folds[0].end == 287 for c in caches)
    return [float(mx.linalg.norm(a - b) / mx.linalg.norm(b)) for a, b in zip(ours, exact)]


def test_rows_similar_across_layers_merge_with_a_small_attention_error() -> None:
    errors = attention_errors(noise=0.02)  # layers apart by noise of 2% of a row component
    assert max(errors) < 0.04, f"relative attention-output errors {errors}"
    assert min(attention_errors(noise=1.0)) > 10 * max(errors), "dissimilar layers merge far worse"


@pytest.mark.parametrize("name,value", [("VELOX_MINICACHE_START", "1.5"), ("VELOX_MINICACHE_T", "-0.1"),
                                        ("VELOX_MINICACHE_GAMMA", "nan"), ("VELOX_MINICACHE_GAMMA", "some")])
def test_bad_knob_values_name_the_setting_and_what_is_allowed(name: str, value: str) -> None:
    with pytest.raises(ConfigError, match=rf"{name}='{value}' is not allowed: expected a number in \[0, 1\]"):
        from_env({"VELOX_KV": "minicache", name: value})
