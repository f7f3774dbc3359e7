"""``veloxpatch bench``: prefill time, decode speed and KV memory per method vs vanilla mlx_lm.

Everything is measured in one process, on one model, one run after another, through mlx_lm's
``generate_step`` (the path a user's app takes), so the ratios compare like with like. Besides
vanilla at each context it runs vanilla at a context equal to the budget: the decode speed a
compressed cache holding that many rows should approach.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import mlx.core as mx

import veloxpatch

from .variants import Variant

LARGE_RANDOM = dict(hidden_size=1024, num_hidden_layers=8, intermediate_size=2816, num_attention_heads=16,
                    num_key_value_heads=4, head_dim=64, vocab_size=4096)


@dataclass
class BenchSpec:
    contexts: list[int] = field(default_factory=lambda: [1024, 4096])
    budget: int = 256
    methods: list[str] = field(default_factory=list)
    new_tokens: int = 64
    repeats: int = 3
    prefill_step: int = 512
    compress: str = "end"


@dataclass
class Timing:
    prefill_s: float
    decode_tok_s: float
    kv_bytes: int
    peak_bytes: int


def time_generation(model: Any, prompt: mx.array, caches: list[Any], spec: BenchSpec) -> Timing:
    """Time to the first token (prefill) and the decode rate of the remaining new tokens."""
    from mlx_lm.generate import generate_step

    mx.clear_cache()
    mx.reset_peak_memory()
    start = time.perf_counter()
    first = None
    for n, _ in enumerate(generate_step(prompt, model, max_tokens=spec.new_tokens, prompt_cache=caches,
                                        prefill_step_size=spec.prefill_step)):
        if n == 0:
            first = time.perf_counter()
    end = time.perf_counter()
    return Timing(first - start, (spec.new_tokens - 1) / (end - first),
                  sum(c.nbytes for c in caches), mx.get_peak_memory())


def median_timing(run: Callable[[], Timing], repeats: int) -> Timing:
    """Median of each figure over ``repeats`` runs, after one warm-up run."""
    run()
    runs = [run() for _ in range(repeats)]
    return Timing(*(statistics.median(getattr(r, f) for r in runs)
                    for f in ("prefill_s", "decode_tok_s", "kv_bytes", "peak_bytes")))


def cases(spec: BenchSpec) -> list[tuple[int, str, Variant]]:
    """(context, label, variant) in run order: vanilla at the budget, then per context vanilla and each method."""
    out = [(spec.budget, f"vanilla@ctx={spec.budget}", Variant("full"))]
    for context in spec.contexts:
        out.append((context, "vanilla", Variant("full")))
        out += [(context, m, Variant(m, spec.budget / context)) for m in spec.methods]
    return out


def run_bench(model: Any, spec: BenchSpec,
              progress: Callable[[Iterator[Any], int], Iterator[Any]] | None = None) -> list[dict[str, Any]]:
    """One row per case, with decode speed relative to vanilla at the same context."""
    all_cases = cases(spec)
    steps = progress(iter(all_cases), len(all_cases)) if progress else iter(all_cases)
    rows: list[dict[str, Any]] = []
    vocab = model.args.vocab_size
    try:
        for context, label, variant in steps:
            prompt = mx.random.randint(0, vocab, (context,), key=mx.random.key(context))
            timing = median_timing(lambda: time_generation(model, prompt, variant.caches(model, context, spec.compress), spec),
                                   spec.repeats)
            rows.append({"context": context, "variant": label, "budget": variant.budget(context), **vars(timing)})
    finally:
        veloxpatch.unpatch()
    return with_ratios(rows)


def with_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Add decode and memory ratios against vanilla at the same context."""
    vanilla = {r["context"]: r for r in rows if r["variant"] == "vanilla"}
    for r in rows:
        base = vanilla.get(r["context"])
        r["decode_vs_vanilla"] = r["decode_tok_s"] / base["decode_tok_s"] if base else None
        r["kv_vs_vanilla"] = r["kv_bytes"] / base["kv_bytes"] if base else None
    return rows
