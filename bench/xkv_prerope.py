"""xKV with its keys factorized before the rotary embedding: the experiment behind xKV's "rotated keys" note.

    python bench/xkv_prerope.py --model FOLDER -- eval --model FOLDER --tasks perplexity --contexts 1024 \\
        --samples 3 --budgets 25%,12.5% --methods xkv --out OUT --no-plots

The shim hands xKV the keys after the rotary embedding, and ``bench/xkv_spectrum.py`` measures that the
same rank keeps more of the keys with the rotation undone. This runs ``veloxpatch`` (the arguments after
``--``) with xKV changed to do that: the exact keys of rows ``[start, end)`` are rotated back before the
group factorizes them (rotating a block by ``-(p)`` is rotating it reversed in time from ``-(end - 1)``),
and rotated again at their positions when a fold is rebuilt; decode steps attend over rebuilt rows (a
rotation per position cannot be folded into the rank space). Only for models whose rotary embedding is
mlx's plain ``nn.RoPE`` with the folder's ``rope_theta`` and ``rope_traditional`` (SmolLM2 is one); a
check at start-up rotates random keys there and back.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from veloxpatch.caches.crosslayer import CrossLayerCache, Fold
from veloxpatch.methods import xkv


def folder_rope(folder: str) -> nn.RoPE:
    """The folder's rotary embedding as mlx_lm's llama builds it without scaling."""
    config = json.loads((Path(folder) / "config.json").read_text())
    if config.get("rope_scaling"):
        raise SystemExit("xkv_prerope: the folder's rope_scaling is not the plain nn.RoPE this experiment undoes")
    dims = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return nn.RoPE(dims, traditional=config.get("rope_traditional", False), base=config.get("rope_theta", 10000))


def unrotated(rope: nn.RoPE, keys: mx.array, start: int) -> mx.array:
    """Keys (B, heads, n, dim) rotated at positions ``start ..`` back to no rotation."""
    n = keys.shape[2]
    wide = keys[:, :, ::-1].astype(mx.float32)
    return rope(wide, offset=-(start + n - 1))[:, :, ::-1].astype(keys.dtype)


def install(rope: nn.RoPE) -> None:
    """xKV folds unrotated keys and rotates them again when it rebuilds a fold."""
    exact, unfold = CrossLayerCache._exact, xkv.XKVCache.unfold

    def _exact(self, start: int, end: int) -> tuple[mx.array, mx.array]:
        keys, values = exact(self, start, end)
        return unrotated(rope, keys, start), values

    def _unfold(self, fold: Fold) -> tuple[mx.array, mx.array]:
        keys, values = unfold(self, fold)
        return rope(keys, offset=fold.start), values

    xkv.XKVCache._exact = _exact
    xkv.XKVCache.unfold = _unfold
    xkv.XKVCache.attend = CrossLayerCache.attend  # over rebuilt rows: no rank-space decode


def check(rope: nn.RoPE) -> None:
    keys = mx.random.normal((1, 2, 9, rope.dims))
    error = mx.abs(unrotated(rope, rope(keys, offset=5), 5) - keys).max().item()
    if error > 1e-4:
        raise SystemExit(f"xkv_prerope: rotating back misses by {error}")


def main() -> None:
    if "--" not in sys.argv or sys.argv[1:3] != ["--model", sys.argv[2]]:
        raise SystemExit(__doc__)
    rope = folder_rope(sys.argv[2])
    check(rope)
    install(rope)
    from veloxpatch.cli import main as cli

    sys.argv = ["veloxpatch", *sys.argv[sys.argv.index("--") + 1:]]
    cli()


if __name__ == "__main__":
    main()
