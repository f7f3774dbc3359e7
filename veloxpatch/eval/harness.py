"""``veloxpatch eval``: retrieval accuracy and perplexity per method, context length and budget.

Retrieval runs through mlx_lm's own ``generate_step`` with the variant's cache list (the path
a user's app takes). Perplexity feeds held-out text in steps of ``PPL_STEP`` tokens through
the same caches, so compression happens between steps as it would in a long chat, and scores
the second half of the text, where the context the cache holds has been compressed.

The RULER-style tasks of ``ruler`` (for a real model) run the same way and are scored by their own rules.
Every finished cell is appended to a JSONL journal as it finishes, so a killed run keeps it and a rerun
with the same arguments skips it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import mlx.core as mx
import veloxpatch

from . import ruler, tasks
from .variants import KVLayout, Variant, variants

TASKS = ("passkey", "multikey", "perplexity")  # the default list, made for the shipped tiny model
ALL_TASKS = TASKS + ruler.TASKS
Item = tuple[str, str] | ruler.Example  # (prompt, answer) for the shipped model's tasks, or a RULER example
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

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> "Cell":
        """The cell a journal line describes."""
        return cls(row["task"], row["context"], Variant(row["method"], row["share"]), row["value"],
                   row["kv_bytes"], row["peak_bytes"], row["samples"])


@dataclass
class Journal:
    """Finished cells as JSON lines; ``key`` holds what else must match for a line to count as done
    (model, samples, seed, prefill step), so changing an argument recomputes instead of reusing."""

    path: Path
    key: dict[str, Any]

    def done(self) -> dict[tuple[str, int, str], Cell]:
        """Cells already measured under this key, by (task, context, label)."""
        if not self.path.exists():
            return {}
        rows = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
        return {(r["task"], r["context"], r["label"]): Cell.from_row(r) for r in rows if r.get("key") == self.key}

    def add(self, cell: Cell) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as handle:
            handle.write(json.dumps({**cell.row(), "key": self.key}) + "\n")


def retrieval(model: Any, tokenizer: Any, variant: Variant, item: Item, spec: EvalSpec,
              quant: dict[str, Any]) -> tuple[float, int]:
    """Greedy answer under the variant's cache: (1.0 if right else 0.0, KV bytes at the end).

    ``quant`` is the variant's kv_bits arguments for mlx_lm (empty unless it is the quantized one).
    RULER answers get a few tokens of slack for separators and a model's own phrasing."""
    from mlx_lm.generate import generate_step

    prompt, answer = (item.prompt, item.answer) if isinstance(item, ruler.Example) else item
    tokens = mx.array(tokenizer.encode(prompt))
    caches = variant.caches(model, tokens.size)
    steps = len(tokenizer.encode(answer)) + (8 if isinstance(item, ruler.Example) else 2)
    out = [t for t, _ in generate_step(tokens, model, max_tokens=steps, prompt_cache=caches,
                                       prefill_step_size=spec.prefill_step, **quant)]
    text = tokenizer.decode(out)
    right = ruler.score(text, item) if isinstance(item, ruler.Example) else tasks.is_correct(text, answer)
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


def examples(task: str, tokenizer: Any, context: int, spec: EvalSpec) -> list[Item]:
    """The spec's held-out (prompt, answer) pairs or RULER examples; perplexity has text and no answer."""
    seeds = range(spec.seed, spec.seed + spec.samples)
    if task in ruler.TASKS:
        return [ruler.example(task, tokenizer, context, seed, "heldout") for seed in seeds]
    if task == "passkey":
        return [tasks.passkey_example(tokenizer, context, seed, "heldout") for seed in seeds]
    if task == "multikey":
        return [tasks.multikey_example(tokenizer, context, seed, "heldout") for seed in seeds]
    return [(tasks.longtext_sample(tokenizer, context, seed), "") for seed in seeds]


def measure(model: Any, tokenizer: Any, task: str, context: int, variant: Variant,
            items: list[Item], spec: EvalSpec, layout: KVLayout) -> Cell:
    """Average one variant over the task's examples, with KV bytes and peak memory."""
    quant = variant.generate_kwargs(layout)
    values, kv, peaks = [], [], []
    for item in items:
        mx.clear_cache()
        mx.reset_peak_memory()
        if task == "perplexity":
            value, nbytes = perplexity(model, tokenizer, variant, item[0], spec, quant)  # type: ignore[index]
        else:
            value, nbytes = retrieval(model, tokenizer, variant, item, spec, quant)
        values.append(value)
        kv.append(nbytes)
        peaks.append(mx.get_peak_memory())
    n = len(values)
    return Cell(task, context, variant, sum(values) / n, sum(kv) / n, sum(peaks) / n, n)


def run_eval(model: Any, tokenizer: Any, spec: EvalSpec,
             progress: Callable[[Iterator[Any], int], Iterator[Any]] | None = None,
             journal: Journal | None = None) -> list[Cell]:
    """Every cell of the grid, reusing the journal's finished cells and adding new ones as they finish;
    leaves mlx_lm unpatched afterwards."""
    grid = [(task, context, v) for task in spec.tasks for context in spec.contexts
            for v in variants(spec.methods, spec.shares)]
    done = journal.done() if journal else {}
    cache: dict[tuple[str, int], list[Item]] = {}
    layout = KVLayout.of(model)
    cells = []
    steps = progress(iter(grid), len(grid)) if progress else iter(grid)
    try:
        for task, context, variant in steps:
            if (task, context, variant.label()) in done:
                cells.append(done[task, context, variant.label()])
                continue
            if (task, context) not in cache:
                cache[task, context] = examples(task, tokenizer, context, spec)
            cells.append(measure(model, tokenizer, task, context, variant, cache[task, context], spec, layout))
            if journal:
                journal.add(cells[-1])
    finally:
        veloxpatch.unpatch()
    return cells
