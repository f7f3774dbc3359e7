"""xKV (Chang et al., arXiv 2503.18893): one low-rank token basis for the keys and values of a group of layers.

The dominant singular vectors of the KV caches of neighbouring layers are well aligned, even where the layers'
per-token vectors are not alike. So the rows of ``VELOX_XKV_GROUP`` consecutive layers, side by side (tokens x
group·heads·head_dim), are factorized once: a token factor ``A`` (tokens x rank) that the group holds once, and per
layer a projection ``B_l`` (rank x heads·head_dim); layer l's rows are ``A B_l``. Keys and values are factorized
separately. The rank is ``VELOX_XKV_RANK``: by default (``auto``) the one whose factors take the bytes
``VELOX_BUDGET`` allows (so xKV compares with eviction at equal bytes), else a number or a percentage of the group's
width; ``VELOX_XKV_ENERGY`` below 1 lowers it to keep just that share of the squared singular values. The group's
rows meet in the coordinator's fan-in (:mod:`veloxpatch.caches.crosslayer`). Deviations from the paper, and why:

* The keys factorized are the rotated ones the attention route hands the cache, which the same rank keeps less of;
  undoing the rotation (``bench/xkv_prerope.py``) did not pay (docs/results.md), and decode would rebuild the keys.
* The factors come from the eigendecomposition of the group's Gram matrix (width x width): the same ``A = U S`` and
  ``B = V^T`` as an SVD of the tokens x width matrix, and mlx has ``eigh`` but no thin SVD.
* The last ``VELOX_WINDOW`` tokens stay exact, and so do decode tokens until ``rank`` of them have gathered (a shorter
  fold would take more bytes than its exact rows). Decode steps attend in the rank space without rebuilding the rows;
  prompt chunks attend over the rebuilt rows. (The paper's Selective Reconstruction is a GPU kernel.)
* A fold longer than ``VELOX_XKV_MAX_CTX`` tokens is an error naming the setting (``A`` is tokens long).
* On models split across ranks: docs/distributed.md.
"""

from __future__ import annotations

import math

import mlx.core as mx

from ..caches.crosslayer import CrossLayerCache, Fold
from ..caches.masks import causal
from ..caches.spec import CacheSpec
from ..registry import method
from ..settings import Budget, ConfigError, Setting, int_range, number_range


def _rank(text: str) -> str:
    value = text.strip().lower()
    return value if value == "auto" else str(Budget.parse(value))


KNOBS = (
    Setting("VELOX_XKV_GROUP", int_range(1, 64), "4", "an integer in [1, 64]",
            "xKV: consecutive full-attention layers whose rows share one token basis."),
    Setting("VELOX_XKV_RANK", _rank, "auto", "auto, an integer >= 1 or a percentage in (0, 100]",
            "xKV: rank of a group's basis: `auto` folds into the bytes VELOX_BUDGET allows (its share of the "
            "tokens seen), else dimensions or a share of the group's width (layers x kv heads x head dim)."),
    Setting("VELOX_XKV_ENERGY", number_range(0, 1, above=True), "1", "a number in (0, 1]",
            "xKV: lower the rank to keep just this share of the squared singular values (1: the rank alone)."),
    Setting("VELOX_XKV_MAX_CTX", int_range(1, None), "65536", "an integer >= 1",
            "xKV: most tokens one fold may factorize; a longer one is an error."),
)


@method("xkv", "Cross-layer SVD: a group of layers shares one low-rank token basis for keys and values "
                "(deviation: factorizes the rotated keys, the only ones the shim sees; the window stays exact).", KNOBS)
class XKVCache(CrossLayerCache):
    """Folds older rows into a token factor shared by the layer group and a projection of its own."""

    budget_use = ("It keeps every token; with VELOX_XKV_RANK=auto, VELOX_BUDGET is the bytes its folded rows may take "
                  "(the rank follows).")

    def __init__(self, spec: CacheSpec, group: int = 4, rank: str = "auto", energy: float = 1.0,
                 max_ctx: int = 65536) -> None:
        super().__init__(spec)
        self.group_layers, self.rank, self.energy, self.max_ctx = group, rank, energy, max_ctx
        self.width = 0  # kv heads x head dim, seen at each step

    def knob_values(self) -> dict[str, object]:
        return {"group": self.group_layers, "rank": self.rank, "energy": self.energy, "max_ctx": self.max_ctx}

    def folded_as(self) -> str:
        return f"as low-rank factors (a token basis per group of {self.group_layers} layers)"

    def group(self) -> tuple[int, ...]:
        """This layer's block of ``VELOX_XKV_GROUP`` consecutive members."""
        return self.block(self.group_layers)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.width = keys.shape[1] * keys.shape[3]  # kv heads x head dim, for the rank of a percentage
        return super().update_and_fetch(keys, values)

    def min_fold(self) -> int:
        """The rank (a shorter fold takes more bytes than its exact rows); nothing folds under ``auto`` with a
        budget of every token seen."""
        if self.rank == "auto" and self._share() >= 1:
            return self.offset + 1
        return self._rank_for(self.width * len(self.group()), None)

    def joint(self, parts: list[tuple[mx.array, mx.array]]) -> tuple[list[dict], dict]:
        """Keys and values of the group's layers, each factorized side by side."""
        key_owns, key_tokens = self._factor([k for k, _ in parts])
        value_owns, value_tokens = self._factor([v for _, v in parts])
        owns = [{"k": k, "v": v} for k, v in zip(key_owns, value_owns)]
        return owns, {"k": key_tokens, "v": value_tokens}

    def unfold(self, fold: Fold) -> tuple[mx.array, mx.array]:
        """``A B_l`` for keys and values: (B, 1, T, r) @ (B, heads, r, head_dim)."""
        return tuple(mx.expand_dims(fold.shared[x], 1) @ fold.own[x] for x in ("k", "v"))

    def attend_held(self, queries: mx.array, scale: float) -> mx.array | None:
        """A decode-sized step attends over the folds in their rank space, logits ``(q B_l^T) A^T`` and output
        ``(p A) B_l``, then over the exact rows (mlx is lazy: the rebuilt rows handed out are never computed)."""
        exact_keys, exact_values = self.store.fetch()
        b, heads_q, n, dim = queries.shape
        heads = exact_keys.shape[1]
        q = (queries.astype(mx.float32) * scale).reshape(b, heads, heads_q // heads, n, dim)
        logits = [(q @ mx.expand_dims(f.own["k"], 2).swapaxes(-1, -2)) @ f.shared["k"][:, None, None].swapaxes(-1, -2)
                  for f in self.folds]
        exact = q @ mx.expand_dims(exact_keys, 2).swapaxes(-1, -2)
        if n > 1:
            exact = mx.where(causal(exact_keys.shape[2], n), exact, -mx.inf)
        probs = mx.softmax(mx.concatenate([*logits, exact], axis=-1), axis=-1, precise=True)
        out: mx.array | int = 0  # the folds' sum
        at = 0
        for f in self.folds:
            p = probs[..., at : at + f.end - f.start]
            out = out + (p @ f.shared["v"][:, None, None]) @ mx.expand_dims(f.own["v"], 2)
            at += f.end - f.start
        out = out + probs[..., at:] @ mx.expand_dims(exact_values, 2)
        return out.reshape(b, heads_q, n, -1).astype(queries.dtype)

    def _factor(self, rows: list[mx.array]) -> tuple[list[mx.array], mx.array]:
        """Rows (B, heads_l, T, dim_l) of each layer -> per layer (B, heads_l, r, dim_l), shared (B, T, r)."""
        b, _, tokens, _ = rows[0].shape
        if tokens > self.max_ctx:
            raise ConfigError(f"VELOX_XKV_MAX_CTX={self.max_ctx} is exceeded: a fold of {tokens} tokens; raise it, "
                              f"or use VELOX_COMPRESS=chunk so each prefill chunk folds on its own")
        side = mx.concatenate([x.astype(mx.float32).transpose(0, 2, 1, 3).reshape(b, tokens, -1) for x in rows],
                              axis=-1)
        energies, vectors = mx.linalg.eigh(side.swapaxes(-1, -2) @ side, stream=mx.cpu)
        rank = self._chosen_rank(energies[..., ::-1], side.shape[-1], tokens)
        basis = vectors[..., ::-1][..., :rank]  # (B, width, r): the top right singular vectors
        shared = (side @ basis).astype(rows[0].dtype)
        owns, at = [], 0
        for x in rows:
            heads, dim = x.shape[1], x.shape[3]
            part = basis[:, at : at + heads * dim, :].reshape(b, heads, dim, rank).swapaxes(-1, -2)
            owns.append(part.astype(x.dtype))
            at += heads * dim
        return owns, shared

    def _chosen_rank(self, energies: mx.array, width: int, tokens: int) -> int:
        """The configured rank, lowered to reach ``VELOX_XKV_ENERGY`` (the most any batch row needs)."""
        rank = min(self._rank_for(width, tokens), tokens)
        if self.energy < 1:
            share = mx.cumsum(mx.maximum(energies, 0), axis=-1) / mx.maximum(energies.sum(axis=-1, keepdims=True),
                                                                          1e-30)
            needed = int(((share < self.energy).sum(axis=-1) + 1).max())
            rank = min(rank, needed)
        return max(rank, 1)

    def _rank_for(self, width: int, tokens: int | None) -> int:
        """The rank for a fold of ``tokens`` rows (None: as long as can be) over ``width`` dimensions; ``auto``: the
        factors (``tokens x rank + rank x width``) take the budget's share of the exact ``tokens x width``."""
        if self.rank != "auto":
            return min(Budget.parse(self.rank).resolve(width), width)
        share = min(self._share(), 1.0)
        if tokens is None:
            return max(1, math.ceil(share * width))
        return max(1, math.floor(share * width * tokens / (tokens + width)))

    def _share(self) -> float:
        """The budget as a share of the tokens seen."""
        return self.budget.resolve(self.offset) / max(self.offset, 1)
