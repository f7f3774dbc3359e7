"""Real models for ``veloxpatch fetch-model``: a pinned download, converted to an mlx_lm folder."""

from __future__ import annotations

from .catalog import MODELS
from .download import DownloadError, cache_root
from .fetch import ModelSpec, fetch_model
from .gguf_arch import GGUFError

__all__ = ["MODELS", "DownloadError", "GGUFError", "ModelSpec", "cache_root", "fetch_model"]
