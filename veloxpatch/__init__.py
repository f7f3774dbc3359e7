"""veloxpatch: compressed KV caches for unmodified mlx_lm applications.

    import veloxpatch
    veloxpatch.patch(kv="snapkv", budget=1024)   # or VeloxConfig(...), or the VELOX_* environment

The heavy parts load on first use of these names, so the bootstrap imports the package cheaply in every process.
"""

from __future__ import annotations

from typing import Any

from ._version import __version__

_LAZY = {**dict.fromkeys(("patch", "unpatch", "is_patched", "active_config"), "veloxpatch.integration"),
         **dict.fromkeys(("VeloxConfig", "ConfigError"), "veloxpatch.config")}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'veloxpatch' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_LAZY[name]), name)
