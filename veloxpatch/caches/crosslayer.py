"""Caches that fold their older rows into a form built jointly with other layers (xKV, MiniCache) or alone (Quant).

A cross-layer cache evicts nothing. It keeps its recent rows exact in the row store and *folds* older ones: rows
``[start, end)`` of every member of a layer group go through the coordinator's fan-in into one joint step (a shared
basis, a merged direction), which returns what each layer keeps alone (``own``) and what the group keeps once
(``shared``, counted once over the list). Attention runs over the folded rows, rebuilt by the method, then the exact
ones.

When rows fold. The last ``VELOX_WINDOW`` tokens always stay exact: the next tokens attend to them most. Older rows
fold once at least :meth:`CrossLayerCache.min_fold` of them are exact: after any step in ``chunk`` mode (so the
prompt's memory stays bounded), after decode-sized steps only in ``end`` mode (the whole prompt folds at the first
decode step). Decode tokens stay exact until that many have gathered, then fold as a new segment.

Order within a forward (:mod:`veloxpatch.coordinators`): earlier members attend over exact rows until they pick the
fold up at their next call; a group that never completes leaves each member to fold alone then, said once.
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, ClassVar

import mlx.core as mx
from mlx.utils import tree_flatten

from .. import stats
from ..coordinators import members_of
from ..log import once
from . import masks
from .base import CompressedKVCache
from .spec import CacheSpec
from .store import RowStore


@dataclass(frozen=True)
class Fold:
    """Rows ``[start, end)`` of one layer, folded: what the layer holds alone and with its group."""

    start: int
    end: int
    own: Any
    shared: Any
    group: tuple[int, ...]  # the layers that folded these rows together (just this one when alone)


class CrossLayerCache(CompressedKVCache):
    """Exact recent rows in the store, older rows in folds made with the layer's group."""

    store_step: ClassVar[int] = 32  # the exact rows stay few (window + one fold's worth): little spare room

    def __init__(self, spec: CacheSpec) -> None:
        super().__init__(spec)
        self.folds: list[Fold] = []
        self.pending: list[tuple[Hashable, tuple[int, ...], int, int]] = []  # contributed, not yet folded
        self.linked = True  # False after loading from a file: shared parts are still per-layer copies
        self.handed: mx.array | None = None  # the keys the last store handed out (a method attending over its folds
        # as held checks the model attends over exactly these, unchanged)

    # ----------------------------------------------------------------- what a method provides
    @abstractmethod
    def group(self) -> tuple[int, ...]:
        """The member layers (``cache.layer``) whose rows fold together with this layer's."""

    @abstractmethod
    def joint(self, parts: list[Any]) -> tuple[list[Any], Any]:
        """The joint step over the group's (keys, values) rows of one range, in layer order: each member's own part
        (same order) and the part the group shares (a method folding other rows, XQuant's X, passes its own)."""

    @abstractmethod
    def unfold(self, fold: Fold) -> tuple[mx.array, mx.array]:
        """The fold's rows as attention uses them: keys and values (B, kv_heads, end - start, head_dim)."""

    def block(self, layers: int) -> tuple[int, ...]:
        """This layer's block of ``layers`` consecutive members (the last one shorter): a group for :meth:`group`."""
        first = self.layer // layers * layers
        return tuple(range(first, min(first + layers, len(members_of(self)))))

    def min_fold(self) -> int:
        """Exact rows (beyond the window) worth folding at once."""
        return 1

    def fold_unit(self) -> int:
        """Rows fold in multiples of this (a method quantizing blocks of tokens folds whole blocks)."""
        return 1

    def shared_parts(self) -> list[Any]:
        return [fold.shared for fold in self.folds if fold.shared is not None]

    @property
    def nbytes(self) -> int:
        """The base's bytes (exact rows, the shared parts this layer is first to hold) and the folds' own parts."""
        own = sum(a.nbytes for fold in self.folds for _, a in tree_flatten(fold.own) if isinstance(a, mx.array))
        return super().nbytes + own

    # ----------------------------------------------------------------- the cache protocol
    def size(self) -> int:
        return self.folded_rows() + self.store.rows

    def folded_rows(self) -> int:
        return sum(self.held_rows(fold) for fold in self.folds)

    def held_rows(self, fold: Fold) -> int:
        """Rows the fold holds per head (its range: a method dropping rows says otherwise)."""
        return fold.end - fold.start

    def folded_as(self) -> str | None:
        """The form of the folded rows, in words for the stats line (None: they are exact keys and values)."""
        return "folded with other layers"

    def kept_forms(self) -> dict[str, int]:
        """The exact rows' form (the base's) and the folded ones'."""
        found = super().kept_forms()
        form, rows = self.folded_as(), self.folded_rows()
        if form is not None and rows:
            found[form] = found.get(form, 0) + rows
        return found

    def _key_positions(self) -> mx.array:
        """The folds' positions (each fold a range of tokens), then the exact rows'."""
        folded = [self.fold_positions(fold) for fold in self.folds]
        return mx.concatenate([*folded, self.store.row_positions()], axis=-1)

    def fold_positions(self, fold: Fold) -> mx.array:
        """(B, kv_heads, rows) the position of each row the fold holds: its range (a method dropping rows says)."""
        heads = self.store.row_positions().shape[:2]
        return mx.broadcast_to(mx.arange(fold.start, fold.end, dtype=mx.int32), (*heads, fold.end - fold.start))

    def empty(self) -> bool:
        return super().empty() and not self.folds

    def _meta(self) -> dict[str, Any]:
        """The base's settings, and each fold's range and group (its arrays are in ``state``)."""
        return {**super()._meta(), "folds": [[fold.start, fold.end, list(fold.group)] for fold in self.folds]}

    def _extra_state(self) -> tuple[Any, ...]:
        """The folds' arrays (None when nothing is folded: an empty list would vanish from a prompt-cache file);
        every holder saves what it shares, linked again on load (:meth:`_relink`)."""
        return ([{"own": fold.own, "shared": fold.shared} for fold in self.folds] or None,)

    def _load_extra(self, extra: tuple[Any, ...], info: dict[str, Any]) -> None:
        (folds,) = extra
        self.folds = [Fold(start, end, arrays["own"], arrays["shared"], tuple(group))
                      for (start, end, group), arrays in zip(info.get("folds", []), folds or [])]
        self.pending = []
        self.linked = False

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Pick up folds completed since the last call, store the new rows, return folded + exact rows."""
        if not self.linked:
            self._relink()
        self._pick_up()
        fetched = super().update_and_fetch(keys, values)
        self.handed = fetched[0]
        return fetched

    def rows(self) -> tuple[mx.array, mx.array]:
        """Every row attention runs over: the folds' rebuilt rows, then the exact ones."""
        keys, values = self.store.fetch()
        if not self.folded_rows():
            return keys, values
        rebuilt = [self.unfold(fold) for fold in self.folds]
        return (mx.concatenate([k for k, _ in rebuilt] + [keys], axis=2).astype(keys.dtype),
                mx.concatenate([v for _, v in rebuilt] + [values], axis=2).astype(values.dtype))

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any = None,
               sinks: mx.array | None = None) -> mx.array:
        """Attention over folded + exact rows (the folds as held where :meth:`_held_usable` and the method's
        :meth:`attend_held` allow), then fold what is due."""
        handed, self.handed = self.handed, None  # not kept past the step: they may be every row, rebuilt
        out = self.attend_held(queries, scale) if keys is handed and self._held_usable(queries, mask, sinks) else None
        if out is None:
            out = self._attention(queries, keys, values, scale, mask, sinks)
        else:
            masks.forget_issued(self, members_of(self))
        self._fold_if_due(queries.shape[2])
        return out

    def attend_held(self, queries: mx.array, scale: float) -> mx.array | None:
        """Attention of a decode-sized step of ``queries`` (B, q_heads, n, dim) over the folds as held, then the
        exact rows (causal among the step's own), without rebuilding the folded rows; None: no such path."""
        return None

    def _held_usable(self, queries: mx.array, mask: Any, sinks: mx.array | None) -> bool:
        """Whether this step may attend over the folds as held (the model attending over the keys the store handed
        out): a decode-sized step over folds, no mask of the model's own, no sinks, no holes among the exact rows."""
        if not self.folds or sinks is not None or self.store.holes:
            return False
        if isinstance(mask, mx.array) and not masks.issued(mask, members_of(self)):
            return False
        return self.schedule.decode_sized(queries.shape[2])

    def cut_to(self, prefix: int) -> None:
        """A fold cut by the new end becomes exact rows of its prefix."""
        self.pending.clear()
        cut = next((i for i, fold in enumerate(self.folds) if fold.end > prefix), None)
        if cut is None:
            super().cut_to(prefix)
            return
        fold = self.folds[cut]
        del self.folds[cut:]
        self._exact_again(fold, fold.start, prefix)

    def _exact_again(self, fold: Fold, start: int, prefix: int) -> None:
        """End the cache at ``prefix`` with no exact rows but those of ``fold`` from position ``start`` on, rebuilt."""
        self.store = RowStore(self.store.bits, self.store.group_size, self.store.step)
        self.offset = prefix
        self.memory.trim(prefix)
        if prefix > start:
            keys, values = self.unfold(fold)
            rows = slice(start - fold.start, prefix - fold.start)
            self.store.append(keys[..., rows, :], values[..., rows, :], start)

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> CrossLayerCache:
        """The base's quantized copy (exact rows quantized, folds as they are), with lists of its own."""
        out = super().to_quantized(group_size, bits)
        if out is not self:
            out.folds, out.pending = list(self.folds), list(self.pending)
        return out

    # ----------------------------------------------------------------- folding
    def _fold_if_due(self, n: int) -> None:
        """Contribute the exact rows older than the window to the group's fan-in when due."""
        start = self.folds[-1].end if self.folds else 0
        unit = self.fold_unit()
        end = start + (self.offset - self.window - start) // unit * unit
        contributed = any(p_start == start for _, _, p_start, _ in self.pending)
        if contributed or not self.schedule.folds(n) or end - start < self.min_fold() or self.store.holes:
            return
        group = self.group()
        key = ("fold", group, start, end)
        part = self._exact(start, end)
        if self.coordinator is None or len(group) == 1:
            self._apply(start, end, (self.layer,), self.joint([part]), 0)
            return
        self.pending.append((key, group, start, end))
        if self.coordinator.contribute(key, self, part, group, self.joint) is not None:  # this layer completed it
            self._pick_up()

    def _pick_up(self) -> None:
        """Apply completed folds; a group that did not complete folds this layer alone."""
        for key, group, start, end in self.pending:
            assert self.coordinator is not None, "only a coordinated layer contributes"
            result, method = self.coordinator.joint(key), self.coordinator.method
            if result is None:
                once(f"{method} fold alone", logging.INFO,
                     f"{method}: layers {self.coordinator.missing(key, group)} of group {list(group)} did not "
                     f"fold rows {start}-{end} with the others; each layer folds alone")
                self._apply(start, end, (self.layer,), self.joint([self._exact(start, end)]), 0)
            else:
                self._apply(start, end, group, result, group.index(self.layer))
        self.pending.clear()

    def _apply(self, start: int, end: int, group: tuple[int, ...], result: tuple[list[Any], Any], at: int) -> None:
        """Replace the exact rows ``[start, end)`` by this layer's fold."""
        owns, shared = result
        self.folds.append(Fold(start, end, owns[at], shared, group))
        stats.count(self, "folds")
        self.store.drop_first(end - start, 0)  # exact rows begin at ``start`` (no holes: checked before contributing)
        # evaluated now: left lazy, the fold and the compacted store would keep every layer's exact rows of a prompt
        # chunk alive until the step ends (docs/results.md, "While a prompt is read")
        self.store.materialize(owns[at], shared)

    def _relink(self) -> None:
        """After loading, use the shared part an earlier member of the same fold holds, so the group holds it once
        again (the file kept a copy per layer)."""
        self.linked = True
        if self.coordinator is None:
            return
        held = {(f.start, f.end, f.group): f.shared for m in self.coordinator.members[: self.layer]
                for f in m.folds}
        self.folds = [Fold(f.start, f.end, f.own, held.get((f.start, f.end, f.group), f.shared), f.group)
                      for f in self.folds]

    def _exact(self, start: int, end: int) -> tuple[mx.array, mx.array]:
        """The exact rows of positions ``[start, end)`` (the store's first rows)."""
        keys, values = self.store.fetch()
        return keys[..., : end - start, :], values[..., : end - start, :]
