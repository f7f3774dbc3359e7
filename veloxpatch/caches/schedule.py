"""When a cache compresses (``VELOX_COMPRESS``), and how many decode rows it lets gather first.

A step of more than ``headroom`` tokens is a prompt chunk. ``chunk`` compresses after each; ``end`` has the first
decode-sized step compress the pending prompt before it attends (SnapKV's one-shot mode). In decode a cache
compresses at budget + headroom rows, so the copy a compression costs is amortised.
"""

from __future__ import annotations

from typing import ClassVar


class Schedule:
    """The compression schedule of one cache, in ``mode`` (``end`` or ``chunk``)."""

    max_headroom: ClassVar[int] = 64

    def __init__(self, mode: str = "end") -> None:
        self.mode = mode

    def headroom(self, keep: int) -> int:
        """Decode rows allowed above a budget of ``keep`` before compressing again (an eighth, 8 to 64)."""
        return min(self.max_headroom, max(8, keep // 8))

    def decode_sized(self, n: int) -> bool:
        """Whether a step of ``n`` tokens is decode-sized under any budget (at most the largest headroom)."""
        return n <= self.max_headroom

    def due(self, rows: int, keep: int, chunk: bool) -> bool:
        """Whether a cache holding ``rows`` rows compresses to ``keep`` after a step (``chunk``: a prompt chunk)."""
        if rows <= keep:
            return False
        if chunk:
            return self.mode == "chunk"
        return rows >= keep + self.headroom(keep)

    def pending(self, rows: int, n: int, keep: int) -> bool:
        """Whether a decode-sized step of ``n`` tokens arrives over a prompt left uncompressed (``end`` mode)."""
        return n <= self.headroom(keep) and rows - n >= keep + self.headroom(keep)

    def folds(self, n: int) -> bool:
        """Whether a cross-layer cache may fold rows after a step of ``n`` tokens (``end``: decode-sized ones)."""
        return self.mode == "chunk" or self.decode_sized(n)
