"""Decode speed of several caches on one model, one step of each in turn, so the machine's drift hits all alike.

    python bench/decode_round_robin.py --model FOLDER [--context 1024] [--rounds 60]
        [--variants 'full,quant,quant[keep=0.125x],quantized[bits=4]']

``veloxpatch bench`` times each case's decode in a run of its own, one after another; on a shared 2-core machine
vanilla's own speed moved by 19% between two such runs in one process (149 and 177 ms a token, Qwen2.5-0.5B at 1k),
more than the differences measured. Here every variant's cache list reads the same prompt first (its own prefill,
as a plain run's), then each round runs one decode step of every variant in turn (the model call and evaluation of
the next token, timed; patching for our methods and unpatching for mlx_lm's caches happens between, untimed). Printed
per variant: the median step time over the rounds (the first three left out) and the speed as a multiple of the
first variant's. Variants are ``veloxpatch eval``'s ``--methods`` items and ``full``; ``quantized[bits=N]`` is
mlx_lm's own ``QuantizedKVCache`` (what ``kv_bits=N`` with ``quantized_kv_start=0`` holds), prefilled quantized.
The prompt is a document of this repository's source, so a method choosing rows by attention meets real text.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm import load, stream_generate
from mlx_lm.models import cache as mlx_cache

import veloxpatch
from veloxpatch.eval.variants import Variant, split_specs
from veloxpatch.registry import METHODS

SKIPPED = 3  # first rounds left out of the median (allocations, caches warming)


def switch(variant: Variant, context: int) -> None:
    """mlx_lm patched for one of our methods, or unpatched for its own caches."""
    if variant.method in METHODS:
        veloxpatch.patch(**variant.settings(variant.budget(context)))
    else:
        veloxpatch.unpatch()


def prefilled(model: Any, tokenizer: Any, variant: Variant, prompt: list[int]) -> tuple[list[Any], mx.array]:
    """The variant's cache list after reading ``prompt`` and the first token it generates."""
    caches = variant.caches(model, len(prompt))
    if variant.method == "quantized":
        bits = int(dict(variant.knobs).get("bits") or 4)
        caches = [mlx_cache.QuantizedKVCache(group_size=64, bits=bits) for _ in caches]
    for response in stream_generate(model, tokenizer, prompt, max_tokens=1, prompt_cache=caches):
        token = response.token
    return caches, mx.array([[token]])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--variants", default="full,quant,quant[keep=0.125x],quantized[bits=4]")
    args = parser.parse_args()
    model, tokenizer = load(args.model)
    source = "".join(p.read_text() for p in sorted(Path(veloxpatch.__file__).parent.rglob("*.py")))
    prompt = tokenizer.encode(source)[: args.context]
    variants = [Variant.of(spec) for spec in split_specs(args.variants)]
    state = {}
    for variant in variants:
        switch(variant, args.context)
        state[variant] = prefilled(model, tokenizer, variant, prompt)
    times: dict[Variant, list[float]] = {v: [] for v in variants}
    for _ in range(args.rounds):
        for variant in variants:
            switch(variant, args.context)
            caches, token = state[variant]
            start = time.perf_counter()
            token = mx.argmax(model(token, cache=caches)[:, -1], axis=-1, keepdims=True)
            mx.eval(token)
            times[variant].append(time.perf_counter() - start)
            state[variant] = caches, token
    medians = {v: statistics.median(t[SKIPPED:]) for v, t in times.items()}
    first = medians[variants[0]]
    print(f"{args.context} tokens, {args.rounds} rounds")
    for variant, seconds in medians.items():
        print(f"{variant.name:32s} {seconds * 1e3:8.1f} ms/token  {first / seconds:5.3f}x {variants[0].name}'s speed")


if __name__ == "__main__":
    main()
