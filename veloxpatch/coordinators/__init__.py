"""Cross-layer state for one cache list.

The builder makes one coordinator per list returned by ``make_prompt_cache`` and hands it to
every member cache. Single-layer methods only use it to be found and reset; cross-layer methods
(ChunkKV index reuse, xKV, SqueezeAttention, MiniCache, XQuant) subclass it to exchange
``mx.array``s between layers. Layers run in order within a forward pass, so a leader layer always
publishes before its followers read.
"""

from __future__ import annotations

from typing import Any


class Coordinator:
    """Shared by the veloxpatch caches of one cache list; reset at the start of each generation."""

    def __init__(self, method: str) -> None:
        self.method = method
        self.members: list[Any] = []
        self.generations = 0

    def join(self, cache: Any) -> None:
        """Register a member cache (in layer order)."""
        self.members.append(cache)

    def reset(self) -> None:
        """Forget per-generation cross-layer state; called when a generation starts."""
        self.generations += 1
