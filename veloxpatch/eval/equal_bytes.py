"""Comparisons at equal bytes: what a cache list holds as a 16-bit model would hold it, and the row budget that
makes a variant hold a given share of the full cache's bytes.

Why 16 bits: the users this is for run float16 or bfloat16 weights (on a Mac), so their dense rows take two bytes a
value; on this CPU the weights run as float32 for speed (``veloxpatch fetch-model`` converts dense float32), which
doubles every dense row and every quantization scale but not a quantized row's packed values, and would flatter any
quantized cache twofold. A cache's bytes are counted as it holds them (``nbytes``: spare capacity, positions,
remembered queries, tier) and scaled by the share its floating-point arrays would shrink to at 16 bits.

Why a measured budget: what a budget of rows costs in bytes depends on the method (positions, the tier of dropped rows
at fewer bits, a coordinator's shared parts), so it is measured rather than assumed: each variant reads a short random
prompt at two budgets, its bytes are a line in the budget (until the tier's cap, which the budgets asked for stay
under), and the budget for a share is read off that line. The share actually reached is reported beside every result.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from veloxpatch.caches import CompressedKVCache
from veloxpatch.stats import sixteen_bit_share

from . import sharing
from .variants import PROTECTED, Variant

CALIBRATION_TOKENS = 512  # a multiple of mlx_lm's KVCache step (256): the full cache holds no spare rows
CALIBRATION_BUDGETS = (48, 96)  # both with the tier's three budgets below the prompt (4 x 96 < 512)
CALIBRATION_STEP = 128  # prompt chunks short enough that chunk-mode methods compress while reading, as at 4k


def held_bytes(caches: list[Any], dense: bool = False) -> float:
    """The bytes ``caches`` hold as a 16-bit model's caches would (``dense``: our never-evicting caches counted as
    mlx_lm's ``KVCache``, rows alone, :func:`sharing.kv_bytes`)."""
    return sum(sharing.kv_bytes([c], dense) * sixteen_bit_share(_arrays(c, dense)) for c in caches)


def _arrays(cache: Any, dense: bool) -> list[mx.array]:
    """What a cache holds: its saved state, or (``dense``, one of ours) its stored rows alone."""
    if dense and isinstance(cache, CompressedKVCache):
        return sharing.rows_arrays(cache)
    return [a for _, a in tree_flatten(cache.state) if isinstance(a, mx.array)]


def full_bytes_per_token(model: Any) -> float:
    """The full cache's 16-bit bytes per token of context, measured on the calibration prompt."""
    return _held_after(model, Variant("full")) / CALIBRATION_TOKENS


def budget_line(model: Any, variant: Variant) -> Callable[[float], int]:
    """The variant's bytes after the calibration prompt as a line in its budget, ``fixed + per_row * budget``, read
    backwards: the budget whose bytes come closest to a target (at least the rows every method protects)."""
    low, high = CALIBRATION_BUDGETS
    held = [_held_after(model, variant, budget) for budget in CALIBRATION_BUDGETS]
    per_row = (held[1] - held[0]) / (high - low)
    fixed = held[0] - per_row * low
    return lambda target: max(PROTECTED, round((target - fixed) / per_row))


def _held_after(model: Any, variant: Variant, budget: int | None = None) -> float:
    """The 16-bit bytes ``variant``'s caches hold at ``budget`` rows once they have read a random calibration prompt."""
    prompt = sharing.random_prompt(model, CALIBRATION_TOKENS)
    caches = variant.caches(model, CALIBRATION_TOKENS, budget=budget)
    sharing.whole(model, prompt, caches, 0, CALIBRATION_STEP)
    return held_bytes(caches)
