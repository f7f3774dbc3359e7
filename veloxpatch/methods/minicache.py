"""MiniCache (Liu et al., arXiv 2405.14366, NeurIPS 2024): adjacent layers share one direction per token.

From the middle of the network on, the KV states of adjacent layers point in nearly the same
direction. So each pair of adjacent layers keeps, per token and KV head, one merged direction (the
pair holds it once) and each layer its own magnitude; a layer rebuilds its row as ``||x|| e`` (the
paper's restoration, its Eq. 2). For a token's rows ``x_a`` (first layer of the pair) and ``x_b``
(second), with unit vectors ``u_a``, ``u_b`` and ``Omega = arccos(u_a . u_b)``, the direction is
their spherical interpolation (SLERP, the paper's Eq. 3)::

    e = sin((1 - t) Omega) / sin(Omega) u_a + sin(t Omega) / sin(Omega) u_b

(linear interpolation where ``Omega`` is within 1e-4 of 0 or pi, where that quotient is 0/0; either
way renormalised to unit length against rounding). ``t`` is ``VELOX_MINICACHE_T`` (the paper's 0.6,
leaning to the deeper layer). Keys and values merge separately, each with its own directions,
magnitudes and retained tokens.

Token retention (the paper's unmergeable-token retention). A few token pairs are far apart, and
merged they would lose what is particular to each layer, so both layers keep them exact. A pair's
distance is the normalised angle ``d = Omega / pi`` (0: same direction, 1: opposite); the threshold
sits between the smallest and the largest distance of the fold, set by ``gamma`` =
``VELOX_MINICACHE_GAMMA`` (the paper's 0.05), and the tokens above it stay exact:
``d > d_max - gamma (d_max - d_min)``, the top ``gamma`` share of the range, per KV head over the
fold's tokens. So a larger ``gamma`` keeps more tokens exact (as in the paper's ablation of gamma:
better accuracy, less compression); 0 merges every token and 1 keeps every token exact (nothing is
merged: the rows come back bit for bit). The threshold is relative to the fold's own range, so with
``gamma > 0`` each head keeps at least its most distant token.

Pairs (the paper merges from half depth, ``S = L / 2``). ``VELOX_MINICACHE_START`` is the share of
the list's layers below the first pair: layers ``floor(start x layers)`` and up pair as (S, S+1),
(S+2, S+3), ...; a layer below S, and a last odd one, has no partner and never folds (its rows stay
exact: merging a layer with itself would save nothing). ``VELOX_BUDGET`` plays no part.

What a fold holds. The pair's shared part is the merged unit directions ``{"k", "v"}`` (B, heads,
tokens, head_dim), in the cache's dtype. Each layer's own part is its magnitudes ``kn``/``vn`` (B,
heads, tokens), the retained positions ``ki``/``vi`` (B, heads, r), ascending, and its exact rows
for them ``kr``/``vr`` (B, heads, r, head_dim); ``r`` is the most any head keeps, and a head that
keeps fewer pads with position ``tokens``, which lands in a spare slot that the rebuild drops (fixed
shapes: every part is an array and saves in a prompt-cache file). The layers of a pair keep the same
positions (one distance per token pair).

The layers of a pair publish their rows through :meth:`Coordinator.contribute` (fan-in); the second
to run merges, and both take the identical shared part: see :mod:`veloxpatch.caches.crosslayer` for
when rows fold and what happens to a pair that does not complete (each layer then folds alone: its
own directions and magnitudes, no saving).

Where the shim's position makes this differ from the paper, and why:

* The keys merged are the rotated ones the attention route hands the cache. This does not change the
  merge: both layers' keys at one position get the same rotation ``R`` (the same rotary embedding,
  an orthogonal map), so ``R u_a . R u_b = u_a . u_b`` and ``||R x|| = ||x||``: the angles, the
  distances, the retained tokens and the magnitudes are those of the unrotated keys, and since SLERP
  combines ``u_a`` and ``u_b`` with coefficients that depend on the angle only, the merged rotated
  direction is the rotation of the merged unrotated one. (It would not hold for a model whose paired
  layers rotate differently, e.g. one with rotary embedding on some layers only.)
* Pairs are taken among the full-attention layers the shim serves (a model's sliding-window layers
  are not members), counted from the first of them; on a model split by pipeline over every rank's
  layers, and a pair cut by a stage boundary stays unmerged.
* The last ``VELOX_WINDOW`` tokens stay exact, and decode tokens stay exact until ``MIN_FOLD`` of them
  have gathered beyond the window; then they merge as a segment of their own, with the threshold of
  that segment (the paper merges each decoded token as it comes).
* Attention runs on the rebuilt rows (the paper's restoration), not on a merged cache read once.
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
            "depth on; 0: every layer pairs; 1: none).", method="minicache"),
    Setting("VELOX_MINICACHE_T", number_range(0, 1), "0.6", "a number in [0, 1]",
            "MiniCache: SLERP interpolation of a pair's directions, from the first layer's (0) to the second's (1); "
            "the paper's 0.6.", method="minicache"),
    Setting("VELOX_MINICACHE_GAMMA", number_range(0, 1), "0.05", "a number in [0, 1]",
            "MiniCache: token retention: tokens whose angular distance across the pair lies in the top gamma of the "
            "fold's range stay exact in both layers (the paper's 0.05; 0: every token merges; 1: none does).",
            method="minicache"),
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

    def __init__(self, spec: CacheSpec, start: float = 0.5,
                 t: float = 0.6, gamma: float = 0.05) -> None:
        super().__init__(spec)
        self.start = start
        self.t = t
        self.gamma = gamma

    def knob_values(self) -> dict[str, object]:
        return {"start": self.start, "t": self.t, "gamma": self.gamma}

    def folded_as(self) -> str:
        return "merged across a pair of layers (their most dissimilar tokens exact)"

    def group(self) -> tuple[int, ...]:
        """The pair (S + 2i, S + 2i + 1) this layer belongs to, as member indexes, or this layer alone
        (no partner). Counted over the model's served layers: on a model split by pipeline, a pair
        whose partner lives on another rank leaves both alone."""
        depth, layers = depth_of(self)
        first = math.floor(self.start * layers + 1e-9)
        if depth < first:
            return (self.layer,)
        lead = self.layer - (depth - first) % 2
        pair = (lead, lead + 1)
        return pair if lead >= 0 and lead + 1 < len(members_of(self)) else (self.layer,)

    def min_fold(self) -> int:
        """``MIN_FOLD`` rows for a layer of a pair; more rows than it holds for one without a partner
        (it never folds: alone it would merge with itself and save nothing).

        Why 32: the retention threshold is relative to the fold's own range of distances, and with
        ``gamma > 0`` every head keeps at least its most distant token exact, so a short fold keeps a
        large share exact and sets its threshold from few distances; 32 rows hold that floor to about
        3% and let decode tokens fold in segments (as many as the default window) rather than one fold
        per step for attention to rebuild."""
        return MIN_FOLD if len(self.group()) == 2 else self.offset + 1

    def joint(self, parts: list[tuple[mx.array, mx.array]]) -> tuple[list[dict], dict]:
        """Keys and values of the pair merged: each layer's norms and retained rows, the shared directions.

        A part alone (a pair that did not complete) or parts of different shapes (layers with other
        head counts or widths) cannot merge: each keeps its own directions (the first layer's as the
        shared part, the others' in their own part), so nothing is saved and nothing breaks."""
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
