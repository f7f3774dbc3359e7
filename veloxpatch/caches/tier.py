"""A second storage tier: the rows an evicting cache drops, kept at low bits instead of lost (``VELOX_TIER``).

Decoding attends over the exact budget alone (as fast as eviction). A prompt chunk attends over the tier's rows
too, and the selection at the end of a prompt takes them back (dequantized) to choose among all rows with that
prompt's queries: rows dropped for an earlier question can come back for the next (a chat's follow-up).

A tier holds at most ``VELOX_TIER_SIZE`` budgets of rows (or what ``VELOX_KV_MEMORY`` leaves it), the policy's best.
The default, three budgets at 8 bits, takes about as many bytes as the budget's own rows in float32 (1.6-1.7x them
where the model's rows are 16-bit: scales and biases are kept in the rows' dtype; 4 bits cost Gemma 3 270M
retrieval: docs/results.md). Rows are kept in time order per head with their columns, so a trim stays exact.
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx

from ..log import once
from .store import RowStore


class Tier:
    """Rows at ``bits`` per element (16: unquantized), time-ordered per head, with positions and row columns."""

    def __init__(self, bits: int) -> None:
        self.bits = bits
        self.store = RowStore()

    @property
    def rows(self) -> int:
        return self.store.rows

    def rows_like(self, rows: int, keys: mx.array) -> int:
        """The rows like ``keys`` that take the bytes of ``rows`` at the tier's bits (fewer where it cannot quantize
        them), so ``VELOX_TIER_SIZE`` bounds the same bytes either way."""
        if self._format(keys)[0] is not None or self.bits == 16:
            return rows
        return rows * self.bits // (8 * keys.dtype.size)

    def take(self, keys: mx.array, values: mx.array, positions: mx.array, columns: dict[str, mx.array] | None = None,
             index: mx.array | None = None) -> None:
        """Add rows with their positions and row columns, keeping time order (:meth:`RowStore.merge`)."""
        if self.store.positions is None:
            self.store = RowStore(*self._format(keys), step=1)
        self.store.merge(keys, values, positions, index, columns)
        # nothing a step returns depends on the tier: left lazy, its arrays would keep what they were made from
        # (the rows at full precision, the tier before) alive until the next prompt reads them (3x the bytes)
        self.store.materialize()

    def drain(self) -> RowStore:
        """Every row as stored, with positions and columns; the tier empty after."""
        rows, self.store = self.store, RowStore(self.store.bits, self.store.group_size, step=1)
        return rows

    @property
    def state(self) -> tuple[Any, ...] | None:
        """The rows as stored, their positions and row columns (the cache's order); None while empty."""
        columns = (c for c in self.store.columns.values() if c is not None)
        return (*self.store.state, *columns) if self.store.rows else None

    def load(self, state: tuple[Any, ...] | None, group_size: int, columns: tuple[str, ...] = ()) -> None:
        """Restore what :attr:`state` saved, its row columns named ``columns``."""
        if state is not None:
            self.store = RowStore(None if len(state[0]) == 1 else self.bits, group_size, step=1)
            self.store.load(tuple(state[:3]))
            self.store.columns = dict(zip(columns, state[3:]))

    def _format(self, rows: mx.array) -> tuple[int | None, int]:
        """(bits, group size) mlx can store rows of this head_dim in, or unquantized where no group divides it (said
        at INFO: the tier is on by default, and still keeps the rows)."""
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

