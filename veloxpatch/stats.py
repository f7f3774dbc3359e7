"""Process-wide KV-cache statistics for ``VELOX_STATS`` (one line on exit).

The statistics are of the caches the app holds: whoever hands a cache to the app registers it (:func:`track`: the
builder, the loader, and with ``built=False`` whoever hands on a copy), and only a registered cache's compressions
and folds count (the probe's caches count nothing). The summary reads the live ones, so nothing is counted twice or
kept alive. Rows kept are exact, quantized or folded, so the line says how many are held in which form (each
cache's ``kept_forms()``), whether the budget applies, and the bytes against a dense cache's.
"""

from __future__ import annotations

import weakref
from collections import Counter
from dataclasses import dataclass
from typing import Any, Literal

import mlx.core as mx
from mlx.utils import tree_flatten

_live: weakref.WeakSet[Any] = weakref.WeakSet()

HELD = ("kv_bytes", "dense_kv_bytes", "rows_kept", "rows_seen", "kv_bytes_16bit", "dense_kv_bytes_16bit")
"""What :func:`held` counts of one cache list."""


@dataclass
class _Totals:
    caches_built: int = 0
    compressions: int = 0
    """Evictions: a layer's rows compressed to its budget (each layer counts)."""
    folds: int = 0
    """Cross-layer methods: a layer's exact rows folded into its method's form (each layer counts)."""
    generations: int = 0


totals = _Totals()


def track(cache: Any, built: bool = True) -> None:
    """Remember a compressed cache (weakly, once however often tracked) for the exit summary; count it if just built."""
    if built:
        totals.caches_built += 1
    _live.add(cache)


def count(cache: Any, step: Literal["compressions", "folds"]) -> None:
    """``cache`` did one more ``step`` (a count of :class:`_Totals`), counted if the app holds it (:func:`track`)."""
    if cache in _live:
        setattr(totals, step, getattr(totals, step) + 1)


def counts(caches: list[Any] | None = None) -> list[int]:
    """This process's numbers for the summary (summed over ranks as they are): generations, caches built, compressions,
    folds, and over the live caches (or ``caches``) tokens seen, rows kept, rows not exact, bytes and dense bytes."""
    live = list(_live) if caches is None else caches
    return [totals.generations, totals.caches_built, totals.compressions, totals.folds, sum(c.offset for c in live),
            sum(c.size() for c in live), sum(sum(c.kept_forms().values()) for c in live), sum(c.nbytes for c in live),
            sum(dense_nbytes(c) for c in live)]


def dense_nbytes(cache: Any) -> int:
    """Bytes a plain KVCache would need for the tokens one of our caches has seen."""
    if cache.empty():
        return 0
    keys, values = cache.store.fetch()
    b, h, _, dk = keys.shape
    return int(cache.offset * b * h * (dk + values.shape[-1]) * keys.itemsize)


def held(caches: list[Any]) -> dict[str, int]:
    """What one cache list holds (:data:`HELD`), ours and mlx_lm's slots alike, summed over layers: physical bytes
    (spare capacity, a tier, a prompt's snapshot included) and mlx_lm's full cache's, rows attended, tokens seen;
    both byte counts also as a 16-bit model's caches hold them (on the CPU float16 weights run as float32: what a Mac
    would hold, :func:`at_16_bits`)."""
    found = dict.fromkeys(HELD, 0)
    for cache in caches:
        nbytes = int(getattr(cache, "nbytes", 0) or 0)
        dense_bytes = dense_nbytes(cache) if hasattr(cache, "store") else nbytes  # mlx_lm's own slots: as they are
        offset = getattr(cache, "offset", None)
        found["kv_bytes"] += nbytes
        found["dense_kv_bytes"] += dense_bytes
        arrays = [a for _, a in tree_flatten(getattr(cache, "state", ())) if isinstance(a, mx.array)]
        widest = max((a.dtype.size for a in arrays if mx.issubdtype(a.dtype, mx.floating)), default=2)
        spare = max(0, nbytes - sum(a.nbytes for a in arrays))  # room for rows not held yet: rows' dtype
        found["kv_bytes_16bit"] += round(at_16_bits(arrays) + spare * min(1.0, 2 / widest))
        found["dense_kv_bytes_16bit"] += round(dense_bytes * min(1.0, 2 / widest))
        if isinstance(offset, int):  # a slot without one (an SSM's state) keeps no rows per token
            found["rows_kept"] += int(cache.size())
            found["rows_seen"] += offset
    return found


def at_16_bits(arrays: list[mx.array]) -> float:
    """The bytes of ``arrays`` as a 16-bit model holds them: floating-point arrays wider than 16 bits halve (rows,
    scales, queries), integer ones (quantized values, positions) stay."""
    return sum(a.nbytes * (2 / a.dtype.size if mx.issubdtype(a.dtype, mx.floating) and a.dtype.size > 2 else 1)
               for a in arrays)


def sixteen_bit_share(arrays: list[mx.array]) -> float:
    """What a cache's arrays shrink to at 16 bits (:func:`at_16_bits` over their bytes)."""
    total = sum(a.nbytes for a in arrays)
    return at_16_bits(arrays) / total if total else 1.0


def summary(method: str, numbers: list[int] | None = None, who: str = "", caches: list[Any] | None = None) -> str:
    """One line of the live caches (or ``caches``), or of ``numbers`` summed over the ranks of a distributed run
    (``who`` naming them; rows in forms not known here are said as "folded or quantized")."""
    live = list(_live) if caches is None else caches
    numbers = counts(live) if numbers is None else numbers
    generations, built, compressions, folds, seen, kept, other, nbytes, dense = numbers
    by_form = sum((Counter(cache.kept_forms()) for cache in live), Counter[str]())
    if sum(by_form.values()) != other:
        by_form = Counter({"folded or quantized": other} if other else {})
    steps = [f"{compressions} compression(s)"] if compressions or not folds else []
    steps += [f"{folds} fold(s)"] if folds else []
    share = f"{100 * kept / seen:.1f}%" if seen else "n/a"
    if live and not any(c.uses_budget for c in live):
        share += ", VELOX_BUDGET does not apply"
    parts = [f"{rows} {form}" for form, rows in by_form.most_common()]
    held = f": {', '.join([*parts, f'{kept - other} exact'])}" if parts else ""
    ratio = f" ({100 * nbytes / dense:.1f}%)" if dense else ""
    return (f"veloxpatch{who}: {method} | {generations} generation(s), {built} layer cache(s) built, "
            f"{', '.join(steps)} | live: {kept}/{seen} rows kept ({share}){held} | KV {nbytes / 2**20:.2f} MiB vs "
            f"{dense / 2**20:.2f} MiB dense{ratio}")
