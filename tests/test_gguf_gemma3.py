"""Gemma 3 through the GGUF converter, and SentencePiece tokenizers from GGUF metadata.

The synthetic GGUF is a random-weight ``gemma3_text`` model from mlx_lm's own class, written with
llama.cpp's ``gguf`` package the way llama.cpp writes Gemma 3: its tensor names, every norm stored
as ``1 + w``, a Q5_0 matrix (a block format mlx cannot read, so the ``gguf`` reader takes over) and a
SentencePiece vocabulary with scores. The tokenizer is checked against a direct implementation of
SentencePiece's BPE rule written here, independent of the converter's merge table.
"""

from __future__ import annotations

import random
import re
import sys

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx.utils import tree_flatten, tree_unflatten

from veloxpatch.eval.random_model import build, config_for
from veloxpatch.models.fetch import write_folder
from veloxpatch.models.gguf import GGUFError, convert, read_gguf
from veloxpatch.models.gguf_tokenizer import build_tokenizer

gguf = pytest.importorskip("gguf")

CONTROLS = ["<pad>", "<eos>", "<bos>", "<unk>"]
USER = ["\n"]
BYTES = [f"<0x{b:02X}>" for b in range(256)]
CHARS = list("\u2581abcdehilnorst,.")
# every piece splits into two earlier pieces, as SentencePiece's BPE training leaves them
PIECES = ["\u2581t", "he", "\u2581the", "in", "\u2581c", "at", "\u2581cat", "is", "\u2581is", "on", "\u2581on",
          "\u2581a", "an", "\u2581an", "ca", "st", "le", "tle", "\u2581ca", "\u2581cast", "\u2581castle", "se",
          "\u2581se", "\u2581sea", "th", "ther", "er", "\u2581\u2581"]
TOKENS = CONTROLS + USER + BYTES + CHARS + PIECES
TYPES = [3] * len(CONTROLS) + [4] * len(USER) + [6] * len(BYTES) + [1] * (len(CHARS) + len(PIECES))
BOS, EOS, UNK = 2, 1, 3
ALPHABET = "abcdehilnorst ,.\n\u00e9\u65e5"  # e-acute and a CJK character are not in the vocabulary: bytes


def scores(seed: int = 0) -> list[float]:
    """Distinct scores in a shuffled order, so the merge order is not simply the list order."""
    normal = [i for i, t in enumerate(TYPES) if t == 1]
    order = random.Random(seed).sample(range(len(normal)), len(normal))
    out = [0.0] * len(TOKENS)
    for i, rank in zip(normal, order):
        out[i] = -float(rank)
    return out


def spm_encode(text: str, score: list[float]) -> list[int]:
    """SentencePiece's BPE (no space prefix), directly: user-defined pieces split out as they are; in each
    stretch between them, spaces become ``\u2581``, then the adjacent pair whose join is a normal piece with
    the highest score merges (leftmost on a tie) until none does; a symbol outside the vocabulary becomes
    its UTF-8 bytes."""
    normal = {t: i for i, t in enumerate(TOKENS) if TYPES[i] == 1}
    out = []
    for stretch in re.split("(\n)", text):
        if stretch in USER:
            out.append(TOKENS.index(stretch))
            continue
        if not stretch:
            continue
        symbols = list(stretch.replace(" ", "\u2581"))
        while True:
            joins = [(score[normal[a + b]], -j) for j, (a, b) in enumerate(zip(symbols, symbols[1:]))
                     if a + b in normal]
            if not joins:
                break
            j = -max(joins)[1]
            symbols[j:j + 2] = [symbols[j] + symbols[j + 1]]
        for symbol in symbols:
            out += [normal[symbol]] if symbol in normal else [TOKENS.index(f"<0x{b:02X}>") for b in symbol.encode()]
    return out


def spm_metadata(space_prefix: bool = False) -> dict:
    """``tokenizer.ggml.*`` as mx.load returns it, for the SentencePiece vocabulary above."""
    return {
        "general.architecture": "gemma3",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": TOKENS,
        "tokenizer.ggml.scores": mx.array(scores(), dtype=mx.float32),
        "tokenizer.ggml.token_type": mx.array(TYPES, dtype=mx.int32),
        "tokenizer.ggml.bos_token_id": mx.array(BOS, dtype=mx.uint32),
        "tokenizer.ggml.eos_token_id": mx.array(EOS, dtype=mx.uint32),
        "tokenizer.ggml.unknown_token_id": mx.array(UNK, dtype=mx.uint32),
        "tokenizer.ggml.add_bos_token": mx.array(True),
        "tokenizer.ggml.add_space_prefix": mx.array(space_prefix),
    }


def test_sentencepiece_tokenizer_is_spm_bpe():
    tokenizer = build_tokenizer(spm_metadata())
    score = scores()

    @settings(max_examples=150, deadline=None)
    @given(st.text(alphabet=ALPHABET, max_size=40))
    def same(text: str) -> None:
        ids = tokenizer.encode(text).ids
        assert ids == [BOS] + spm_encode(text, score)
        assert tokenizer.decode(ids, skip_special_tokens=True) == text

    same()
    text = "the cat is on the sea"
    assert len(tokenizer.encode(text).ids) - 1 < len(text) * 2 // 3  # pieces merge
    with pytest.raises(ValueError, match="add_space_prefix is true"):  # Llama 2's files: not checked, refused
        build_tokenizer(spm_metadata(space_prefix=True))


# the synthetic Gemma 3: one global layer after five sliding ones, as llama.cpp assumes for the family
GEMMA = dict(num_hidden_layers=6, sliding_window_pattern=6, sliding_window=16, head_dim=16, query_pre_attn_scalar=16,
             max_position_embeddings=512, vocab_size=len(TOKENS), rms_norm_eps=1e-6)
TO_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
           "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
           "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
           "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
           "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
Q5 = "model.layers.0.self_attn.v_proj.weight"  # written as Q5_0


def gguf_name(path: str) -> str:
    base = path.removesuffix(".weight")
    outer = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    if base in outer:  # mlx_lm's gemma3_text keeps an lm_head until a folder without one ties it
        return outer[base] + ".weight"
    _, _, layer, module = base.split(".", 3)
    return f"blk.{layer}.{TO_GGUF[module]}.weight"


@pytest.fixture(scope="module")
def original():
    """A random gemma3_text model whose norms are random too (a missed or doubled shift shows)."""
    model = build(config_for("gemma3_text", **GEMMA), seed=5)
    mx.random.seed(6)
    model.update(tree_unflatten([(k, mx.random.normal(v.shape) * 0.3) for k, v in tree_flatten(model.parameters())
                                 if v.ndim == 1]))
    return model


def expected_weights(model) -> dict[str, mx.array]:
    """The model's weights as the GGUF holds them: the Q5_0 matrix is what Q5_0 keeps of it."""
    from gguf.quants import dequantize, quantize

    weights = dict(tree_flatten(model.parameters()))
    q5 = np.array(weights[Q5])
    weights[Q5] = mx.array(dequantize(quantize(q5, gguf.GGMLQuantizationType.Q5_0), gguf.GGMLQuantizationType.Q5_0))
    return weights


def write_gemma_gguf(path, model) -> None:
    """llama.cpp's layout: its names, norms as 1 + w, one Q5_0 matrix, gemma3.* and SentencePiece metadata."""
    from gguf.quants import quantize

    writer = gguf.GGUFWriter(str(path), "gemma3")
    for key, value in (("block_count", 6), ("embedding_length", 64), ("feed_forward_length", 96),
                       ("attention.head_count", 4), ("attention.head_count_kv", 2), ("attention.key_length", 16),
                       ("attention.value_length", 16), ("attention.sliding_window", 16), ("context_length", 512)):
        writer.add_uint32(f"gemma3.{key}", value)
    writer.add_float32("gemma3.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_float32("gemma3.rope.freq_base", 10000.0)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(TOKENS)
    writer.add_token_scores(scores())
    writer.add_token_types(TYPES)
    for key, value in (("bos_token_id", BOS), ("eos_token_id", EOS), ("unknown_token_id", UNK)):
        writer.add_uint32(f"tokenizer.ggml.{key}", value)
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.add_bool("tokenizer.ggml.add_space_prefix", False)
    for path_, w in tree_flatten(model.parameters()):
        data = np.array(w + 1.0 if path_.endswith("norm.weight") else w, dtype=np.float32)
        if path_ == Q5:
            writer.add_tensor(gguf_name(path_), quantize(data, gguf.GGMLQuantizationType.Q5_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q5_0)
        else:
            writer.add_tensor(gguf_name(path_), data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def gemma_gguf(tmp_path_factory, original):
    path = tmp_path_factory.mktemp("gemma") / "gemma.gguf"
    write_gemma_gguf(path, original)
    return path


def test_gemma3_weights_and_config(gemma_gguf, original):
    with pytest.raises(RuntimeError):  # the reason the gguf reader is needed
        mx.load(str(gemma_gguf))
    weights, metadata = read_gguf(gemma_gguf)
    converted, config = convert(weights, metadata)
    expected = expected_weights(original)
    assert sorted(converted) == sorted(expected)
    for name, w in expected.items():
        assert converted[name].shape == w.shape and mx.allclose(converted[name], w, atol=1e-6).item(), name
    assert config["model_type"] == "gemma3_text" and not config["tie_word_embeddings"]
    assert (config["head_dim"], config["query_pre_attn_scalar"], config["sliding_window"],
            config["sliding_window_pattern"]) == (16, 16, 16, 6)


def test_gemma3_folder_logits_tokenizer_and_slots(gemma_gguf, original, tmp_path):
    import mlx_lm
    import mlx_lm.models.cache as mlx_cache

    import veloxpatch
    from veloxpatch.caches import CompressedKVCache

    folder = write_folder(gemma_gguf, tmp_path / "gemma")
    model, tokenizer = mlx_lm.load(str(folder))
    reference = build(config_for("gemma3_text", **GEMMA))
    reference.load_weights(list(expected_weights(original).items()))
    tokens = mx.array([[BOS, 300, 290, 301, 5, 299, 270, 296]])
    assert mx.allclose(model(tokens), reference(tokens), atol=1e-4).item()
    assert tokenizer.encode("the cat") == [BOS] + spm_encode("the cat", scores())
    veloxpatch.patch(kv="snapkv", budget=40)
    try:
        slots = [type(c) for c in mlx_cache.make_prompt_cache(model)]  # looked up after patching, as an app's call
    finally:
        veloxpatch.unpatch()
    assert issubclass(slots[5], CompressedKVCache) and slots[:5] == [mlx_cache.RotatingKVCache] * 5


def test_kquant_file_kept_quantized_or_without_gguf_fails_clearly(gemma_gguf, monkeypatch, tmp_path):
    weights, metadata = read_gguf(gemma_gguf)
    with pytest.raises(GGUFError, match="dequantized on reading.*mlx_lm convert -q"):
        convert(weights, metadata, quantized=True)
    monkeypatch.setitem(sys.modules, "gguf", None)  # as if not installed
    with pytest.raises(GGUFError, match=r"pip install 'veloxpatch\[gguf\]'"):
        write_folder(gemma_gguf, tmp_path / "out")
    assert not (tmp_path / "out").exists()
