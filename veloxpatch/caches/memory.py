"""``VELOX_KV_MEMORY``: the bytes a cache list may hold, turned into rows per layer (and tier rows).

A plan is made per cache list from what the probe saw each slot hold per token (:class:`SlotLayout`). The slots
that stay mlx_lm's are paid for first (a plain cache of theirs cannot be bounded); ours share the rest equally per
layer: ``keep + headroom(keep)`` rows, a window of queries, and tier rows in what the store leaves, all scaled by the
batch. Not counted: a prefill chunk's own rows until the compression after it, and the forward's activations.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx

from ..settings import ConfigError, size_text
from .schedule import Schedule

POSITION_BYTES = 4  # an int32 position per row and head
SLACK = 8  # rows per layer kept free: methods whose layers keep different budgets (PyramidKV, SqueezeAttention)
# give a small layer a headroom above an eighth of its budget (at least 8 rows), which a mean cannot see


@dataclass(frozen=True)
class SlotLayout:
    """What one slot holds per token in mlx_lm's cache, batch 1; ``rows``: the most it keeps (a rotating window) or
    None (one per token); ``fixed``: the bytes of a slot that holds no rows (a recurrent state)."""

    heads: int = 0
    key_dim: int = 0
    value_dim: int = 0
    itemsize: int = 0
    rows: int | None = None
    fixed: int = 0
    query_bytes: int = 0  # one remembered query of every query head (our caches keep a window of them)

    @property
    def row_bytes(self) -> int:
        """One token's keys and values, every head, as mlx_lm stores them."""
        return self.heads * (self.key_dim + self.value_dim) * self.itemsize

    @property
    def stored_row_bytes(self) -> int:
        """One row of our store: mlx_lm's row and its positions."""
        return self.row_bytes + self.heads * POSITION_BYTES

    def tier_row_bytes(self, bits: int) -> int:
        """One row of a tier at ``bits`` (unquantized where :class:`~.tier.Tier` keeps it so)."""
        group = next((g for g in (64, 32) if self.key_dim % g == 0), None)
        if bits == 16 or group is None:
            return self.stored_row_bytes
        width = self.key_dim + self.value_dim
        scales = -(-self.key_dim // group) - (-self.value_dim // group)
        return self.heads * (width * bits // 8 + 2 * scales * self.itemsize + POSITION_BYTES)

    def bounded_bytes(self) -> int | None:
        """Bytes of a slot left to mlx_lm, or None where it grows with the context."""
        if self.heads == 0:
            return self.fixed
        return None if self.rows is None else self.rows * self.row_bytes


def layout_of(cache: Any) -> SlotLayout:
    """The layout of one of mlx_lm's caches after a forward (a quantized one grows with its rows as stored)."""
    keys: Any = getattr(cache, "keys", None)  # mlx_lm's: an array, a quantized triple, or none
    values: Any = getattr(cache, "values", None)
    if isinstance(keys, mx.array) and isinstance(values, mx.array):
        return SlotLayout(keys.shape[1], keys.shape[3], values.shape[3], keys.dtype.size,
                          getattr(cache, "max_size", None))
    if keys is not None:  # quantized: (packed, scales, biases) per key and value
        return SlotLayout(1, sum(p.nbytes for p in keys), sum(p.nbytes for p in values), 1)
    return SlotLayout(fixed=int(getattr(cache, "nbytes", 0)))


@dataclass(frozen=True)
class MemoryPlan:
    """Rows per layer for our caches (``ours``) under ``total`` bytes, after the slots left to mlx_lm (``others``)."""

    total: int
    setting: str  # VELOX_KV_MEMORY as given, for messages
    ours: tuple[SlotLayout, ...]
    others: tuple[SlotLayout, ...]
    queries: int  # queries a cache holds between steps (its observation window, or H2O's queue)
    floor: int  # the fewest rows a layer keeps (sink + window)
    tier_bits: int = 0
    policy_row_bytes: int = 0  # per row and KV head, what the policy keeps beside the row, in store and tier alike

    def __post_init__(self) -> None:
        if self.keep_cap(1) < self.floor:
            raise ConfigError(
                f"VELOX_KV_MEMORY={self.setting} is not allowed here: it must be at least {self.smallest()} bytes "
                f"({size_text(self.smallest())}) for this model, enough for the {self.floor} rows a layer always "
                f"keeps (VELOX_SINK + VELOX_WINDOW) and its decode headroom"
                + (f", after {size_text(self.fixed)} for the slots mlx_lm keeps" if self.fixed else ""))

    @property
    def fixed(self) -> int:
        """Bytes of the slots left to mlx_lm that are bounded, batch 1."""
        return sum(b for b in (s.bounded_bytes() for s in self.others) if b is not None)

    @property
    def unbounded(self) -> int:
        """How many slots left to mlx_lm grow with the context (the plan cannot bound them)."""
        return sum(s.bounded_bytes() is None for s in self.others)

    def _available(self, batch: int) -> int:
        """Bytes for our rows: the total less the slots left to mlx_lm and our remembered queries."""
        queries = sum(self.queries * s.query_bytes for s in self.ours)
        return self.total - batch * (self.fixed + queries)

    def _row_bytes(self) -> int:
        """One row in every layer of ours, with its position and the policy's share."""
        return sum(s.stored_row_bytes + s.heads * self.policy_row_bytes for s in self.ours)

    def keep_cap(self, batch: int) -> int:
        """The most rows a layer may keep with its decode headroom, for ``batch`` sequences."""
        rows = self._available(batch) // max(1, batch * self._row_bytes()) - SLACK
        headroom = Schedule().headroom
        keep = max(0, rows - headroom(rows))
        while keep + 1 + headroom(keep + 1) <= rows:  # a smaller keep has a smaller headroom
            keep += 1
        return keep

    def tier_rows(self, keep: int, batch: int) -> int:
        """Rows a layer's tier may hold beside a store of ``keep`` rows and their headroom."""
        if not self.tier_bits:
            return 0
        held = (keep + Schedule().headroom(keep) + SLACK) * batch * self._row_bytes()
        per_row = batch * sum(s.tier_row_bytes(self.tier_bits) + s.heads * self.policy_row_bytes for s in self.ours)
        return max(0, (self._available(batch) - held) // max(1, per_row))

    def smallest(self) -> int:
        """The fewest bytes that hold ``floor`` rows per layer with their headroom, batch 1."""
        rows = self.floor + Schedule().headroom(self.floor) + SLACK
        return self.total - self._available(1) + rows * self._row_bytes()

    def vanilla_tokens(self) -> int:
        """Tokens of context mlx_lm's own caches would hold in the same bytes."""
        growing = sum(s.row_bytes for s in (*self.ours, *self.others) if s.bounded_bytes() is None)
        return max(0, self.total - self.fixed) // max(1, growing)

    def shared_with(self, other: MemoryPlan) -> MemoryPlan:
        """One plan for this list and ``other`` (a speculative draft's), the total for both."""
        return replace(self, ours=self.ours + other.ours, others=self.others + other.others)

    def describe(self) -> str:
        """One line for ``veloxpatch info``."""
        keep = self.keep_cap(1)
        tier = f", and {self.tier_rows(keep, 1)} rows at {self.tier_bits} bits in its tier" if self.tier_bits else ""
        left = (f"; {self.unbounded} slot(s) left to mlx_lm grow with the context and are not bounded"
                if self.unbounded else "")
        return (f"VELOX_KV_MEMORY={self.setting} ({size_text(self.total)}): each of {len(self.ours)} compressed "
                f"layers keeps at most {keep} rows{tier}, per sequence; mlx_lm's own caches would hold "
                f"{self.vanilla_tokens()} tokens of context in it{left}")


def device_bytes() -> int:
    """The memory mlx reports for the default device, or the physical memory where it reports none (the CPU)."""
    reported = mx.device_info().get("memory_size")
    if reported:
        return int(reported)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
