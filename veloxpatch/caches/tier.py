"""A second storage tier: the rows an evicting cache drops, kept at low bits instead of lost (``VELOX_TIER``).

An evicting cache keeps its budget of rows exact, and decoding attends over those alone (as fast as eviction).
With a tier, a compression hands the rows it drops to the tier, which holds them in mlx's affine-quantized
format with their positions. Two things read it: a prompt chunk attends over the tier's rows too (a long
document read in chunks still sees all of itself, approximately), and the selection at the end of a prompt
(the first decode-sized step, in either ``VELOX_COMPRESS`` mode) takes the tier's rows back into the store and
chooses among all of them with that prompt's own window of queries. So rows dropped while reading, or for an
earlier question, can come back for the next one (a chat's follow-up, the server's prompt-cache reuse).

Rows come back as the tier holds them (dequantized): at 16 bits exactly, at fewer with the quantization error.
A tier holds at most ``VELOX_TIER_SIZE`` budgets of rows (or what ``VELOX_KV_MEMORY`` leaves it), the best by the
policy's score where more are dropped, so the memory it takes is bounded by the budget like the store's. The
default, three budgets at 8 bits, takes about as many bytes as the budget's own rows in float32 (1.6-1.7x them where
the model's rows are 16-bit: scales and biases are kept in the rows' dtype; 4 bits halves it, and cost Gemma 3 270M
retrieval: docs/results.md), and at a budget of 25% it holds every row the store drops. The tier keeps its rows in
time order per head (holes last), as the row store does, so a trim stays exact; rows
taken back merge into the store in time order too (SnapKV pools scores over neighbouring rows). A policy's state of
a row (H2O's accumulated attention, a row column of the store: :mod:`.store`) goes with the row and comes back
with it.
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx

from ..log import once
from .store import RowStore


class Tier:
    """Rows at ``bits`` per element (16: unquantized), time-ordered per head, with their positions and row
    columns."""

    def __init__(self, bits: int) -> None:
        self.bits = bits
        self.store = RowStore()

    @property
    def rows(self) -> int:
        return self.store.rows

    @property
    def holes(self) -> bool:
        return self.store.holes

    @property
    def nbytes(self) -> int:
        return self.store.nbytes

    def rows_like(self, rows: int, keys: mx.array) -> int:
        """The rows that take the bytes of ``rows`` at the tier's bits, for rows like ``keys`` (..., head_dim):
        as many where it quantizes them, fewer where it keeps them unquantized (a head_dim no group divides),
        so ``VELOX_TIER_SIZE`` bounds the same bytes either way."""
        if self._format(keys)[0] is not None or self.bits == 16:
            return rows
        return rows * self.bits // (8 * keys.dtype.size)

    def take(self, keys: mx.array, values: mx.array, positions: mx.array, columns: dict[str, mx.array] | None = None,
             index: mx.array | None = None) -> None:
        """Add rows (B, kv_heads, n, head_dim) with their positions (B, kv_heads, n), keeping time order, and their
        row columns (B, kv_heads, n) by name (rows that come without one get zeros). With ``index`` (B, kv_heads,
        n), the rows are those rows of ``keys``/``values`` (:meth:`RowStore.merge`)."""
        if self.store.positions is None:
            self.store = RowStore(*self._format(keys), step=1)
        self.store.merge(keys, values, positions, index, columns)
        # nothing a step returns depends on the tier: left lazy, its arrays would keep what they were made from
        # (the rows at full precision, the tier before) alive until the next prompt reads them (3x the bytes)
        mx.eval(self.store.keys, self.store.values, self.store.positions, *self.store.columns.values())

    def drain(self) -> RowStore:
        """Every row (as stored: quantized where the tier quantizes) with its position and row columns; the tier
        empty after."""
        rows = self.store
        self.store = RowStore(self.store.bits, self.store.group_size, step=1)
        return rows

    def trim_to(self, prefix: int) -> None:
        """Forget every row whose position is ``prefix`` or later."""
        self.store.trim_to(prefix)

    @property
    def state(self) -> tuple[Any, ...] | None:
        """What a prompt-cache file keeps: the rows as stored, their positions and their row columns (in the order
        the cache declares them); None while empty."""
        if self.store.rows == 0:
            return None
        return (*self.store.state, *(c for c in self.store.columns.values() if c is not None))

    def load(self, state: tuple[Any, ...] | None, group_size: int, columns: tuple[str, ...] = ()) -> None:
        """Restore what :attr:`state` saved, stored in groups of ``group_size``: quantized where its keys are a
        quantized triple, else as they are (16 bits, or a head_dim no group divides: :meth:`_format`); the row
        columns saved after the positions are named ``columns``."""
        if state is not None:
            self.store = RowStore(None if len(state[0]) == 1 else self.bits, group_size, step=1)
            self.store.load(tuple(state[:3]))
            self.store.columns = dict(zip(columns, state[3:]))

    def _format(self, rows: mx.array) -> tuple[int | None, int]:
        """(bits, group size) mlx can store rows of this head_dim in: the widest group that divides it, or
        unquantized where none does (said once, at INFO: the tier is on by default, and still keeps the rows)."""
        if self.bits == 16:
            return None, 64
        dim = rows.shape[-1]
        group = next((g for g in (64, 32) if dim % g == 0), None)
        if group is None:
            once(f"tier head_dim {dim}", logging.INFO,
                 f"VELOX_TIER={self.bits}: rows of head_dim {dim} cannot be quantized in groups of 32 or 64; the "
                 "tier keeps them unquantized")
            return None, 64
        return self.bits, group

