"""How alike adjacent layers' KV rows are: the premise of the cross-layer methods, measured on a model.

    python bench/layer_similarity.py --model FOLDER [--context 2048] [--seed 0]

MiniCache (arXiv 2405.14366) merges two adjacent layers' rows per token, which pays off when the
rows of layer l and l+1 for the same token and KV head point in nearly the same direction. xKV
(arXiv 2503.18893) needs less: that the layers' rows span similar subspaces. This reads one
held-out ``niah_single`` prompt into mlx_lm's own caches and prints, per adjacent pair from the
first layer on, the mean and median cosine similarity of the pair's rows (same token, same KV head)
for keys and values. Prints a Markdown table.
"""

from __future__ import annotations

import argparse

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from veloxpatch.eval import ruler


def unit(x: mx.array) -> mx.array:
    return x / mx.maximum(mx.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def cosines(caches: list, tokens: int, which: str) -> list[mx.array]:
    """Per adjacent pair, the cosine of each (token, KV head) row pair, flattened."""
    rows = [unit(getattr(c, which)[..., :tokens, :].astype(mx.float32)) for c in caches]
    return [(a * b).sum(axis=-1).flatten() for a, b in zip(rows, rows[1:])]


def prompt_caches(model, tokenizer, context: int, seed: int) -> tuple[list, int]:
    """mlx_lm's own caches after one held-out ``niah_single`` prompt of about ``context`` tokens, and its length."""
    prompt = mx.array(tokenizer.encode(ruler.example("niah_single", tokenizer, context, seed).prompt))
    caches = make_prompt_cache(model)
    for start in range(0, prompt.size, 2048):
        model(prompt[None, start : start + 2048], cache=caches)
        mx.eval([c.state for c in caches])
    return caches, prompt.size


def summary(values: mx.array) -> str:
    ordered = mx.sort(values)
    return f"{values.mean().item():.3f} / {ordered[ordered.size // 2].item():.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model, tokenizer = load(args.model)
    caches, tokens = prompt_caches(model, tokenizer, args.context, args.seed)
    keys, values = cosines(caches, tokens, "keys"), cosines(caches, tokens, "values")
    print(f"adjacent-layer cosine similarity of KV rows, {tokens} tokens (mean / median)\n")
    print("| layers | keys | values |\n|---|---|---|")
    for layer, (k, v) in enumerate(zip(keys, values)):
        print(f"| {layer}-{layer + 1} | {summary(k)} | {summary(v)} |")


if __name__ == "__main__":
    main()
