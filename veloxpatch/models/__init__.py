"""Real models for ``veloxpatch fetch-model``: a pinned download, converted to an mlx_lm folder."""

from .catalog import MODELS
from .fetch import DownloadError, ModelSpec, cache_root, fetch_model
from .gguf_arch import GGUFError

__all__ = ["MODELS", "DownloadError", "GGUFError", "ModelSpec", "cache_root", "fetch_model"]
