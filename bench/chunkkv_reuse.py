"""ChunkKV's layer-wise index reuse: what a compression step costs with and without it.

    python bench/chunkkv_reuse.py --model FOLDER [--context 2048] [--budget 256] [--repeats 5]

The paper (arXiv 2502.00299) reports lower latency from reuse: a follower layer applies its
leader's kept positions instead of scoring its own rows. This times the one decode step that
compresses an ``end``-mode prompt (every layer compresses in it) for reuse 1 (every layer chooses),
2 and 4, against the same step with nothing to compress (the budget above the context), so the
difference is the compression's own cost. One prompt is prefilled once through the real shim; each
timed step runs on a fresh deep copy of that prefill. Prints a Markdown table (medians).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

import veloxpatch
from veloxpatch.config import Budget

NEVER = 1 << 30


def prefilled(model, prompt: mx.array, step: int) -> list:
    """A chunkkv cache list holding ``prompt[:-1]`` uncompressed (end mode, budget never reached)."""
    veloxpatch.patch(kv="chunkkv", budget=NEVER, compress="end")
    caches = make_prompt_cache(model)
    for start in range(0, prompt.size - 1, step):
        model(prompt[None, start : min(start + step, prompt.size - 1)], cache=caches)
        mx.eval([c.state for c in caches])
    return caches


def timed_step(model, last: mx.array, caches: list, budget: int, reuse: int) -> float:
    """Seconds of the decode step on a copy of ``caches`` at ``budget`` rows with reuse ``reuse``."""
    copies = copy.deepcopy(caches)
    for cache in copies:
        cache.budget, cache.reuse = Budget(tokens=budget), reuse
    mx.eval([c.state for c in copies])
    start = time.perf_counter()
    mx.eval(model(last[None], cache=copies))
    mx.eval([c.state for c in copies])
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prefill-step", type=int, default=2048)
    args = parser.parse_args()
    model, _ = load(args.model)
    prompt = mx.random.randint(0, model.args.vocab_size, (args.context,), key=mx.random.key(0))
    caches = prefilled(model, prompt, args.prefill_step)
    cases = [("no compression", NEVER, 1)] + [(f"reuse {n}", args.budget, n) for n in (1, 2, 4)]
    timed_step(model, prompt[-1:], caches, args.budget, 1)  # warm-up
    medians = {}
    for label, budget, reuse in cases:
        medians[label] = statistics.median(timed_step(model, prompt[-1:], caches, budget, reuse)
                                           for _ in range(args.repeats))
    base = medians["no compression"]
    print(f"ChunkKV, {args.context}-token prompt, budget {args.budget}, {len(caches)} layers, "
          f"median of {args.repeats}\n")
    print("| case | step s | compression s | vs reuse 1 |\n|---|---|---|---|")
    for label, seconds in medians.items():
        own = seconds - base
        ratio = "" if label == "no compression" else f"{own / (medians['reuse 1'] - base):.2f}"
        print(f"| {label} | {seconds:.4f} | {own:.4f} | {ratio} |")
    veloxpatch.unpatch()


if __name__ == "__main__":
    main()
