"""What is patched right now: the active config and every attribute swapped, for exact undo."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from ..config import VeloxConfig


@dataclass
class Swap:
    """One function replaced in mlx_lm: the original and our replacement, bound on ``owner`` (a class)
    or, when that is None, at every module-level binding of ``name``."""

    name: str
    original: Any
    replacement: Any
    owner: Any = None


@dataclass
class PatchState:
    lock: threading.RLock = field(default_factory=threading.RLock)
    config: VeloxConfig | None = None
    swaps: dict[str, Swap] = field(default_factory=dict)
    hooks_registered: bool = False
    stats_registered: bool = False

    @property
    def active(self) -> bool:
        return self.config is not None


STATE = PatchState()
