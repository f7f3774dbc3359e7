"""Process-wide KV-cache statistics for ``VELOX_STATS`` (one line on exit).

Caches register themselves here when they are built; copies made without ``__init__`` (the
server's ``copy.deepcopy`` of prompt caches, a quantized copy) are registered by whoever hands them
on, with ``built=False``. The summary reads the live ones, so nothing is counted twice and nothing is
kept alive by the statistics.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

_live: "weakref.WeakSet[Any]" = weakref.WeakSet()


@dataclass
class _Totals:
    caches_built: int = 0
    compressions: int = 0
    generations: int = 0


totals = _Totals()


def track(cache: Any, built: bool = True) -> None:
    """Remember a compressed cache (weakly) for the exit summary; count it if it was just built.

    Tracking the same cache again is harmless: the live set holds each cache once.
    """
    if built:
        totals.caches_built += 1
    _live.add(cache)


def counts() -> list[int]:
    """This process's numbers for the summary: generations, caches built, compressions, and over the
    live caches tokens seen, rows kept, bytes held and the bytes a dense cache would hold."""
    live = list(_live)
    return [totals.generations, totals.caches_built, totals.compressions, sum(c.offset for c in live),
            sum(c.size() for c in live), sum(c.nbytes for c in live), sum(c.dense_nbytes() for c in live)]


def summary(method: str, numbers: list[int] | None = None, who: str = "") -> str:
    """One line: method, caches, tokens seen vs rows kept, physical bytes vs a dense cache; of this
    process, or of ``numbers`` (summed over the ranks of a distributed run), ``who`` naming them."""
    generations, built, compressions, seen, kept, nbytes, dense = counts() if numbers is None else numbers
    share = f"{100 * kept / seen:.1f}%" if seen else "n/a"
    return (
        f"veloxpatch{who}: {method} | {generations} generation(s), {built} layer cache(s) built, "
        f"{compressions} compression(s) | live: {kept}/{seen} rows kept ({share}), "
        f"KV {nbytes / 2**20:.2f} MiB vs {dense / 2**20:.2f} MiB dense"
    )
