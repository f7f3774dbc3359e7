"""The mlx_lm versions veloxpatch is tested with; outside them the shim passes through."""

from __future__ import annotations

import importlib.metadata
import re

TESTED_MLX_LM = ((0, 32, 0), (0, 33, 0))  # [low, high)
TESTED_RANGE_TEXT = ">=0.32.0,<0.33.0"


def mlx_lm_version() -> str | None:
    """Installed mlx-lm version, without importing it (None if not installed)."""
    try:
        return importlib.metadata.version("mlx-lm")
    except importlib.metadata.PackageNotFoundError:
        return None


def parse(version: str) -> tuple[int, ...]:
    """Leading numeric release parts: ``"0.32.2.dev1"`` -> (0, 32, 2)."""
    parts = []
    for piece in version.split(".")[:3]:
        match = re.match(r"\d+", piece)
        if not match:
            break
        parts.append(int(match.group()))
    return tuple(parts)


def is_tested(version: str | None) -> bool:
    """True if ``version`` lies in the tested range."""
    if version is None:
        return False
    low, high = TESTED_MLX_LM
    return low <= parse(version) < high
