"""Rows of one layer's KV cache, per head, each with the position of the token it came from.

Each row's original position makes a trim exact at any time (speculative decoding's rewind, the server's
prompt-cache reuse), whatever was evicted before. Heads keep different rows, so a trim can leave the shorter heads
ending in *holes*: rows with position -1 that attention masks out and compression drops first. Storage is dense or
mlx's affine-quantized (packed, scales, biases) triple, rows on axis 2 either way.

*Row columns* are named per-row arrays (B, H, rows) of a policy's state (H2O's accumulated attention) that follow
every compaction, trim and merge. A column may be shorter than the rows (zeros past its end) or None (zeros
everywhere); columns are replaced, never changed in place, so a shallow copy of the store keeps its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

Parts = tuple[mx.array, ...]
HOLE = -1
BITS = (2, 3, 4, 5, 6, 8, 16)  # the widths mlx quantizes to (:func:`encode`); 16: unquantized, in the model's dtype
GROUPS = (32, 64, 128)  # mlx's quantization group sizes
LATE = 2**30  # a hole's sort key: after every position


def encode(x: mx.array, bits: int | None, group_size: int) -> Parts:
    """``x`` as stored: the array itself (``bits`` None), or mlx's quantized triple."""
    return (x,) if bits is None else tuple(mx.quantize(x, group_size=group_size, bits=bits))


def decode(parts: Parts, bits: int | None, group_size: int) -> mx.array:
    """What :func:`encode` stored, back as an array (dequantized in the original dtype)."""
    if bits is None:
        return parts[0]
    packed, scales, biases = parts
    return mx.dequantize(packed, scales, biases, group_size=group_size, bits=bits).astype(scales.dtype)


def _grow(parts: Parts, extra: int) -> Parts:
    """The same arrays with ``extra`` zero rows appended (spare capacity)."""
    return parts if extra == 0 else join(parts, _zero_rows(parts, extra))


def _zero_rows(parts: Parts, rows: int) -> Parts:
    """Zero arrays of ``rows`` rows shaped as ``parts``' (spare capacity to join after them)."""
    return tuple(mx.zeros((*p.shape[:2], rows, p.shape[3]), p.dtype) for p in parts)


def _head(parts: Parts, rows: int) -> Parts:
    """The first ``rows`` rows of each array (a view when nothing is cut)."""
    return tuple(p if p.shape[2] == rows else p[..., :rows, :] for p in parts)


def take_rows(parts: Parts, index: mx.array) -> Parts:
    """Rows ``index`` (B, H, k) of each array, gathered per head."""
    return tuple(mx.take_along_axis(p, index[..., None], axis=2) for p in parts)


def join(*groups: Parts | None, axis: int = 2) -> Parts:
    """Each array of the groups (None: none held) followed by its counterparts along ``axis`` (the rows'), in one
    concatenation; a group alone is returned as it is."""
    held = [g for g in groups if g is not None]
    return held[0] if len(held) == 1 else tuple(mx.concatenate(list(parts), axis=axis) for parts in zip(*held))


class RowStore:
    """Keys, values and positions of the rows one layer keeps, with spare capacity like KVCache."""

    def __init__(self, bits: int | None = None, group_size: int = 64, step: int = 256) -> None:
        self.bits = bits
        self.group_size = group_size
        self.step = step  # rows added at a time when full (KVCache's 256; fewer for a store that stays small)
        self.keys: Parts | None = None
        self.values: Parts | None = None
        self.positions: mx.array | None = None  # (B, H, capacity, 1) int32
        self.rows = 0
        self.holes = False
        self.columns: dict[str, mx.array | None] = {}  # row columns by name (module doc)

    # ----------------------------------------------------------------- encoding
    def encode(self, x: mx.array) -> Parts:
        return encode(x, self.bits, self.group_size)

    def decode(self, parts: Parts) -> mx.array:
        return decode(parts, self.bits, self.group_size)

    # ----------------------------------------------------------------- reading
    @property
    def capacity(self) -> int:
        return 0 if self.positions is None else self.positions.shape[2]

    def _held(self) -> tuple[Parts, Parts, mx.array]:
        """Keys, values and positions, which the first rows written (or loaded) make: a store is read after that."""
        assert self.keys is not None and self.values is not None and self.positions is not None, "no rows yet"
        return self.keys, self.values, self.positions

    def fetch(self) -> tuple[mx.array, mx.array]:
        """Every stored row (holes included), decoded."""
        keys, values, _ = self._held()
        return self.decode(_head(keys, self.rows)), self.decode(_head(values, self.rows))

    def row_positions(self) -> mx.array:
        """Original token position of each stored row, (B, H, rows); -1 marks a hole."""
        return _head((self._held()[2],), self.rows)[0][..., 0]

    @property
    def nbytes(self) -> int:
        """Physical bytes held, spare capacity included."""
        if self.positions is None:
            return 0
        keys, values, positions = self._held()
        return sum(p.nbytes for p in (*keys, *values, positions, *self.columns.values()) if p is not None)

    # ----------------------------------------------------------------- row columns
    def column(self, name: str, rows: int | None = None) -> mx.array:
        """Column ``name`` of the first ``rows`` rows (every stored row by default), float32 zeros past its end."""
        rows = self.rows if rows is None else rows
        held = self.columns.get(name)
        if held is None:
            return mx.zeros((*self.row_positions().shape[:2], rows), mx.float32)
        if held.shape[-1] == rows:
            return held
        return mx.concatenate([held, mx.zeros((*held.shape[:2], rows - held.shape[-1]), held.dtype)], axis=-1)

    def set_column(self, name: str, value: mx.array | None) -> None:
        """Hold ``value`` (B, H, <= rows) as column ``name``."""
        self.columns = {**self.columns, name: value}

    def full_columns(self, index: mx.array | None = None) -> dict[str, mx.array]:
        """Every column over every stored row (or the rows ``index``, (B, H, k)), zeros where not held."""
        if index is None:
            return {name: self.column(name) for name in self.columns}
        return {name: mx.take_along_axis(self.column(name), index, axis=-1) for name in self.columns}

    # ----------------------------------------------------------------- writing
    def append(self, keys: mx.array, values: mx.array, start: int) -> None:
        """Write ``keys``/``values`` (B, H, n, d) after the stored rows, as the rows of positions ``start`` on."""
        n = keys.shape[2]
        self._reserve(n, keys, values)
        held_keys, held_values, positions = self._held()
        fresh = (*self.encode(keys), *self.encode(values), mx.arange(start, start + n, dtype=mx.int32)[:, None])
        for target, part in zip((*held_keys, *held_values, positions), fresh):
            target[..., self.rows : self.rows + n, :] = part
        self.rows += n

    def merge(self, keys: mx.array, values: mx.array, positions: mx.array, index: mx.array | None = None,
              columns: dict[str, mx.array] | None = None) -> None:
        """Add rows at ``positions`` (-1: a hole) with their ``columns``, in time order per head (holes last; rows that
        are holes in every head go), no spare capacity left; with ``index``, those rows of ``keys``/``values``."""
        def rows(i: int) -> Parts:
            half = (keys, values)[i]
            return self.encode(half if index is None else take_rows((half,), index)[0])
        self._merge(rows, positions.astype(mx.int32), 0, columns)

    def take_in(self, other: RowStore, spare: int = 0) -> None:
        """Every row of ``other`` (a tier's) merged in as :meth:`merge` does, with ``spare`` free rows after them."""
        keys, values, positions = other.state
        self._merge(lambda i: self.encode(other.decode((keys, values)[i])), positions.astype(mx.int32), spare,
                    other.full_columns())

    def _merge(self, new: Callable[[int], Parts], positions: mx.array, spare: int,
               columns: dict[str, mx.array] | None = None) -> None:
        """:meth:`merge`'s work, the new rows' keys as ``new(0)`` and values as ``new(1)`` (encoded as stored); each
        half replaces the one held as soon as it is made, so the keys' old rows are gone before values decode."""
        b, h, n = positions.shape
        if self.rows:
            positions = mx.concatenate([self.row_positions(), positions], axis=-1)
        when = mx.where(positions < 0, LATE, positions)
        order = mx.argsort(when, axis=-1)[..., : int((when < LATE).sum(axis=-1).max())]
        total = positions.shape[-1]
        index = mx.concatenate([order, mx.broadcast_to(mx.arange(total, total + spare, dtype=order.dtype),
                                                       (b, h, spare))], axis=-1)
        self.columns = self._merged_columns(columns or {}, order, n)
        self.keys = self._merged(0, new, index, spare)
        self.values = self._merged(1, new, index, spare)
        positions = mx.concatenate([positions, mx.full((b, h, spare), HOLE, mx.int32)], axis=-1)
        self.positions = mx.take_along_axis(positions, index, axis=-1)[..., None]
        self.rows = order.shape[-1]
        self.holes = bool((self.row_positions() < 0).any().item())

    def _merged_columns(self, new: dict[str, mx.array], order: mx.array, n: int) -> dict[str, mx.array | None]:
        """The columns after :meth:`_merge`: held then ``n`` new rows (zeros where missing), in the order ``order``."""
        held = self.full_columns() if self.rows else {}
        b, h = order.shape[:2]

        def joined(name: str) -> mx.array:
            return mx.concatenate([held[name] if name in held else mx.zeros((b, h, self.rows), mx.float32),
                                   new[name] if name in new else mx.zeros((b, h, n), mx.float32)], axis=-1)
        return {name: mx.take_along_axis(joined(name), order, axis=-1) for name in {**self.columns, **new}}

    def _merged(self, half: int, new: Callable[[int], Parts], index: mx.array, spare: int) -> Parts:
        """One half of :meth:`_merge` (0: keys, 1: values) in the order ``index``. mlx keeps every array of one
        evaluation alive until it ends, so each step is evaluated and dropped in turn: two copies alive, not four."""
        held = (self.keys, self.values)[half] if self.rows else None
        parts = new(half)
        mx.eval(parts)
        joined = join(None if held is None else _head(held, self.rows), parts, _zero_rows(parts, spare))
        del held, parts
        mx.eval(joined)
        out = take_rows(joined, index)
        del joined
        mx.eval(out)
        return out

    def keep(self, index: mx.array, spare: int) -> None:
        """Compact to rows ``index`` (B, H, k), ascending per head, plus ``spare`` free rows."""
        if self.columns:
            self.columns = dict(self.full_columns(index))
        self._rebuild(lambda parts: _grow(take_rows(_head(parts, self.rows), index), spare))
        self.rows = index.shape[-1]
        if self.holes:
            self.holes = bool((self.row_positions() < 0).any().item())

    def drop_first(self, n: int, spare: int) -> None:
        """Compact to every row but the first ``n``, plus ``spare`` free rows (``0, 0``: give back the spare room)."""
        b, h = self.row_positions().shape[:2]
        self.keep(mx.broadcast_to(mx.arange(n, self.rows), (b, h, self.rows - n)), spare)

    def trim_to(self, prefix: int) -> None:
        """Forget every row at ``prefix`` or later: a suffix of each head, the shorter ones keeping holes."""
        if self.rows == 0:
            return
        positions = self.row_positions()
        left = (positions >= 0) & (positions < prefix)
        rows = int(mx.where(left, mx.arange(self.rows), -1).max()) + 1  # past the last row kept in any head
        kept = left[..., :rows]
        self.columns = {name: None if c is None else c[..., :rows] for name, c in self.columns.items()}
        self.holes = rows > 0 and not bool(kept.all().item())
        if self.holes:
            self._held()[2][..., :rows, :] = mx.where(kept, positions[..., :rows], HOLE)[..., None]
        self.rows = rows

    def quantized(self, bits: int, group_size: int) -> RowStore:
        """A copy of this store in mlx's quantized format; ValueError (mlx's) for one it cannot store."""
        out = RowStore(bits, group_size, self.step)
        out.rows, out.holes, out.columns = self.rows, self.holes, self.columns
        if self.positions is None:
            out.encode(mx.zeros((1, group_size)))  # checks the format before any row arrives
        else:
            keys, values = self.fetch()
            spare = self.capacity - self.rows
            out.keys, out.values = _grow(out.encode(keys), spare), _grow(out.encode(values), spare)
            out.positions = mx.array(self.positions)
        return out

    def materialize(self, *also: Any) -> None:
        """Evaluate the held arrays and row columns now (with ``also``, in one evaluation), so what they were computed
        from (the larger buffer a compaction took rows of) is freed now, not when the model's step is evaluated."""
        mx.eval(self.keys, self.values, self.positions, *self.columns.values(), *also)

    def tie(self, dependency: mx.array) -> None:
        """Make the stored rows depend on ``dependency``, so evaluating the state evaluates it too."""
        self.positions = mx.depends(self._held()[2], dependency)

    # ----------------------------------------------------------------- saving
    @property
    def state(self) -> tuple[Any, ...]:
        """Stored rows without spare capacity: (key parts, value parts, positions)."""
        if self.keys is None or self.values is None or self.positions is None:
            return None, None, None
        return _head(self.keys, self.rows), _head(self.values, self.rows), self.row_positions()

    def load(self, state: tuple[Any, ...]) -> None:
        """Hold exactly the rows ``state`` gives (as :attr:`state` returns them)."""
        keys, values, positions = state
        if positions is None:
            return
        self.keys, self.values = tuple(keys), tuple(values)
        self.positions = positions[..., None]
        self.rows = positions.shape[2]
        self.holes = bool((positions < 0).any().item())

    # ----------------------------------------------------------------- internals
    def _reserve(self, n: int, keys: mx.array, values: mx.array) -> None:
        """Make room for ``n`` more rows, growing in whole steps as KVCache does."""
        if self.positions is not None and self.rows + n <= self.capacity:
            return
        grow = (n + self.step - 1) // self.step * self.step
        if self.positions is None:
            b, h = keys.shape[:2]
            self.keys = self.encode(mx.zeros((b, h, grow, keys.shape[3]), keys.dtype))
            self.values = self.encode(mx.zeros((b, h, grow, values.shape[3]), values.dtype))
            self.positions = mx.zeros((b, h, grow, 1), mx.int32)
            return
        self._rebuild(lambda parts: _grow(_head(parts, self.rows), grow))

    def _rebuild(self, rebuild: Callable[[Parts], Parts]) -> None:
        """Replace keys, values and positions alike (they share their rows axis)."""
        keys, values, positions = self._held()
        self.keys, self.values = rebuild(keys), rebuild(values)
        (self.positions,) = rebuild((positions,))
