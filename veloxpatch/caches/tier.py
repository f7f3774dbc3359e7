"""A second storage tier: the rows an evicting cache drops, kept at low bits instead of lost (``VELOX_TIER``).

An evicting cache keeps its budget of rows exact, and decoding attends over those alone (as fast as eviction).
With a tier, a compression hands the rows it drops to the tier, which holds them in mlx's affine-quantized
format with their positions. Two things read it: a prompt chunk attends over the tier's rows too (a long
document read in chunks still sees all of itself, approximately), and the selection at the end of a prompt
(the first decode-sized step, in either ``VELOX_COMPRESS`` mode) takes the tier's rows back into the store and
chooses among all of them with that prompt's own window of queries. So rows dropped while reading, or for an
earlier question, can come back for the next one (a chat's follow-up, the server's prompt-cache reuse).

Rows come back as the tier holds them (dequantized): at 16 bits exactly, at fewer with the quantization error.
The tier keeps its rows in time order per head (holes last), as the row store does, so a trim stays exact; rows
taken back merge into the store in time order too (SnapKV pools scores over neighbouring rows).
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx

from ..log import once
from .store import Parts, RowStore


class Tier:
    """Rows at ``bits`` per element (16: unquantized), time-ordered per head, with their positions."""

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

    def fetch(self) -> tuple[mx.array, mx.array]:
        """Every row, decoded (holes included)."""
        return self.store.fetch()

    def positions(self) -> mx.array:
        """(B, kv_heads, rows) positions; -1: a hole."""
        return self.store.row_positions()

    def take(self, keys: mx.array, values: mx.array, positions: mx.array) -> None:
        """Add rows (B, kv_heads, n, head_dim) with their positions (B, kv_heads, n), keeping time order."""
        if self.store.positions is None:
            self.store = RowStore(*self._format(keys), step=1)
        self.store.merge(keys, values, positions)
        # nothing a step returns depends on the tier: left lazy, its arrays would keep what they were made from
        # (the rows at full precision, the tier before) alive until the next prompt reads them (3x the bytes)
        mx.eval(self.store.keys, self.store.values, self.store.positions)

    def drain(self) -> tuple[mx.array, mx.array, mx.array]:
        """Every row (decoded) and its position, and the tier empty after."""
        keys, values = self.fetch()
        positions = self.positions()
        self.store = RowStore(self.store.bits, self.store.group_size, step=1)
        return keys, values, positions

    def trim_to(self, prefix: int) -> None:
        """Forget every row whose position is ``prefix`` or later."""
        self.store.trim_to(prefix)

    @property
    def state(self) -> tuple[Parts, Parts, mx.array] | None:
        """What a prompt-cache file keeps: the rows as stored and their positions (None while empty)."""
        return None if self.store.rows == 0 else self.store.state

    def load(self, state: tuple[Any, Any, Any] | None, group_size: int) -> None:
        """Restore what :attr:`state` saved, stored in groups of ``group_size``."""
        if state is not None:
            self.store = RowStore(None if self.bits == 16 else self.bits, group_size, step=1)
            self.store.load(state)

    def _format(self, rows: mx.array) -> tuple[int | None, int]:
        """(bits, group size) mlx can store rows of this head_dim in: the widest group that divides it, or
        unquantized (said once) where none does."""
        if self.bits == 16:
            return None, 64
        dim = rows.shape[-1]
        group = next((g for g in (64, 32) if dim % g == 0), None)
        if group is None:
            once(f"tier head_dim {dim}", logging.WARNING,
                 f"VELOX_TIER={self.bits}: rows of head_dim {dim} cannot be quantized in groups of 32 or 64; the "
                 "tier keeps them unquantized")
            return None, 64
        return self.bits, group
