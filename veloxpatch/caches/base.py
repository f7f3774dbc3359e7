"""The shared base of veloxpatch's compressed KV caches.

A method only says how important each stored row is (:meth:`CompressedKVCache.score`); the base
keeps the contracts every cache shares (see DESIGN.md):

* ``offset`` counts the tokens the layer has seen (mlx_lm rotates queries and keys with it);
  ``rows`` counts what is stored. Rows stay in temporal order per head and keep their rotation.
* Attention for our caches is routed here (:meth:`attend`) with the real queries, and the cache
  supplies the mask for its own rows: every kept row is in the past, so a lower-right aligned
  causal mask is right for kept + new rows under any chunking.
* Compression runs after a step's attention, so the step itself saw everything; during a chunked
  prefill the rows never exceed ``budget + chunk``, and in decode ``budget + headroom`` (an
  eighth of the budget, 8 to 64 rows), so the copy a compression costs is amortised.
* Storage is preallocated and grown in steps like mlx_lm's ``KVCache``; until a cache evicts,
  its arrays and attention calls are exactly those of ``KVCache``, so outputs are identical.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import mlx.core as mx

from .. import stats
from ..config import Budget
from ..coordinators import Coordinator


class CompressedKVCache(ABC):
    """A per-layer KV cache that keeps at most a budget of rows, chosen by :meth:`score`.

    Deliberately has no ``merge``, ``to_quantized`` or ``bits``: mlx_lm would otherwise batch,
    quantize or re-route it as one of its own caches.
    """

    method: ClassVar[str] = ""
    step: ClassVar[int] = 256
    max_headroom: ClassVar[int] = 64
    uses_queries: ClassVar[bool] = True

    def __init__(self, budget: Budget, sink: int = 4, window: int = 32) -> None:
        self.budget = budget
        self.sink = sink
        self.window = window
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.queries: mx.array | None = None
        self.offset = 0
        self.rows = 0
        self.tail = 0
        self.evicted = False
        self.coordinator: Coordinator | None = None
        stats.track(self)

    # ----------------------------------------------------------------- what a method provides
    @abstractmethod
    def score(self, keys: mx.array, scale: float) -> mx.array:
        """Importance of each stored row, shape (B, kv_heads, rows); higher is kept."""

    def knob_values(self) -> dict[str, Any]:
        """The method's own knobs, saved with the cache so it loads back the same."""
        return {}

    # ----------------------------------------------------------------- mlx_lm cache protocol
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append new rows (already rotated at ``offset``) and return every stored row."""
        n = keys.shape[2]
        self._reserve(n, keys, values)
        self.keys[..., self.rows : self.rows + n, :] = keys
        self.values[..., self.rows : self.rows + n, :] = values
        self.rows += n
        self.offset += n
        self.tail += n
        return self._stored()

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> Any:
        """The mask a model asks for before this step: causal over our own rows, as KVCache does."""
        if window_size is None and n == 1:
            return None
        if window_size is None and not return_array:
            return "causal"
        rows = mx.arange(self.rows + n)
        query_rows = mx.arange(self.rows, self.rows + n)[:, None]
        mask = query_rows >= rows[None]
        if window_size is not None:
            mask = mask & (query_rows < rows[None] + window_size)
        return mask

    def size(self) -> int:
        return self.rows

    def empty(self) -> bool:
        return self.keys is None

    def is_trimmable(self) -> bool:
        """Only a cache that has evicted nothing can be trimmed by any amount exactly."""
        return not self.evicted

    def trim(self, n: int) -> int:
        """Drop the last ``n`` tokens if they are exactly the last stored rows; else refuse (0)."""
        n = min(n, self.offset)
        if n > self.tail:
            return 0
        self.rows -= n
        self.offset -= n
        self.tail -= n
        if self.queries is not None:
            kept = self.queries.shape[2] - n
            self.queries = self.queries[..., :kept, :] if kept > 0 else None
        return n

    @property
    def nbytes(self) -> int:
        """Physical bytes held: key/value storage (with unused capacity) and remembered queries."""
        arrays = (self.keys, self.values, self.queries)
        return sum(a.nbytes for a in arrays if a is not None)

    def dense_nbytes(self) -> int:
        """Bytes a plain KVCache would need for the same tokens (for statistics)."""
        if self.keys is None:
            return 0
        b, h, _, dk = self.keys.shape
        return self.offset * b * h * (dk + self.values.shape[-1]) * self.keys.itemsize

    @property
    def meta_state(self) -> str:
        """Scalars and settings as one JSON string (mlx_lm saves strings in prompt-cache files)."""
        return json.dumps({
            "offset": self.offset, "rows": self.rows, "tail": self.tail, "evicted": self.evicted,
            "budget": str(self.budget), "sink": self.sink, "window": self.window,
            "knobs": self.knob_values(),
        })

    @property
    def state(self) -> tuple[Any, ...]:
        """Stored rows (without spare capacity), remembered queries and :attr:`meta_state`."""
        if self.keys is None:
            return None, None, None, self.meta_state
        keys, values = self._stored()
        return keys, values, self.queries, self.meta_state

    @state.setter
    def state(self, value: tuple[Any, ...]) -> None:
        keys, values, queries, meta = value
        info = json.loads(meta)
        self.keys, self.values, self.queries = keys, values, queries
        self.offset, self.rows, self.tail = info["offset"], info["rows"], info["tail"]
        self.evicted = info["evicted"]

    @classmethod
    def from_state(cls, state: tuple[Any, ...]) -> "CompressedKVCache":
        """Rebuild a cache saved with ``save_prompt_cache`` (mlx_lm looks the class up by name)."""
        info = json.loads(state[-1])
        cache = cls(Budget.parse(info["budget"]), info["sink"], info["window"], **info["knobs"])
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
        """Attention of this step over our rows (our mask, not the model's), then compress."""
        n = queries.shape[2]
        out = mx.fast.scaled_dot_product_attention(
            queries, keys, values, scale=scale, mask=None if n == 1 else "causal", sinks=sinks
        )
        if self.uses_queries:
            self._remember(queries)
        keep = self.target()
        if self.rows > keep and (n > 1 or self.rows >= keep + self.headroom(keep)):
            self.compress(keep, scale)
        return out

    def headroom(self, keep: int) -> int:
        """Decode rows allowed above the budget before compressing again (an eighth, 8 to 64)."""
        return min(self.max_headroom, max(8, keep // 8))

    def target(self) -> int:
        """Rows to keep now: the budget, but never fewer than the protected sink + window."""
        return max(self.budget.resolve(self.offset), self.sink + self.window)

    def compress(self, keep: int, scale: float) -> None:
        """Keep the ``keep`` best rows per head (sink and recent window always), in time order."""
        keys, values = self._stored()
        scores = self._protect(self.score(keys, scale).astype(mx.float32))
        order = mx.argpartition(-scores, kth=keep - 1, axis=-1)[..., :keep]
        self.keep_rows(mx.sort(order, axis=-1))

    def keep_rows(self, index: mx.array) -> None:
        """Compact storage to the rows ``index`` (B, kv_heads, keep), ascending per head."""
        keep = index.shape[-1]
        keys, values = self._stored()
        idx = index[..., None]
        spare = self.headroom(keep)
        self.keys = self._with_spare(mx.take_along_axis(keys, idx, axis=2), spare)
        self.values = self._with_spare(mx.take_along_axis(values, idx, axis=2), spare)
        self.tail = min(self.tail, self.window) if keep < self.rows else self.tail
        self.evicted = self.evicted or keep < self.rows
        self.rows = keep
        stats.totals.compressions += 1

    # ----------------------------------------------------------------- helpers for methods
    def window_attention(self, keys: mx.array, scale: float) -> mx.array:
        """Attention mass each row gets from the remembered recent queries, (B, kv_heads, rows).

        The queries are the last ``w`` tokens, whose own keys are the last ``w`` rows, so the
        causal mask is lower-right aligned. Summed over the query heads of each KV head (GQA).
        """
        b, hq, w, d = self.queries.shape
        hkv, rows = keys.shape[1], keys.shape[2]
        q = self.queries.astype(mx.float32).reshape(b, hkv, hq // hkv, w, d) * scale
        logits = q @ mx.expand_dims(keys.astype(mx.float32), 2).swapaxes(-1, -2)
        visible = mx.arange(rows)[None] <= (rows - w + mx.arange(w))[:, None]
        logits = mx.where(visible, logits, -mx.inf)
        return mx.softmax(logits, axis=-1).sum(axis=(2, 3))

    # ----------------------------------------------------------------- internals
    def _stored(self) -> tuple[mx.array, mx.array]:
        if self.rows < self.keys.shape[2]:
            return self.keys[..., : self.rows, :], self.values[..., : self.rows, :]
        return self.keys, self.values

    def _reserve(self, n: int, keys: mx.array, values: mx.array) -> None:
        """Make room for ``n`` more rows, growing in whole steps as KVCache does."""
        if self.keys is not None and self.rows + n <= self.keys.shape[2]:
            return
        grow = (n + self.step - 1) // self.step * self.step
        b, h, _, dk = keys.shape
        new_k = mx.zeros((b, h, grow, dk), keys.dtype)
        new_v = mx.zeros((b, h, grow, values.shape[3]), values.dtype)
        if self.keys is None:
            self.keys, self.values = new_k, new_v
            return
        old_k, old_v = self._stored()
        self.keys = mx.concatenate([old_k, new_k], axis=2)
        self.values = mx.concatenate([old_v, new_v], axis=2)

    @staticmethod
    def _with_spare(kept: mx.array, spare: int) -> mx.array:
        b, h, _, d = kept.shape
        return mx.concatenate([kept, mx.zeros((b, h, spare, d), kept.dtype)], axis=2)

    def _remember(self, queries: mx.array) -> None:
        """Keep the most recent ``window`` queries (the observation window)."""
        if self.queries is not None and queries.shape[2] < self.window:
            queries = mx.concatenate([self.queries, queries], axis=2)
        self.queries = queries[..., -self.window :, :]

    def _protect(self, scores: mx.array) -> mx.array:
        """Make the first ``sink`` rows and the last ``window`` rows unevictable."""
        rows = scores.shape[-1]
        index = mx.arange(rows)
        protected = (index < self.sink) | (index >= rows - self.window)
        return mx.where(protected, mx.inf, scores)
