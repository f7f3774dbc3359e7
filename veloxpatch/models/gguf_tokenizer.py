"""A GGUF file's byte-level BPE tokenizer as tokenizer.json + tokenizer_config.json.

GGUF stores the vocabulary, merges, token types and chat template as metadata; mlx_lm loads
tokenizers through transformers, which reads a ``tokenizers`` fast tokenizer from a folder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx

# llama.cpp token types (gguf TokenType): control tokens are special, user-defined ones are added text.
CONTROL, USER_DEFINED = 3, 4


def _pre_tokenizer(name: str) -> Any:
    """The pre-tokenizer llama.cpp calls ``name``; ``smollm`` also splits digits one by one."""
    from tokenizers import pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if name == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if name in ("gpt2", "default"):
        return byte_level
    raise ValueError(f"tokenizer.ggml.pre is {name!r}; supported: smollm, gpt2, default")


def build_tokenizer(metadata: dict[str, Any]) -> Any:
    """A ``tokenizers.Tokenizer`` from ``tokenizer.ggml.*`` (model ``gpt2``: byte-level BPE)."""
    from tokenizers import AddedToken, Tokenizer, decoders
    from tokenizers.models import BPE

    model = metadata.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"tokenizer.ggml.model is {model!r}; only 'gpt2' (byte-level BPE) is supported")
    if bool(metadata.get("tokenizer.ggml.add_bos_token", mx.array(False)).item()):
        raise ValueError("tokenizer.ggml.add_bos_token is true; only tokenizers that add no BOS are supported")
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ")) for m in metadata["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tokenizer.pre_tokenizer = _pre_tokenizer(metadata.get("tokenizer.ggml.pre", "default"))
    tokenizer.decoder = decoders.ByteLevel()
    types = metadata["tokenizer.ggml.token_type"].tolist() if "tokenizer.ggml.token_type" in metadata else []
    tokenizer.add_tokens([AddedToken(tokens[i], special=t == CONTROL, normalized=False)
                          for i, t in enumerate(types) if t in (CONTROL, USER_DEFINED)])
    return tokenizer


def _token(metadata: dict[str, Any], key: str) -> str | None:
    """The text of the token whose id is metadata ``key``, if the file names one."""
    if key not in metadata:
        return None
    return metadata["tokenizer.ggml.tokens"][metadata[key].item()]


def tokenizer_config(metadata: dict[str, Any]) -> dict[str, Any]:
    """tokenizer_config.json: the fast tokenizer class, special tokens, chat template."""
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    for field, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"),
                       ("pad_token", "padding")):
        text = _token(metadata, f"tokenizer.ggml.{key}_token_id")
        if text is not None:
            config[field] = text
    if "llama.context_length" in metadata:
        config["model_max_length"] = metadata["llama.context_length"].item()
    if "tokenizer.chat_template" in metadata:
        config["chat_template"] = metadata["tokenizer.chat_template"]
    return config


def write_tokenizer(metadata: dict[str, Any], folder: Path) -> None:
    """Write tokenizer.json and tokenizer_config.json into ``folder``."""
    build_tokenizer(metadata).save(str(folder / "tokenizer.json"))
    text = json.dumps(tokenizer_config(metadata), indent=2, ensure_ascii=False)
    (folder / "tokenizer_config.json").write_text(text, encoding="utf-8")
