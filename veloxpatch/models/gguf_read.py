"""Read a GGUF file as ``mx.load(path, return_metadata=True)`` returns it, whatever its tensor types.

mlx keeps Q4_0, Q4_1 and Q8_0 blocks quantized, refuses Q5_0/Q5_1, and dequantizes K-quants to float16, wrongly for
Q4_K (docs/models.md, "The yardstick's models"). So mlx reads a file only where it keeps every tensor as it is;
otherwise llama.cpp's optional package ``gguf`` reads it, dequantized to float32. Without it, such a file is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx

from .gguf_arch import GGUFError

INSTALL = "pip install 'veloxpatch[gguf]'"
MLX_KEEPS = frozenset({"F32", "F16", "Q4_0", "Q4_1", "Q8_0"})  # tensor types mx.load returns as the file has them


def read_gguf(path: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """The file's tensors (quantized triples where mlx reads them, else dense float32) and metadata."""
    try:
        from gguf import GGUFReader
    except ImportError:
        return _read_with_mlx_alone(path)
    if {t.tensor_type.name for t in GGUFReader(str(path)).tensors} <= MLX_KEEPS:
        return _mlx_load(path)
    return read_with_gguf(path)


def _mlx_load(path: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    loaded = mx.load(str(path), return_metadata=True)
    assert isinstance(loaded, tuple), "mx.load returns (weights, metadata) with return_metadata"
    return loaded[0], loaded[1]


def _read_with_mlx_alone(path: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """Without the ``gguf`` package: mlx's reading, where it cannot be wrong."""
    try:
        weights, metadata = _mlx_load(path)
    except (RuntimeError, ValueError) as error:
        raise GGUFError(f"{path} has tensor types mlx cannot read ({error}); the gguf package can: {INSTALL}") from None
    if any(w.dtype == mx.float16 for w in weights.values()):
        raise GGUFError(f"{path} has float16 or K-quant tensors, which mlx returns alike, and some K-quants (Q4_K) "
                        f"wrongly; the gguf package reads them exactly: {INSTALL}")
    return weights, metadata


def read_with_gguf(path: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """Every tensor dequantized to float32 and the metadata, through the ``gguf`` package."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    weights = {t.name: mx.array(dequantize(t.data, t.tensor_type)) for t in reader.tensors}
    metadata = {name: _value(field) for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    return weights, metadata


def _value(field: Any) -> Any:
    """A metadata field as mx.load gives it: strings and string lists as they are, numbers as mx arrays."""
    from gguf import GGUFValueType

    value = field.contents()
    kind = field.types[-1]
    if kind == GGUFValueType.STRING:
        return value
    if kind == GGUFValueType.BOOL:
        return mx.array(value, dtype=mx.bool_)
    return mx.array(value, dtype=mx.float32 if kind in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64) else mx.int64)
