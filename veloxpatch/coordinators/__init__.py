"""Cross-layer state for one cache list.

The builder makes one coordinator per list returned by ``make_prompt_cache`` and hands it to every member cache, in
layer order (``cache.layer``); a method that shares state across layers names its class (``coordinator_class``).
Layers run in order within a forward, so an earlier member always runs before a later one: a leader publishes within
the forward and its followers read it (stamped with the forward's ``step``, so never a stale value), and a group's
joint step is a fan-in (:meth:`Coordinator.contribute`) that the last member to run completes, earlier members
picking the result up on their next call; nothing ever waits. On a model split across ranks each rank has its own
list and coordinator, whose :class:`Span` places it in the whole model.

A new sequence's cross-layer state is reset on two signals: a generation starts on the list (the integration resets
every coordinator of the list handed to ``generate_step``), which covers a reused list such as a chat's next turn;
and the first member receives rows at offset 0 (:meth:`Coordinator.on_update`), which covers loops that call the
model directly. The first member runs first in a forward, so nothing of the new forward has been published yet when
it resets (a later member at offset 0 would wipe the leader's publication).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx
from mlx.utils import tree_flatten


@dataclass(frozen=True)
class Span:
    """Where a cache list's members sit among the served layers of the whole model: ``first`` is the index of its
    first member, ``total`` their number over every rank; ``split``: whole-model values need a collective."""

    first: int = 0
    total: int | None = None
    split: bool = False
    tensor: Any = None  # the group sharing this list's layers by heads (tensor parallel), or None


class Coordinator:
    """Shared by the veloxpatch caches of one cache list; reset when a new sequence starts."""

    def __init__(self, method: str, span: Span = Span()) -> None:
        self.method = method
        self.members: list[Any] = []
        self.generations = 0
        self.step = 0  # forwards begun since the last reset
        self.fresh = False  # reset, and no member has received rows since
        self.published: dict[Any, tuple[int, Any]] = {}
        self.parts: dict[Hashable, dict[int, Any]] = {}  # fan-in: group -> layer -> contribution
        self.results: dict[Hashable, Any] = {}  # fan-in: group -> its joint result
        self.span = span  # the list's layers in the whole model (a model split across ranks: the builder's)

    def join(self, cache: Any) -> None:
        """Register a member cache (in layer order); it knows its coordinator and index from then on."""
        cache.layer = len(self.members)
        self.members.append(cache)
        cache.coordinator = self

    def replace(self, old: Any, new: Any) -> None:
        """``new`` takes ``old``'s place (and layer order), e.g. its quantized copy."""
        self.members = [new if m is old else m for m in self.members]
        new.coordinator = self

    def reset(self) -> None:
        """Forget per-generation cross-layer state; a new sequence or generation starts."""
        self.generations += 1
        self.fresh = True
        self.step = 0
        self.published.clear()
        self.parts.clear()
        self.results.clear()

    def on_update(self, cache: Any) -> None:
        """A member is about to store rows: on the first member a forward starts (``step``), and at offset 0 a new
        sequence (unless the generation start has just reset, ``fresh``)."""
        if self.members and cache is self.members[0]:
            if cache.offset == 0 and not self.fresh:
                self.reset()
            self.step += 1
        self.fresh = False

    def publish(self, topic: Any, value: Any) -> None:
        """Make ``value`` available under ``topic`` to the members that run later in this forward."""
        self.published[topic] = (self.step, value)

    def latest(self, topic: Any) -> Any:
        """What was published under ``topic`` in the current forward, or None (never a stale value)."""
        step, value = self.published.get(topic, (-1, None))
        return value if step == self.step else None

    # ----------------------------------------------------------------- depth over the whole model
    def position(self, cache: Any) -> int:
        """``cache``'s index among the served layers of the whole model (its list index on one process)."""
        return self.span.first + cache.layer

    def layer_count(self) -> int:
        """Served layers in the whole model: this list's members, or every rank's on a split model."""
        return len(self.members) if self.span.total is None else self.span.total

    def pooled(self, values: Mapping[int, mx.array | float]) -> list[float | None]:
        """Whole-model values per layer from this list's ``values`` (member index -> value), None where no rank had
        one. On a split model every rank calls this at the same point: one all-sum, each layer averaged over the
        ranks holding it."""
        sums = mx.zeros((2, self.layer_count()), dtype=mx.float32)
        if values:
            where = mx.array([self.span.first + layer for layer in values])
            sums[0, where] = mx.stack([mx.array(v, dtype=mx.float32) for v in values.values()])
            sums[1, where] = 1.0
        if self.span.split:
            drain_streams()
            sums = mx.distributed.all_sum(sums, stream=mx.cpu)
        totals, counts = cast(list[list[float]], sums.tolist())
        return [total / count if count else None for total, count in zip(totals, counts)]

    def head_mean(self, value: mx.array) -> mx.array:
        """``value``, a mean over this rank's heads, averaged over the ranks holding the layer's other heads (tensor
        parallel), so a whole-layer choice is the same on every rank. Called inside a forward, at the same layer
        and step on every rank."""
        group = self.span.tensor
        return value if group is None else mx.distributed.all_sum(value, group=group) / group.size()

    # ----------------------------------------------------------------- fan-in and joint steps
    def contribute(self, group: Hashable, member: Any, part: Any, layers: Sequence[int],
                   compute: Callable[[list[Any]], Any]) -> Any:
        """Add ``member``'s ``part`` to ``group`` (whose members are ``layers``); the contribution that completes it
        runs ``compute`` on the parts in layer order, once. Returns the joint result, or None while incomplete. A
        second contribution from the same member before completion replaces its first."""
        if group not in self.results:
            parts = self.parts.setdefault(group, {})
            parts[member.layer] = part
            if set(layers) <= set(parts):
                self.results[group] = compute([parts[layer] for layer in layers])
                del self.parts[group]
        return self.results.get(group)

    def joint(self, group: Hashable) -> Any:
        """``group``'s joint result (the same object for every member), or None if not complete yet."""
        return self.results.get(group)

    def missing(self, group: Hashable, layers: Sequence[int]) -> list[int]:
        """The layers of ``group`` that have not contributed (empty once it is complete)."""
        return [] if group in self.results else [layer for layer in layers if layer not in self.parts.get(group, {})]

    # ----------------------------------------------------------------- storage held for several layers
    def owned_nbytes(self, member: Any) -> int:
        """Bytes of the storage shared across layers that ``member`` is the first live holder of, so a sum over the
        list counts each shared array once, even after the layer that made it let go."""
        mine = {id(part): part for part in member.shared_parts()}
        if not mine:
            return 0
        for other in self.members:
            if other is member:
                break
            for part in other.shared_parts():
                mine.pop(id(part), None)
        return sum(a.nbytes for part in mine.values() for _, a in tree_flatten(part) if isinstance(a, mx.array))


def drain_streams() -> None:
    """Wait for the work in flight before a collective of ours: a step still running on mlx_lm's generation stream
    holds the model's collectives, which ours would pair with on the ring, swapping data between ranks."""
    mx.synchronize()
    stream = getattr(sys.modules.get("mlx_lm.generate"), "generation_stream", None)
    if stream is not None:
        mx.synchronize(stream)


def members_of(cache: Any) -> list[Any]:
    """The caches of ``cache``'s list in layer order (just ``cache`` without a coordinator)."""
    return cache.coordinator.members if cache.coordinator is not None else [cache]


def depth_of(cache: Any) -> tuple[int, int]:
    """``cache``'s index among the served layers of the model and their number (over every rank's layers)."""
    if cache.coordinator is None:
        return 0, 1
    return cache.coordinator.position(cache), cache.coordinator.layer_count()


def coordinators_of(caches: Any) -> list[Coordinator]:
    """Every distinct coordinator in a cache list, in list order (a server list holds main and draft caches);
    empty for any other object."""
    found: dict[int, Coordinator] = {}
    for cache in caches if isinstance(caches, (list, tuple)) else ():
        coordinator = getattr(cache, "coordinator", None)
        if isinstance(coordinator, Coordinator):
            found.setdefault(id(coordinator), coordinator)
    return list(found.values())
