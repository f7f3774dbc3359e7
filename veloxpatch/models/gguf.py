"""A GGUF file read as mlx_lm weights and config.json, for the architectures of ``gguf_arch``.

mlx keeps Q4_0, Q4_1 and Q8_0 blocks quantized, refuses Q5_0/Q5_1, and dequantizes K-quants to float16, wrongly for
Q4_K (docs/models.md, "The yardstick's models"). So mlx reads a file only where it keeps every tensor as it is;
otherwise llama.cpp's optional package ``gguf`` reads it, dequantized to float32. Without it, such a file is refused.

The tensors read (mlx affine triples under llama.cpp's names, or dense) are then renamed to mlx_lm's module paths,
what llama.cpp changed is undone (:mod:`.gguf_arch`; llama's q/k rows put back so that mlx_lm's default
``rope_traditional: false`` applies), and they are dequantized or their quantization described in config.json.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any

import mlx.core as mx

from .gguf_arch import GLOBAL_NAMES, Architecture, GGUFError, architecture

INSTALL = "pip install 'veloxpatch[gguf]'"
MLX_KEEPS = frozenset({"F32", "F16", "Q4_0", "Q4_1", "Q8_0"})  # tensor types mx.load returns as the file has them
# GGML quantizes in blocks of 32 values; mlx's GGUF reader keeps that as the group size.
GGUF_GROUP_SIZE = 32
QUANT_SUFFIXES = (".weight", ".scales", ".biases")
BIAS = ".bias"  # a layer's additive bias (Qwen2's q/k/v projections): always dense, never a quantization's
SUFFIXES = (*QUANT_SUFFIXES, BIAS)
BLOCK_PATTERN = re.compile(r"blk\.(\d+)\.(\w+)$")


def read_gguf(path: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """The file's tensors (quantized triples where mlx reads them, else dense float32) and metadata."""
    try:
        from gguf import GGUFReader
    except ImportError:  # without the ``gguf`` package: mlx's reading, where it cannot be wrong
        try:
            weights, metadata = _mlx_load(path)
        except (RuntimeError, ValueError) as error:
            raise GGUFError(f"{path} has tensor types mlx cannot read ({error}); "
                            f"the gguf package can: {INSTALL}") from None
        if any(w.dtype == mx.float16 for w in weights.values()):
            raise GGUFError(f"{path} has float16 or K-quant tensors, which mlx returns alike, and some K-quants "
                            f"(Q4_K) wrongly; the gguf package reads them exactly: {INSTALL}")
        return weights, metadata
    if {t.tensor_type.name for t in GGUFReader(str(path)).tensors} <= MLX_KEEPS:
        return _mlx_load(path)
    return read_with_gguf(path)


def _mlx_load(path: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    loaded = mx.load(str(path), return_metadata=True)
    assert isinstance(loaded, tuple), "mx.load returns (weights, metadata) with return_metadata"
    return loaded[0], loaded[1]


def read_with_gguf(path: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """Every tensor dequantized to float32 and the metadata, through the ``gguf`` package."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    weights = {t.name: mx.array(dequantize(t.data, t.tensor_type)) for t in reader.tensors}
    return weights, {name: _value(field) for name, field in reader.fields.items() if not name.startswith("GGUF.")}


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


def split_suffix(name: str) -> tuple[str, str]:
    """``"blk.0.attn_q.scales"`` -> ``("blk.0.attn_q", ".scales")``."""
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)], suffix
    raise GGUFError(f"tensor {name!r} has none of the suffixes {', '.join(SUFFIXES)}")


def mlx_lm_name(gguf_name: str, arch: Architecture) -> str:
    """llama.cpp's tensor base name -> mlx_lm module path (``blk.3.ffn_up`` -> ``model.layers.3.mlp.up_proj``)."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    match = BLOCK_PATTERN.match(gguf_name)
    if match is None or match.group(2) not in arch.block_names:
        known = ", ".join([*GLOBAL_NAMES, *(f"blk.N.{n}" for n in arch.block_names)])
        raise GGUFError(f"tensor {gguf_name!r} is not a {arch.name} tensor this converter knows ({known})")
    return f"model.layers.{match.group(1)}.{arch.block_names[match.group(2)]}"


def unpermute_rotary(rows: mx.array, heads: int) -> mx.array:
    """Undo llama.cpp's q/k row order, which interleaves each head's two rotary halves (rows 0, d/2, 1, ...);
    only whole rows move, so packed/scales/biases rows work alike."""
    grouped = rows.reshape(heads, rows.shape[0] // heads // 2, 2, *rows.shape[1:])  # rows: the out features
    return grouped.swapaxes(1, 2).reshape(rows.shape)


def quantized_bits(packed: mx.array, scales: mx.array) -> int:
    """Bits per value of an mlx affine triple with GGUF's group size of 32."""
    return packed.shape[-1] * 32 // (scales.shape[-1] * GGUF_GROUP_SIZE)


def convert_tensor(base: str, parts: dict[str, mx.array], arch: Architecture, config: dict[str, Any],
                   quantized: bool) -> dict[str, mx.array]:
    """One tensor's arrays in mlx_lm form: a norm less llama.cpp's shift, q/k rows llama.cpp reordered put back for
    RoPE, dense (float32, or float16 beside kept quantized matrices) or kept quantized, a bias dense."""
    if arch.norm_shift and base.endswith("norm"):
        parts = {".weight": parts[".weight"] - arch.norm_shift}
    heads = {"attn_q": "num_attention_heads", "attn_k": "num_key_value_heads"}.get(base.rsplit(".", 1)[-1])
    if arch.interleaved_rotary and heads is not None:
        parts = {suffix: unpermute_rotary(a, config[heads]) for suffix, a in parts.items()}
    dtype = mx.float16 if quantized else mx.float32
    bias = {BIAS: parts[BIAS].astype(dtype)} if BIAS in parts else {}
    if ".scales" not in parts:
        return {".weight": parts[".weight"].astype(dtype), **bias}
    if quantized:
        return {suffix: parts[suffix] for suffix in QUANT_SUFFIXES} | bias
    packed, scales, biases = parts[".weight"], parts[".scales"], parts[".biases"]
    dense = mx.dequantize(packed, scales, biases, group_size=GGUF_GROUP_SIZE, bits=quantized_bits(packed, scales))
    return {".weight": dense.astype(dtype), **bias}


def quantization_config(tensors: dict[str, dict[str, mx.array]], arch: Architecture) -> dict[str, Any]:
    """config.json ``quantization``: the commonest bits as default, other widths per module path."""
    bits = {mlx_lm_name(base, arch): quantized_bits(p[".weight"], p[".scales"])
            for base, p in tensors.items() if ".scales" in p}
    if not bits:
        raise GGUFError("this GGUF has no matrices mlx keeps quantized (its K-quants are dequantized on reading): "
                        "convert it dense, then quantize the folder with `python -m mlx_lm convert -q`")
    default = Counter(bits.values()).most_common(1)[0][0]
    others = {path: {"group_size": GGUF_GROUP_SIZE, "bits": width} for path, width in sorted(bits.items())
              if width != default}
    return {"group_size": GGUF_GROUP_SIZE, "bits": default, **others}


def convert(weights: dict[str, mx.array], metadata: dict[str, Any],
            quantized: bool = False) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """mlx_lm weights and config from a GGUF's ``(weights, metadata)``: dense float32 by default (mlx's CPU backend
    is fast at float32, ~10x slower at float16); ``quantized`` keeps the quantized matrices, for Metal."""
    arch = architecture(metadata)
    tensors: dict[str, dict[str, mx.array]] = {}  # {"blk.0.attn_q": {".weight": ..., ".scales": ...}, ...}
    for name, value in weights.items():
        base, suffix = split_suffix(name)
        tensors.setdefault(base, {})[suffix] = value
    config = arch.config(metadata, "output" not in tensors)
    if quantized:
        config["quantization"] = quantization_config(tensors, arch)
    converted = {mlx_lm_name(base, arch) + suffix: a for base, parts in tensors.items()
                 for suffix, a in convert_tensor(base, parts, arch, config, quantized).items()}
    return converted, config
