"""Shared prefills for the retrieval tasks: one prompt prefill serves many variants, exactly.

Why it is exact. Retrieval runs our caches in ``VELOX_COMPRESS=end`` mode: the prompt's chunks never compress (a chunk
longer than the decode headroom is a prefill chunk), and mlx_lm's ``generate_step`` feeds the prompt's last token as
the first decode-sized step, which compresses the prompt before it attends. So once ``prompt[:-1]`` is in, a cache of a
method that keeps no state of its own holds its rows, the remembered queries and its offset, none of which depends on
the budget or on which such method it is. From there each variant decodes on its own copy:

* **shared** (the full cache, and the methods :data:`PROMPT_STATE` names): one prefill per prompt by a *source* method
  at a budget no prompt reaches; each variant gets a fresh cache list made as an app's would be (``variants``: the real
  builder, knobs and coordinator) with a copy of the source's rows, offset and (``window``) remembered queries moved
  in. The full cache decodes on the source itself (our cache never evicting is mlx_lm's ``KVCache``, which the check
  checks too), its KV bytes counted as ``KVCache``'s (rows with spare capacity; no positions, no queries).
* **own** (every other method of ours: accumulated attention, the newest query alone, reports to a coordinator,
  folds): one prefill per (method, knobs) at a budget no prompt reaches, deep-copied (coordinator included) per
  budget, whose ``budget`` is set before decoding.
* **plain**: mlx_lm's own variants (rotating, quantized: their prefill differs) and anything a check refuses run
  ``generate_step`` on the whole prompt.

The prefill is mlx_lm's own ``generate_step``, stopped by its progress callback once ``prompt[:-1]`` is in (so
chunking, coordinator resets and evaluation are a plain run's). Decoding calls it unwrapped from the last prompt token:
the shim's wrapper would reset the coordinators as a new generation starts, which a plain run did before its prompt,
not between the prompt and its last token.

Two checks keep it exact rather than assumed. A prompt with a chunk no longer than the largest decode headroom may
hold a decode-sized step (compressed in the middle of a plain run's prompt, or told from a prompt chunk differently at
two budgets): it runs plain for the variant. And before a (model, method, knobs) first shares, :func:`modes` runs it
both ways on a short random prompt at two evicting budgets: tokens, log-probabilities and the final cache state must
be equal, else it falls back to its own prefill, then to plain, said once in the log.
"""

from __future__ import annotations

import copy
import gc
import time
import weakref
from collections import Counter
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from veloxpatch.caches import CompressedKVCache
from veloxpatch.config import Budget
from veloxpatch.integration.wrappers import ours
from veloxpatch.log import log
from veloxpatch.registry import METHODS, name_of

from .variants import PROTECTED, KVLayout, Variant

HUGE = 1 << 30  # a budget no prompt reaches: the cache never evicts
# What reading a prompt leaves in a method's caches besides state of its own: its rows and offset, and for a method
# scoring by the prompt's last queries their remembered window. Any other method (a plugin's too) prefills alone.
PROMPT_STATE = {"streamingllm": "rows", "snapkv": "window", "pyramidkv": "window", "chunkkv": "window"}
SOURCE = "snapkv"  # the shared prefill's method: its prompt leaves its rows and the window of queries for any to take
SHARED, OWN, PLAIN = "shared", "own", "plain"
# the check: a prompt of 1 + 2 chunks longer than any default headroom (64), budgets that evict (headroom 8 and
# 9), enough decode steps for a compression after the prompt's
PROBE_PROMPT, PROBE_STEP, PROBE_BUDGETS, PROBE_DECODE = 1 + 2 * 65, 65, (PROTECTED + 4, 2 * PROTECTED), 10


@dataclass
class Request:
    """One variant to decode from a prompt: at ``budget`` rows, the way ``mode`` says."""

    variant: Variant
    budget: int
    mode: str


@dataclass
class Result:
    """What a request produced: the greedy tokens (with log-probabilities), the cache list it ended with, its KV
    bytes, the peak memory its run would have had on its own, and its :class:`Reading` peak."""

    request: Request
    tokens: list[int]
    logprobs: list[mx.array]
    caches: list[Any]
    kv_bytes: int
    peak_bytes: int
    read_peak_bytes: int
    shared: bool = True  # False: it ran plain


class Reading:
    """The most memory held while a prompt is read (every token but the last, whose step starts decoding: where
    ``end`` mode compresses) over what was held when the run began (the loaded model, anything kept aside): what a
    user must have free to read a long document. :meth:`progress` is ``generate_step``'s progress callback."""

    def __init__(self) -> None:
        self.start = mx.get_active_memory()
        self.peak = 0

    def progress(self, done: int, total: int) -> None:
        if done == total - 1:
            self.done()

    def done(self) -> None:
        self.peak = max(self.peak, mx.get_peak_memory() - self.start)


def fresh_reading() -> Reading:
    """The :class:`Reading` of a run about to start, its peak its own: earlier runs' garbage collected (a cache list
    with a coordinator is a cycle, which only the collector frees: left, it counted in the next run's peak), mlx's
    buffer cache emptied and its peak reset."""
    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    return Reading()


def random_prompt(model: Any, size: int) -> mx.array:
    """``size`` random tokens of ``model``'s vocabulary, the same ones at every call of that size."""
    return mx.random.randint(0, model.args.vocab_size, (size,), key=mx.random.key(size))


def candidate(variant: Variant) -> str:
    """The mode the declared rule gives a variant (before :func:`modes` checks it)."""
    if variant.method not in METHODS:
        return SHARED if variant.method == "full" else PLAIN
    return SHARED if variant.method in PROMPT_STATE else OWN


# ----------------------------------------------------------------------------- the two halves of generate_step
class _Prefilled(Exception):
    """Raised by the progress callback to stop ``generate_step`` once ``prompt[:-1]`` is in the caches."""


class Prefill:
    """``tokens[:-1]`` read into ``base`` once (as the module docstring says), for several decodes to start from on
    copies: the chunk sizes it used, its seconds, its peak memory and its :class:`Reading`."""

    def __init__(self, model: Any, tokens: mx.array, base: list[Any], step: int) -> None:
        from mlx_lm.generate import generate_step  # the patched one, as a plain run calls it

        self.base = base
        self.chunks: list[int] = []
        self.reading = fresh_reading()

        def progress(done: int, total: int) -> None:
            if done > sum(self.chunks):
                self.chunks.append(done - sum(self.chunks))
            if done >= total - 1:
                raise _Prefilled

        start = time.perf_counter()
        try:
            next(generate_step(tokens, model, max_tokens=1, prompt_cache=base, prefill_step_size=step,
                               prompt_progress_callback=progress))
        except _Prefilled:
            self.seconds = time.perf_counter() - start
        else:
            raise RuntimeError("mlx_lm's generate_step did not report its prompt progress")
        self.reading.done()
        self.peak = mx.get_peak_memory()

    def untouched(self, caches: list[Any]) -> bool:
        """Whether every prompt chunk was a prefill chunk both for this prefill and for a plain run with ``caches``:
        longer than any decode headroom their caches can have (the headroom for a budget no prompt reaches; asked
        without calling ``target()``, which a method may keep state in)."""
        return not self.chunks or all(min(self.chunks) > c.schedule.headroom(HUGE)
                                      for c in ours(caches) + ours(self.base))


def whole(model: Any, tokens: mx.array, caches: list[Any], max_tokens: int, step: int, reading: Reading | None = None,
          raw: bool = False, stop: Collection[int] = (), **quant: Any) -> list[tuple[int, mx.array]]:
    """Greedy tokens (ids, whatever ``generate_step``'s annotation says) and log-probabilities by mlx_lm's
    ``generate_step`` as the shim patches it, up to the first token in ``stop`` (an end of turn, fed to the caches as
    a chat's next turn finds it); ``raw``: unwrapped, to decode from a prefill's last prompt token (see the module)."""
    from mlx_lm.generate import generate_step

    run = getattr(generate_step, "__wrapped__", generate_step) if raw else generate_step
    out: list[tuple[int, mx.array]] = []
    for token, logprobs in run(tokens, model, max_tokens=max_tokens, prompt_cache=caches, prefill_step_size=step,
                               prompt_progress_callback=reading.progress if reading is not None else None, **quant):
        out.append((int(token), logprobs))
        if out[-1][0] in stop:
            break
    return out


# ----------------------------------------------------------------------------- moving a prefill
def transplant(source: list[Any], target: list[Any]) -> list[Any] | None:
    """``target`` (a fresh list of another method) holding a copy of ``source``'s prefill: per slot, our
    caches get the source's rows, offset and remembered queries (if the target's prompt keeps the window); any
    other slot becomes a copy of the source's. None when the lists do not line up slot for slot."""
    if len(source) != len(target):
        return None
    memo: dict[int, Any] = {}
    out = list(target)
    for i, (s, t) in enumerate(zip(source, target)):
        if isinstance(s, CompressedKVCache) and isinstance(t, CompressedKVCache):
            window = PROMPT_STATE.get(name_of(t)) == "window"
            if (s.sink, s.window, s.schedule.mode) != (t.sink, t.window, t.schedule.mode) or (
                    window and PROMPT_STATE.get(name_of(s)) != "window"):
                return None
            if id(t) not in memo:
                memo[id(t)] = t
                t.store = copy.deepcopy(s.store)  # appends write into the store's arrays in place
                if window:
                    t.memory = copy.copy(s.memory)  # its queries are replaced, never written in place
                t.offset, t.evicted = s.offset, s.evicted
                if hasattr(t, "prompt_open"):  # a prompt was read: the next decode-sized step takes the snapshot
                    t.prompt_open = getattr(s, "prompt_open", True)
        elif type(s) is type(t) and not isinstance(s, CompressedKVCache):
            out[i] = copy.deepcopy(s, memo)
        else:
            return None
    return out


def kv_bytes(caches: list[Any], dense: bool = False) -> int:
    """KV bytes of a list as the harness reports them; ``dense``: our never-evicting caches counted as
    mlx_lm's ``KVCache`` would hold the same rows (the same capacity steps; no positions, no queries)."""
    return sum(sum(a.nbytes for a in rows_arrays(c)) if dense and isinstance(c, CompressedKVCache) else c.nbytes
               for c in caches)


def rows_arrays(cache: CompressedKVCache) -> list[mx.array]:
    """The arrays of a cache of ours' stored keys and values (none before its first rows)."""
    store = cache.store
    if cache.empty() or store.keys is None or store.values is None:
        return []
    return [*store.keys, *store.values]


# ----------------------------------------------------------------------------- the engine
def run(model: Any, tokens: mx.array, requests: list[Request], max_tokens: int, step: int) -> Iterator[Result]:
    """Each request yielded as it finishes: the plain ones first, then the others decoded from a shared prefill (shared
    and own modes, see the module docstring); a request whose prompt chunking could compress mid-prompt runs plain."""
    groups: dict[Any, list[Request]] = {}
    for r in requests:  # the shared group first; in it the full cache decodes on the source itself, last
        if r.mode == PLAIN:
            yield _plain(model, tokens, r, max_tokens, step)
        else:
            groups.setdefault(SHARED if r.mode == SHARED else (r.variant.method, r.variant.knobs), []).append(r)
    for key, members in sorted(groups.items(), key=lambda group: group[0] != SHARED):
        base = Variant(SOURCE) if key == SHARED else members[0].variant
        members = sorted(members, key=lambda r: r.variant.method == "full")
        yield from _group(model, tokens, base.caches(model, tokens.size, budget=HUGE), members, max_tokens, step)


def _group(model: Any, tokens: mx.array, base: list[Any], members: list[Request], max_tokens: int,
           step: int) -> Iterator[Result]:
    """One prefill into ``base``, then each member decoded on its own copy (the last on ``base`` itself when
    it can be)."""
    prefill = Prefill(model, tokens, base, step)
    for i, r in enumerate(members):
        v = r.variant
        caches: list[Any] | None
        if r.mode == SHARED and v.method != "full":
            caches = transplant(base, v.caches(model, tokens.size, budget=r.budget))
        else:  # the base itself for the last member, else a copy (coordinator included), at the member's budget
            caches = copy.deepcopy(base) if i < len(members) - 1 else base
            for cache in ours(caches):
                cache.budget = Budget(tokens=HUGE if v.method == "full" else r.budget)
        held = kv_bytes(base) if caches is not base else 0  # kept for the next members, not this run's own
        if caches is None or (v.method != "full" and not prefill.untouched(caches)):
            yield _plain(model, tokens, r, max_tokens, step, held)
            continue
        fresh_reading()
        pairs = whole(model, tokens[-1:], caches, max_tokens, step, raw=True)
        peak = max(prefill.peak, mx.get_peak_memory() - held)
        yield Result(r, [t for t, _ in pairs], [p for _, p in pairs], caches,
                     kv_bytes(caches, dense=v.method == "full"), peak, prefill.reading.peak)
        del caches


def _plain(model: Any, tokens: mx.array, r: Request, max_tokens: int, step: int, held: int = 0) -> Result:
    """A whole ``generate_step`` run of ``r``'s variant, with its own generate arguments (mlx_lm's kv_bits)."""
    quant = r.variant.generate_kwargs(KVLayout.of(model))
    caches = r.variant.caches(model, tokens.size, budget=r.budget)
    reading = fresh_reading()
    pairs = whole(model, tokens, caches, max_tokens, step, reading, **quant)
    return Result(r, [t for t, _ in pairs], [p for _, p in pairs], caches, kv_bytes(caches),
                  mx.get_peak_memory() - held, reading.peak, shared=False)


# ----------------------------------------------------------------------------- the check
_modes: dict[tuple[Any, ...], str] = {}


def modes(model: Any, chosen: list[Variant]) -> dict[Variant, str]:
    """How each variant runs on ``model``: :func:`candidate`'s mode where the check (the module docstring) finds
    it exact, else the next safer one, said in the log. Checked once per (model, method, knobs), all variants
    together, so the shared candidates are checked from one source prefill."""
    todo = {(id(model), v.method, v.knobs): Variant(v.method, 1.0, v.knobs) for v in chosen
            if candidate(v) != PLAIN and (id(model), v.method, v.knobs) not in _modes}
    for key, found in _check(model, todo).items():
        _modes[key] = found
        weakref.finalize(model, _modes.pop, key, None)
    return {v: PLAIN if candidate(v) == PLAIN else _modes[id(model), v.method, v.knobs] for v in chosen}


def plan(model: Any, chosen: list[Variant]) -> dict[Variant, str]:
    """The mode of each variant on one prompt: a group that would share a prefill with nobody (the full cache
    alone, one budget of an own-prefill method) gains nothing, so it runs plain, unchecked."""
    def group(v: Variant) -> Any:
        return SHARED if candidate(v) == SHARED else (v.method, v.knobs)

    sizes = Counter(group(v) for v in chosen if candidate(v) != PLAIN)
    found = modes(model, [v for v in chosen if candidate(v) != PLAIN and sizes[group(v)] > 1])
    return {v: found.get(v, PLAIN) for v in chosen}


def _check(model: Any, todo: dict[tuple[Any, ...], Variant]) -> dict[tuple[Any, ...], str]:
    tokens = random_prompt(model, PROBE_PROMPT)

    def budgets(v: Variant) -> tuple[int, ...]:
        return (HUGE,) if v.method == "full" else PROBE_BUDGETS

    expected = {(v, b): _plain(model, tokens, Request(v, b, PLAIN), PROBE_DECODE, PROBE_STEP)
                for v in todo.values() for b in budgets(v)}
    found: dict[tuple[Any, ...], str] = {}
    trying = {key: candidate(v) for key, v in todo.items()}
    while trying:
        requests = [Request(todo[key], b, m) for key, m in trying.items() for b in budgets(todo[key])]
        failed = {got.request.variant for got in run(model, tokens, requests, PROBE_DECODE, PROBE_STEP)
                  if not _same(expected[got.request.variant, got.request.budget], got)}
        retry = {}
        for key, m in trying.items():
            name = todo[key].name
            if todo[key] not in failed:
                found[key] = m
                if m != candidate(todo[key]):
                    log.warning("eval: %s differs when it takes over a shared prefill; it gets its own", name)
            elif m == SHARED and todo[key].method != "full":
                retry[key] = OWN
            else:
                found[key] = PLAIN
                log.warning("eval: %s differs from a plain run on a prefill shared across budgets; it runs plain", name)
        trying = retry
    return found


def _same(a: Result, b: Result) -> bool:
    """Equal greedy tokens and log-probabilities, KV bytes, and (both ours) equal cache states."""
    if a.tokens != b.tokens or a.kv_bytes != b.kv_bytes or not _state_equal(a.logprobs, b.logprobs):
        return False
    return b.request.variant.method == "full" or (
        len(a.caches) == len(b.caches) and all(_state_equal(x.state, y.state) for x, y in zip(a.caches, b.caches)))


def _state_equal(x: Any, y: Any) -> bool:
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(_state_equal(x[k], y[k]) for k in x)
    if isinstance(x, (tuple, list)) and isinstance(y, (tuple, list)):
        return len(x) == len(y) and all(_state_equal(a, b) for a, b in zip(x, y))
    if isinstance(x, mx.array) and isinstance(y, mx.array):
        return x.shape == y.shape and x.dtype == y.dtype and bool(mx.array_equal(x, y).item())
    return type(x) is type(y) and x == y
