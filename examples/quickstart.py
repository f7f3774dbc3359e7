"""An ordinary mlx_lm script: load a model, ask a question about a long prompt, print the answer.

Nothing here knows about veloxpatch; run it under the launcher to compress its KV cache:

    veloxpatch run --kv snapkv --budget 256 --stats examples/quickstart.py
    python examples/quickstart.py                       # the same, plain mlx_lm

Without ``--model`` it uses the model shipped inside veloxpatch when present, otherwise it writes
a small random-weight llama to a temporary folder (its answers are noise; the point is the cache).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import mlx.core as mx
from mlx_lm import load, stream_generate


def default_model() -> str:
    from veloxpatch.assets import model_path
    from veloxpatch.eval.random_model import write_model_dir

    shipped = model_path()
    if (shipped / "config.json").exists():
        return str(shipped)
    folder = Path(tempfile.mkdtemp(prefix="velox-tiny-")) / "model"
    print(f"(no shipped model yet: using a random-weight llama in {folder})")
    return str(write_model_dir(folder, hidden_size=256, num_hidden_layers=4, intermediate_size=512,
                               num_attention_heads=8, num_key_value_heads=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="mlx_lm model folder")
    parser.add_argument("--words", type=int, default=200, help="length of the filler text (200: ~900 tokens)")
    args = parser.parse_args()
    model, tokenizer = load(args.model or default_model())
    filler = " ".join(["The grass is green. The sky is blue. The sun is yellow."] * (args.words // 12))
    needle = "The pass key is 71432. Remember it. 71432 is the pass key."
    prompt = f"{filler}\n{needle}\n{filler}\nWhat is the pass key? The pass key is"
    text, last = "", None
    for last in stream_generate(model, tokenizer, prompt, max_tokens=16, prefill_step_size=512):
        text += last.text
    print(f"answer: {text.strip().splitlines()[0] if text.strip() else ''!r} (expected 71432)")
    print(f"prompt {last.prompt_tokens} tokens at {last.prompt_tps:.0f} tok/s, "
          f"decode {last.generation_tps:.1f} tok/s, peak memory {mx.get_peak_memory() / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
