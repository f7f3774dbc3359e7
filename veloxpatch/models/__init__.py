"""Real models for ``veloxpatch fetch-model``: a pinned download, converted to an mlx_lm folder."""

from __future__ import annotations

from .download import DownloadError, cache_root
from .fetch import ModelSpec, fetch_model, model_folder
from .smollm2 import SMOLLM2

MODELS: dict[str, ModelSpec] = {SMOLLM2.name: SMOLLM2}

__all__ = ["MODELS", "DownloadError", "ModelSpec", "cache_root", "fetch_model", "model_folder"]
