"""A GGUF file's tokenizer as tokenizer.json + tokenizer_config.json.

Two kinds are known (``tokenizer.ggml.model``): ``gpt2``, byte-level BPE with its merges (SmolLM2, Qwen2.5), and
``llama``, SentencePiece BPE (Gemma), whose file has pieces and scores but no merges. SentencePiece merges the
adjacent pair whose joined piece scores highest; a BPE whose merges are every split of every normal piece into two
normal pieces, ranked by the joined piece's score, applies the same pairs in the same order.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# llama.cpp token types (gguf TokenType): control tokens are special, user-defined ones are added text.
NORMAL, CONTROL, USER_DEFINED = 1, 3, 4
SPACE = "\u2581"  # SentencePiece's visible space


# Qwen2's word split (its tokenizer.json, and llama.cpp's ``qwen2`` pre-tokenizer): GPT-2's, but every digit its own
# piece, letters taking one leading non-letter, and runs of line breaks kept together.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")


def build_tokenizer(metadata: dict[str, Any]) -> Any:
    """A ``tokenizers.Tokenizer`` from ``tokenizer.ggml.*``, with the file's added tokens and its BOS if it asks."""
    from tokenizers import AddedToken

    model = metadata.get("tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        raise ValueError(f"tokenizer.ggml.model is {model!r}; supported: gpt2 (byte-level BPE), "
                         "llama (SentencePiece BPE)")
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    given_types = metadata.get("tokenizer.ggml.token_type")  # every token normal when the file has none
    types = [NORMAL] * len(tokens) if given_types is None else given_types.tolist()
    tokenizer = _byte_level(metadata, tokens) if model == "gpt2" else _sentencepiece(metadata, tokens, types)
    tokenizer.add_tokens([AddedToken(tokens[i], special=t == CONTROL, normalized=False)
                          for i, t in enumerate(types) if t in (CONTROL, USER_DEFINED)])
    if _flag(metadata, "add_bos_token", False):
        from tokenizers import processors

        bos_id = metadata["tokenizer.ggml.bos_token_id"].item()
        bos = tokens[bos_id]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
    return tokenizer


def _flag(metadata: dict[str, Any], name: str, default: bool) -> bool:
    key = f"tokenizer.ggml.{name}"
    return bool(metadata[key].item()) if key in metadata else default


def _byte_level(metadata: dict[str, Any], tokens: list[str]) -> Any:
    """Byte-level BPE, split into words by the pre-tokenizer llama.cpp calls ``tokenizer.ggml.pre``."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    merges = [tuple(m.split(" ")) for m in metadata["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    pre = metadata.get("tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "qwen2":
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tokenizer.normalizer = normalizers.NFC()  # as Qwen2's own tokenizer.json
    elif pre == "smollm":
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in ("gpt2", "default"):
        tokenizer.pre_tokenizer = byte_level
    else:
        raise ValueError(f"tokenizer.ggml.pre is {pre!r}; supported: smollm, qwen2, gpt2, default")
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def sentencepiece_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Every split of a normal piece into two normal pieces, the highest-scoring joined piece first (ties: ids)."""
    ids = {t: i for i, t in enumerate(tokens) if types[i] == NORMAL}
    ranked = []
    for i, piece in enumerate(tokens):
        if types[i] != NORMAL:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                ranked.append((-scores[i], i, ids[left], left, right))
    return [(left, right) for *_, left, right in sorted(ranked)]


def _sentencepiece(metadata: dict[str, Any], tokens: list[str], types: list[int]) -> Any:
    """SentencePiece BPE without the dummy space prefix (Gemma's); one with it (Llama 2's) is refused: where it
    goes around user-defined pieces is not checked here."""
    from tokenizers import Tokenizer, decoders, normalizers
    from tokenizers.models import BPE

    if _flag(metadata, "add_space_prefix", True):
        raise ValueError("tokenizer.ggml.add_space_prefix is true (or absent: SentencePiece's default); only "
                         "SentencePiece tokenizers without the space prefix (Gemma's) are supported")
    merges = sentencepiece_merges(tokens, metadata["tokenizer.ggml.scores"].tolist(), types)
    unknown = tokens[metadata["tokenizer.ggml.unknown_token_id"].item()]
    tokenizer = Tokenizer(BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, unk_token=unknown,
                              byte_fallback=True, fuse_unk=True))
    tokenizer.normalizer = normalizers.Replace(" ", SPACE)
    tokenizer.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    return tokenizer


def tokenizer_config(metadata: dict[str, Any]) -> dict[str, Any]:
    """tokenizer_config.json: the fast tokenizer class, special tokens, chat template."""
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": _flag(metadata, "add_bos_token", False),
        "clean_up_tokenization_spaces": False,
    }
    for field, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding")):
        token_id = metadata.get(f"tokenizer.ggml.{key}_token_id")  # the file may name none
        if token_id is not None:
            config[field] = metadata["tokenizer.ggml.tokens"][token_id.item()]
    context = f"{metadata.get('general.architecture')}.context_length"
    if context in metadata:
        config["model_max_length"] = metadata[context].item()
    if "tokenizer.chat_template" in metadata:
        config["chat_template"] = metadata["tokenizer.chat_template"]
    return config


def write_tokenizer(metadata: dict[str, Any], folder: Path) -> None:
    """Write tokenizer.json and tokenizer_config.json into ``folder``."""
    build_tokenizer(metadata).save(str(folder / "tokenizer.json"))
    text = json.dumps(tokenizer_config(metadata), indent=2, ensure_ascii=False)
    (folder / "tokenizer_config.json").write_text(text, encoding="utf-8")
