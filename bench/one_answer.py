"""One question on a document, asked as a user of mlx_lm asks it (``mlx_lm.generate``), under the full cache,
mlx_lm's own ``kv_bits`` (``quantized_kv_start=0``) and veloxpatch's methods: each answer and the KV bytes it held.

The document is held-out text of the eval (CPython's documentation, ``--tokens`` long), the question "What is the text
above about?" in the model's chat template, greedy decoding. A quick check that a cache answers at all, not a rate:
the rates are the eval's (``veloxpatch eval``).

    python bench/one_answer.py --model "$(veloxpatch fetch-model qwen2.5-1.5b | tail -1)" [--tokens 900] \
        [--kv-bits 4,8] [--methods 'quant[bits=4],quant[bits=3]']
"""

from __future__ import annotations

import argparse
from typing import Any

from mlx_lm import generate, load

import veloxpatch
from veloxpatch.eval import tasks
from veloxpatch.eval.variants import Variant, split_specs

QUESTION = "\n\nWhat is the text above about? Answer in one sentence."


def answer(model: Any, tokenizer: Any, prompt: list[int], cache: list, **kwargs: Any) -> tuple[str, int]:
    """The greedy answer (30 tokens at most) on ``cache`` and the bytes the list holds after it."""
    text = generate(model, tokenizer, prompt, max_tokens=30, prompt_cache=cache, **kwargs)
    return text, sum(c.nbytes for c in cache)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--tokens", type=int, default=900)
    parser.add_argument("--kv-bits", default="4,8")
    parser.add_argument("--methods", default="quant[bits=4],quant[bits=3]")
    args = parser.parse_args()
    model, tokenizer = load(args.model)
    text = tasks.longtext_sample(tokenizer, args.tokens, 0)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": text + QUESTION}], add_generation_prompt=True)
    print(f"prompt: {len(prompt)} tokens")
    full = Variant("full")
    rows = [("full", *answer(model, tokenizer, prompt, full.caches(model, len(prompt))))]
    for bits in map(int, filter(None, args.kv_bits.split(","))):
        rows.append((f"kv_bits={bits}", *answer(model, tokenizer, prompt, full.caches(model, len(prompt)),
                                                 kv_bits=bits, quantized_kv_start=0)))
    for spec in split_specs(args.methods):
        rows.append((spec, *answer(model, tokenizer, prompt, Variant.of(spec).caches(model, len(prompt)))))
    veloxpatch.unpatch()
    for label, said, nbytes in rows:
        print(f"{label:24} {nbytes / 2**20:7.2f} MiB  {said!r}")


if __name__ == "__main__":
    main()
