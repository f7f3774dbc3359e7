"""Bundled assets: the small llama trained by ``train/train.py`` for long-context quality evaluation."""

from __future__ import annotations

from pathlib import Path


def model_path() -> Path:
    """Folder of the shipped model (load with ``mlx_lm.load(str(model_path()))``; works offline)."""
    return Path(__file__).resolve().parent / "model"
