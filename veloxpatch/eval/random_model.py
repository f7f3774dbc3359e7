"""Random-weight models from mlx_lm's own model classes, in memory or as a loadable folder.

Random weights give flat attention, so they say nothing about quality, but they are real architectures: the tests check
exactness and contracts on them, the quick-start runs without a download, and ``bench`` times larger ones. Weights are
scaled so greedy tokens vary.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

COMMON: dict[str, Any] = dict(
    hidden_size=64, num_hidden_layers=3, intermediate_size=96, num_attention_heads=4,
    num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=97, rope_theta=10000.0,
    tie_word_embeddings=True, max_position_embeddings=4096,
)

ARCHS: dict[str, dict[str, Any]] = {
    "llama": dict(model_type="llama"),
    "qwen2": dict(model_type="qwen2"),
    "qwen3": dict(model_type="qwen3", head_dim=16),
    "mistral": dict(model_type="mistral"),
    "phi3": dict(model_type="phi3", original_max_position_embeddings=4096),
    # gemma3's make_cache mixes full-attention KVCache and sliding-window RotatingKVCache slots
    "gemma3_text": dict(model_type="gemma3_text", head_dim=16, query_pre_attn_scalar=16,
                        sliding_window=16, sliding_window_pattern=2, rope_local_base_freq=10000.0,
                        num_hidden_layers=4),
    # a hybrid: short-convolution layers keep ArraysCache slots, attention layers KVCache slots
    # (block_ff_dim as real LFM2 configs give it: mlx-lm 0.28-0.31 require it, 0.32 defaults it to intermediate_size)
    "lfm2": dict(model_type="lfm2", norm_eps=1e-5, conv_bias=False, conv_L_cache=3, block_dim=64,
                 block_ff_dim=COMMON["intermediate_size"], block_multiple_of=16, block_ffn_dim_multiplier=1.0,
                 block_auto_adjust_ff_dim=False, full_attn_idxs=[1, 3], num_hidden_layers=4),
}


def config_for(arch: str, **overrides: Any) -> dict[str, Any]:
    """The config.json contents of a small ``arch`` model (``overrides`` win)."""
    return {**COMMON, **ARCHS[arch], **overrides}


def build(config: dict[str, Any], seed: int = 0) -> nn.Module:
    """Instantiate mlx_lm's class for ``config`` with random weights (std 0.5 on matrices)."""
    from mlx_lm.utils import MODEL_REMAPPING, _get_classes

    model_type = MODEL_REMAPPING.get(config["model_type"], config["model_type"])
    model_cls, args_cls = _get_classes({**config, "model_type": model_type})
    model = model_cls(args_cls.from_dict({**config, "model_type": model_type}))
    mx.random.seed(seed)
    params = [(k, mx.random.normal(v.shape) * 0.5 if v.ndim > 1 else v)
              for k, v in tree_flatten(model.parameters())]
    model.update(tree_unflatten(params))
    mx.eval(model.parameters())
    return model


def write_byte_tokenizer(path: Path) -> int:
    """A byte-level BPE tokenizer with no merges (any text encodes); returns its vocab size."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["</s>"] = len(vocab)
    tok = Tokenizer(BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>", "model_max_length": 1 << 20}))
    return len(vocab)


def write_model_dir(path: Path, arch: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    """A folder ``mlx_lm.load`` reads offline: config.json, model.safetensors, tokenizer."""
    path.mkdir(parents=True, exist_ok=True)
    config = config_for(arch, vocab_size=write_byte_tokenizer(path), **overrides)
    (path / "config.json").write_text(json.dumps(config))
    weights = dict(tree_flatten(build(config, seed).parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    return path
