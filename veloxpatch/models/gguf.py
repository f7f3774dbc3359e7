"""A llama-architecture GGUF file as mlx_lm's llama weights and config.json.

``mx.load`` already reads GGUF: quantized matrices come back as mlx affine triples
(``.weight`` uint32, ``.scales``, ``.biases``) under llama.cpp's tensor names. What is left is
renaming them to mlx_lm's module paths, undoing llama.cpp's rotary row order on the q/k
projections (so the folder is the Hugging Face layout and mlx_lm's default ``rope_traditional:
false`` applies), and either dequantizing or describing the quantization in config.json.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

import mlx.core as mx

# GGML quantizes in blocks of 32 values; mlx's GGUF reader keeps that as the group size.
GGUF_GROUP_SIZE = 32
QUANT_SUFFIXES = (".weight", ".scales", ".biases")

GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_norm": "post_attention_layernorm",
}
BLOCK_PATTERN = re.compile(r"blk\.(\d+)\.(\w+)$")


class GGUFError(ValueError):
    """The GGUF file is not something this converter handles; the message says what and why."""


def _scalar(metadata: dict[str, Any], key: str) -> Any:
    """A required scalar metadata value as a Python number."""
    if key not in metadata:
        raise GGUFError(f"GGUF metadata has no {key!r}, which a llama model needs")
    value = metadata[key]
    return value.item() if isinstance(value, mx.array) else value


def llama_config(metadata: dict[str, Any], tied: bool) -> dict[str, Any]:
    """mlx_lm's llama config.json from the ``llama.*`` metadata (``tied``: no ``output`` matrix)."""
    arch = metadata.get("general.architecture")
    if arch != "llama":
        raise GGUFError(f"general.architecture is {arch!r}; only 'llama' is supported")
    heads = _scalar(metadata, "llama.attention.head_count")
    hidden = _scalar(metadata, "llama.embedding_length")
    return {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": _scalar(metadata, "llama.block_count"),
        "intermediate_size": _scalar(metadata, "llama.feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": _scalar(metadata, "llama.attention.head_count_kv"),
        "head_dim": hidden // heads,
        "rms_norm_eps": float(_scalar(metadata, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_scalar(metadata, "llama.rope.freq_base")),
        "rope_traditional": False,
        "max_position_embeddings": _scalar(metadata, "llama.context_length"),
        "vocab_size": len(metadata["tokenizer.ggml.tokens"]),
        "tie_word_embeddings": tied,
        "bos_token_id": _scalar(metadata, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _scalar(metadata, "tokenizer.ggml.eos_token_id"),
    }


def split_suffix(name: str) -> tuple[str, str]:
    """``"blk.0.attn_q.scales"`` -> ``("blk.0.attn_q", ".scales")``."""
    for suffix in QUANT_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)], suffix
    raise GGUFError(f"tensor {name!r} has none of the suffixes {', '.join(QUANT_SUFFIXES)}")


def mlx_lm_name(gguf_name: str) -> str:
    """llama.cpp's tensor base name -> mlx_lm llama module path (``blk.3.ffn_up`` -> ``model.layers.3.mlp.up_proj``)."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    match = BLOCK_PATTERN.match(gguf_name)
    if match is None or match.group(2) not in BLOCK_NAMES:
        known = ", ".join([*GLOBAL_NAMES, *(f"blk.N.{n}" for n in BLOCK_NAMES)])
        raise GGUFError(f"tensor {gguf_name!r} is not a llama tensor this converter knows ({known})")
    return f"model.layers.{match.group(1)}.{BLOCK_NAMES[match.group(2)]}"


def unpermute_rotary(rows: mx.array, heads: int) -> mx.array:
    """Undo llama.cpp's q/k row order: per head it interleaves the two rotary halves
    (rows 0, d/2, 1, d/2+1, ...); Hugging Face and mlx_lm's default RoPE keep them as halves.

    Works on dense weights and on packed/scales/biases rows alike: only whole rows move.
    """
    out_features = rows.shape[0]
    grouped = rows.reshape(heads, out_features // heads // 2, 2, *rows.shape[1:])
    return grouped.swapaxes(1, 2).reshape(rows.shape)


def quantized_bits(packed: mx.array, scales: mx.array) -> int:
    """Bits per value of an mlx affine triple with GGUF's group size of 32."""
    return packed.shape[-1] * 32 // (scales.shape[-1] * GGUF_GROUP_SIZE)


def _grouped(weights: dict[str, mx.array]) -> dict[str, dict[str, mx.array]]:
    """``{"blk.0.attn_q": {".weight": ..., ".scales": ..., ".biases": ...}, ...}``."""
    tensors: dict[str, dict[str, mx.array]] = {}
    for name, value in weights.items():
        base, suffix = split_suffix(name)
        tensors.setdefault(base, {})[suffix] = value
    return tensors


def _rotary_heads(gguf_name: str, config: dict[str, Any]) -> int | None:
    """Heads to unpermute by for q/k projections; None for every other tensor."""
    if gguf_name.endswith(".attn_q"):
        return config["num_attention_heads"]
    if gguf_name.endswith(".attn_k"):
        return config["num_key_value_heads"]
    return None


def convert_tensor(parts: dict[str, mx.array], heads: int | None, quantized: bool,
                   dtype: mx.Dtype) -> dict[str, mx.array]:
    """One tensor's arrays in mlx_lm form: rows reordered for RoPE, then dense ``dtype`` or kept quantized."""
    if heads is not None:
        parts = {suffix: unpermute_rotary(a, heads) for suffix, a in parts.items()}
    if ".scales" not in parts:
        return {".weight": parts[".weight"].astype(dtype)}
    if quantized:
        return parts
    packed, scales, biases = parts[".weight"], parts[".scales"], parts[".biases"]
    dense = mx.dequantize(packed, scales, biases, group_size=GGUF_GROUP_SIZE,
                          bits=quantized_bits(packed, scales))
    return {".weight": dense.astype(dtype)}


def quantization_config(tensors: dict[str, dict[str, mx.array]]) -> dict[str, Any]:
    """config.json ``quantization``: the commonest bits as default, other widths per module path."""
    bits = {mlx_lm_name(base): quantized_bits(p[".weight"], p[".scales"])
            for base, p in tensors.items() if ".scales" in p}
    if not bits:
        raise GGUFError("no quantized tensors in this GGUF: convert without keeping quantization")
    default = Counter(bits.values()).most_common(1)[0][0]
    config: dict[str, Any] = {"group_size": GGUF_GROUP_SIZE, "bits": default}
    for path, width in sorted(bits.items()):
        if width != default:
            config[path] = {"group_size": GGUF_GROUP_SIZE, "bits": width}
    return config


def convert(weights: dict[str, mx.array], metadata: dict[str, Any],
            quantized: bool = False) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """mlx_lm llama weights and config from ``mx.load(gguf, return_metadata=True)``'s result.

    Dense float32 by default (mlx's CPU backend is fast at float32, ~10x slower at float16);
    ``quantized`` keeps GGUF's quantized matrices with float16 norms, for Metal.
    """
    tensors = _grouped(weights)
    config = llama_config(metadata, tied="output" not in tensors)
    if quantized:
        config["quantization"] = quantization_config(tensors)
    dtype = mx.float16 if quantized else mx.float32
    converted = {}
    for base, parts in tensors.items():
        arrays = convert_tensor(parts, _rotary_heads(base, config), quantized, dtype)
        converted.update({mlx_lm_name(base) + suffix: a for suffix, a in arrays.items()})
    return converted, config
