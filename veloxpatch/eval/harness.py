"""``veloxpatch eval``: retrieval accuracy and perplexity per method, context length and budget.

Retrieval runs through mlx_lm's own ``generate_step`` with the variant's cache list (the path a user's app takes),
sharing a prompt's prefill among variants where that is exact (``sharing``); perplexity streams held-out text through
the same caches (:func:`perplexity`). The RULER-style tasks of ``ruler`` (for a real model) run the same way and are
scored by their own rules; ``followup``, a chat of two turns on one cache list (:func:`chat`), depends on each
variant's first answer, so every variant runs on its own prefill. Finished examples and cells go to journals
(:class:`Journal`), so a killed run keeps them and a rerun with the same arguments skips them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import mlx.core as mx

import veloxpatch

from . import equal_bytes as equal_bytes_
from . import ruler, sharing, tasks
from .report import wilson
from .variants import KVLayout, Variant, line_identity, variants

TASKS = ("passkey", "multikey", "perplexity")  # the default list, made for the shipped tiny model
ALL_TASKS = TASKS + tuple(ruler.GENERATORS)
Item = tuple[str, str] | ruler.Example  # (prompt, answer) for the shipped model's tasks, or a RULER example
PPL_STEP = 64
FIRST_TURN = 24  # tokens a follow-up's first answer may take (a seven-digit number, then the end of the turn)


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
    share_prefill: bool = True  # False: every (example, variant) runs its own prefill (the same results, slower)
    protocol: str = "inside"  # "after": a RULER example's context compressed alone, its question the next turn
    equal_bytes: bool = False  # True: a share is of the full cache's 16-bit bytes once the context is read, not rows


@dataclass(frozen=True)
class Sample:
    """One variant on one example: the task's metric, KV bytes at the end, peak memory of the run, and the most
    memory held while a prompt was read, over the loaded model (``sharing.Reading``); the last two are None in
    journals written before they were measured."""

    value: float
    kv_bytes: float
    peak_bytes: float
    read_peak_bytes: float | None = None
    kv16_bytes: float | None = None  # the KV bytes as a 16-bit model holds them (``equal_bytes``), where measured

    @classmethod
    def of_row(cls, row: dict[str, Any]) -> Sample:
        return cls(row["value"], row["kv_bytes"], row["peak_bytes"], row.get("read_peak_bytes"), row.get("kv16_bytes"))

    @classmethod
    def mean(cls, samples: list[Sample]) -> Sample:
        """Each figure's mean, or None where any sample lacks it."""
        figures = [[getattr(s, f.name) for s in samples] for f in fields(cls)]
        means: list[Any] = [None if None in values else sum(values) / len(values) for values in figures]
        return cls(*means)


@dataclass
class Cell:
    """One measured (task, context, variant) cell: the mean of its samples."""

    task: str
    context: int
    variant: Variant
    mean: Sample
    samples: int

    def row(self) -> dict[str, Any]:
        """The cell as JSON; an accuracy carries its 95% Wilson interval over the cell's samples."""
        accuracy, mean = self.task != "perplexity", self.mean
        low, high = wilson(mean.value * self.samples, self.samples) if accuracy else (None, None)
        return {
            "task": self.task, "context": self.context, "method": self.variant.name,
            "share": self.variant.share, "label": self.variant.label(), "knobs": self.variant.knob_values(),
            "metric": "accuracy" if accuracy else "perplexity",
            "value": mean.value, "ci95_low": low, "ci95_high": high,
            "kv_bytes": mean.kv_bytes, "peak_bytes": mean.peak_bytes, "read_peak_bytes": mean.read_peak_bytes,
            "kv16_bytes": mean.kv16_bytes, "samples": self.samples,
        }

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Cell:
        """The cell a journal line describes (``method`` carries a variant's knobs: ``snapkv[kernel=15]``)."""
        return cls(row["task"], row["context"], Variant.of(row["method"], row["share"]), Sample.of_row(row),
                   row["samples"])


@dataclass
class Journal:
    """Finished cells as JSON lines; ``key`` holds what else must match for a line to count as done (model, samples,
    seed, prefill step), so changing an argument recomputes instead of reusing.

    Beside it (``eval.samples.jsonl`` for ``eval.cells.jsonl``), each (example, variant) result as it finishes: a
    cell of many examples is long at 8k tokens, and a rerun resumes inside it. An example is named by its seed, so
    its result counts for any sample count and first seed (a run stopped after 5 of 10 examples is reported with
    ``--samples 5``)."""

    path: Path
    key: dict[str, Any]

    @property
    def samples_path(self) -> Path:
        return self.path.with_name(self.path.name.split(".")[0] + ".samples.jsonl")

    def done(self) -> dict[tuple[str, int, str], Cell]:
        """Cells already measured under this key, by (task, context, variant identity)."""
        return {(r["task"], r["context"], line_identity(r["label"], r.get("knobs"))): Cell.from_row(r)
                for r in self._rows(self.path)}

    def samples(self) -> dict[tuple[str, int, str, int], Sample]:
        """Examples already measured under this key, by (task, context, variant identity, seed)."""
        return {(r["task"], r["context"], line_identity(r["label"], r.get("knobs")), r["seed"]): Sample.of_row(r)
                for r in self._rows(self.samples_path, ignore=("samples", "seed"))}

    def add(self, cell: Cell) -> None:
        self._write(self.path, cell.row())

    def add_sample(self, task: str, context: int, variant: Variant, seed: int, sample: Sample) -> None:
        self._write(self.samples_path, {"task": task, "context": context, "label": variant.label(),
                                        "knobs": variant.knob_values(), "seed": seed, **asdict(sample)})

    def _rows(self, path: Path, ignore: tuple[str, ...] = ()) -> list[dict[str, Any]]:
        """The lines of ``path`` written under this key (its ``ignore`` fields aside)."""
        if not path.exists():
            return []
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        key = {k: v for k, v in self.key.items() if k not in ignore}
        return [r for r in rows if {k: v for k, v in r.get("key", {}).items() if k not in ignore} == key]

    def _write(self, path: Path, row: dict[str, Any]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as handle:
            handle.write(json.dumps({**row, "key": self.key}) + "\n")


def conversation(model: Any, tokenizer: Any, variant: Variant, item: Item, spec: EvalSpec,
                 budget: int | None = None) -> Sample:
    """The variant's :class:`Sample` of one example, on its own prefill (a follow-up's every turn on one cache list,
    :func:`chat`); its peak memory is the run's since the caches were built (as :func:`retrievals` measures a question
    asked after its context: not the equal-bytes calibration or the probe before)."""
    tokens, steps = _prompt(tokenizer, item)
    quant = variant.generate_kwargs(KVLayout.of(model))  # mlx_lm's kv_bits arguments for its quantized cache
    caches = variant.caches(model, tokens.size, budget=budget)
    reading = sharing.fresh_reading()
    if isinstance(item, ruler.Example) and item.turns:
        out = chat(model, tokenizer, caches, item, spec, quant, reading)[-1]
    else:
        out = [t for t, _ in sharing.whole(model, tokens, caches, steps, spec.prefill_step, reading, **quant)]
    held = sharing.kv_bytes(caches)  # before the 16-bit count reads the state (H2O then folds its queued queries)
    kv16 = equal_bytes_.held_bytes(caches) if spec.equal_bytes else None  # a plain run's: mlx_lm's full cache
    return Sample(_right(tokenizer, out, item), held, mx.get_peak_memory(), reading.peak, kv16)


def chat(model: Any, tokenizer: Any, caches: list[Any], item: ruler.Example, spec: EvalSpec,
         quant: dict[str, Any], reading: sharing.Reading) -> list[list[int]]:
    """Every turn of ``item`` on one cache list, each answer's tokens: a turn before the last answered to its end
    of turn (at most :data:`FIRST_TURN` tokens); each turn the conversation so far and the next question, templated
    anew, of which the caches keep the tokens they hold and read the rest (trimmed back first where the new text
    parts from them, as the server does); ``reading`` told when each turn's prompt is read."""
    from mlx_lm.models.cache import trim_prompt_cache

    cached: list[int] = []  # what the caches hold
    answers: list[list[int]] = []
    texts: list[str] = []
    for turn in range(len(item.turns)):
        full = tokenizer.encode(ruler.conversation(tokenizer, item.turns, texts))
        keep = next((i for i, (a, b) in enumerate(zip(cached, full)) if a != b), min(len(cached), len(full)))
        if turn:
            trim_prompt_cache(caches, len(cached) - keep)
        limit = _steps(tokenizer, item) if turn == len(item.turns) - 1 else FIRST_TURN
        out = _turn(model, tokenizer, mx.array(full[keep:]), caches, limit, spec, quant, reading)
        answers.append(out)
        cached = full + out
        texts.append(tokenizer.decode([t for t in out if t not in tokenizer.eos_token_ids]))
    return answers


def _turn(model: Any, tokenizer: Any, tokens: mx.array, caches: list[Any], limit: int, spec: EvalSpec,
          quant: dict[str, Any], reading: sharing.Reading | None = None) -> list[int]:
    """One chat turn through mlx_lm's ``generate_step`` as the shim patches it (as mlx_lm chat calls it): greedy
    tokens up to the end of the turn or ``limit`` tokens."""
    return [t for t, _ in sharing.whole(model, tokens, caches, limit, spec.prefill_step, reading,
                                        stop=tokenizer.eos_token_ids, **quant)]


def retrievals(model: Any, tokenizer: Any, chosen: list[Variant], item: Item, spec: EvalSpec,
               budgets: Budgets) -> dict[Variant, Sample]:
    """Every chosen variant on one example, sharing prefills where that is exact (``sharing``); a follow-up
    example's variants each on their own. Under ``protocol="after"``, the field's protocol (kvpress's leaderboard),
    each variant's cache reads a RULER example's context alone, as a generation of no tokens, and compresses it as a
    chat's first turn would leave it; then the question comes as the next turn on that cache. KV bytes are those held
    once the prompt (or the context) is read."""
    follow_up = isinstance(item, ruler.Example) and bool(item.turns)
    tokens, steps = _prompt(tokenizer, item)
    question = None
    if isinstance(item, ruler.Example) and spec.protocol == "after" and not follow_up:
        tokens = mx.array(tokenizer.encode(item.context))
        question = mx.array(tokenizer.encode(item.question, add_special_tokens=False))
    shared = spec.share_prefill and not follow_up
    modes = sharing.plan(model, chosen) if shared else dict.fromkeys(chosen, sharing.PLAIN)
    requests = [sharing.Request(v, budgets(v, tokens.size), modes[v]) for v in chosen]
    out = {r.variant: conversation(model, tokenizer, r.variant, item, spec, r.budget)
           for r in requests if r.mode == sharing.PLAIN and question is None}
    for r in sharing.run(model, tokens, [r for r in requests if r.variant not in out],
                         steps if question is None else 0, spec.prefill_step):
        variant = r.request.variant
        counted = spec.equal_bytes or question is not None
        # the full cache's rows alone, as mlx_lm's KVCache holds them (a shared prefill runs it as one of ours)
        kv16 = equal_bytes_.held_bytes(r.caches, variant.method == "full") if counted else None
        answer, peak = r.tokens, r.peak_bytes
        if question is not None:  # the next turn on the caches; the peak the run's since they were built
            quant = variant.generate_kwargs(KVLayout.of(model))
            answer = _turn(model, tokenizer, question, r.caches, steps, spec, quant)
            peak = max(peak, mx.get_peak_memory())
        out[variant] = Sample(_right(tokenizer, answer, item), r.kv_bytes, peak, r.read_peak_bytes, kv16)
        del r  # its caches let go before the next variant reads the prompt (they would count in its peak)
    return {v: out[v] for v in chosen}


class Budgets:
    """The rows each variant keeps of a context: its share of the rows, or (``equal_bytes``) the budget whose bytes
    are its share of the full cache's 16-bit bytes (:mod:`equal_bytes`), measured once per variant."""

    def __init__(self, model: Any, equal_bytes: bool) -> None:
        self.model, self.equal_bytes = model, equal_bytes
        self.per_token: float | None = None
        self.lines: dict[tuple[str, Any], Callable[[float], int]] = {}  # by (method, knobs): one serves every share

    def __call__(self, variant: Variant, context: int) -> int:
        """The rows for ``variant`` at ``context`` tokens; by its share where its own rule stands (mlx_lm's quantized
        cache, a method keeping every token, a budget of rows), all of them (:data:`sharing.HUGE`) for the full one."""
        if variant.method == "full":
            return sharing.HUGE
        if not self.equal_bytes or variant.method == "quantized" or variant.ignores_budget():
            return variant.budget(context)
        if self.per_token is None:
            self.per_token = equal_bytes_.full_bytes_per_token(self.model)
        key = (variant.method, variant.knobs)
        if key not in self.lines:
            self.lines[key] = equal_bytes_.budget_line(self.model, variant)
        return self.lines[key](variant.share * self.per_token * context)


def _prompt(tokenizer: Any, item: Item) -> tuple[mx.array, int]:
    """The prompt's tokens and how many to generate (:func:`_steps`)."""
    prompt = item.prompt if isinstance(item, ruler.Example) else item[0]
    return mx.array(tokenizer.encode(prompt)), _steps(tokenizer, item)


def _steps(tokenizer: Any, item: Item) -> int:
    """How many tokens to generate: the answer's, and a few of slack for separators (RULER answers get more, for a
    model's own phrasing; a list answer RULER's own number, ``ruler.ANSWER_TOKENS``)."""
    if isinstance(item, ruler.Example):
        return max(len(tokenizer.encode(item.answer)) + 8, item.tokens)
    return len(tokenizer.encode(item[1])) + 2


def _right(tokenizer: Any, out: list[int], item: Item) -> float:
    text = tokenizer.decode(out)
    return float(ruler.score(text, item) if isinstance(item, ruler.Example) else tasks.is_correct(text, item[1]))


def perplexity(model: Any, tokenizer: Any, variant: Variant, text: str) -> Sample:
    """exp(mean NLL) of the second half of ``text`` (where the context the cache holds has been compressed) under the
    variant's cache, KV bytes and memory (the whole text is read: the run's peak). The text streams through the cache
    in steps of PPL_STEP tokens, each scored as it arrives, so our caches compress between steps as in a long chat
    (``VELOX_COMPRESS=chunk``): with ``end`` every method would score as the full cache."""
    from mlx_lm.generate import maybe_quantize_kv_cache

    reading = sharing.fresh_reading()
    tokens = mx.array(tokenizer.encode(text))
    caches = variant.caches(model, tokens.size, compress="chunk")
    quant = variant.generate_kwargs(KVLayout.of(model))
    total, count, start_scoring = 0.0, 0, tokens.size // 2
    for start in range(0, tokens.size - 1, PPL_STEP):
        end = min(start + PPL_STEP, tokens.size - 1)
        logits = model(tokens[None, start:end], cache=caches)[0].astype(mx.float32)
        if quant:
            maybe_quantize_kv_cache(caches, quant["quantized_kv_start"], quant["kv_group_size"], quant["kv_bits"])
        targets = tokens[start + 1 : end + 1]
        nll = mx.logsumexp(logits, axis=-1) - mx.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]
        scored = mx.arange(start, end) >= start_scoring
        total += float(mx.sum(mx.where(scored, nll, 0.0)))
        count += int(mx.sum(scored))
    value, nbytes = float(mx.exp(mx.array(total / max(count, 1)))), sharing.kv_bytes(caches)
    reading.done()
    return Sample(value, nbytes, mx.get_peak_memory(), reading.peak)


def examples(task: str, tokenizer: Any, context: int, spec: EvalSpec) -> list[Item]:
    """The spec's held-out (prompt, answer) pairs or RULER examples; perplexity has text and no answer."""
    seeds = range(spec.seed, spec.seed + spec.samples)
    if task in ruler.GENERATORS:
        return [ruler.example(task, tokenizer, context, seed, "heldout") for seed in seeds]
    if task == "perplexity":
        return [(tasks.longtext_sample(tokenizer, context, seed), "") for seed in seeds]
    make = tasks.passkey_example if task == "passkey" else tasks.multikey_example
    return [make(tokenizer, context, seed, "heldout") for seed in seeds]


def measure(model: Any, tokenizer: Any, task: str, item: Item, chosen: list[Variant], spec: EvalSpec,
            budgets: Budgets) -> dict[Variant, Sample]:
    """The chosen variants on one of the task's examples, with KV bytes and peak memory. Variants that differ
    only in a share their method ignores (``Variant.twin_key``) are measured once (XQuant's decoding is slow)."""
    first: dict[tuple[Any, ...], Variant] = {}
    for variant in chosen:
        first.setdefault(variant.twin_key(), variant)
    if task == "perplexity":
        out = {v: perplexity(model, tokenizer, v, item[0]) for v in first.values()}  # type: ignore[index]
    else:
        out = retrievals(model, tokenizer, list(first.values()), item, spec, budgets)
    return {v: out[first[v.twin_key()]] for v in chosen}


def run_eval(model: Any, tokenizer: Any, spec: EvalSpec,
             progress: Callable[[Iterator[Any], int], Iterator[Any]] | None = None,
             journal: Journal | None = None) -> list[Cell]:
    """Every cell of the grid, reusing the journal's finished cells and examples and adding new ones as they
    finish; leaves mlx_lm unpatched afterwards. The work goes example by example (progress counts them): all
    variants of a (task, context) on one example, so they can share its prefill."""
    grid = variants(spec.methods, spec.shares)
    done = journal.done() if journal else {}
    measured = journal.samples() if journal else {}
    items: dict[tuple[str, int], list[Item]] = {}
    budgets = Budgets(model, spec.equal_bytes)
    units = [(task, context, i) for task in spec.tasks for context in spec.contexts for i in range(spec.samples)]
    cells = []
    try:
        for task, context, i in progress(iter(units), len(units)) if progress else units:
            seed = spec.seed + i
            todo = [v for v in grid if (task, context, v.identity()) not in done
                    and (task, context, v.identity(), seed) not in measured]
            if todo:
                if (task, context) not in items:
                    items[task, context] = examples(task, tokenizer, context, spec)
                for variant, sample in measure(model, tokenizer, task, items[task, context][i], todo, spec,
                                               budgets).items():
                    measured[task, context, variant.identity(), seed] = sample
                    if journal:
                        journal.add_sample(task, context, variant, seed, sample)
            if i < spec.samples - 1:
                continue
            for variant in grid:
                key = (task, context, variant.identity())
                if key not in done:
                    got = [measured[key + (s,)] for s in range(spec.seed, spec.seed + spec.samples)]
                    done[key] = Cell(task, context, variant, Sample.mean(got), len(got))
                    if journal:
                        journal.add(done[key])
                cells.append(replace(done[key], variant=variant))  # as asked, if measured under another name
    finally:
        veloxpatch.unpatch()
    return cells
