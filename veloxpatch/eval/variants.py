"""What a quality or speed run compares: every registry method, and what mlx_lm users already have.

Each variant makes its cache list the way a user's app would get it: our methods through
``veloxpatch.patch`` and mlx_lm's own ``make_prompt_cache`` (the real shim), mlx_lm's
alternatives as mlx_lm builds them. mlx_lm ignores ``max_kv_size`` for models that define
``make_cache`` (llama does), so the rotating variant builds the ``RotatingKVCache(max_size,
keep=4)`` list mlx_lm would have built; quantization goes through mlx_lm's own
``maybe_quantize_kv_cache`` (``kv_bits`` in ``generate_step``) from the first token on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import veloxpatch
from veloxpatch.caches import METHODS
from veloxpatch.config import setting

# a token budget may not be smaller than the rows every method protects (default sink + window)
PROTECTED = int(setting("VELOX_SINK").default) + int(setting("VELOX_WINDOW").default)

QUANT_BITS = (8, 4, 2)  # the widths mlx_lm users pick with --kv-bits; a tie goes to the wider one


@dataclass(frozen=True)
class KVLayout:
    """What the byte arithmetic of quantization needs: element width and head dimension."""

    dtype_bits: int
    head_dim: int

    @classmethod
    def of(cls, model: Any) -> "KVLayout":
        from mlx.utils import tree_flatten

        args = model.args
        head_dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
        return cls(tree_flatten(model.parameters())[0][1].dtype.size * 8, head_dim)

    @property
    def group(self) -> int:
        """mlx_lm's default group of 64, or 32 when the head dimension is not a multiple of 64."""
        for group in (64, 32):
            if self.head_dim % group == 0:
                return group
        raise ValueError(f"the quantized variant needs head_dim divisible by 32 (mlx's smallest group); "
                         f"this model has head_dim {self.head_dim}")

    def share(self, bits: int) -> float:
        """Bytes of a quantized row relative to the unquantized one (values + fp16 scale and bias)."""
        return (bits + 2 * 16 / self.group) / self.dtype_bits

    def bits_for(self, share: float) -> int:
        """The kv_bits whose bytes come closest to ``share`` of the unquantized cache (ties: more bits)."""
        return min(QUANT_BITS, key=lambda b: abs(self.share(b) - share))


@dataclass(frozen=True)
class Variant:
    """A cache configuration: ``method`` is a registry id, ``full``, ``rotating`` or ``quantized``."""

    method: str
    share: float = 1.0

    def budget(self, context: int) -> int:
        """Rows this variant may keep for a context of ``context`` tokens (all for the full cache,
        else the share, but at least sink + window)."""
        if self.method == "full":
            return context
        return max(round(self.share * context), PROTECTED)

    def label(self) -> str:
        return "full" if self.method == "full" else f"{self.method}@{self.share:g}"

    def caches(self, model: Any, context: int, compress: str | None = None) -> list[Any]:
        """The cache list for one run (patching or unpatching mlx_lm as the variant needs);
        ``compress`` overrides ``VELOX_COMPRESS`` for our methods."""
        import mlx_lm.models.cache as mlx_cache  # looked up after (un)patching, as an app's call would be

        if self.method in METHODS:
            extra = {} if compress is None else {"compress": compress}
            veloxpatch.patch(kv=self.method, budget=self.budget(context), **extra)
            return mlx_cache.make_prompt_cache(model)
        veloxpatch.unpatch()
        caches = mlx_cache.make_prompt_cache(model)
        if self.method == "rotating":
            size = self.budget(context)
            return [mlx_cache.RotatingKVCache(max_size=size, keep=4) if type(c) is mlx_cache.KVCache else c
                    for c in caches]
        return caches

    def generate_kwargs(self, layout: KVLayout) -> dict[str, Any]:
        """Extra ``generate_step`` arguments (kv_bits for the quantized variant)."""
        if self.method != "quantized":
            return {}
        return {"kv_bits": layout.bits_for(self.share), "kv_group_size": layout.group, "quantized_kv_start": 0}


def variants(methods: list[str], shares: list[float]) -> list[Variant]:
    """The full cache once, then each method (registry ids, ``rotating``, ``quantized``) at each share < 1."""
    out = [Variant("full")]
    for method in methods:
        out += [Variant(method, s) for s in shares if s < 1.0]
    return out


def known_methods() -> list[str]:
    """Every registry method, then mlx_lm's own alternatives."""
    return sorted(METHODS) + ["rotating", "quantized"]
