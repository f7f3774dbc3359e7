"""mlx_lm's batched generation, which merges caches into batch caches that ours cannot join.

* ``BatchGenerator.insert_segments`` (``insert`` goes through it): batched generation runs on
  mlx_lm's own caches (logged once). Caches it makes stay mlx_lm's; compressed caches a caller hands in (the server's
  prompt-cache reuse, ``batch_generate(prompt_caches=...)``) become mlx_lm's: empty or lossless
  ones as exact copies, evicted ones by re-reading the tokens they saw, which the caller gives as
  ``all_tokens`` (the server does). An evicted cache without its tokens is refused before anything
  changes: its evicted rows are gone, and a batch cache cannot hold a history with gaps, so any
  tokens it produced would be wrong.
* ``batch_generate``: it hands ``insert`` no tokens, so a call whose prompt caches have evicted rows
  would meet that refusal. Such a call runs one sequence at a time through ``generate_step`` on
  copies of the caller's caches (logged once) and returns mlx_lm's ``BatchResponse``; every other
  call is mlx_lm's own. A failure there has no fall-back: mlx_lm's own would refuse the call.
"""

from __future__ import annotations

import copy
import inspect
import logging
import sys
import time
from typing import Any, Callable, NamedTuple

import mlx.core as mx
import wrapt

from ..caches.base import CompressedKVCache
from ..log import once
from .state import batched_generation
from .wrappers import ours

@wrapt.decorator
def batch_insert_segments(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    call = inspect.signature(wrapped).bind(*args, **kwargs)
    with batched_generation():
        _own_caches(instance, call.arguments)
        return wrapped(*call.args, **call.kwargs)


@wrapt.decorator
def batch_generate(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Prompt caches with evicted rows cannot join a batch, and ``batch_generate`` has no tokens to
    re-read them from, so such a call runs one sequence at a time; any other call is mlx_lm's own."""
    try:
        call = inspect.signature(wrapped).bind(*args, **kwargs)
    except TypeError:
        return wrapped(*args, **kwargs)  # mlx_lm reports the bad call itself
    if not any(_lost_rows(c) for caches in call.arguments.get("prompt_caches") or [] for c in caches or []):
        return wrapped(*args, **kwargs)
    once("batched sequential", logging.WARNING,
         "batch_generate got compressed caches with evicted rows; that batch runs one sequence at a time on them")
    call.apply_defaults()
    options = call.arguments.pop("kwargs")
    return _sequential_batch(**call.arguments, options=options)


def _own_caches(generator: Any, arguments: dict[str, Any]) -> None:
    """Swap the compressed caches a caller handed to ``insert_segments`` for mlx_lm's own.

    New lists only (the caller's stay as they were), written back only once every sequence is
    done, so a refusal leaves the generator and the caller untouched.
    """
    caches = arguments.get("caches")
    if not caches or not any(ours(c) for c in caches):
        return
    segments = list(arguments["segments"])
    seen = list(arguments.get("all_tokens") or [[] for _ in segments])
    if not len(caches) == len(segments) == len(seen):
        return  # mlx_lm reports the mismatch itself
    caches = list(caches)
    for i, cache_list in enumerate(caches):
        caches[i], segments[i], seen[i] = _own_sequence(generator, cache_list, segments[i], seen[i])
    arguments.update(caches=caches, segments=segments, all_tokens=seen)


def _own_sequence(generator: Any, caches: Any, segments: list, seen: list) -> tuple[Any, list, list]:
    """One sequence's (caches, segments, all_tokens) with mlx_lm's caches in place of ours."""
    found = ours(caches)
    if not found:
        return caches, segments, seen
    if not any(_lost_rows(c) for c in found):
        once("batched copy", logging.INFO, "compressed caches that lost nothing join mlx_lm's batch as exact copies")
        return [_dense_copy(c) if isinstance(c, CompressedKVCache) else c for c in caches], segments, seen
    if len(seen) != found[0].offset:
        raise ValueError(
            f"a compressed cache that has evicted rows ({found[0].size()} kept of {found[0].offset} tokens) cannot "
            "join mlx_lm's batched generation: pass the tokens it has seen as all_tokens (they are read again), "
            "or generate this sequence with generate, stream_generate or batch_generate (which runs such caches "
            "one sequence at a time)"
        )
    once("batched reread", logging.INFO,
         "a compressed cache with evicted rows joins mlx_lm's batch by re-reading the tokens it saw")
    fresh = sys.modules["mlx_lm.models.cache"].make_prompt_cache(generator.model, generator.max_kv_size)
    first = list(segments[0]) if segments else []
    return fresh, [list(seen) + first, *segments[1:]], []


def _dense_copy(cache: CompressedKVCache) -> Any:
    """mlx_lm's ``KVCache`` holding the same rows as ``cache``, which must have lost none."""
    from mlx_lm.models.cache import KVCache

    dense = KVCache()
    if not cache.empty():
        rows = cache.size()
        dense.update_and_fetch(cache.keys[..., :rows, :], cache.values[..., :rows, :])
    return dense


def _lost_rows(cache: Any) -> bool:
    """True for a compressed cache whose stored rows are no longer its whole history."""
    if not isinstance(cache, CompressedKVCache) or cache.empty():
        return False
    return cache.evicted or cache.size() != cache.offset


class _Finished(NamedTuple):
    """One sequence served sequentially: what ``batch_generate`` reports for it."""

    caches: list
    tokens: list[int]
    logprobs: list[float]


def _sequential_batch(
    model: Any, tokenizer: Any, prompts: list[list[int]], prompt_caches: list, max_tokens: int | list[int],
    verbose: bool, return_prompt_caches: bool, return_token_ids: bool, return_logprobs: bool,
    options: dict[str, Any],
) -> Any:
    """``batch_generate``'s answer, served one sequence at a time through ``generate_step``.

    The caller's caches are deep-copied first: ``batch_generate`` promises not to update them.
    """
    generate = sys.modules["mlx_lm.generate"]
    limits = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
    _check_sequences(prompts, prompt_caches, limits)
    step_options, stop = _step_options(model, options), set(tokenizer.eos_token_ids)
    stats = generate.BatchStats()
    start = time.perf_counter()
    done: list[_Finished] = []
    with generate.wired_limit(model):
        for prompt, caches, limit in zip(prompts, prompt_caches, limits):
            caches = copy.deepcopy(caches) if caches is not None else _fresh_caches(model, options)
            done.append(_generate_one(model, prompt, caches, limit, stop, step_options, stats, return_logprobs))
            if verbose:
                print(f"[batch_generate] {len(done)}/{len(prompts)} sequences done (one at a time)", end="\r")
    stats.wall_time = time.perf_counter() - start
    stats.peak_memory = mx.get_peak_memory() / 1e9
    if verbose:
        _print_batch_stats(stats)
    return generate.BatchResponse(
        texts=[tokenizer.decode(d.tokens) for d in done], stats=stats,
        caches=[d.caches for d in done] if return_prompt_caches else None,
        token_ids=[d.tokens for d in done] if return_token_ids else None,
        logprobs=[d.logprobs for d in done] if return_logprobs else None,
    )


def _check_sequences(prompts: list[list[int]], prompt_caches: list, limits: list[int]) -> None:
    """Refuse what ``BatchGenerator.insert`` refuses, before any sequence has run."""
    if not len(prompts) == len(prompt_caches) == len(limits):
        raise ValueError(f"prompt_caches and max_tokens must have one entry per prompt ({len(prompts)}): "
                         f"got {len(prompt_caches)} and {len(limits)}")
    for i, (prompt, limit) in enumerate(zip(prompts, limits)):
        if not prompt:
            raise ValueError(f"Sequence {i} has an empty prompt.")
        if limit <= 0:
            raise ValueError(f"Sequence {i}'s max_tokens must be > 0.")


def _step_options(model: Any, options: dict[str, Any]) -> dict[str, Any]:
    """The ``BatchGenerator`` settings that ``generate_step`` also takes (sampler, logits processors,
    prefill step size, stream, ...); the rest only shape batches. A setting ``BatchGenerator``
    would reject raises its TypeError here too. None means "the default" to both."""
    generate = sys.modules["mlx_lm.generate"]
    inspect.signature(generate.BatchGenerator).bind(model, stop_tokens=None, **options)
    shared = inspect.signature(generate.generate_step).parameters
    return {name: value for name, value in options.items() if name in shared and value is not None}


def _fresh_caches(model: Any, options: dict[str, Any]) -> list:
    """A prompt without a cache gets the one ``make_prompt_cache`` gives (compressed while patched)."""
    return sys.modules["mlx_lm.models.cache"].make_prompt_cache(model, options.get("max_kv_size"))


def _generate_one(
    model: Any, prompt: list[int], caches: list, limit: int, stop: set[int], step_options: dict[str, Any],
    stats: Any, want_logprobs: bool,
) -> _Finished:
    """One sequence on its own caches: a stop token ends it unreported, as in mlx_lm's batch.

    Time to the first token counts as prompt time, the rest as decode time, both added to ``stats``.
    """
    steps = sys.modules["mlx_lm.generate"].generate_step(
        mx.array(prompt), model, prompt_cache=caches, max_tokens=limit, **step_options)
    stats.prompt_tokens += len(prompt)
    tokens: list[int] = []
    logprobs: list[float] = []
    tic = time.perf_counter()
    for n, (token, vector) in enumerate(steps):
        elapsed = time.perf_counter() - tic
        if n == 0:
            stats.prompt_time += elapsed
        else:
            stats.decode_time += elapsed
        stats.generation_tokens += 1
        stats.generation_steps += 1
        if token in stop:
            break
        tokens.append(token)
        if want_logprobs:
            logprobs.append(vector[token].item())
        tic = time.perf_counter()
    return _Finished(caches, tokens, logprobs)


def _print_batch_stats(stats: Any) -> None:
    """What ``batch_generate(verbose=True)`` reports at the end, from our own measurements."""
    print()
    print(f"[batch_generate] Prompt: {stats.prompt_tokens} tokens, {stats.prompt_tps:.3f} tokens-per-sec")
    print(f"[batch_generate] Generation: {stats.generation_tokens} tokens, {stats.generation_tps:.3f} tokens-per-sec")
    print(f"[batch_generate] Peak memory: {stats.peak_memory:.3f} GB")
