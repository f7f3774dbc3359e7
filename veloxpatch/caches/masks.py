"""Attention masks for the rows a cache holds, as plain functions.

A cache supplies the mask for its own rows (contract 3 of docs/DESIGN.md): every row held is in the past, so
causal is right except around holes; a mask with the model's own information is combined with ours.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx


def issued(mask: mx.array, members: list[Any]) -> bool:
    """True if ``mask`` is one a cache of the list (``members``) handed the model: it carries nothing of its own."""
    return any(mask is m.issued_mask for m in members)


def forget_issued(cache: Any, members: list[Any]) -> None:
    """Once the last layer (``cache``) has attended, drop the masks issued: a chunk's would live to the next forward."""
    if cache is members[-1]:
        for member in members:
            member.issued_mask = None


def causal(rows: int, n: int, window_size: int | None = None) -> mx.array:
    """(n, rows): the last ``n`` rows are the queries, each seeing the rows up to its own (within ``window_size``)."""
    columns = mx.arange(rows)[None]
    queries = mx.arange(rows - n, rows)[:, None]
    mask = queries >= columns
    if window_size is not None:
        mask = mask & (queries < columns + window_size)
    return mask


def visible(positions: mx.array, n: int, end: int) -> mx.array:
    """(B, kv_heads, n, rows): the rows the ``n`` tokens before ``end`` see: no hole, nothing in their future."""
    query_positions = end - n + mx.arange(n)
    rows = positions[:, :, None, :]
    return (rows >= 0) & (rows <= query_positions[:, None])


def marked(shape: tuple[int, ...], index: mx.array) -> mx.array:
    """Boolean of ``shape``, true at the indexes ``index`` along the last axis."""
    return mx.put_along_axis(mx.zeros(shape, mx.bool_), index, mx.array(True), axis=-1)


def restricted(kept: mx.array, rows: int, n: int, query_heads: int, given: Any) -> mx.array:
    """``given`` limited to the rows ``kept`` and the step's own ``n``: rows about to go are masked for the step."""
    keep = marked((*kept.shape[:2], rows), kept) | (mx.arange(rows) >= rows - n)
    keep = mx.repeat(keep, query_heads // keep.shape[1], axis=1)[:, :, None, :]
    return combined(keep, given, rows, n)


def combined(visible: mx.array | str, given: Any, rows: int, n: int) -> Any:
    """Boolean ``visible`` (or ``"causal"``) combined with ``given``: None, ``"causal"``, boolean or additive."""
    if isinstance(visible, str):
        visible = causal(rows, n)
    if given is None:
        return visible
    if isinstance(given, str):
        given = causal(rows, n)
    if given.dtype == mx.bool_:
        return visible & given
    return mx.where(visible, given, mx.array(-mx.inf, given.dtype))
