"""MiniCache (Liu et al., arXiv 2405.14366, NeurIPS 2024): adjacent layers share one direction per token.

From the middle of the network on, the KV states of adjacent layers point in nearly the same direction. So each
pair of adjacent layers keeps, per token and KV head, one merged direction (held once by the pair) and each layer its
own magnitude; a layer rebuilds its row as ``||x|| e`` (the paper's Eq. 2). For a token's rows ``x_a`` (first layer
of the pair) and ``x_b``, with unit vectors ``u_a``, ``u_b`` and ``Omega = arccos(u_a . u_b)``, the direction is
their spherical interpolation (SLERP, the paper's Eq. 3), ``t`` being ``VELOX_MINICACHE_T`` (the paper's 0.6)::

    e = sin((1 - t) Omega) / sin(Omega) u_a + sin(t Omega) / sin(Omega) u_b

(linear interpolation where ``Omega`` is within 1e-4 of 0 or pi, where that quotient is 0/0; renormalised to unit
length either way). Keys and values merge separately. Token retention: merged, far-apart tokens would lose what is
particular to each layer, so both keep exact, per KV head over the fold's tokens, those whose ``d = Omega / pi`` exceeds
``d_max - gamma (d_max - d_min)`` (``gamma``: ``VELOX_MINICACHE_GAMMA``; 1 gives the rows back bit for bit).

Layers ``S = floor(VELOX_MINICACHE_START x layers)`` and up pair as (S, S+1), (S+2, S+3), ... (the paper merges from
half depth); a layer below S, and a last odd one, never folds (alone it would save nothing). A pair's rows meet in
the coordinator's fan-in (:mod:`veloxpatch.caches.crosslayer`: when rows fold, and what a pair that does not complete
does). Deviations:

* The keys merged are the rotated ones the attention route hands the cache. Both layers' keys at one position get
  the same rotation, which keeps angles and norms, and SLERP's coefficients depend on the angle only, so the merged
  rotated direction is the rotation of the merged unrotated one (not so where paired layers rotate differently).
* Pairs are taken among the full-attention layers the shim serves (on models split across ranks:
  docs/distributed.md).
* The last ``VELOX_WINDOW`` tokens stay exact, and decode tokens merge in segments of ``MIN_FOLD``, each with its own
  threshold (the paper merges each decoded token as it comes). Attention runs on the rebuilt rows.
"""

from __future__ import annotations

import logging
import math

import mlx.core as mx

from ..caches.crosslayer import CrossLayerCache, Fold
from ..caches.spec import CacheSpec
from ..coordinators import depth_of, members_of
from ..log import once
from ..registry import method
from ..settings import Setting, number_range

MIN_FOLD = 32  # exact rows beyond the window that fold at once (see ``min_fold``)
PARALLEL = 1e-4  # radians from 0 or pi within which SLERP is 0/0: renormalised linear interpolation
TINY = 1e-30  # a zero row has no direction: it divides by this and rebuilds as zero


KNOBS = (
    Setting("VELOX_MINICACHE_START", number_range(0, 1), "0.5", "a number in [0, 1]",
            "MiniCache: share of the list's layers below the first merged pair (the paper's 0.5: pairs from half "
            "depth on; 0: every layer pairs; 1: none)."),
    Setting("VELOX_MINICACHE_T", number_range(0, 1), "0.6", "a number in [0, 1]",
            "MiniCache: SLERP interpolation of a pair's directions, from the first layer's (0) to the second's (1); "
            "the paper's 0.6."),
    Setting("VELOX_MINICACHE_GAMMA", number_range(0, 1), "0.05", "a number in [0, 1]",
            "MiniCache: token retention: tokens whose angular distance across the pair lies in the top gamma of the "
            "fold's range stay exact in both layers (the paper's 0.05; 0: every token merges; 1: none does)."),
)


@method("minicache", "Cross-layer merging: from VELOX_MINICACHE_START of the depth on, each pair of adjacent layers "
                     "keeps one SLERP-merged direction per token and KV head, each layer its own norms, and the most "
                     "dissimilar tokens exact (deviation: merges the rotated keys, the only ones the shim sees, which "
                     "leaves the pair's angles unchanged; the window stays exact; decode tokens merge in segments).",
        KNOBS)
class MiniCacheCache(CrossLayerCache):
    """Folds older rows of a layer pair into shared directions, per-layer norms and retained exact rows."""

    uses_budget = False
    budget_use = "VELOX_BUDGET does not apply: it keeps every token, merged across a pair of layers or exact."

    def __init__(self, spec: CacheSpec, start: float = 0.5, t: float = 0.6, gamma: float = 0.05) -> None:
        super().__init__(spec)
        self.start, self.t, self.gamma = start, t, gamma

    def knob_values(self) -> dict[str, object]:
        return {"start": self.start, "t": self.t, "gamma": self.gamma}

    def folded_as(self) -> str:
        return "merged across a pair of layers (their most dissimilar tokens exact)"

    def group(self) -> tuple[int, ...]:
        """The pair (S + 2i, S + 2i + 1) this layer belongs to, as member indexes, or this layer alone (no partner,
        or its partner on another pipeline rank)."""
        depth, layers = depth_of(self)
        first = math.floor(self.start * layers + 1e-9)
        if depth < first:
            return (self.layer,)
        lead = self.layer - (depth - first) % 2
        pair = (lead, lead + 1)
        return pair if lead >= 0 and lead + 1 < len(members_of(self)) else (self.layer,)

    def min_fold(self) -> int:
        """``MIN_FOLD`` rows for a layer of a pair (never for one without a partner). Why 32: every head keeps its
        most distant token exact, so a short fold keeps a large share exact and sets its threshold from few
        distances; 32 rows hold that floor to about 3%, and decode tokens fold in segments, not one fold a step."""
        return MIN_FOLD if len(self.group()) == 2 else self.offset + 1

    def joint(self, parts: list[tuple[mx.array, mx.array]]) -> tuple[list[dict], dict]:
        """Keys and values of the pair merged: shared, the unit directions ``{"k", "v"}``; each layer's own, its norms
        ``kn``/``vn``, its retained positions ``ki``/``vi`` (each head's padded with the token count, a spare slot
        the rebuild drops: fixed shapes save in a prompt-cache file) and their exact rows ``kr``/``vr``. A part
        alone or parts of different shapes cannot merge: each keeps its own directions (the first layer's as the
        shared part, the others' in their own)."""
        if len(parts) == 2 and all(parts[0][i].shape == parts[1][i].shape for i in (0, 1)):
            keys, values = (self._merge(parts[0][i], parts[1][i]) for i in (0, 1))
            owns = [{**_own("k", k), **_own("v", v)} for k, v in zip(keys[1], values[1])]
            return owns, {"k": keys[0], "v": values[0]}
        if len(parts) > 1:
            once("minicache shapes", logging.INFO,
                 "minicache: a pair of layers holds rows of different shapes; each keeps its own directions")
        alone = [[self._merge(x, x) for x in part] for part in parts]
        owns = [{**_own("k", k[1][0]), **_own("v", v[1][0])} for k, v in alone]
        for own, (k, v) in list(zip(owns, alone))[1:]:
            own.update({"kd": k[0], "vd": v[0]})
        return owns, {"k": alone[0][0][0], "v": alone[0][1][0]}

    def unfold(self, fold: Fold) -> tuple[mx.array, mx.array]:
        """Norms x directions, with the retained tokens' exact rows put back."""
        own = fold.own
        out = []
        for x in ("k", "v"):
            direction = own[x + "d"] if x + "d" in own else fold.shared[x]
            out.append(_put_back(own[x + "n"][..., None] * direction, own[x + "i"], own[x + "r"]))
        return out[0], out[1]

    def _merge(self, first: mx.array, second: mx.array) -> tuple[mx.array, list[tuple[mx.array, mx.array, mx.array]]]:
        """Rows (B, heads, T, dim) of the two layers -> the merged unit directions (B, heads, T, dim) and
        per layer (norms (B, heads, T), retained positions (B, heads, r), their exact rows)."""
        dtype = first.dtype
        a, b = first.astype(mx.float32), second.astype(mx.float32)
        norm_a = mx.linalg.norm(a, axis=-1, keepdims=True)
        norm_b = mx.linalg.norm(b, axis=-1, keepdims=True)
        unit_a, unit_b = a / mx.maximum(norm_a, TINY), b / mx.maximum(norm_b, TINY)
        omega = mx.arccos(mx.clip((unit_a * unit_b).sum(axis=-1, keepdims=True), -1.0, 1.0))
        curved = (omega > PARALLEL) & (omega < math.pi - PARALLEL)
        sine = mx.where(curved, mx.sin(omega), 1.0)
        weight_a = mx.where(curved, mx.sin((1 - self.t) * omega) / sine, 1 - self.t)
        weight_b = mx.where(curved, mx.sin(self.t * omega) / sine, self.t)
        direction = weight_a * unit_a + weight_b * unit_b  # unit in exact arithmetic; renormalised for rounding
        direction = direction / mx.maximum(mx.linalg.norm(direction, axis=-1, keepdims=True), TINY)
        index = _positions(self._retained(omega[..., 0] / math.pi))
        return direction.astype(dtype), [(norm[..., 0].astype(dtype), index, _gather(rows, index))
                                         for norm, rows in ((norm_a, first), (norm_b, second))]

    def _retained(self, distance: mx.array) -> mx.array:
        """(B, heads, T) -> True where the token pair stays exact: distance in the top ``gamma`` of
        its head's range over the fold (all with ``gamma`` 1, none with 0)."""
        if self.gamma >= 1:
            return mx.ones(distance.shape, mx.bool_)
        high = distance.max(axis=-1, keepdims=True)
        low = distance.min(axis=-1, keepdims=True)
        return distance > high - self.gamma * (high - low)


def _own(x: str, part: tuple[mx.array, mx.array, mx.array]) -> dict[str, mx.array]:
    norms, index, rows = part
    return {x + "n": norms, x + "i": index, x + "r": rows}


def _positions(keep: mx.array) -> mx.array:
    """(B, heads, T) bool -> (B, heads, r) int32: each head's kept positions ascending, padded with T
    (``r``: the most any head keeps, possibly 0)."""
    tokens = keep.shape[-1]
    count = int(keep.sum(axis=-1).max()) if keep.size else 0
    order = mx.where(keep, mx.arange(tokens, dtype=mx.int32), tokens)
    return mx.sort(order, axis=-1)[..., :count]


def _gather(rows: mx.array, index: mx.array) -> mx.array:
    """Rows (B, heads, T, dim) at ``index`` (B, heads, r), zero where the index is padding (T)."""
    tokens, dim = rows.shape[2], rows.shape[3]
    at = mx.broadcast_to(mx.minimum(index, tokens - 1)[..., None], (*index.shape, dim))
    return mx.where((index < tokens)[..., None], mx.take_along_axis(rows, at, axis=2), 0)


def _put_back(rebuilt: mx.array, index: mx.array, rows: mx.array) -> mx.array:
    """``rebuilt`` (B, heads, T, dim) with ``rows`` at ``index``; padding (T) goes to a spare slot dropped after."""
    b, h, tokens, dim = rebuilt.shape
    spare = mx.concatenate([rebuilt, mx.zeros((b, h, 1, dim), rebuilt.dtype)], axis=2)
    at = mx.broadcast_to(index[..., None], (*index.shape, dim))
    return mx.put_along_axis(spare, at, rows.astype(rebuilt.dtype), axis=2)[:, :, :tokens]
