"""Read a GGUF file as ``mx.load(path, return_metadata=True)`` returns it, whatever its tensor types.

mlx reads GGUF's float and 4/8-bit block formats (Q4_0, Q4_1, Q8_0) itself, but not Q5_0/Q5_1 or
the K-quants (Q4_K, Q6_K, ...) that most published GGUF files mix in (Gemma 3 270M's Q4_K_M file
has all of them). For those, llama.cpp's own Python package ``gguf`` reads the file and dequantizes
every tensor to float32; its metadata is put in mlx's form (numbers as mx arrays, strings and
string lists as Python ones) so the converter reads either the same way. ``gguf`` is an optional
dependency: ``pip install 'veloxpatch[gguf]'``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx

from .gguf_arch import GGUFError

INSTALL = "pip install 'veloxpatch[gguf]'"


def read_gguf(path: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """The file's tensors (quantized triples where mlx reads them, else dense float32) and metadata."""
    try:
        return mx.load(str(path), return_metadata=True)
    except (RuntimeError, ValueError) as error:
        refused = error
    try:
        import gguf  # noqa: F401  (only its presence is checked here)
    except ImportError:
        raise GGUFError(f"{path} has tensor types mlx cannot read ({refused}); the gguf package can: "
                        f"{INSTALL}") from None
    return read_with_gguf(path)


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
