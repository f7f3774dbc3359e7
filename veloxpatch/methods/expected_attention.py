"""Expected Attention (Devoto et al., arXiv 2510.00636): keep the rows that the queries still to come are expected
to attend to, without knowing them.

A layer's queries, before the rotary embedding, are close to Gaussian; from the mean and variance of recent ones and
the rotation of the positions ahead, the attention a future query pays each row has a closed form: the softmax, over
the rows, of ``scale * mu . k + scale**2 / 2 * k' Sigma k``, with ``mu`` and ``Sigma`` the statistics rotated to the
next ``VELOX_EXPECTED_ATTENTION_FUTURE`` positions (the rotation averaged over them). Each row's score is that
expected attention, averaged over the query heads sharing its KV head, times its value's norm (a row moves the output
by its attention times its value). Nothing here reads the question: a prompt can be compressed before it comes, as a
chat or a server's reused prompt is (the question asked after, kvpress's protocol). Deviations, and why:

* The statistics are those of the cache's remembered queries (the last ``VELOX_WINDOW``, as SnapKV's window), not of
  every query of the prompt: what a cache keeps between steps stays bounded, and the window is what it remembers.
* ``Sigma`` is diagonal (each channel's variance), so a row's score costs two matmuls, not a ``d x d`` form per row.
* The rotation is the model's own rotary module applied to the identity (so every variant mlx_lm ships, scaled or
  not, is the right one); a module without one (or one whose call fails) leaves the statistics unrotated, said once.
* It loses needles KVzip's repeat score (``VELOX_KV=quant`` with ``VELOX_QUANT_KEEP``) keeps (docs/results.md, "Rows
  to drop before the question: the repeat score").
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from ..caches.evicting import EvictingCache, Policy
from ..log import once
from ..registry import method
from ..settings import Setting, int_range

KNOBS = (
    Setting("VELOX_EXPECTED_ATTENTION_FUTURE", int_range(1, 8192), "512", "an integer in [1, 8192]",
            "Expected Attention: how many positions after the newest token the expected query is averaged over."),
)


def rotations(rope: Any, first: int, count: int, width: int) -> mx.array:
    """The rotary module's linear maps at positions ``first`` .. ``first + count - 1``, (count, width, width): row
    ``i``, column ``j`` of map ``p`` is what input channel ``i`` becomes in output channel ``j`` (``x @ map``)."""
    identity = mx.broadcast_to(mx.eye(width, dtype=mx.float32)[None, :, None, :], (1, width, count, width))
    return rope(identity, offset=first)[0].swapaxes(0, 1)


def mean_ahead(rope: Any, end: int, future: int, width: int, base: mx.array | None = None) -> mx.array:
    """The mean of the module's maps at positions ``end`` .. ``end + future - 1``. With ``base``, the mean map of
    positions ``0`` .. ``future - 1``, it is the map at ``end`` times ``base`` (a rotation by ``end + t`` is one by
    ``end`` then one by ``t``; a scaled module's gain divided out once), two maps instead of ``future``: taken where
    that composition holds at the window's far end, else (a module whose frequencies move with the position, as
    dynamic NTK's) the mean of every map."""
    if base is not None:
        first = rotations(rope, end, 1, width)[0]
        gain = mx.sqrt((first * first).sum(axis=-1, keepdims=True))  # each input channel's gain (1 unscaled)
        far = rotations(rope, end + future - 1, 1, width)[0]
        if mx.allclose(first @ rotations(rope, future - 1, 1, width)[0] / gain, far, atol=1e-4).item():
            return first @ base / gain
    return rotations(rope, end, future, width).mean(axis=0)


def expected_logits(queries: mx.array, keys: mx.array, rope: Any, end: int, future: int, scale: float,
                    base: mx.array | None = None) -> mx.array:
    """The logits a future query is expected to give each row, (B, kv_heads, group, rows): ``queries`` (B, q_heads,
    n, d) at positions ``end - n`` .. ``end - 1`` rotated back, their mean and per-channel variance taken, then
    rotated by the mean map over the next ``future`` positions (``rope`` None: not rotated; ``base``: see
    :func:`mean_ahead`)."""
    b, hq, n, d = queries.shape
    q = queries.astype(mx.float32)
    ahead = mx.eye(d, dtype=mx.float32)
    if rope is not None:
        back = rotations(rope, end - n, n, d)  # (n, d, d): q_rotated = q_plain @ back[i]
        gain = (back[0] * back[0]).sum(axis=-1)  # each channel's squared gain (a scaled rotation's, else 1)
        q = mx.einsum("bhic,ijc->bhij", q, back) / gain
        ahead = mean_ahead(rope, end, future, d, base)
    mean, var = q.mean(axis=2), q.var(axis=2)  # (B, q_heads, d)
    hkv = keys.shape[1]
    seen = keys.astype(mx.float32) @ ahead.T  # (B, kv_heads, rows, d): each row's key in the plain query's frame
    mean, var = (x.reshape(b, hkv, hq // hkv, d) for x in (mean, var))
    return scale * (mean @ seen.swapaxes(-1, -2)) + 0.5 * scale * scale * (var @ (seen * seen).swapaxes(-1, -2))


@dataclass(eq=False)
class ExpectedAttention(Policy):
    """Ranks rows by the attention the next queries are expected to pay them, times their value's norm."""

    future: int = 512
    base: mx.array | None = field(default=None, init=False)  # the rotary module's mean map over 0 .. future - 1

    def score(self, cache: EvictingCache, keys: mx.array, positions: mx.array, scale: float) -> mx.array:
        """Expected attention over the stored rows (holes none), averaged over each KV head's query heads, times the
        value's norm; recency while no query is remembered (a trim took them back)."""
        memory = cache.memory
        if memory.queries is None or memory.queries.shape[-1] != keys.shape[-1]:
            return positions.astype(mx.float32)
        return self.rank(cache, keys, cache.store.fetch()[1], positions, scale)

    def rank(self, cache: Any, keys: mx.array, values: mx.array, positions: mx.array, scale: float) -> mx.array:
        """The score of rows ``keys``/``values`` at ``positions`` (-1: a hole, scored nothing) from ``cache``'s
        remembered queries (:meth:`expected`): this policy's, and ``quant``'s rows to keep under
        ``VELOX_QUANT_SCORE=expected``."""
        logits = mx.where((positions >= 0)[:, :, None], self.expected(cache, keys, scale), -mx.inf)
        norms = mx.linalg.norm(values.astype(mx.float32), axis=-1)
        return mx.softmax(logits, axis=-1).mean(axis=2) * norms

    def expected(self, cache: Any, keys: mx.array, scale: float) -> mx.array:
        """:func:`expected_logits` rotated by the layer's rotary module where the cache has seen its attention module
        and that has one the identity goes through; else unrotated (said once). ``cache``: any with remembered
        queries (``memory``) and ``module`` (a reference to its attention module, or None): ``quant`` uses it too."""
        memory = cache.memory
        assert memory.queries is not None, "scored with remembered queries"
        rope = getattr(None if cache.module is None else cache.module(), "rope", None)
        if rope is not None:
            try:
                if self.base is None:
                    self.base = rotations(rope, 0, self.future, keys.shape[-1]).mean(axis=0)
                return expected_logits(memory.queries, keys, rope, memory.end, self.future, scale, self.base)
            except Exception as error:  # a rotary module whose call this does not fit (a model's own signature)
                name = type(rope).__name__
                once(f"expected_attention {name}", logging.INFO, f"expected_attention: the rotary module {name} "
                     f"does not take the identity ({error!r}); the query statistics stay unrotated")
        return expected_logits(memory.queries, keys, None, memory.end, self.future, scale)


@method("expected_attention", "Attention expected from future queries (their statistics, rotated ahead), times the "
        "value's norm; top-k per KV head; reads no question.", KNOBS)
class ExpectedAttentionCache(EvictingCache):
    """Expected Attention's cache (:class:`ExpectedAttention`); it sees the layer's rotary module at every step."""

    policy_class = ExpectedAttention
    wants_layer_io = True
    module: weakref.ref | None = None  # the attention module, from the first step on

    def see_attention_input(self, normed: mx.array, module: Any) -> None:
        """Remember the attention module (its rotary embedding rotates the query statistics)."""
        self.module = weakref.ref(module)
