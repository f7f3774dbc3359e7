"""``veloxpatch bench``: prefill time, decode speed and KV memory per method vs vanilla mlx_lm.

Everything runs in one process, on one model, one run after another, through mlx_lm's ``generate_step`` (the path a
user's app takes), so the ratios compare like with like. Vanilla also runs at a context equal to the budget: the
decode speed a compressed cache holding that many rows should approach.

A long prefill dominates a bench on a CPU, and in ``end`` mode it is the same work for many methods (``sharing`` says
why and checks it). So with ``--share-prefill`` (the default) and ``--compress end``, each context times the prefill
of ``prompt[:-1]`` once per group, and each case decodes from the last prompt token on fresh copies of its group's
caches (moved into a list of its own method, or deep-copied): a warm-up, then ``repeats`` timed decodes, medians.
``prefill_s`` is the group's prefill plus the case's first decode step (where ``end`` mode compresses): a plain run's
time to the first token. A case the checks refuse gets its own prefill, or runs plain.

Plain (``--no-share-prefill``, ``--compress chunk``, vanilla at the budget's context, mlx_lm's quantized cache, which
``generate_step`` quantizes as it goes, fallbacks): a warm-up, then ``repeats`` whole runs, medians. The rows'
``prefill`` field says how a case was timed: ``plain``, ``own`` or ``shared:<source method>``.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

import veloxpatch
from veloxpatch.registry import METHODS

from . import sharing
from .variants import KVLayout, Variant

LARGE_RANDOM = dict(hidden_size=1024, num_hidden_layers=8, intermediate_size=2816, num_attention_heads=16,
                    num_key_value_heads=4, head_dim=64, vocab_size=4096)

PEAK_NOTE = ("peak_bytes: the most memory mlx held during the case's run (model weights included): with a shared "
             "or own prefill, the larger of its prefill group's peak (prompt[:-1]) and its own decode's peak (from "
             "the last prompt token, less the group's prefill kept aside for the other cases); both are in the "
             "JSON/CSV as prefill_peak_bytes and decode_peak_bytes. read_peak_bytes: the most memory held while the "
             "prompt was read (every token but the last), over what was held before (the loaded model). prefill_s: "
             "time to the first token.")


@dataclass
class BenchSpec:
    contexts: list[int] = field(default_factory=lambda: [1024, 4096])
    budget: int = 256
    methods: list[str] = field(default_factory=list)
    new_tokens: int = 64
    repeats: int = 3
    prefill_step: int = 512
    compress: str = "end"
    share_prefill: bool = True


@dataclass
class Timing:
    prefill_s: float
    decode_tok_s: float
    kv_bytes: int
    peak_bytes: int
    prefill_peak_bytes: int
    decode_peak_bytes: int
    read_peak_bytes: int  # the most memory held while the prompt was read, over the loaded model (sharing.Reading)


@dataclass
class Measured:
    """One case's figures, the greedy tokens it generated and how its prefill was timed."""

    index: int  # in :func:`cases`
    context: int
    label: str
    variant: Variant
    timing: Timing
    tokens: list[int]
    prefill: str

    def row(self) -> dict[str, Any]:
        return {"context": self.context, "variant": self.label, "budget": self.variant.budget(self.context),
                **vars(self.timing), "prefill": self.prefill}


def time_generation(model: Any, prompt: mx.array, caches: list[Any], spec: BenchSpec, held: int = 0,
                    extra: dict[str, Any] | None = None, raw: bool = False) -> tuple[Timing, list[int]]:
    """A run: time to the first token (prefill) and the decode rate of the remaining new tokens; peaks less
    ``held`` (memory kept by others meanwhile); ``extra``: more ``generate_step`` arguments (mlx_lm's ``kv_bits``);
    ``raw``: decoding a prefill's copy from the last prompt token, as :func:`sharing.whole` does."""
    from mlx_lm.generate import generate_step

    if raw:
        mx.eval([c.state for c in caches])  # the copy is made before the clock starts
    run = getattr(generate_step, "__wrapped__", generate_step) if raw else generate_step
    reading = sharing.fresh_reading()
    tokens: list[int] = []
    start = time.perf_counter()
    first, prefill_peak = start, 0
    for n, (token, _) in enumerate(run(prompt, model, max_tokens=spec.new_tokens, prompt_cache=caches,
                                       prefill_step_size=spec.prefill_step, prompt_progress_callback=reading.progress,
                                       **(extra or {}))):
        if n == 0:
            first = time.perf_counter()
            prefill_peak = mx.get_peak_memory()
            mx.reset_peak_memory()
        tokens.append(int(token))
    end = time.perf_counter()
    prefill_peak, decode_peak = max(prefill_peak - held, 0), max(mx.get_peak_memory() - held, 0)
    return Timing(first - start, (spec.new_tokens - 1) / (end - first), sum(c.nbytes for c in caches),
                  max(prefill_peak, decode_peak), prefill_peak, decode_peak, reading.peak), tokens


def median_timing(run: Callable[[], tuple[Timing, list[int]]], repeats: int,
                  low: Collection[str] = ()) -> tuple[Timing, list[int]]:
    """Median of each figure over ``repeats`` runs, after one warm-up run (the figures in ``low``: the lower middle of
    an even count, a run's own); the last run's tokens."""
    run()
    runs = [run() for _ in range(max(repeats, 1))]
    return Timing(*((statistics.median_low if f in low else statistics.median)(getattr(t, f) for t, _ in runs)
                    for f in vars(runs[0][0]))), runs[-1][1]


def cases(spec: BenchSpec) -> list[tuple[int, str, Variant]]:
    """(context, label, variant) in row order: vanilla at the budget, then per context vanilla and each method."""
    out = [(spec.budget, f"vanilla@ctx={spec.budget}", Variant("full"))]
    for context in spec.contexts:
        out.append((context, "vanilla", Variant("full")))
        out += [(context, m, Variant.of(m, spec.budget / context)) for m in spec.methods]
    return out


def measure(model: Any, spec: BenchSpec) -> Iterator[Measured]:
    """Every case of :func:`cases`, yielded as it finishes (not in row order when prefills are shared)."""
    all_cases = [(i, *case) for i, case in enumerate(cases(spec))]
    if not (spec.share_prefill and spec.compress == "end"):  # exact in ``end`` mode: chunk mode's prefill differs
        yield from (_plain(model, *case, spec) for case in all_cases)
        return
    # a shared candidate is first checked against plain runs on a short prompt (see sharing); an own prefill
    # needs no check: it is the case's own plain prefill, and a deep copy of any cache list replays it
    layout = KVLayout.of(model)
    modes = sharing.modes(model, [v for *_, v in all_cases if v.method in METHODS
                                  and sharing.candidate(v) == sharing.SHARED])
    # mlx_lm quantizes inside generate_step: its prefill is its own
    how = {v: sharing.PLAIN if v.generate_kwargs(layout) else modes.get(v, sharing.OWN) for *_, v in all_cases}
    yield _plain(model, *all_cases[0], spec)  # vanilla at the budget's context: cheap
    for context in spec.contexts:
        here = [case for case in all_cases[1:] if case[1] == context]
        prompt = sharing.random_prompt(model, context)
        groups = [(case[3], [case], sharing.OWN) for case in here if how[case[3]] == sharing.OWN]  # vanilla first
        shared = [case for case in here if how[case[3]] == sharing.SHARED]
        if shared:  # right after vanilla
            groups.insert(1, (Variant(sharing.SOURCE), shared, f"{sharing.SHARED}:{sharing.SOURCE}"))
        for source, members, label in groups:
            yield from _group(model, prompt, source, members, label, spec)
        yield from (_plain(model, *case, spec) for case in here if how[case[3]] == sharing.PLAIN)


def _plain(model: Any, index: int, context: int, label: str, variant: Variant, spec: BenchSpec,
           held: int = 0) -> Measured:
    prompt = sharing.random_prompt(model, context)
    extra = variant.generate_kwargs(KVLayout.of(model))
    timing, tokens = median_timing(
        lambda: time_generation(model, prompt, variant.caches(model, context, spec.compress), spec, held, extra),
        spec.repeats)
    return Measured(index, context, label, variant, timing, tokens, sharing.PLAIN)


def _group(model: Any, prompt: mx.array, source: Variant, members: list[tuple[int, int, str, Variant]],
           how: str, spec: BenchSpec) -> Iterator[Measured]:
    """One timed prefill of ``prompt[:-1]`` into ``source``'s caches (shared: at a budget no prompt reaches), then
    each member's decodes on its own copy: moved into a fresh list of its method (shared), or deep-copied (own)."""
    base = source.caches(model, prompt.size, spec.compress, budget=None if how == sharing.OWN else sharing.HUGE)
    prefill = sharing.Prefill(model, prompt, base, spec.prefill_step)
    held = sharing.kv_bytes(base)  # kept aside while a copy decodes: not the case's own
    for index, context, label, variant in members:
        def fresh() -> list[Any] | None:
            """A copy to decode on; None where a prompt chunk could be a decode step, or the lists do not line up."""
            if how == sharing.OWN:
                return copy.deepcopy(base)  # coordinators included (one deepcopy of the whole list)
            caches = sharing.transplant(base, variant.caches(model, context, spec.compress))
            return caches if caches is not None and prefill.untouched(caches) else None

        def decode() -> tuple[Timing, list[int]]:
            caches = fresh()
            assert caches is not None  # made as the first one was, which was not None
            return time_generation(model, prompt[-1:], caches, spec, held, raw=True)

        if how != sharing.OWN and fresh() is None:
            yield _plain(model, index, context, label, variant, spec, held)
            continue
        # byte counts: a run's own; peak_bytes: the whole decode's
        decoded, tokens = median_timing(decode, spec.repeats, low=("kv_bytes", "peak_bytes"))
        timing = Timing(prefill.seconds + decoded.prefill_s, decoded.decode_tok_s, decoded.kv_bytes,
                        max(prefill.peak, decoded.peak_bytes), prefill.peak, decoded.peak_bytes, prefill.reading.peak)
        yield Measured(index, context, label, variant, timing, tokens, how)


def run_bench(model: Any, spec: BenchSpec,
              progress: Callable[[Iterator[Any], int], Iterator[Any]] | None = None) -> list[dict[str, Any]]:
    """One row per case (in :func:`cases` order), with decode speed, KV bytes and the reading's peak relative to
    vanilla at the same context."""
    steps = measure(model, spec)
    try:
        found = {m.index: m for m in (progress(steps, len(cases(spec))) if progress else steps)}
    finally:
        veloxpatch.unpatch()
    rows = [found[i].row() for i in sorted(found)]
    vanilla = {r["context"]: r for r in rows if r["variant"] == "vanilla"}
    for r in rows:
        base = vanilla.get(r["context"])
        for ratio, figure in (("decode", "decode_tok_s"), ("kv", "kv_bytes"), ("read", "read_peak_bytes")):
            r[f"{ratio}_vs_vanilla"] = r[figure] / base[figure] if base else None
    return rows
