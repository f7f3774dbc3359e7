"""One layer of mlx_lm's batched generation over caches that each stay their own sequence's.

mlx_lm merges a batch's caches into one with a shared layout (left padding, one mask); ours keep each sequence's own
rows, positions and budget. So a :class:`SequenceBatch` (one per layer) keeps the sequences' caches side by side and
runs per sequence only the part of a forward that touches a cache: each stores its slice of the step (up to its own
length where mlx_lm right-pads) and attends with its own queries, exactly as alone. A member may also be mlx_lm's
plain ``KVCache`` (a sequence that asked for no method), attended in blocks of queries as ours (:mod:`.blocks`).
"""

from __future__ import annotations

import copy
import weakref
from typing import Any, cast

import mlx.core as mx

from . import blocks, masks

_COPIES: weakref.WeakKeyDictionary[Any, dict[int, Any]] = weakref.WeakKeyDictionary()
"""Per coordinator, its members' copies from the latest :meth:`SequenceBatch.extract`: mlx_lm extracts layer by
layer, and every layer's copy must come from one copy of the whole list (its layers share the coordinator)."""


class SequenceBatch:
    """A batch cache (one layer) holding each sequence's own cache: see the module doc."""

    def __init__(self, members: list[Any]) -> None:
        self.members = list(members)
        self._lengths: list[int] | None = None
        self._fetched: list[tuple[mx.array, mx.array] | None] = []

    # ----------------------------------------------------------------- joining and leaving
    @classmethod
    def merge(cls, caches: list[Any]) -> SequenceBatch:
        """The batch of ``caches`` (one layer, one per sequence), as mlx_lm merges a prefill group: compressed caches
        of ours, or plain ``KVCache`` the integration marked ``batch_plain``."""
        for cache in caches:
            if not (hasattr(cache, "attend") or getattr(cache, "batch_plain", False)):
                raise ValueError(f"a batch of compressed caches cannot hold mlx_lm's {type(cache).__name__} in the "
                                 "same layer (a layer batches compressed caches with plain KVCache only)")
        return cls(list(caches))

    def extend(self, other: SequenceBatch) -> None:
        """Append ``other``'s sequences (mlx_lm joins a prefill group to the running batch so)."""
        if not isinstance(other, SequenceBatch):
            raise TypeError(f"a batch of compressed caches extends with another ({type(other).__name__} given)")
        self.members.extend(other.members)

    def filter(self, batch_indices: Any) -> None:
        """Keep the sequences at ``batch_indices``, in that order."""
        keep = cast(list[int], batch_indices.tolist()) if isinstance(batch_indices, mx.array) else list(batch_indices)
        self.members = [self.members[i] for i in keep]

    def extract(self, idx: int) -> Any:
        """A copy of sequence ``idx``'s cache: the caller may keep it while the sequence goes on in the batch."""
        member = self.members[idx]
        coordinator = getattr(member, "coordinator", None)
        if coordinator is None:
            return copy.deepcopy(member)
        if member is coordinator.members[0] or id(member) not in _COPIES.get(coordinator, {}):
            memo: dict[int, Any] = {}
            copy.deepcopy(member, memo)
            # only the copies: deepcopy's memo also keeps every original alive (the coordinator, this dict's key)
            _COPIES[coordinator] = {id(m): memo[id(m)] for m in coordinator.members if id(m) in memo}
        return _COPIES[coordinator][id(member)]

    # ----------------------------------------------------------------- a step
    def prepare(self, *, lengths: list[int] | None = None, right_padding: list[int] | None = None,
                left_padding: list[int] | None = None) -> None:
        """The next step is right-padded: sequence i brings ``lengths[i]`` real tokens."""
        if left_padding is not None and any(left_padding):
            raise ValueError("a batch of compressed caches takes right-padded steps only (left_padding given)")
        self._lengths = None if lengths is None else [int(n) for n in lengths]

    def finalize(self) -> None:
        """The padded step is over (mlx_lm rolls its padding out here; ours never stored any)."""
        self._lengths = None

    @property
    def offset(self) -> mx.array:
        """Each sequence's token count, where the model rotates its next token."""
        return mx.array([m.offset for m in self.members], dtype=mx.int32)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Each sequence stores its own slice of the step (:meth:`attend` attends over each one's own rows)."""
        self._fetched = [
            m.update_and_fetch(keys[i:i + 1, :, :n], values[i:i + 1, :, :n]) if n else None
            for i, (m, n) in enumerate(zip(self.members, self.step_lengths(keys.shape[2])))
        ]
        return keys, values

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any = None,
               sinks: mx.array | None = None) -> mx.array:
        """Each sequence's attention over its own rows with its own queries, padded back to the step."""
        steps = queries.shape[2]
        outputs = []
        for i, (member, n, rows) in enumerate(zip(self.members, self.step_lengths(steps), self._fetched)):
            out = mx.zeros((1, queries.shape[1], 0, values.shape[-1]), dtype=queries.dtype)
            if rows is not None:  # a plain member attends in blocks, as ours do
                attend = member.attend if hasattr(member, "attend") else blocks.attention
                out = attend(queries[i:i + 1, :, :n], *rows, scale=scale, mask=None if n == 1 else "causal",
                             sinks=sinks)
            if n < steps:
                out = mx.pad(out, [(0, 0), (0, 0), (0, steps - n), (0, 0)])
            outputs.append(out)
        self._fetched = []
        return mx.concatenate(outputs, axis=0)

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> Any:
        """Unused: each sequence's attention makes its own mask. A model insisting on an array gets a causal one."""
        if n == 1:
            return None
        if not return_array and window_size is None:
            return "causal"
        return masks.causal(n, n, window_size)

    def step_lengths(self, steps: int) -> list[int]:
        """The real tokens each sequence brings to a step of ``steps`` (fewer where mlx_lm right-pads it)."""
        return self._lengths if self._lengths is not None else [steps] * len(self.members)

    # ----------------------------------------------------------------- layer inputs and outputs
    @property
    def wants_layer_io(self) -> bool:
        return any(getattr(m, "wants_layer_io", False) for m in self.members)

    def tell(self, hook: str, *args: Any) -> None:
        """Hand each member that defines ``hook`` its own row of each argument, its real tokens."""
        steps = next(a.shape[1] for a in args if isinstance(a, mx.array))
        for i, (member, n) in enumerate(zip(self.members, self.step_lengths(steps))):
            own = getattr(member, hook, None)
            if n and own is not None and getattr(member, "wants_layer_io", False):
                own(*(a[i:i + 1, :n] if isinstance(a, mx.array) else a for a in args))

    # ----------------------------------------------------------------- what mlx_lm reads
    @property
    def state(self) -> list[Any]:
        """Every sequence's state (mlx_lm evaluates it after each step)."""
        return [m.state for m in self.members]

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.members)

    def size(self) -> int:
        return max((m.size() for m in self.members), default=0)

    def __len__(self) -> int:
        return self.size()

    def __bool__(self) -> bool:
        return True

    def empty(self) -> bool:
        return all(m.empty() for m in self.members)

    def is_trimmable(self) -> bool:
        return all(m.is_trimmable() for m in self.members)

    def trim(self, n: int) -> int:
        return min((m.trim(n) for m in self.members), default=0)

