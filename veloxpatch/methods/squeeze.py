"""SqueezeAttention (Wang et al., arXiv 2404.04793): the budget moved between layers by how much
each layer's attention matters, with any method picking the rows inside a layer.

While the prompt is read each layer's importance is measured, the layers are clustered by it into three groups
(k-means), and the group whose attention matters least keeps a fraction ``p = 1 - VELOX_SQUEEZE_STRENGTH`` of its
budget, the others sharing the rest evenly, so the list holds as many rows as with a uniform budget. The policy
inside each layer is any method registered with ``policy=True``, its scores, state and knobs unchanged (as kvpress's
wrapper presses take an inner press). Deviations, and why:

* The signal: ``cosine`` (:func:`attention_change`) takes ``h`` and ``o`` from
  :mod:`veloxpatch.integration.layer_io`; a chunk without them reports ``entropy`` (:meth:`SqueezeCache.dispersion`),
  said once: a proxy that needs no hook, as attention parked on a few rows changes the hidden state little. With
  Gemma's sandwich norm ``h + o`` is the paper's formula, not the block's next hidden state.
* When. Every prompt chunk reports, accumulating over the prompt; the first decode-sized step after one ends
  reporting, so decode runs on a schedule fixed by the prompt. It is recomputed at most once per forward: in
  ``chunk`` mode the first chunk compresses with uniform budgets, later chunks with the schedule so far.
* The clustering is exact 1-D k-means (the best split of the sorted scores into three runs): deterministic.
* ``p`` applies to the budget above ``VELOX_SINK + VELOX_WINDOW``, as in :mod:`.pyramidkv`; no layer gets more rows
  than the tokens it has seen (the rest goes to the others); budgets sum to exactly layers x budget.
* What is frozen is each layer's share, not a number of rows: a percentage budget keeps growing with the context.
* A list where some layer never reports runs on uniform budgets, said once; a prompt too short to report keeps the
  shares it had (saved with each cache, kept by a continued sequence such as a chat's next turn), or uniform ones.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import Any, cast

import mlx.core as mx

from ..caches.evicting import EvictingCache, Policy
from ..caches.masks import visible
from ..caches.spec import CacheSpec
from ..coordinators import Coordinator, Span, members_of
from ..log import once
from ..registry import cache_class, method, policies
from ..settings import Setting, choice, number_range

SIGNALS = ("cosine", "entropy")
GROUPS = 3  # the paper's k-means clusters


KNOBS = (
    Setting("VELOX_SQUEEZE_POLICY", choice(policies), "snapkv", lambda: "one of " + ", ".join(policies()),
            "SqueezeAttention: the method that picks the rows inside each layer."),
    Setting("VELOX_SQUEEZE_STRENGTH", number_range(0, 1), "0.5", "a number in [0, 1]",
            "SqueezeAttention: the part of its budget above sink + window that the least important group of "
            "layers gives to the others (the paper's 1 - p; 0: uniform)."),
    Setting("VELOX_SQUEEZE_SIGNAL", choice(SIGNALS), "cosine", "one of " + ", ".join(SIGNALS),
            "SqueezeAttention: how a layer's importance is measured: `cosine` (the paper's: how much self-attention "
            "changes the hidden state) or `entropy` (how widely its attention spreads over the rows)."),
)


def kmeans_1d(values: Sequence[float], groups: int) -> list[int]:
    """Exact 1-D k-means: each value's group, numbered by ascending mean, for the split of the sorted
    values into ``groups`` runs with the least within-group sum of squares (the first on a tie)."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranked = [values[i] for i in order]
    sums = list(itertools.accumulate(ranked, initial=0.0))
    squares = list(itertools.accumulate((v * v for v in ranked), initial=0.0))

    def cost(a: int, b: int) -> float:
        return squares[b] - squares[a] - (sums[b] - sums[a]) ** 2 / (b - a)

    def total(cuts: tuple[int, ...]) -> float:
        bounds = (0, *cuts, len(ranked))
        return sum(cost(a, b) for a, b in itertools.pairwise(bounds))

    best = min(itertools.combinations(range(1, len(ranked)), groups - 1), key=total)
    labels = [0] * len(values)
    for group, (a, b) in enumerate(itertools.pairwise((0, *best, len(ranked)))):
        for i in order[a:b]:
            labels[i] = group
    return labels


def attention_change(hidden: mx.array, output: mx.array) -> mx.array:
    """The paper's signal as an importance (scalar): 1 - the cosine similarity of each token's block input h
    (``hidden``) and h + ``output``, averaged over the tokens and the batch."""
    before = hidden.astype(mx.float32)
    after = before + output.astype(mx.float32)
    norms = mx.linalg.norm(before, axis=-1) * mx.linalg.norm(after, axis=-1)
    return 1 - ((before * after).sum(axis=-1) / mx.maximum(norms, 1e-30)).mean()


def squeeze_shares(importance: Sequence[float], strength: float) -> tuple[float, ...]:
    """Each layer's share of the budget (mean 1): the least important k-means group gets ``1 - strength``, the
    others evenly what it gives up; uniform when nothing tells layers apart."""
    layers = len(importance)
    if strength == 0 or layers < 2 or max(importance) - min(importance) <= 0:
        return (1.0,) * layers
    squeezed = [label == 0 for label in kmeans_1d(importance, min(GROUPS, layers))]
    count = sum(squeezed)
    raised = 1 + strength * count / (layers - count)
    return tuple(1 - strength if low else raised for low in squeezed)


class SqueezeCoordinator(Coordinator):
    """Collects each layer's importance over the prompt and sets the members' shares from it."""

    def __init__(self, method: str, span: Span = Span()) -> None:
        super().__init__(method, span)
        self.reports: dict[int, tuple[mx.array, int]] = {}  # layer -> (sum of chunk scores, chunks)
        self.closed = False  # decoding has started: the prompt's reports are all in
        self.stale = False  # reports arrived since the shares were set
        self.considered = -1  # the forward whose first layer last looked at the reports
        self.pooled_shares: tuple[float, ...] | None = None  # every served layer's, from the last allocation

    def reset(self) -> None:
        """A new sequence: forget the reports; members that hold no rows forget their shares."""
        super().reset()
        self.reports.clear()
        self.closed = self.stale = False
        self.considered = -1
        self.pooled_shares = None
        for member in self.members:
            if member.offset == 0:
                member.share = None

    def report(self, cache: Any, score: mx.array) -> None:
        """A prompt chunk's importance for ``cache``'s layer (ignored once decoding has started)."""
        if self.closed:
            return
        total, chunks = self.reports.get(cache.layer, (0.0, 0))
        self.reports[cache.layer] = (total + score, chunks + 1)
        self.stale = True

    def close(self) -> None:
        """A decode-sized step: once a prompt chunk has reported, the schedule stays as the prompt set it."""
        self.closed = self.closed or bool(self.reports)

    def schedule(self) -> tuple[float, ...] | None:
        """The members' shares (None while any is unset), set from new reports once per forward."""
        if self.considered != self.step:
            self.considered = self.step
            if self.stale:
                self._allocate()
        return self.pooled_shares or shares_of(self.members)  # (only _allocate changes them within a forward)

    def _allocate(self) -> None:
        """Set every member's share from every layer's reports (pooled over ranks); none if some layer has not."""
        self.stale = False
        if not self.members:
            return
        means = self.pooled({layer: total / chunks for layer, (total, chunks) in self.reports.items()})
        missing = means.count(None)
        self.pooled_shares = None if missing else squeeze_shares(cast(list[float], means), self.members[0].strength)
        if missing:
            once("squeeze partial", logging.INFO,
                 f"squeeze: {missing} of {len(means)} layers report no prompt attention "
                 "(they do not attend through veloxpatch); their list runs on uniform budgets")
        for member in self.members:
            member.share = None if self.pooled_shares is None else self.pooled_shares[self.position(member)]


def shares_of(members: Sequence[Any]) -> tuple[float, ...] | None:
    """Every member's share, or None while any is unset (or the list has one member)."""
    shares = tuple(member.share for member in members)
    return None if len(shares) < 2 or None in shares else cast(tuple[float, ...], shares)


@method("squeeze", "Layer budgets set by how much each layer's attention changes the hidden state over the prompt "
        "(k-means groups); rows by a policy.", KNOBS, composes=lambda knobs: (knobs.get("squeeze_policy", "snapkv"),))
class SqueezeCache(EvictingCache):
    """Per-layer budgets from :class:`SqueezeCoordinator`; the rows are picked by the chosen method's policy."""

    coordinator_class = SqueezeCoordinator
    wants_layer_io = True  # the cosine signal compares the block input with the attention output
    budget_use = "VELOX_BUDGET is the rows it keeps per layer on average (moved between layers)."

    def __init__(self, spec: CacheSpec, policy: str = "snapkv",
                 strength: float = 0.5, signal: str = "cosine", share: float | None = None, **knobs: Any) -> None:
        self.policy_name = policy  # before the base makes the policy from it
        super().__init__(spec, **knobs)
        self.strength, self.signal = strength, signal
        self.share = share  # this layer's share of the budget (mean 1 over the list), None: not set
        self.block_input: mx.array | None = None  # this step's block input, until the attention output comes
        self.awaiting = False  # this step is a prompt chunk whose cosine report waits for the attention output

    def make_policy(self, **knobs: Any) -> Policy:
        """The policy of the method named by ``VELOX_SQUEEZE_POLICY``, with that method's knobs."""
        return cache_class(self.policy_name).policy_class(**knobs)

    def knob_values(self) -> dict[str, Any]:
        return {**super().knob_values(), "policy": self.policy_name, "strength": self.strength,
                "signal": self.signal, "share": self.share}

    def observe(self, queries: mx.array, keys: mx.array, scale: float) -> None:
        """The policy's hook; then a prompt chunk reports its importance (under ``cosine`` once the attention
        output is in, :meth:`see_attention`), and a decode-sized step ends reporting."""
        super().observe(queries, keys, scale)
        coordinator = self.coordinator
        if not isinstance(coordinator, SqueezeCoordinator):
            return
        if queries.shape[2] <= self.schedule.headroom(max(self.budget_rows(), self.sink + self.window)):
            coordinator.close()
        elif self.block_input is not None:
            self.awaiting = True
        else:
            if self.signal == "cosine":
                once("squeeze signal", logging.INFO,
                     "no layer input/output reached a squeeze cache for a prompt chunk (the model's attention modules "
                     "are not called with a `cache` argument, or the cache is driven directly): such chunks report "
                     "the entropy signal")
            self._report(self.dispersion(queries, keys, scale))

    def see_block_input(self, hidden: mx.array) -> None:
        """Under ``cosine``, keep the block input (h) until the attention output comes."""
        if self.signal == "cosine":
            self.block_input = hidden

    def see_attention(self, normed: mx.array, output: mx.array) -> None:
        """A prompt chunk waiting for the attention output reports :func:`attention_change`. The block input is let
        go at every step (kept, it would hold the step's activations alive)."""
        hidden, self.block_input = self.block_input, None
        if self.awaiting:
            assert hidden is not None, "awaiting: see_block_input kept this step's block input"
            self.awaiting = False
            self._report(attention_change(hidden, output))

    def dispersion(self, queries: mx.array, keys: mx.array, scale: float) -> mx.array:
        """How widely the step's last ``window`` queries spread their attention over the stored rows: entropy over
        the rows each sees over its most (log of their count), averaged (scalar)."""
        b, hq, n, d = queries.shape
        w = min(self.window, n)
        hkv = keys.shape[1]
        q = (queries[..., -w:, :].astype(mx.float32) * scale).reshape(b, hkv, hq // hkv, w, d)
        logits = q @ mx.expand_dims(keys.astype(mx.float32), 2).swapaxes(-1, -2)
        seen_rows = visible(self.store.row_positions(), w, self.offset)[:, :, None]
        probs = mx.softmax(mx.where(seen_rows, logits, -mx.inf), axis=-1, precise=True)
        entropy = -(probs * mx.log(mx.maximum(probs, 1e-30))).sum(axis=-1)
        seen = seen_rows.sum(axis=-1)
        return mx.where(seen > 1, entropy / mx.log(mx.maximum(seen, 2)), 0.0).mean()

    def _report(self, importance: mx.array) -> None:
        """Report a prompt chunk's importance, computed now (lazy, it would hold h and o, or queries and keys)."""
        mx.async_eval(importance)
        cast(SqueezeCoordinator, self.coordinator).report(self, importance)  # its coordinator_class

    def layer_weights(self) -> tuple[tuple[float, ...], int] | None:
        """The shares and this layer's index in them: every served layer's when the reports set them, the list's
        own when they came with the caches (a loaded list); None if this layer has none (the plain budget)."""
        coordinator = self.coordinator
        if isinstance(coordinator, SqueezeCoordinator):
            shares = coordinator.schedule()
            pooled = shares is not None and shares is coordinator.pooled_shares
            index = coordinator.position(self) if pooled else self.layer
        else:
            shares, index = shares_of(members_of(self)), self.layer
        return (shares, index) if shares is not None and index < len(shares) else None
