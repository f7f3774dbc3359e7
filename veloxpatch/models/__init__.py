"""Real models for ``veloxpatch fetch-model``: a pinned download, converted to an mlx_lm folder."""

from __future__ import annotations

from .download import DownloadError, cache_root
from .fetch import ModelSpec, fetch_model
from .gemma3 import GEMMA3
from .gguf_arch import GGUFError
from .qwen2_5 import QWEN2_5_0_5B, QWEN2_5_1_5B
from .smollm2 import SMOLLM2

MODELS: dict[str, ModelSpec] = {spec.name: spec for spec in (SMOLLM2, GEMMA3, QWEN2_5_0_5B, QWEN2_5_1_5B)}

__all__ = ["MODELS", "DownloadError", "GGUFError", "ModelSpec", "cache_root", "fetch_model"]
