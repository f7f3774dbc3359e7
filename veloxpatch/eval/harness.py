"""``veloxpatch eval``: retrieval accuracy and perplexity per method, context length and budget.

Retrieval runs through mlx_lm's own ``generate_step`` with the variant's cache list (the path
a user's app takes). Perplexity feeds held-out text in steps of ``PPL_STEP`` tokens through
the same caches, so compression happens between steps as it would in a long chat, and scores
the second half of the text, where the context the cache holds has been compressed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import mlx.core as mx
import veloxpatch

from . import tasks
from .variants import KVLayout, Variant, variants

TASKS = ("passkey", "multikey", "perplexity")
PPL_STEP = 64


@dataclass
class EvalSpec:
    """The grid: tasks x context lengths x variants, ``samples`` held-out seeds per cell."""

    tasks: list[str] = field(default_factory=lambda: list(TASKS))
    contexts: list[int] = field(default_factory=lambda: [1024])
    shares: list[float] = field(default_factory=lambda: [1.0, 0.5, 0.25, 0.125])
    methods: list[str] = field(default_factory=list)
    samples: int = 20
    prefill_step: int = 512
    seed: int = 0  # a cell uses held-out seeds seed .. seed + samples - 1


@dataclass
class Cell:
    """One measured (task, context, variant) cell."""

    task: str
    context: int
    variant: Variant
    metric: float
    kv_bytes: float
    peak_bytes: float
    samples: int

    def row(self) -> dict[str, Any]:
        return {
            "task": self.task, "context": self.context, "method": self.variant.method,
            "share": self.variant.share, "label": self.variant.label(),
            "metric": "accuracy" if self.task != "perplexity" else "perplexity",
            "value": self.metric, "kv_bytes": self.kv_bytes, "peak_bytes": self.peak_bytes,
            "samples": self.samples,
        }


def retrieval(model: Any, tokenizer: Any, variant: Variant, prompt: str, answer: str, spec: EvalSpec,
              quant: dict[str, Any]) -> tuple[float, int]:
    """Greedy answer under the variant's cache: (1.0 if right else 0.0, KV bytes at the end).

    ``quant`` is the variant's kv_bits arguments for mlx_lm (empty unless it is the quantized one)."""
    from mlx_lm.generate import generate_step

    tokens = mx.array(tokenizer.encode(prompt))
    caches = variant.caches(model, tokens.size)
    steps = len(tokenizer.encode(answer)) + 2
    out = [t for t, _ in generate_step(tokens, model, max_tokens=steps, prompt_cache=caches,
                                       prefill_step_size=spec.prefill_step, **quant)]
    right = tasks.is_correct(tokenizer.decode(out), answer)
    return float(right), sum(c.nbytes for c in caches)


def perplexity(model: Any, tokenizer: Any, variant: Variant, text: str, spec: EvalSpec,
               quant: dict[str, Any]) -> tuple[float, int]:
    """exp(mean NLL) of the second half of ``text`` under the variant's cache, and KV bytes.

    The text streams through the cache in steps of PPL_STEP tokens, each scored as it arrives, so
    our caches compress between steps (``VELOX_COMPRESS=chunk``): with ``end`` nothing would be
    compressed before the last token and every method would score as the full cache.
    """
    from mlx_lm.generate import maybe_quantize_kv_cache

    tokens = mx.array(tokenizer.encode(text))
    caches = variant.caches(model, tokens.size, compress="chunk")
    total, count, start_scoring = 0.0, 0, tokens.size // 2
    for start in range(0, tokens.size - 1, PPL_STEP):
        end = min(start + PPL_STEP, tokens.size - 1)
        logits = model(tokens[None, start:end], cache=caches)[0].astype(mx.float32)
        if quant:
            maybe_quantize_kv_cache(caches, quant["quantized_kv_start"], quant["kv_group_size"], quant["kv_bits"])
        targets = tokens[start + 1 : end + 1]
        nll = mx.logsumexp(logits, axis=-1) - mx.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]
        scored = mx.arange(start, end) >= start_scoring
        total += mx.sum(mx.where(scored, nll, 0.0)).item()
        count += int(mx.sum(scored).item())
    return float(mx.exp(mx.array(total / max(count, 1))).item()), sum(c.nbytes for c in caches)


def examples(task: str, tokenizer: Any, context: int, spec: EvalSpec) -> list[tuple[str, str]]:
    """The spec's held-out (prompt, answer) pairs; perplexity has text and no answer."""
    seeds = range(spec.seed, spec.seed + spec.samples)
    if task == "passkey":
        return [tasks.passkey_example(tokenizer, context, seed, "heldout") for seed in seeds]
    if task == "multikey":
        return [tasks.multikey_example(tokenizer, context, seed, "heldout") for seed in seeds]
    return [(tasks.longtext_sample(tokenizer, context, seed), "") for seed in seeds]


def measure(model: Any, tokenizer: Any, task: str, context: int, variant: Variant,
            items: list[tuple[str, str]], spec: EvalSpec, layout: KVLayout) -> Cell:
    """Average one variant over the task's examples, with KV bytes and peak memory."""
    quant = variant.generate_kwargs(layout)
    values, kv, peaks = [], [], []
    for prompt, answer in items:
        mx.clear_cache()
        mx.reset_peak_memory()
        if task == "perplexity":
            value, nbytes = perplexity(model, tokenizer, variant, prompt, spec, quant)
        else:
            value, nbytes = retrieval(model, tokenizer, variant, prompt, answer, spec, quant)
        values.append(value)
        kv.append(nbytes)
        peaks.append(mx.get_peak_memory())
    n = len(values)
    return Cell(task, context, variant, sum(values) / n, sum(kv) / n, sum(peaks) / n, n)


def run_eval(model: Any, tokenizer: Any, spec: EvalSpec,
             progress: Callable[[Iterator[Any], int], Iterator[Any]] | None = None) -> list[Cell]:
    """Every cell of the grid; leaves mlx_lm unpatched afterwards."""
    grid = [(task, context, v) for task in spec.tasks for context in spec.contexts
            for v in variants(spec.methods, spec.shares)]
    cache: dict[tuple[str, int], list[tuple[str, str]]] = {}
    layout = KVLayout.of(model)
    cells = []
    steps = progress(iter(grid), len(grid)) if progress else iter(grid)
    try:
        for task, context, variant in steps:
            if (task, context) not in cache:
                cache[task, context] = examples(task, tokenizer, context, spec)
            cells.append(measure(model, tokenizer, task, context, variant, cache[task, context], spec, layout))
    finally:
        veloxpatch.unpatch()
    return cells
