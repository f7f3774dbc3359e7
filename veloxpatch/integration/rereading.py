"""A second reading of each prompt, for caches that choose their rows by it (``quant`` with ``VELOX_QUANT_KEEP``
below 100%).

KVzip (Kim et al., arXiv 2505.23416) rates a context's rows by the attention they get while the model reads the
context again: a row the model needs to say the document again is one a later question may need. A cache cannot run
the model, but the model's own call can, so the class defining the top-level model's ``__call__`` is wrapped (once,
undone by ``unpatch``). Over caches of ours that ask for it, prompt chunks are read as usual and remembered; the first
decode-sized call after them (the prompt's last token) first reads the whole prompt again (:func:`_read_again`) while
the caches record the most attention each row gets, then each head keeps its best rows. The prompt is read again as it
is, without KVzip's "Repeat the previous context" (a model call has no tokenizer; docs/results.md, "Rows to drop
before the question: the repeat score"). In a batch of ours each sequence is read again alone, over its own caches.

``VELOX_QUANT_SCORE`` ``expected`` or ``snapkv`` chooses at that call without a second reading, from the prompt's
last queries (:func:`attention_modules`); ``heads`` reads the first prompt long enough again to rate the heads, and
scores later prompts by those ratings.

Where it cannot be done the prompt is read once and every row kept, said once: a list holding a cache that is not one
of ours asking for it (mlx_lm's sliding-window slot, whose rows cannot be trimmed), or input embeddings. The cost is
the paper's: each prompt is read twice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Any

import mlx.core as mx

from ..caches.batch import SequenceBatch
from ..config import VeloxConfig
from ..fallback import fall_back
from ..log import once
from ..memo import kept, per_model
from ..registry import cache_class
from .layer_io import Parameters, defined_call, wrap_calls
from .state import in_force

LEAD = 256
"""Tokens read again before each chunk of the second reading but the first (trimmed with it): a chunk read again
cold starts where the model is not repeating the prompt yet, and its first rows score as it finds its place
(docs/results.md, "RULER at 4k on Qwen2.5 (the yardstick)": the second reading's chunks, led in)."""


def prepare(model: Any, config: VeloxConfig) -> None:
    """Wrap ``model``'s call when ``config``'s method may ask for a second reading (before the builder probes it)."""
    if getattr(cache_class(config.kv), "rereads_prompt", False):
        install(model)


def install(model: Any) -> None:
    """Wrap the class defining ``model``'s ``__call__`` (once); said once where it takes no ``cache``."""
    found = defined_call(type(model))
    wrap_calls(model, {} if found is None else {found[0]: partial(_reading_twice, found[1])}, "rereading",
               "the model's call takes no `cache` argument; prompt chunks are read once and every row kept")


_ratings: dict[tuple[int, Any], dict[int, mx.array]] = {}  # ``score=heads``: per model (:mod:`..memo`), per layer (H,)


def _reading_twice(params: Parameters, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """The wrapper of the model's ``__call__`` (``params`` bound): each sequence's step as the module docstring says."""
    for readers, tokens in _readers(params, args, kwargs):
        first, n = readers[0], tokens.shape[1]
        if not first.schedule.decode_sized(n) or first.before_prompt_end(n):
            for cache in readers:
                cache.read_prompt_chunk(tokens)
        elif first.unscored and first.scores_by_queries:  # each with its layer's attention module (its rotary one)
            modules = attention_modules(instance)
            _choose_unread(readers, lambda c: c.score_by_queries(modules[c.layer] if c.layer < len(modules) else None))
        elif first.unscored and first.score == "heads" and (rated := kept(_ratings, instance, "heads")) is not None:
            _choose_unread(readers, lambda c: c.score_by_heads(rated.get(c.layer)))  # a layer not rated keeps all
        elif first.unscored:
            _read_again(wrapped, params, args, kwargs, readers)
            if first.score == "heads":
                _rate(instance, readers)
    return wrapped(*args, **kwargs)


def _readers(params: Parameters, args: tuple, kwargs: dict) -> list[tuple[list[Any], mx.array]]:
    """Each sequence of the call whose caches all ask for a second reading, with its own tokens of the step
    (:func:`_sequences`). Empty where no cache asks or one is reading already (checked first: every model call
    passes here), and, said once, where a list mixes caches that ask with others or the input is embeddings."""
    caches = params.cache(args, kwargs)
    if not isinstance(caches, (list, tuple)) or not caches:
        return []
    flat = [m for c in caches for m in (c.members if isinstance(c, SequenceBatch) else (c,))]
    asking_caches = [c for c in flat if asks(c)]
    if not asking_caches or any(c.rereading for c in asking_caches):
        return []
    tokens = params.input(args, kwargs)
    if kwargs.get("input_embeddings") is not None or not isinstance(tokens, mx.array) or tokens.ndim != 2 \
            or mx.issubdtype(tokens.dtype, mx.floating):
        return _refused()
    asking = [(readers, own) for readers, own in _sequences(caches, tokens) if any(asks(c) for c in readers)]
    if any(len(readers) < len(caches) or not all(asks(c) for c in readers) for readers, _ in asking):
        return _refused()
    return asking


def _refused() -> list[tuple[list[Any], mx.array]]:
    """No second reading for this call, said once."""
    once("rereading refused", logging.INFO,
         "VELOX_QUANT_KEEP: a prompt over caches that are not all ours (or given as embeddings) is read once "
         "and every row kept")
    return []


def _sequences(caches: list[Any] | tuple[Any, ...], tokens: mx.array) -> list[tuple[list[Any], mx.array]]:
    """The call's sequences as (caches, tokens): one, or in a batch of ours (a :class:`SequenceBatch` per layer)
    each sequence that brings tokens to the step, with its members of every layer, to be read again alone."""
    if not isinstance(caches[0], SequenceBatch):
        return [(list(caches), tokens)]
    lengths = caches[0].step_lengths(tokens.shape[1])
    return [([c.members[i] for c in caches if isinstance(c, SequenceBatch)], tokens[i: i + 1, :n])
            for i, n in enumerate(lengths) if n]


def asks(cache: Any) -> bool:
    """Whether ``cache`` (of any kind: mlx_lm's too) asks for a second reading now."""
    return bool(getattr(cache, "wants_rereading", False))


def _read_again(wrapped: Callable[..., Any], params: Parameters, args: tuple, kwargs: dict,
                readers: list[Any]) -> None:
    """Read the readers' unscored prompt again, a chunk at a time as it was read, each led by the :data:`LEAD`
    tokens before it (a call of their own: the same attention as one call over both), so each chunk attends over the
    prompt read once and its lead alone; then the readers keep their best rows. A failure is said (or raised under
    ``VELOX_STRICT``) and leaves every row."""
    chunks = readers[0].unscored
    offsets = [cache.offset for cache in readers]
    for cache in readers:
        cache.start_rereading()
    read, lead = False, None
    try:
        for chunk in chunks:
            pieces = [chunk] if lead is None else [lead, chunk]
            lead = mx.concatenate(pieces, axis=1)[:, -LEAD:]  # the last tokens read before the next chunk
            try:
                for piece in pieces:  # the lead in a call of its own: no more activations than the chunk's
                    for cache in readers:  # the lead's rows stored for the chunk, the chunk's attended only
                        cache.store_next_rows(piece is not chunk)
                    again, named = _with_input(params, args, kwargs, piece, readers)
                    wrapped(*again, **named)
            finally:  # the second reading's rows go, whether it finished or not
                for cache, offset in zip(readers, offsets):
                    cache.store_next_rows(True)
                    cache.trim(cache.offset - offset)
        read = True
    except Exception as error:  # the host app must keep running
        fall_back("reading a prompt again", error, in_force(), instead="its rows are all kept")
    finally:
        for cache in readers:
            cache.stop_rereading(read)
        type(readers[0]).keep_chosen(readers)


def _choose_unread(readers: list[Any], score: Callable[[Any], None]) -> None:
    """Each reader's rows scored by ``score(cache)`` without a second reading, then the best kept. A failure is said
    (or raised under ``VELOX_STRICT``) and leaves every row."""
    try:
        for cache in readers:
            score(cache)
    except Exception as error:  # the host app must keep running
        fall_back(f"scoring a prompt's rows by {readers[0].score}", error, in_force(), instead="its rows are all kept")
        for cache in readers:
            cache.stop_rereading(False)
    type(readers[0]).keep_chosen(readers)


def _rate(model: Any, readers: list[Any]) -> None:
    """``score=heads``: the heads' ratings of the prompt just read again, kept for ``model`` while it lives, where
    every layer rated its heads (a prompt too short to rate them leaves the next one to)."""
    rated = {cache.layer: cache.rated for cache in readers}
    if kept(_ratings, model, "heads") is None and all(r is not None for r in rated.values()):
        per_model(_ratings, model, "heads", lambda: rated)
        once("quant heads rated", logging.INFO, "VELOX_QUANT_SCORE=heads: the heads are rated from this prompt's "
             "second reading; later prompts are chosen by them without one")


def attention_modules(model: Any) -> list[Any]:
    """Each layer's attention module (the child of a ``model.layers`` block holding a ``rope``; None where none
    does): where a cache of the layer finds its rotary embedding without hooking every layer's call."""
    names = ("self_attn", "attention", "attn")
    return [next((getattr(layer, n) for n in names if hasattr(getattr(layer, n, None), "rope")), None)
            for layer in getattr(model, "layers", [])]


def _with_input(params: Parameters, args: tuple, kwargs: dict, tokens: mx.array,
                caches: list[Any]) -> tuple[tuple, dict]:
    """The call's arguments with ``tokens`` as its input and ``caches`` (one sequence's) as its cache."""
    given, named = list(args), dict(kwargs)
    if given:
        given[0] = tokens
    else:
        named[params.input_name] = tokens
    if "cache" in named or params.cache_index is None or params.cache_index >= len(given):
        named["cache"] = caches
    else:
        given[params.cache_index] = caches
    return tuple(given), named
