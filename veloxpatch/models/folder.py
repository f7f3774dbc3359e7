"""Write a GGUF file out as an mlx_lm model folder, all or nothing.

Written under a temporary name and renamed at the end, so an interrupted conversion never looks finished.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import mlx.core as mx

from .gguf import convert
from .gguf_read import read_gguf
from .gguf_tokenizer import write_tokenizer

# Written last: its presence marks a complete folder.
WEIGHTS_FILE = "model.safetensors"


def is_complete(folder: Path) -> bool:
    """Whether ``folder`` holds a finished conversion (config, tokenizer and weights)."""
    names = ("config.json", "tokenizer.json", "tokenizer_config.json", WEIGHTS_FILE)
    return all((folder / name).is_file() for name in names)


def write_folder(gguf_path: Path, target: Path, quantized: bool = False) -> Path:
    """Convert ``gguf_path`` into ``target`` (reused if already complete); returns ``target``."""
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    staging.chmod(0o755)  # mkdtemp's 0700 would make the shared cache folder private
    try:
        weights, metadata = read_gguf(gguf_path)
        converted, config = convert(weights, metadata, quantized=quantized)
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        write_tokenizer(metadata, staging)
        mx.save_safetensors(str(staging / WEIGHTS_FILE), converted, metadata={"format": "mlx"})
        if target.exists():  # an earlier, incomplete attempt
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
