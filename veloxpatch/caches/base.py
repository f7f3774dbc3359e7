"""The part every veloxpatch cache shares: mlx_lm's cache protocol and saving, over the row store.

A cache keeps the contracts of docs/DESIGN.md: ``offset`` counts the tokens seen, while the rows live in a
:class:`RowStore` with their positions, so ``trim`` goes back to any prefix exactly; attention is routed to
:meth:`CompressedKVCache.attend` with the real queries and the cache's own mask (:mod:`.masks`); until a row is
dropped or folded, attention sees exactly ``KVCache``'s rows. Evicting caches (:mod:`.evicting`) and cross-layer
ones (:mod:`.crosslayer`) are siblings over this class.
"""

from __future__ import annotations

import copy
import json
import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar, TypeVar

import mlx.core as mx

from .. import stats
from ..config import Budget
from ..coordinators import Coordinator, members_of
from ..log import once
from . import blocks, masks
from .batch import SequenceBatch
from .queries import QueryMemory
from .schedule import Schedule
from .spec import CacheSpec
from .store import RowStore

_Cache = TypeVar("_Cache", bound="CompressedKVCache")


class CompressedKVCache(ABC):
    """A per-layer KV cache. Deliberately has no ``bits``: mlx_lm would send it to its own quantized attention."""

    coordinator_class: ClassVar[type[Coordinator]] = Coordinator
    store_step: ClassVar[int] = 256  # rows the store grows by (KVCache's step)
    wants_layer_io: ClassVar[bool] = False  # integration.layer_io hands it the hidden states around attention
    uses_budget: ClassVar[bool] = True  # False: VELOX_BUDGET changes nothing it does (the eval measures it once)
    bounds_memory: ClassVar[bool] = False  # True: VELOX_KV_MEMORY can cap its rows (the methods that evict)
    memory_instead: ClassVar[str] = ""  # where VELOX_KV_MEMORY is refused: the method's own way to less memory
    budget_use: ClassVar[str] = "VELOX_BUDGET is the rows it keeps per layer."  # said by `veloxpatch methods`
    saved_scalars: ClassVar[tuple[str, ...]] = ()  # attributes of a kind of cache saved in the meta under their names

    def __init__(self, spec: CacheSpec) -> None:
        self.budget, self.sink, self.window = spec.budget, spec.sink, spec.window
        self.runtime = spec.runtime  # the integration's answers
        self.schedule = Schedule(spec.mode)
        self.store = RowStore(step=self.store_step)
        self.memory = QueryMemory()
        self.offset = 0
        self.evicted = False
        self.issued_mask: mx.array | None = None
        self.coordinator: Coordinator | None = None
        self.layer = 0  # index in the coordinator's members (set when it joins)
        self.prompt_end: int | None = None  # the offset at which the prompt a generation announced ends
        self.uses_queries = False  # the cache's choices read the model's real queries (the probe and batching ask)

    # ----------------------------------------------------------------- what a kind of cache provides
    @abstractmethod
    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any = None,
               sinks: mx.array | None = None) -> mx.array:
        """Attention of this step over the rows :meth:`update_and_fetch` returned, then the cache's own work."""

    def knob_values(self) -> dict[str, Any]:
        """The method's own knobs, saved with the cache so it loads back the same."""
        return {}

    @classmethod
    def resolved_knobs(cls, values: dict[str, Any]) -> dict[str, Any]:
        """The knob ``values`` a cache built from them runs with, where one knob's ``auto`` depends on another's:
        what an eval journal names, so a line counts for every spelling of the cache it measured."""
        return values

    def shared_parts(self) -> list[Any]:
        """Arrays (or trees of them) shared with other layers of the list: counted once, by the first holder."""
        return []

    # ----------------------------------------------------------------- mlx_lm cache protocol
    @property
    def merge(self) -> Any:
        """``merge`` (mlx_lm's server batches only caches that have it), present only while the :class:`Runtime` says
        batched generation is patched: else mlx_lm would merge our caches into its own, which know no positions."""
        if not self.runtime.batching():
            raise AttributeError(f"{type(self).__name__}.merge: batched generation is not patched")
        return SequenceBatch.merge

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append new rows (already rotated at ``offset``) and return every row attention runs over."""
        if self.coordinator is not None:
            self.coordinator.on_update(self)
        self.store.append(keys, values, self.offset)
        self.offset += keys.shape[2]
        return self.rows()

    def rows(self) -> tuple[mx.array, mx.array]:
        """Every row attention runs over, keys and values (B, kv_heads, size, head_dim): the stored ones."""
        return self.store.fetch()

    @property
    def keys(self) -> mx.array | None:
        """The rows' keys (decoded), for code that reads a cache's keys (a copy into mlx_lm's own cache)."""
        return None if self.empty() else self.rows()[0]

    @keys.setter
    def keys(self, value: mx.array) -> None:
        """mlx_lm's pipelined models write ``cache[-1].keys = mx.depends(cache[-1].keys, h)`` so that evaluating
        the caches runs the send of ``h`` too: the value's graph is hung on our rows. Any other assignment is
        refused: rows written from outside would bypass positions and eviction."""
        shape = None if self.empty() else tuple(self.rows()[0].shape)
        if tuple(value.shape) != shape:
            raise AttributeError(
                f"{type(self).__name__} keeps its rows itself: assigning `keys` only ties a value of the cache's "
                f"own shape {shape} into the graph (mlx_lm's pipeline send), not {tuple(value.shape)}")
        self.store.tie(value)

    @property
    def values(self) -> mx.array | None:
        return None if self.empty() else self.rows()[1]

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> Any:
        """Causal over our own rows; an array handed out is remembered, to tell it from a mask of the model's own."""
        if window_size is None and n == 1:
            return None
        if window_size is None and not return_array:
            return "causal"
        self.issued_mask = masks.causal(self.rows_before(n) + n, n, window_size)
        return self.issued_mask

    def rows_before(self, n: int) -> int:
        """Rows a step of ``n`` tokens will attend over besides its own: the stored ones."""
        return self.size()

    def size(self) -> int:
        """Rows attention runs over: the stored ones (cross-layer caches add their folded rows)."""
        return self.store.rows

    def __len__(self) -> int:
        """:meth:`size`, under the name mlx-lm 0.28 and 0.29 ask for (``cache_length``, batch sorting)."""
        return self.size()

    def __bool__(self) -> bool:
        """Always true, as mlx_lm's caches: with ``__len__`` an empty cache would otherwise be false."""
        return True

    def empty(self) -> bool:
        return self.store.positions is None

    def is_trimmable(self) -> bool:
        """Always: every row knows its position, so any prefix can be restored exactly."""
        return True

    def expect_prompt(self, tokens: int) -> None:
        """The next ``tokens`` tokens are a generation's prompt, however short its steps (a chat's next turn comes in
        decode-sized steps). An evicting cache leaves a snapshot where it ends; quant reads it a second time."""
        self.prompt_end = self.offset + tokens

    def before_prompt_end(self, n: int) -> bool:
        """Whether a step of ``n`` tokens read from here stops before the last token of the announced prompt."""
        return self.prompt_end is not None and self.offset + n < self.prompt_end

    def trim(self, n: int) -> int:
        """Forget the last ``n`` tokens: the cache becomes the compressed cache of the prefix (:meth:`cut_to`)."""
        n = min(n, self.offset)
        if n <= 0:
            return 0
        self.cut_to(self.offset - n)
        return n

    def cut_to(self, prefix: int) -> None:
        """Forget every token from ``prefix`` on (``0 <= prefix < offset``): what a kind of cache adds to a trim."""
        self.offset = prefix
        self.store.trim_to(prefix)
        self.memory.trim(prefix)

    def to_quantized(self: _Cache, group_size: int = 64, bits: int = 4) -> _Cache:
        """This cache with its rows quantized; mlx_lm calls it at every step, so one already in that format returns
        itself, and a format mlx cannot store leaves the cache as it is (said once)."""
        if (self.store.bits, self.store.group_size) == (bits, group_size):
            return self
        try:
            store = self.store.quantized(bits, group_size)
        except ValueError as error:
            once(f"kv_bits {bits}/{group_size}", logging.WARNING,
                 f"kv_bits={bits} with group size {group_size} is not honoured ({error}); KV rows stay unquantized")
            return self
        out = copy.copy(self)
        out.store, out.memory = store, copy.copy(self.memory)  # its own parts: the original may still step
        stats.track(out, built=False)
        if self.coordinator is not None:
            self.coordinator.replace(self, out)
        return out

    @property
    def nbytes(self) -> int:
        """Physical bytes held, spare capacity and the shared parts this layer first holds included."""
        shared = 0 if self.coordinator is None else self.coordinator.owned_nbytes(self)
        return self.store.nbytes + self.memory.nbytes + shared

    def kept_forms(self) -> dict[str, int]:
        """Rows held in a form other than exact keys and values, by that form in words (``VELOX_STATS``)."""
        if self.store.bits is None or not self.store.rows:
            return {}
        return {f"at {self.store.bits} bits (kv_bits)": self.store.rows}

    # ----------------------------------------------------------------- saving (save_prompt_cache)
    @property
    def meta_state(self) -> str:
        """Scalars and settings as JSON, or where saved apart (:attr:`Runtime.meta_apart`) the whole state's layout."""
        if self.runtime.meta_apart():
            return json.dumps({"apart": _layout(self._whole_state(), [])})
        return json.dumps(self._meta())

    def _meta(self) -> dict[str, Any]:
        """What :attr:`meta_state` holds; a kind of cache adds its own scalars."""
        return {"offset": self.offset, "evicted": self.evicted, "budget": str(self.budget), "sink": self.sink,
                "window": self.window, "mode": self.schedule.mode, "bits": self.store.bits,
                "group_size": self.store.group_size, "knobs": self.knob_values(), "queries_end": self.memory.end,
                **{name: getattr(self, name) for name in self.saved_scalars}}

    @property
    def state(self) -> tuple[Any, ...] | list[mx.array]:
        """Rows, positions, queries, :meth:`_extra_state`, meta; its arrays alone where meta is saved apart."""
        whole = self._whole_state()
        if self.runtime.meta_apart():
            arrays: list[mx.array] = []
            _layout(whole, arrays)
            return arrays
        return whole

    @state.setter
    def state(self, value: Sequence[Any]) -> None:
        info = json.loads(value[-1])
        self.store = RowStore(info["bits"], info["group_size"], self.store_step)
        self.store.load(tuple(value[:3]))
        self.memory = QueryMemory(value[3], info.get("queries_end", info["offset"]))
        self.offset, self.evicted = info["offset"], info["evicted"]
        self._load_extra(tuple(value[4:-1]), info)
        for name in self.saved_scalars:
            if name in info:  # (else a file from before it was saved: the constructor's value)
                setattr(self, name, info[name])

    def _whole_state(self) -> tuple[Any, ...]:
        """What :attr:`state` is where mlx_lm saves it alone (mlx-lm 0.32), meta string last."""
        return (*self.store.state, self.memory.queries, *self._extra_state(), json.dumps(self._meta()))

    def _extra_state(self) -> tuple[Any, ...]:
        """Arrays a kind of cache saves besides rows and queries (between them and the meta string)."""
        return ()

    def _load_extra(self, extra: tuple[Any, ...], info: dict[str, Any]) -> None:
        """Restore what :meth:`_extra_state` saved (``extra``) and :meth:`_meta` added (``info``)."""

    @classmethod
    def from_state(cls, state: Sequence[Any], meta_state: str | None = None) -> CompressedKVCache:
        """Rebuild a cache saved with ``save_prompt_cache`` (mlx_lm looks the class up by name)."""
        if meta_state is not None:
            state = _rebuilt(json.loads(meta_state)["apart"], state)
        info = json.loads(state[-1])
        spec = CacheSpec(Budget.parse(info["budget"]), info["sink"], info["window"], info["mode"])
        cache = cls(spec, **info["knobs"])
        cache.state = state
        return cache

    # ----------------------------------------------------------------- attention over our rows
    def _attention(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any,
                   sinks: mx.array | None, kept: mx.array | None = None) -> mx.array:
        """mlx's attention of this step with our mask: causal (every row is in the past) unless holes are among the
        rows, combined with the model's own where it gave one; with ``kept``, the stored rows not in it are masked."""
        n, rows = queries.shape[2], keys.shape[2]
        own: mx.array | str | None = None if n == 1 else "causal"
        if self.has_holes():  # (B, query heads, n, rows) by the positions of the rows this step attends over
            positions = self._key_positions()
            own = mx.repeat(masks.visible(positions, n, self.offset), queries.shape[1] // positions.shape[1], axis=1)
        if isinstance(mask, mx.array) and not masks.issued(mask, members_of(self)):
            own = mask if own is None else masks.combined(own, mask, rows, n)
        if kept is not None:
            own = masks.restricted(kept, self.store.rows, n, queries.shape[1], own)
        out = blocks.attention(queries, keys, values, scale, own, sinks)
        masks.forget_issued(self, members_of(self))
        return out

    def has_holes(self) -> bool:
        """Whether a row attention runs over is a hole (position -1), so masks must go by position."""
        return self.store.holes

    def _key_positions(self) -> mx.array:
        """(B, kv_heads, rows): the position of every row attention runs over, in its order (-1: a hole)."""
        return self.store.row_positions()


def _layout(tree: Any, arrays: list[mx.array]) -> Any:
    """``tree`` as JSON, each array appended to ``arrays`` and written as its number there."""
    if isinstance(tree, mx.array):
        arrays.append(tree)
        return {"array": len(arrays) - 1}
    if isinstance(tree, dict):
        return {"dict": {key: _layout(value, arrays) for key, value in tree.items()}}
    if isinstance(tree, (tuple, list)):
        return [_layout(item, arrays) for item in tree]
    return tree


def _rebuilt(layout: Any, arrays: Sequence[mx.array]) -> Any:
    """The tree :func:`_layout` wrote, with ``arrays`` back in their places (lists for tuples)."""
    if isinstance(layout, dict):
        if "array" in layout:
            return arrays[layout["array"]]
        return {key: _rebuilt(value, arrays) for key, value in layout["dict"].items()}
    if isinstance(layout, list):
        return [_rebuilt(item, arrays) for item in layout]
    return layout
