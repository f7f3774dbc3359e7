"""mlx_lm's batched generation, which merges per-sequence caches into its batch caches.

* ``BatchGenerator.insert_segments`` (``insert`` goes through it): batched generation runs on
  mlx_lm's own caches (logged once). Caches it makes stay mlx_lm's; compressed caches a caller hands in (the server's
  prompt-cache reuse, ``batch_generate(prompt_caches=...)``, direct calls) join as mlx_lm's:

  - empty or lossless ones as exact copies (``KVCache``);
  - evicted ones whose tokens the caller gives as ``all_tokens`` (the server does) by re-reading those tokens, so
    the batch continues exactly as mlx_lm's own would;
  - evicted ones without their tokens with the rows they kept, at their true positions (:class:`_Joined`).
    mlx_lm's ``BatchKVCache`` keeps each sequence's RoPE position (``offset``, one per sequence) apart from
    the rows it stores (``_idx``, masked on the left by ``left_padding``); only ``merge`` equates the two.
    Each kept row is already rotated at its own position and lies in the past of every new token, so the
    sequence's batch offset is set to the tokens the cache has seen and the batch attends over exactly the
    rows the cache would attend over on its own, at the same positions. Every row the sequence adds in the
    batch is kept (eviction is frozen while it is batched); a finished sequence comes back from ``extract``
    as a compressed cache of its own method holding those rows, each with its position, and its true offset.

  mlx_lm merges a prefill group with the ``merge`` of the group's first sequence, so when such a sequence
  is inserted every ``KVCache`` waiting in that generator becomes a :class:`_JoiningRows` and every batch
  cache it runs a :class:`_PositionedBatch`: both behave exactly as mlx_lm's own for every other sequence,
  and every batch cache that will hold the sequence keeps its positions.
  A batch masks rows per sequence, for every head and layer, so heads that hold different numbers of rows
  (*holes*, left by a trim) and layers that do (per-layer budgets) join as copies compressed further to the
  fewest rows any of them holds. Refused before anything changes (a ValueError naming what works instead):
  a list mixing mlx_lm's own caches with compressed ones of different lengths.
* ``batch_generate``: a call whose prompt caches have evicted rows runs one sequence at a time through
  ``generate_step`` on copies of the caller's caches (logged once) and returns mlx_lm's ``BatchResponse``:
  it has no tokens to re-read such caches from, and one at a time they keep compressing as they would in
  ``generate`` (in a batch every new row is kept). Every other call is mlx_lm's own. A failure there has no
  fall-back.

Every mlx_lm layout this relies on is reached through :mod:`.compat`, and checked there once, at the
first batched call (:func:`_layout_known`). Where the installed mlx_lm differs, both entries pass
through to mlx_lm, which then batches its own caches only (one warning naming what differs; an error
under ``VELOX_STRICT``), while everything else stays patched; where only what ``batch_generate``'s
sequential answer relies on differs (:data:`.compat.ANSWERING`), that entry alone passes through.
Whether the two entries are wrapped at all is decided when mlx_lm.generate is imported
(:mod:`.features`: a name missing, or parameters different).
"""

from __future__ import annotations

import copy
import functools
import inspect
import json
import logging
import sys
import time
from typing import Any, Callable, NamedTuple

import mlx.core as mx
import wrapt

from ..caches import CompressedKVCache
from ..caches.evicting import EvictingCache
from ..fallback import StrictError, notice
from ..log import once
from . import compat
from .state import batched_generation, in_force
from .wrappers import ours


@wrapt.decorator
def batch_insert_segments(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Caches made in here stay mlx_lm's; compressed caches handed in join as mlx_lm's (module doc)."""
    with batched_generation():
        if not _ours_to_batch() or not _layout_known(compat.BATCHING):
            return wrapped(*args, **kwargs)
        _refused_under_strict()
        call = inspect.signature(wrapped).bind(*args, **kwargs)
        _own_caches(instance, call.arguments)
        return wrapped(*call.args, **call.kwargs)


@wrapt.decorator
def batch_generate(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Prompt caches with evicted rows run one sequence at a time, where they keep compressing and
    ``batch_generate`` has no tokens to re-read them from; any other call is mlx_lm's own."""
    if not _ours_to_batch() or not _layout_known(tuple(compat.LAYOUTS)):
        return wrapped(*args, **kwargs)
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


def _ours_to_batch() -> bool:
    """Whether a compression method is on (with only ``VELOX_FLOAT32`` at work, batching is mlx_lm's own)."""
    config = in_force()
    return config is not None and config.enabled


def _layout_known(names: tuple[str, ...]) -> bool:
    """True when mlx_lm's batched generation has the layouts ``names`` as :mod:`.compat` knows them.
    Otherwise batching runs on mlx_lm's own caches only, said once; under ``VELOX_STRICT`` that is an
    error instead."""
    problem = compat.layout_problem(names)
    if problem is None:
        return True
    notice(f"batched generation runs on mlx_lm's own caches only: {problem}", in_force(),
           key=f"batched layout: {problem}")
    return False


def _refused_under_strict() -> None:
    """A batch runs on mlx_lm's batch caches, which hold every row it is given and every row it adds:
    compression does not go on there, a fallback that ``VELOX_STRICT`` turns into an error."""
    config = in_force()
    if config.strict:
        raise StrictError(f"mlx_lm's batched generation (BatchGenerator, batch_generate, the server's batched path) "
                          f"runs on mlx_lm's own batch caches, not compressed by {config.kv}, but VELOX_STRICT is set")


def _own_caches(generator: Any, arguments: dict[str, Any]) -> None:
    """Swap the compressed caches a caller handed to ``insert_segments`` for mlx_lm's own.

    New lists only (the caller's stay as they were), written back only once every sequence is
    done, so a refusal leaves the generator and the caller untouched. A sequence joining with its
    kept rows then has the generator's caches made to keep positions (:func:`_keep_positions`).
    """
    caches = arguments.get("caches")
    if not caches or not any(ours(c) or _joining(c) for c in caches):
        return
    segments = list(arguments["segments"])
    seen = list(arguments.get("all_tokens") or [[] for _ in segments])
    if not len(caches) == len(segments) == len(seen):
        return  # mlx_lm reports the mismatch itself
    caches = list(caches)
    for i, cache_list in enumerate(caches):
        caches[i], segments[i], seen[i] = _own_sequence(generator, cache_list, segments[i], seen[i])
    if any(_joining(c) for c in caches):
        caches = _keep_positions(generator, caches)
    arguments.update(caches=caches, segments=segments, all_tokens=seen)


def _own_sequence(generator: Any, caches: Any, segments: list, seen: list) -> tuple[Any, list, list]:
    """One sequence's (caches, segments, all_tokens) with mlx_lm's caches in place of ours."""
    found = ours(caches)
    if not found:
        return caches, segments, seen
    if not any(_lost_rows(c) for c in found):
        once("batched copy", logging.INFO, "compressed caches that lost nothing join mlx_lm's batch as exact copies")
        return [_dense_copy(c) if isinstance(c, CompressedKVCache) else c for c in caches], segments, seen
    if len(seen) == found[0].offset:
        once("batched reread", logging.INFO,
             "a compressed cache with evicted rows joins mlx_lm's batch by re-reading the tokens it saw")
        fresh = compat.new_sequence_caches(generator)
        first = list(segments[0]) if segments else []
        return fresh, [list(seen) + first, *segments[1:]], []
    joining = _joining_list(caches)
    once("batched join", logging.INFO,
         "a compressed cache with evicted rows and without its tokens joins mlx_lm's batch with the rows it kept, "
         "at their true positions")
    return joining, segments, seen


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


# --------------------------------------------------------------------- joining with the kept rows
class _Joined(NamedTuple):
    """What a batch keeps of a compressed cache that joined it with its kept rows, to give the
    sequence back as such a cache: its class, its settings (``meta_state``, decoded), the positions
    of the rows it brought, (1, kv_heads, rows), and the tokens it had seen then."""

    cls: type
    meta: dict[str, Any]
    positions: mx.array
    offset: int

    def rebuild(self, keys: mx.array, values: mx.array, offset: int) -> CompressedKVCache:
        """The compressed cache of the sequence's ``keys``/``values`` rows (the ones it brought, then
        one per token since) after ``offset`` tokens: a batch keeps every new row, so the rows after
        the brought ones are the last tokens, contiguous."""
        brought = self.positions.shape[2]
        added = keys.shape[2] - brought
        if added < 0:
            raise ValueError("a batch trimmed a sequence below the rows it joined with; its positions are lost")
        tail = mx.broadcast_to(mx.arange(offset - added, offset, dtype=mx.int32), (*self.positions.shape[:2], added))
        positions = mx.concatenate([self.positions.astype(mx.int32), tail], axis=2)
        meta = json.dumps({**self.meta, "offset": offset, "evicted": True, "bits": None})
        return self.cls.from_state(((keys,), (values,), positions, None, meta))


def _joined_rows(cache: CompressedKVCache) -> Any:
    """A :class:`_JoiningRows` holding ``cache``'s kept rows, which know their positions (no holes:
    :func:`_equal_rows` has removed them). Quantized rows join decoded, as attention uses them; the
    rows a batch adds stay unquantized."""
    joined = _Joined(type(cache), json.loads(cache.meta_state), cache.store.row_positions(), cache.offset)
    return _batch_classes()[0].holding(cache.keys, cache.values, cache.size(), joined)


def _equal_rows(caches: list) -> list:
    """``caches`` with its compressed caches replaced by copies that hold the same number of real rows
    in every head and layer: the fewest any of them holds.

    A batch cache masks rows per sequence, the same for every head and (one mask per forward) every
    layer. Heads differ after a trim left *holes*; layers differ under per-layer budgets (PyramidKV,
    SqueezeAttention). Compressing the fuller ones a little further, by their own method (by recency
    when they remember no queries), is a valid compressed cache that a batch can hold exactly.
    """
    found = [c for c in caches if isinstance(c, CompressedKVCache)]
    real = [(c.store.row_positions() >= 0).sum(axis=-1) for c in found]
    fewest = min(int(r.min().item()) for r in real)
    if all(int(r.max().item()) == fewest == c.size() for r, c in zip(real, found)):
        return caches
    once("batched equalise", logging.INFO,
         f"a compressed cache list joins mlx_lm's batch with {fewest} rows in every head and layer "
         "(a batch masks them alike); fuller heads and layers are compressed further")
    copies = copy.deepcopy(caches)
    for cache in copies:
        if isinstance(cache, EvictingCache) and (cache.size() != fewest or cache.store.holes):
            _shrink(cache, fewest)
    return copies


def _shrink(cache: EvictingCache, keep: int) -> None:
    """Compress ``cache`` to ``keep`` real rows per head, by its method or by recency without queries."""
    if cache.memory.queries is not None or not cache.uses_queries:
        scale = cache.memory.queries.shape[-1] ** -0.5 if cache.memory.queries is not None else 1.0
        cache.compress(keep, scale)
        return
    positions = cache.store.row_positions()
    newest = mx.argpartition(-positions, kth=keep - 1, axis=-1)[..., :keep]
    cache.keep_rows(mx.sort(newest, axis=-1))


def _joining_list(caches: list) -> list:
    """A sequence's cache list with every compressed cache as a :class:`_JoiningRows`.

    A model's layers share one mask per forward, built by one layer's cache, so every cache that
    becomes a ``BatchKVCache`` (ours and mlx_lm's ``KVCache``) must hold as many rows as the others.
    """
    from mlx_lm.models.cache import KVCache

    joining = [_joined_rows(c) if isinstance(c, CompressedKVCache) else c for c in _equal_rows(caches)]
    rows = {c.size() for c in joining if isinstance(c, KVCache)}
    if len(rows) > 1:
        raise ValueError(
            f"a cache list with evicted rows whose layers hold different numbers of rows ({sorted(rows)}: mlx_lm's "
            "own caches among compressed ones) cannot join mlx_lm's batched generation without its tokens: a batch "
            "masks every layer with one mask. Pass the tokens it has seen as all_tokens (they are read again), or "
            "generate this sequence with generate, stream_generate or batch_generate (which runs such caches one "
            "sequence at a time)"
        )
    return joining


def _joining(caches: Any) -> bool:
    """True for a cache list holding a compressed cache's kept rows on their way into a batch."""
    return isinstance(caches, (list, tuple)) and any(getattr(c, "joined", None) is not None for c in caches)


def _keep_positions(generator: Any, caches: list) -> list:
    """Make every merge and batch cache that will hold a joining sequence keep positions.

    mlx_lm merges a prefill group with its first sequence's ``merge`` and extends a running batch
    cache with the next group's, so every ``KVCache`` waiting in ``generator`` (this call's too, a
    missing list made now as mlx_lm would) becomes a :class:`_JoiningRows`, and every batch cache
    already running a :class:`_PositionedBatch`. For any other sequence both behave as mlx_lm's
    own. Sequences inserted later queue behind this one, so its prefill group always merges with ours.
    """
    from mlx_lm.models.cache import BatchKVCache, KVCache

    joining_rows, positioned = _batch_classes()

    def mergeable(cache_list: Any) -> Any:
        if not isinstance(cache_list, (list, tuple)):
            return cache_list
        return [joining_rows.holding(*compat.kv_cache_rows(c)) if type(c) is KVCache else c for c in cache_list]

    caches = [mergeable(c if c is not None else compat.new_sequence_caches(generator)) for c in caches]
    compat.replace_waiting_caches(generator, mergeable)
    compat.replace_running_caches(generator, lambda c: positioned.adopt(c) if type(c) is BatchKVCache else c)
    return caches


class _JoiningRowsMixin:
    """One sequence's rows waiting to be merged into a batch: mlx_lm's ``KVCache`` (mixed in),
    whose ``merge`` makes a :class:`_PositionedBatch`. ``joined`` says where a compressed cache's
    kept rows came from (None: mlx_lm's own rows, which start at position 0).

    mlx_lm only reads these (``merge``). A joined one given back before its prefill began
    (``extract_cache``, ``remove``) can be inserted again, and refuses to store rows anywhere else:
    as a ``KVCache`` its positions would restart after its kept rows.
    """

    joined: _Joined | None = None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self.joined is not None:
            raise ValueError("these are a compressed cache's kept rows waiting to join a BatchGenerator (given back "
                             "before its prefill began): insert them into a BatchGenerator again; on their own their "
                             "positions would be wrong")
        return super().update_and_fetch(keys, values)  # type: ignore[misc]

    @classmethod
    def holding(cls, keys: Any, values: Any, rows: int, joined: _Joined | None = None) -> Any:
        cache = compat.kv_cache_holding(cls, keys, values, rows)
        cache.joined = joined
        return cache

    @classmethod
    def merge(cls, caches: list) -> Any:
        return _batch_classes()[1].merge(caches)


class _PositionedBatchMixin:
    """mlx_lm's ``BatchKVCache`` (mixed in) that also knows, per sequence, the :class:`_Joined` it
    came from (None for mlx_lm's own): ``merge`` sets a joined sequence's offset to its true token
    count, ``filter`` and ``extend`` carry the records along, and ``extract`` gives a joined sequence
    back as the compressed cache it is. A sequence's offset is right everywhere else already:
    mlx_lm moves offsets and rows together from then on.
    """

    joined: list

    @classmethod
    def adopt(cls, batch: Any) -> Any:
        """``batch`` (a ``BatchKVCache``) as this class, same arrays, no joined sequence."""
        if isinstance(batch, cls):
            return batch
        positioned = compat.recast(batch, cls)
        positioned.joined = [None] * compat.batch_size(batch)
        return positioned

    @classmethod
    def merge(cls, caches: list) -> Any:
        batch = cls.adopt(super().merge(caches))  # type: ignore[misc]
        batch.joined = [getattr(c, "joined", None) for c in caches]
        shift = [0 if j is None else j.offset - c.size() for j, c in zip(batch.joined, caches)]
        if any(shift):
            compat.shift_offsets(batch, shift)
        return batch

    def filter(self, batch_indices: Any) -> None:
        keep = batch_indices.tolist() if isinstance(batch_indices, mx.array) else list(batch_indices)
        super().filter(batch_indices)  # type: ignore[misc]
        self.joined = [self.joined[i] for i in keep]

    def extend(self, other: Any) -> None:
        joined = self.joined + list(getattr(other, "joined", None) or [None] * compat.batch_size(other))
        super().extend(other)  # type: ignore[misc]
        self.joined = joined

    def extract(self, idx: int) -> Any:
        cache = super().extract(idx)  # type: ignore[misc]
        joined = self.joined[idx]
        if joined is None:
            return cache
        keys, values, _ = compat.kv_cache_rows(cache)
        return joined.rebuild(keys, values, compat.sequence_offset(self, idx))


@functools.cache
def _batch_classes() -> tuple[type, type]:
    """``_JoiningRows`` and ``_PositionedBatch``: the mixins on mlx_lm's classes, made on first use
    (importing veloxpatch does not import mlx_lm)."""
    return compat.mixed_into(_JoiningRowsMixin, "KVCache"), compat.mixed_into(_PositionedBatchMixin, "BatchKVCache")


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
    limits = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
    _check_sequences(prompts, prompt_caches, limits)
    step_options, stop = _step_options(model, options), set(tokenizer.eos_token_ids)
    stats = compat.batch_stats()
    start = time.perf_counter()
    done: list[_Finished] = []
    with compat.wired_limit(model):
        for prompt, caches, limit in zip(prompts, prompt_caches, limits):
            caches = copy.deepcopy(caches) if caches is not None else _fresh_caches(model, options)
            done.append(_generate_one(model, prompt, caches, limit, stop, step_options, stats, return_logprobs))
            if verbose:
                print(f"[batch_generate] {len(done)}/{len(prompts)} sequences done (one at a time)", end="\r")
    stats.wall_time = time.perf_counter() - start
    stats.peak_memory = mx.get_peak_memory() / 1e9
    if verbose:
        _print_batch_stats(stats)
    return compat.batch_response(
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
