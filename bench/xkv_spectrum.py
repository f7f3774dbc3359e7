"""How much of a layer group's keys one shared rank-r basis keeps, with the rotary embedding applied
(what the attention route hands a cache, what ``xkv`` factorizes) and without it.

    python bench/xkv_spectrum.py --model FOLDER [--context 2048] [--group 4] [--seed 0]

xKV (arXiv 2503.18893) puts the keys (and values) of ``--group`` consecutive layers side by side and
keeps their top singular directions. Rotary position embedding turns each key by an angle that grows
with its position, which spreads a low-rank set of keys over more directions; low-rank KV methods
therefore often factorize keys before the rotation. This reads one held-out ``niah_single`` prompt into
mlx_lm's own caches, undoes the rotation of the stored keys (``nn.RoPE`` models only; checked by rotating
back), and prints per group the share of the squared norm the top r directions keep, for keys with and
without rotation and for values: 1 - that share is the relative squared error of a rank-r fold.
"""

from __future__ import annotations

import argparse

import mlx.core as mx
import mlx.nn as nn
from mlx_lm import load

from layer_similarity import prompt_caches

RANKS = (32, 64, 96, 128, 192)


def unrotate(keys: mx.array, rope: nn.RoPE) -> mx.array:
    """``keys`` (B, H, T, D) stored at positions 0..T-1, turned back by their rotary angles."""
    half = rope.dims // 2
    theta = rope.base ** (-mx.arange(half, dtype=mx.float32) / half)
    angle = (mx.arange(keys.shape[2], dtype=mx.float32) * rope.scale)[:, None] * theta[None]
    cos, sin = mx.cos(angle), mx.sin(angle)
    x = keys[..., : rope.dims].astype(mx.float32)
    if rope.traditional:
        a, b = x[..., 0::2], x[..., 1::2]
    else:
        a, b = x[..., :half], x[..., half:]
    a, b = a * cos + b * sin, b * cos - a * sin
    turned = mx.stack([a, b], axis=-1).reshape(x.shape) if rope.traditional else mx.concatenate([a, b], axis=-1)
    return mx.concatenate([turned, keys[..., rope.dims :].astype(mx.float32)], axis=-1)


def side_by_side(rows: list[mx.array]) -> mx.array:
    """Layers' (1, H, T, D) rows as one (T, layers x H x D) matrix, as xKV joins them."""
    return mx.concatenate([r[0].astype(mx.float32).transpose(1, 0, 2).reshape(r.shape[2], -1) for r in rows], axis=1)


def kept(matrix: mx.array) -> list[float]:
    """Share of the squared norm the top r singular directions keep, for each r in RANKS."""
    gram = matrix.T @ matrix
    energy = mx.sort(mx.linalg.eigh(gram, stream=mx.cpu)[0])[::-1]
    total = energy.sum()
    return [(energy[:r].sum() / total).item() for r in RANKS]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model, tokenizer = load(args.model)
    caches, tokens = prompt_caches(model, tokenizer, args.context, args.seed)
    rope = model.layers[0].self_attn.rope
    if type(rope) is not nn.RoPE:
        raise SystemExit(f"this model's rotary embedding is {type(rope).__name__}; only nn.RoPE is undone here")
    keys = [c.keys[..., :tokens, :] for c in caches]
    plain = [unrotate(k, rope) for k in keys]
    back = rope(plain[0])
    error = (mx.linalg.norm(back - keys[0].astype(mx.float32)) / mx.linalg.norm(keys[0].astype(mx.float32))).item()
    assert error < 1e-3, f"undoing the rotation does not round-trip (relative error {error:.2e})"
    print(f"share of squared norm kept by the top r directions, groups of {args.group} layers, {tokens} tokens\n")
    print("| layers | " + " | ".join(f"r={r}: rotated keys / unrotated / values" for r in RANKS) + " |")
    print("|---|" + "---|" * len(RANKS))
    for first in range(0, len(caches), args.group):
        group = range(first, min(first + args.group, len(caches)))
        rotated = kept(side_by_side([keys[i] for i in group]))
        unrotated = kept(side_by_side([plain[i] for i in group]))
        values = kept(side_by_side([caches[i].values[..., :tokens, :] for i in group]))
        cells = " | ".join(f"{a:.3f} / {b:.3f} / {c:.3f}" for a, b, c in zip(rotated, unrotated, values))
        print(f"| {group[0]}-{group[-1]} | {cells} |")


if __name__ == "__main__":
    main()
