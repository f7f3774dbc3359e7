"""xKV: the group's fan-in and fan-out, reconstruction, physical bytes, saving, trimming, limits."""

from __future__ import annotations

import copy
import logging

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

import veloxpatch
from conftest import KVCacheRoute, count_joints, feed_layers, greedy, random_tokens, tiny
from veloxpatch.caches import CacheSpec
from veloxpatch.config import Budget, ConfigError
from veloxpatch.coordinators import Coordinator
from veloxpatch.methods.xkv import XKVCache


def xkv_list(layers: int, group: int, rank: str, window: int = 4, mode: str = "end") -> list[XKVCache]:
    coordinator = Coordinator("xkv")
    caches = [XKVCache(CacheSpec(Budget(tokens=64), 0, window, mode), group=group, rank=rank) for _ in range(layers)]
    for cache in caches:
        coordinator.join(cache)
    return caches


def low_rank_rows(layers: int, tokens: int, rank: int, heads: int = 2, dim: int = 8, seed: int = 0,
                  noise: float = 0.0) -> list[tuple[mx.array, mx.array]]:
    """Each layer's rows (1, heads, tokens, dim) = one token factor shared by the layers x its own projection,
    as both keys and values."""
    rng = np.random.default_rng(seed)
    tokens_factor = rng.standard_normal((tokens, rank))
    rows = [mx.array((tokens_factor @ rng.standard_normal((rank, heads * dim)) + noise * rng.standard_normal(
        (tokens, heads * dim))).reshape(1, tokens, heads, dim).transpose(0, 2, 1, 3).astype(np.float32))
        for _ in range(layers)]
    return [(x, x) for x in rows]


def test_the_fan_in_completes_once_per_group_and_every_member_gets_the_same_basis(monkeypatch) -> None:
    calls = count_joints(monkeypatch, XKVCache)
    caches = xkv_list(layers=5, group=2, rank="100%")
    rows = low_rank_rows(5, 160, rank=3)
    feed_layers(caches, rows, [80, 70, 1, 1])  # a prompt of 150 tokens in two chunks (end mode), two decode steps
    assert calls == [2, 2, 1], "groups (0, 1), (2, 3) and (4,) fold once each"
    assert all(len(c.folds) == 1 and (c.folds[0].start, c.folds[0].end) == (0, 147) for c in caches)
    assert caches[0].folds[0].shared is caches[1].folds[0].shared, "fan-out: the identical object"
    assert caches[2].folds[0].shared is caches[3].folds[0].shared is not caches[0].folds[0].shared
    assert [c.folds[0].group for c in caches] == [(0, 1), (0, 1), (2, 3), (2, 3), (4,)]
    caches[0].coordinator.reset()
    assert caches[0].coordinator.joint(("fold", (0, 1), 0, 147)) is None, "a new generation starts empty"


def test_a_group_whose_member_never_contributes_folds_each_layer_alone(monkeypatch, caplog) -> None:
    caches = xkv_list(layers=2, group=2, rank="100%")
    monkeypatch.setattr(caches[1], "_fold_if_due", lambda n: None)  # a layer that differs: it never folds
    rows = low_rank_rows(2, 120, rank=3)
    with caplog.at_level(logging.INFO, logger="veloxpatch"):
        feed_layers(caches, rows, [100, 1, 1])
    assert [len(c.folds) for c in caches] == [1, 0] and caches[0].folds[0].group == (0,)
    assert "did not fold rows 0-97 with the others" in caplog.text


def test_full_rank_rebuilds_the_rows_and_low_rank_rows_fold_with_a_small_error() -> None:
    rows = low_rank_rows(4, 120, rank=6, noise=0.01)
    exact = feed_layers([KVCacheRoute() for _ in rows], rows, [100, 1])
    for rank, bound in (("100%", 1e-4), ("6", 0.02)):
        caches = xkv_list(layers=4, group=4, rank=rank)
        got = feed_layers(caches, rows, [100, 1, 1])[:1]
        caches_now = feed_layers(xkv_list(layers=4, group=4, rank=rank), rows, [100, 1])
        errors = [float(mx.linalg.norm(a - b) / mx.linalg.norm(b)) for a, b in zip(caches_now, exact)]
        assert all(len(c.folds) == 1 for c in caches) and got
        assert max(errors) < bound, f"rank {rank}: relative attention-output errors {errors}"


def test_a_fold_longer_than_the_limit_is_an_error_naming_the_setting() -> None:
    model = tiny("llama")
    veloxpatch.patch(kv="xkv", budget="50%", window=8, compress="end", knobs={"xkv_max_ctx": 50})
    caches = make_prompt_cache(model)
    with pytest.raises(ConfigError, match="VELOX_XKV_MAX_CTX=50 is exceeded: a fold of 92 tokens"):
        greedy(model, random_tokens(100, 2), caches, steps=2, chunk=100)


@pytest.mark.parametrize("n", [1, 4])
def test_decode_steps_attend_in_the_rank_space_as_over_the_rebuilt_rows(n: int) -> None:
    """The latent path (logits (q B^T) A^T, output (p A) B) gives what attention over ``A B`` gives, for a
    decode step and a speculative verification step of 4 tokens; a prompt chunk takes the rebuilt path."""
    caches = xkv_list(layers=3, group=3, rank="6")
    rows = low_rank_rows(3, 200, rank=6, noise=0.05)
    feed_layers(caches, rows, [80, 70, 1])
    assert len(caches[-1].folds) == 1 and all(c.pending for c in caches[:-1]), "the others fold on their next call"
    rng = np.random.default_rng(3)
    queries = mx.array(rng.standard_normal((1, 4, n, 8)).astype(np.float32))
    for cache, (keys, _) in zip(caches, rows):
        chunk = keys[..., 151 : 151 + n, :]
        rebuilt = copy.deepcopy(cache)
        k, v = cache.update_and_fetch(chunk, chunk)
        k2, v2 = rebuilt.update_and_fetch(chunk, chunk)
        assert len(cache.folds) == 1
        latent = cache.attend(queries, k, v, 0.25, mask="causal" if n > 1 else None)
        over_rows = rebuilt._attention(queries, k2, v2, 0.25, "causal" if n > 1 else None, None)
        assert mx.allclose(latent, over_rows, atol=1e-4).item(), float(mx.abs(latent - over_rows).max())


def test_the_latent_path_is_taken_for_decode_steps_only(monkeypatch) -> None:
    taken: list[int] = []
    latent = XKVCache.attend_held

    def counted(self, queries, scale):
        taken.append(queries.shape[2])
        return latent(self, queries, scale)

    monkeypatch.setattr(XKVCache, "attend_held", counted)
    caches = xkv_list(layers=2, group=2, rank="6")
    feed_layers(caches, low_rank_rows(2, 300, rank=6), [80, 70, 1, 1, 100])
    assert taken == [1, 1], "the second decode step, in both layers (the first folded after attending); no chunk"
