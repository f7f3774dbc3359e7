"""The architectures the GGUF converter knows: llama.cpp's metadata and tensor names as mlx_lm's.

Each :class:`Architecture` says how its metadata becomes mlx_lm's config.json, its block tensors' mlx_lm names,
and what llama.cpp changed in the weights (llama's interleaved q/k rotary rows; Gemma's norms stored as ``1 + w``,
where mlx_lm's Gemma norm adds the one itself).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx


class GGUFError(ValueError):
    """The GGUF file is not something this converter handles; the message says what and why."""


def scalar(metadata: dict[str, Any], key: str) -> Any:
    """A required scalar metadata value as a Python number."""
    if key not in metadata:
        raise GGUFError(f"GGUF metadata has no {key!r}, which this model needs")
    value = metadata[key]
    return value.item() if isinstance(value, mx.array) else value


def _common(metadata: dict[str, Any], arch: str, tied: bool) -> dict[str, Any]:
    """What every architecture's config.json takes from ``<arch>.*`` and ``tokenizer.ggml.*``."""
    get = lambda key: scalar(metadata, f"{arch}.{key}")  # noqa: E731
    return {
        "hidden_size": get("embedding_length"),
        "num_hidden_layers": get("block_count"),
        "intermediate_size": get("feed_forward_length"),
        "num_attention_heads": get("attention.head_count"),
        "num_key_value_heads": get("attention.head_count_kv"),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get("rope.freq_base")),
        "max_position_embeddings": get("context_length"),
        "vocab_size": len(metadata["tokenizer.ggml.tokens"]),
        "tie_word_embeddings": tied,
        "bos_token_id": scalar(metadata, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": scalar(metadata, "tokenizer.ggml.eos_token_id"),
    }


def llama_config(metadata: dict[str, Any], tied: bool) -> dict[str, Any]:
    """mlx_lm's llama config.json (``tied``: the file has no ``output`` matrix)."""
    config = {"model_type": "llama", **_common(metadata, "llama", tied), "rope_traditional": False}
    config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    return config


def qwen2_config(metadata: dict[str, Any], tied: bool) -> dict[str, Any]:
    """mlx_lm's ``qwen2`` config.json: llama's fields under ``qwen2.*``; the q/k/v biases are in the weights."""
    return {"model_type": "qwen2", **_common(metadata, "qwen2", tied), "rope_traditional": False}


# What Gemma 3's GGUF does not record and llama.cpp fixes for the family: every sixth layer attends
# globally, the local layers' RoPE base is 10000.
GEMMA3_PATTERN, GEMMA3_LOCAL_BASE = 6, 10_000.0


def gemma3_config(metadata: dict[str, Any], tied: bool) -> dict[str, Any]:
    """mlx_lm's ``gemma3_text`` config.json; 27B (62 layers), which scales queries by hidden / heads, is refused."""
    config = {"model_type": "gemma3_text", **_common(metadata, "gemma3", tied)}
    if config["num_hidden_layers"] == 62:
        raise GGUFError("Gemma 3 27B scales its queries by hidden_size / heads, which its GGUF does not record; "
                        "only the other Gemma 3 sizes are supported")
    head_dim = scalar(metadata, "gemma3.attention.key_length")
    config.update(head_dim=head_dim, query_pre_attn_scalar=head_dim,
                  sliding_window=scalar(metadata, "gemma3.attention.sliding_window"),
                  sliding_window_pattern=GEMMA3_PATTERN, rope_local_base_freq=GEMMA3_LOCAL_BASE)
    if "gemma3.rope.scaling.type" in metadata:
        config["rope_scaling"] = {"rope_type": metadata["gemma3.rope.scaling.type"],
                                  "factor": float(scalar(metadata, "gemma3.rope.scaling.factor"))}
    return config


GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
ATTENTION_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


@dataclass(frozen=True)
class Architecture:
    """One ``general.architecture`` (the tensors outside the blocks are named alike in all: ``GLOBAL_NAMES``)."""

    name: str
    config: Callable[[dict[str, Any], bool], dict[str, Any]]
    block_names: dict[str, str]
    interleaved_rotary: bool  # llama.cpp reordered the q/k rows (its llama converter does, its Gemma one not)
    norm_shift: float = 0.0  # llama.cpp stores these norms as shift + w; mlx_lm's module adds the shift itself


LLAMA = Architecture("llama", llama_config, {
    **ATTENTION_NAMES,
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}, interleaved_rotary=True)

GEMMA3 = Architecture("gemma3", gemma3_config, {
    **ATTENTION_NAMES,
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}, interleaved_rotary=False, norm_shift=1.0)

# llama.cpp's qwen2 converter keeps Hugging Face's q/k row order (it permutes for llama only).
QWEN2 = Architecture("qwen2", qwen2_config, dict(LLAMA.block_names), interleaved_rotary=False)

ARCHITECTURES = {arch.name: arch for arch in (LLAMA, GEMMA3, QWEN2)}


def architecture(metadata: dict[str, Any]) -> Architecture:
    """The architecture ``general.architecture`` names; GGUFError for one this converter does not know."""
    name = metadata.get("general.architecture")
    if name not in ARCHITECTURES:
        raise GGUFError(f"general.architecture is {name!r}; supported: {', '.join(sorted(ARCHITECTURES))}")
    return ARCHITECTURES[name]
