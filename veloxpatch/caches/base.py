"""The shared base of veloxpatch's compressed KV caches.

A method only says how important each stored row is (:meth:`CompressedKVCache.score`); the base
keeps the contracts every cache shares (docs/DESIGN.md):

* ``offset`` counts the tokens the layer has seen (mlx_lm rotates queries and keys with it); the
  rows stored are separate and live in a :class:`RowStore` with the position each came from, so
  ``trim`` can always go back to any prefix exactly (speculative decoding, the server's reuse).
* Attention for our caches is routed here (:meth:`attend`) with the real queries, and the cache
  supplies the mask for its own rows: every kept row is in the past, so a lower-right aligned
  causal mask is right for kept + new rows under any chunking (holes left by a trim are masked
  by position). A mask the model built with information of its own is honoured.
* When to compress: ``VELOX_COMPRESS=chunk`` compresses after each prefill chunk (memory stays
  bounded during prefill; each chunk is scored by its own last queries); ``end`` keeps every
  prompt row and compresses when decoding starts, scored by the prompt's last window (SnapKV's
  one-shot mode). During decode a cache grows ``headroom`` rows (an eighth of the budget, 8 to
  64) above the budget before compressing again, so the copy a compression costs is amortised.
* Storage is preallocated and grown in steps like mlx_lm's ``KVCache``; until a cache evicts,
  its attention calls see exactly the rows of ``KVCache``, so outputs are identical.
"""

from __future__ import annotations

import copy
import json
import logging
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar

import mlx.core as mx

from .. import stats
from ..config import Budget
from ..coordinators import Coordinator
from ..log import once
from .store import RowStore


class CompressedKVCache(ABC):
    """A per-layer KV cache that keeps at most a budget of rows, chosen by :meth:`score`.

    Deliberately has no ``merge`` or ``bits``: mlx_lm would otherwise batch it or send it to its
    own quantized attention. ``to_quantized`` returns a cache of the same method whose rows are
    stored quantized.
    """

    method: ClassVar[str] = ""
    max_headroom: ClassVar[int] = 64
    uses_queries: ClassVar[bool] = True
    coordinator_class: ClassVar[type[Coordinator]] = Coordinator
    store_step: ClassVar[int] = 256  # rows the store grows by (KVCache's step)
    wants_layer_io: ClassVar[bool] = False  # see_block_input / see_attention(_input) are called (layer_io)
    uses_budget: ClassVar[bool] = True  # False: VELOX_BUDGET changes nothing it does (the eval measures it once)

    def __init__(self, budget: Budget, sink: int = 4, window: int = 32, mode: str = "end") -> None:
        self.budget = budget
        self.sink = sink
        self.window = window
        self.mode = mode
        self.store = RowStore(step=self.store_step)
        self.queries: mx.array | None = None
        self.queries_end = 0  # tokens seen when the last remembered query attended
        self.offset = 0
        self.evicted = False
        self.issued_mask: mx.array | None = None
        self.coordinator: Coordinator | None = None
        self.layer = 0  # index in the coordinator's members (set when it joins)
        stats.track(self)

    # ----------------------------------------------------------------- what a method provides
    @classmethod
    def built_as(cls, knobs: Mapping[str, Any]) -> type["CompressedKVCache"]:
        """The class whose instances this class builds under these knobs (by full key); which other
        methods' knobs reach the constructor follows from its bases (``caches.knob_settings``)."""
        return cls

    @abstractmethod
    def score(self, keys: mx.array, positions: mx.array, scale: float) -> mx.array:
        """Importance of each stored row, shape (B, kv_heads, rows); higher is kept.

        ``positions`` (B, kv_heads, rows) holds each row's original token position (-1: hole).
        """

    def knob_values(self) -> dict[str, Any]:
        """The method's own knobs, saved with the cache so it loads back the same."""
        return {}

    def shared_parts(self) -> list[Any]:
        """Arrays (or trees of them) this layer uses together with other layers of its list; they
        count once over the list, in the first holder's ``nbytes``. Cross-layer methods list theirs."""
        return []

    def observe(self, queries: mx.array, keys: mx.array, scale: float) -> None:
        """Called with every step's real queries and the keys they attended, one per stored row in
        storage order, before the step compresses; methods that accumulate evidence over time
        (H2O) or report to their coordinator override it."""

    def see_block_input(self, hidden: mx.array) -> None:
        """The decoder block's input (the residual stream, (B, n, hidden)) at every step, before the
        block runs; called only when the class sets ``wants_layer_io``. The attention route sees
        rotated queries and keys only: methods whose signal is the hidden state override this."""

    def see_attention_input(self, normed: mx.array, module: Any) -> None:
        """What the attention module is about to receive (the normed block input) and the module itself,
        at every step, before it runs (so before :meth:`update_and_fetch`); called only when the class
        sets ``wants_layer_io``. For methods that keep the attention's input instead of its keys and
        values and recompute them with the module's own projections (XQuant)."""

    def see_attention(self, normed: mx.array, output: mx.array) -> None:
        """What the attention module received (the normed block input) and returned, at every step,
        after it has run (and so after :meth:`observe`); called only when the class sets
        ``wants_layer_io``. For methods that compare or keep the attention's input and output."""

    def select(self, keep: int, scale: float) -> mx.array:
        """Row indexes to keep, (B, kv_heads, keep), ascending per head: the ``keep`` best by
        :meth:`score`, sink and recent window always, holes never. Cross-layer methods override
        it (e.g. to apply a leader layer's choice)."""
        keys, _ = self.store.fetch()
        positions = self.store.row_positions()
        scores = self.score(keys, positions, scale).astype(mx.float32)
        scores = mx.where(self.protected(positions), mx.inf, scores)
        scores = mx.where(positions < 0, -mx.inf, scores)
        order = mx.argpartition(-scores, kth=keep - 1, axis=-1)[..., :keep]
        return mx.sort(order, axis=-1)

    # ----------------------------------------------------------------- mlx_lm cache protocol
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append new rows (already rotated at ``offset``) and return every stored row."""
        if self.coordinator is not None:
            self.coordinator.on_update(self)
        self.store.append(keys, values, self.offset)
        self.offset += keys.shape[2]
        return self.store.fetch()

    @property
    def keys(self) -> mx.array | None:
        """The stored key rows (decoded), for code that reads a cache's keys."""
        return None if self.empty() else self.store.fetch()[0]

    @keys.setter
    def keys(self, value: mx.array) -> None:
        self.tie(value)

    @property
    def values(self) -> mx.array | None:
        return None if self.empty() else self.store.fetch()[1]

    def tie(self, value: mx.array) -> None:
        """What assigning ``cache.keys`` does: mlx_lm's pipelined models write
        ``cache[-1].keys = mx.depends(cache[-1].keys, h)`` so that evaluating the caches after a prompt
        chunk also runs the send of ``h`` to the next rank. Our rows live in the store, so the value's
        graph is hung on them; any other assignment (rows of another shape) is refused, since rows
        written from outside would bypass positions and eviction."""
        current = self.keys
        if current is None or tuple(value.shape) != tuple(current.shape):
            shape = None if current is None else tuple(current.shape)
            raise AttributeError(
                f"{type(self).__name__} keeps its rows itself: assigning `keys` only ties a value of the cache's "
                f"own shape {shape} into the graph (mlx_lm's pipeline send), not {tuple(value.shape)}")
        self.store.tie(value)

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> Any:
        """The mask a model asks for before this step: causal over our own rows, as KVCache does.

        An array handed out is remembered, so the attention route can tell it from a mask that
        carries the model's own information.
        """
        if window_size is None and n == 1:
            return None
        if window_size is None and not return_array:
            return "causal"
        rows = mx.arange(self.size() + n)
        query_rows = mx.arange(self.size(), self.size() + n)[:, None]
        mask = query_rows >= rows[None]
        if window_size is not None:
            mask = mask & (query_rows < rows[None] + window_size)
        self.issued_mask = mask
        return mask

    def size(self) -> int:
        """Rows attention runs over: the stored ones (cross-layer caches add their folded rows)."""
        return self.store.rows

    def empty(self) -> bool:
        return self.store.positions is None

    def is_trimmable(self) -> bool:
        """Always: every row knows its position, so any prefix can be restored exactly."""
        return True

    def trim(self, n: int) -> int:
        """Forget the last ``n`` tokens: the cache becomes the compressed cache of the prefix."""
        n = min(n, self.offset)
        if n <= 0:
            return 0
        self.offset -= n
        self.store.trim_to(self.offset)
        if self.queries is not None and self.queries_end > self.offset:
            kept = self.queries.shape[2] - (self.queries_end - self.offset)
            self.queries = self.queries[..., :kept, :] if kept > 0 else None
        self.queries_end = min(self.queries_end, self.offset)
        return n

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> "CompressedKVCache":
        """This cache with its rows stored in mlx's quantized format (same method and rows).

        mlx_lm calls this at every step once ``kv_bits`` applies, so an already quantized cache
        with the same format returns itself. A format mlx cannot store (head_dim not a multiple
        of the group size, an unsupported width) leaves the cache as it is, said once.
        """
        if (self.store.bits, self.store.group_size) == (bits, group_size):
            return self
        try:
            store = self.store.quantized(bits, group_size)
        except ValueError as error:
            once(f"kv_bits {bits}/{group_size}", logging.WARNING,
                 f"kv_bits={bits} with group size {group_size} is not honoured ({error}); KV rows stay unquantized")
            return self
        out = copy.copy(self)
        out.store = store
        stats.track(out, built=False)
        if self.coordinator is not None:
            self.coordinator.replace(self, out)
        return out

    @property
    def nbytes(self) -> int:
        """Physical bytes held: stored rows (with unused capacity), positions, remembered queries, and
        storage shared across layers that this layer is the first holder of (counted once per list)."""
        shared = 0 if self.coordinator is None else self.coordinator.owned_nbytes(self)
        return self.store.nbytes + (0 if self.queries is None else self.queries.nbytes) + shared

    def dense_nbytes(self) -> int:
        """Bytes a plain KVCache would need for the same tokens (for statistics)."""
        if self.empty():
            return 0
        keys, values = self.store.fetch()
        b, h, _, dk = keys.shape
        return self.offset * b * h * (dk + values.shape[-1]) * keys.itemsize

    @property
    def meta_state(self) -> str:
        """Scalars and settings as one JSON string (mlx_lm saves strings in prompt-cache files)."""
        return json.dumps({
            "offset": self.offset, "evicted": self.evicted, "budget": str(self.budget),
            "sink": self.sink, "window": self.window, "mode": self.mode, "bits": self.store.bits,
            "group_size": self.store.group_size, "knobs": self.knob_values(), "queries_end": self.queries_end,
        })

    @property
    def state(self) -> tuple[Any, ...]:
        """Stored rows (without spare capacity), their positions, remembered queries, meta."""
        return (*self.store.state, self.queries, self.meta_state)

    @state.setter
    def state(self, value: tuple[Any, ...]) -> None:
        *rows, queries, meta = value
        info = json.loads(meta)
        self.store = RowStore(info["bits"], info["group_size"], self.store_step)
        self.store.load(tuple(rows))
        self.queries = queries
        self.offset, self.evicted = info["offset"], info["evicted"]
        self.queries_end = info.get("queries_end", self.offset)

    @classmethod
    def from_state(cls, state: tuple[Any, ...]) -> "CompressedKVCache":
        """Rebuild a cache saved with ``save_prompt_cache`` (mlx_lm looks the class up by name)."""
        info = json.loads(state[-1])
        cache = cls(Budget.parse(info["budget"]), info["sink"], info["window"], info["mode"], **info["knobs"])
        cache.state = state
        return cache

    # ----------------------------------------------------------------- the attention route
    def attend(
        self,
        queries: mx.array,
        keys: mx.array,
        values: mx.array,
        scale: float,
        mask: Any = None,
        sinks: mx.array | None = None,
    ) -> mx.array:
        """Attention of this step over our rows with our mask (and the model's, if it has one
        of its own), then compress if due."""
        n = queries.shape[2]
        keep = self.target()
        own = self._mask(queries, mask)
        kept = self.select(keep, scale) if self._prompt_pending(n, keep) else None
        if kept is not None:
            own = self._only(kept, queries, own)
        out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=own, sinks=sinks)
        self.observe(queries, keys, scale)
        if self.uses_queries:
            self._remember(queries)
        self._forget_issued_masks()
        if kept is not None:
            self.keep_rows(kept)
        elif self._due(n, keep):
            self.compress(keep, scale)
        return out

    def headroom(self, keep: int) -> int:
        """Decode rows allowed above the budget before compressing again (an eighth, 8 to 64)."""
        return min(self.max_headroom, max(8, keep // 8))

    def target(self) -> int:
        """Rows to keep now: the budget, but never fewer than the protected sink + window."""
        return max(self.budget.resolve(self.offset), self.sink + self.window)

    def compress(self, keep: int, scale: float) -> None:
        """Keep the rows :meth:`select` picks."""
        self.keep_rows(self.select(keep, scale))

    def keep_rows(self, index: mx.array) -> None:
        """Compact storage to the rows ``index`` (B, kv_heads, keep), ascending per head."""
        keep = index.shape[-1]
        self.evicted = self.evicted or keep < self.store.rows
        self.store.keep(index, self.headroom(keep))
        stats.totals.compressions += 1

    def protected(self, positions: mx.array) -> mx.array:
        """Rows never evicted: the first ``sink`` tokens and the last ``window`` tokens."""
        return (positions >= 0) & ((positions < self.sink) | (positions >= self.offset - self.window))

    # ----------------------------------------------------------------- helpers for methods
    def window_attention(self, keys: mx.array, positions: mx.array, scale: float) -> mx.array:
        """Attention mass each row gets from the remembered recent queries, (B, kv_heads, rows).

        The queries are those of the ``w`` tokens before ``queries_end``; a row is visible to a
        query when its position is not later (holes never), so rows stored since (the step that
        compresses an ``end``-mode prompt) get nothing. Summed over the query heads of each KV head
        (GQA). With no query remembered (a trim took the window, or a cache rebuilt without one) the
        newest rows score highest.
        """
        if self.queries is None:
            return positions.astype(mx.float32)
        b, hq, w, d = self.queries.shape
        hkv = keys.shape[1]
        q = self.queries.astype(mx.float32).reshape(b, hkv, hq // hkv, w, d) * scale
        logits = q @ mx.expand_dims(keys.astype(mx.float32), 2).swapaxes(-1, -2)
        visible = self._visible(positions, w, self.queries_end)[:, :, None]
        logits = mx.where(visible, logits, -mx.inf)
        return mx.softmax(logits, axis=-1).sum(axis=(2, 3))

    # ----------------------------------------------------------------- internals
    def _due(self, n: int, keep: int) -> bool:
        """Whether to compress after a step of ``n`` tokens (see the module docstring)."""
        if self.store.rows <= keep:
            return False
        room = self.headroom(keep)
        if n > room:  # a prefill chunk
            return self.mode == "chunk"
        return self.store.rows >= keep + room

    def _prompt_pending(self, n: int, keep: int) -> bool:
        """A decode-sized step arrives over a prompt left uncompressed (``end`` mode): the prompt
        is compressed as the paper does, before this step attends, scored by the prompt's window."""
        return n <= self.headroom(keep) and self.store.rows - n >= keep + self.headroom(keep)

    def _only(self, kept: mx.array, queries: mx.array, given: Any) -> mx.array:
        """``given`` restricted to the rows ``kept`` (B, kv_heads, keep) and this step's own rows.

        The step's keys came from the store before compression (or were derived from it by the
        model), so the rows about to go are masked instead of removed for this one step."""
        rows = self.store.rows
        n = queries.shape[2]
        keep = mx.zeros(kept.shape[:2] + (rows,), mx.bool_)
        keep = mx.put_along_axis(keep, kept, mx.array(True), axis=-1) | (mx.arange(rows) >= rows - n)
        keep = mx.repeat(keep, queries.shape[1] // keep.shape[1], axis=1)[:, :, None, :]
        return _combined(keep, given, rows, n)

    def _mask(self, queries: mx.array, given: Any) -> Any:
        """Our mask for this step, combined with the model's when it carries its own information."""
        n = queries.shape[2]
        own = self._position_mask(queries) if self.store.holes else (None if n == 1 else "causal")
        if not isinstance(given, mx.array) or self._issued(given):
            return own
        if own is None:
            return given
        return _combined(own, given, self.size(), n)

    def _visible(self, positions: mx.array, n: int, end: int | None = None) -> mx.array:
        """(B, kv_heads, n, rows): which rows the ``n`` tokens before ``end`` (default: the last ``n``
        seen) see: no hole, nothing in their future."""
        query_pos = (self.offset if end is None else end) - n + mx.arange(n)
        rows = positions[:, :, None, :]
        return (rows >= 0) & (rows <= query_pos[:, None])

    def _position_mask(self, queries: mx.array) -> mx.array:
        """(B, query heads, n, rows): :meth:`_visible` repeated over the query heads of each KV head."""
        positions = self.store.row_positions()
        visible = self._visible(positions, queries.shape[2])
        return mx.repeat(visible, queries.shape[1] // positions.shape[1], axis=1)

    def _depth(self) -> tuple[int, int]:
        """This layer's index among the served layers of the model and their number: over every rank's
        layers on a model split by pipeline (the coordinator's span), so depth-set choices match one
        process."""
        if self.coordinator is None:
            return 0, 1
        return self.coordinator.position(self), self.coordinator.layer_count()

    def _members(self) -> list["CompressedKVCache"]:
        """The caches of this cache's list in layer order (just this one without a coordinator)."""
        return self.coordinator.members if self.coordinator is not None else [self]

    def _issued(self, mask: mx.array) -> bool:
        """True if ``mask`` is one our caches handed the model (it carries nothing of its own)."""
        return any(mask is m.issued_mask for m in self._members())

    def _forget_issued_masks(self) -> None:
        """After the last layer of a forward has attended, drop the mask handed to the model for
        it: kept, a prefill chunk's mask (chunk x rows) would stay alive until the next forward."""
        members = self._members()
        if self is members[-1]:
            for member in members:
                member.issued_mask = None

    def _remember(self, queries: mx.array) -> None:
        """Keep a copy of the most recent ``window`` queries (the observation window).

        A copy, not a slice: a slice would keep the whole chunk's query tensor alive. After a
        prompt chunk the copy is scheduled at once (``async_eval``): left lazy, it would be computed
        only when the forward's results are, keeping every layer's whole query tensor alive until
        then and raising the prompt's peak memory above mlx_lm's. Queries of a different width
        (models that attend in another space when decoding) start afresh.
        """
        window = self.remembered()
        old = self.queries
        if old is not None and queries.shape[2] < window and old.shape[-1] == queries.shape[-1]:
            queries = mx.concatenate([old, queries], axis=2)
        self.queries = mx.contiguous(queries[..., -window:, :])
        self.queries_end = self.offset
        if queries.shape[2] > window:
            mx.async_eval(self.queries)

    def remembered(self) -> int:
        """How many of the most recent queries to remember: the observation window."""
        return self.window


def _combined(visible: mx.array | str, given: Any, rows: int, n: int) -> Any:
    """Boolean ``visible`` (or ``"causal"``) combined with a mask ``given`` for ``n`` queries over
    ``rows`` rows: None, ``"causal"``, a boolean array, or an additive one (-inf where hidden)."""
    if isinstance(visible, str):
        visible = mx.arange(rows)[None] <= mx.arange(rows - n, rows)[:, None]
    if given is None:
        return visible
    if isinstance(given, str):
        given = mx.arange(rows)[None] <= mx.arange(rows - n, rows)[:, None]
    if given.dtype == mx.bool_:
        return visible & given
    return mx.where(visible, given, mx.array(-mx.inf, given.dtype))
