"""A second reading of each prompt chunk, for caches that choose their rows by it (``quant`` with
``VELOX_QUANT_KEEP`` below 100%).

KVzip (Kim et al., arXiv 2505.23416) rates a context's rows by the attention they get while the model reads the
context again: a row the model needs to say the document again is one a later question may need, and the question,
not asked yet, cannot choose (``bench/agnostic_selection.py``: at 35% of Qwen2.5-0.5B's rows this score kept every
answer the full cache gave, where the prompt's own last queries lost the needles at 50%). A cache cannot run the
model, but the model's own call can: the class defining the top-level model's ``__call__`` is wrapped (once, undone
by ``unpatch``), and a call over a list of our caches that ask for it, with a prompt chunk of token ids, runs the
model over the same tokens a second time. Between the two readings the caches hold the chunk's rows back from
folding; during the second they record the most attention each row gets; after it they trim the second reading's
rows and fold, each head keeping its best-scored rows. The paper puts "Repeat the previous context" before the
repeat; a model call has no tokenizer, so the chunk is read again as it is (the model's copying heads attend to
where each repeated token came from).

Where it cannot be done the chunk is read once and every row kept, said once: a list holding any cache that is not
one of ours asking for it (a sliding-window slot of mlx_lm's, whose rows cannot be trimmed; batched generation's
caches), or input embeddings instead of token ids. The cost is the paper's: each prompt chunk is read twice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from ..config import VeloxConfig
from ..fallback import fall_back
from ..log import model_type, once
from ..registry import cache_class
from .layer_io import Parameters, Wrapper, defined_call, wrap_call
from .state import STATE, in_force


def prepare(model: Any, config: VeloxConfig) -> None:
    """Wrap ``model``'s call when ``config``'s method may ask for a second reading (before the builder probes it)."""
    if getattr(cache_class(config.kv), "rereads_prompt", False):
        install(model)


def install(model: Any) -> None:
    """Wrap the class defining ``model``'s ``__call__`` (once); said once where it takes no ``cache``."""
    found = defined_call(type(model))
    if found is None:
        name = model_type(model)
        once(f"rereading {name}", logging.INFO,
             f"{name}: the model's call takes no `cache` argument; prompt chunks are read once and every row kept")
        return
    owner, params = found
    with STATE.lock:
        wrap_call(owner, _reading_twice(params), "rereading")


def _reading_twice(params: Parameters) -> Wrapper:
    """The model's ``__call__``: a prompt chunk over caches that ask for it is read a second time for its scores."""

    def call(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        readers = _readers(params, args, kwargs)
        if not readers:
            return wrapped(*args, **kwargs)
        n = params.input(args, kwargs).shape[1]
        for cache in readers:
            cache.awaiting = True
        read = False
        try:
            out = wrapped(*args, **kwargs)
            read = _read_again(wrapped, args, kwargs, readers, n)
        finally:
            for cache in readers:
                cache.scored(n, read)
        return out

    return call


def _readers(params: Parameters, args: tuple, kwargs: dict) -> list[Any]:
    """The call's caches when every one asks for a second reading of this step (a prompt chunk of token ids and
    none reading already), else none."""
    caches = params.cache(args, kwargs)
    if not isinstance(caches, (list, tuple)) or not caches:
        return []
    asking = [c for c in caches if getattr(c, "wants_rereading", False)]
    if not asking or any(c.awaiting for c in asking):
        return []
    tokens = params.input(args, kwargs)
    if not isinstance(tokens, mx.array) or tokens.ndim != 2 or asking[0].schedule.decode_sized(tokens.shape[1]):
        return []
    if len(asking) < len(caches) or kwargs.get("input_embeddings") is not None or mx.issubdtype(
            tokens.dtype, mx.floating):
        once("rereading refused", logging.INFO,
             "VELOX_QUANT_KEEP: a prompt chunk over caches that are not all ours (or given as embeddings) is read "
             "once and every row kept")
        return []
    return asking


def _read_again(wrapped: Callable[..., Any], args: tuple, kwargs: dict, readers: list[Any], n: int) -> bool:
    """The same call again with the readers recording, then its ``n`` rows trimmed: whether it was read (a failure
    is said, or raised under ``VELOX_STRICT``, and leaves each cache as the first reading left it)."""
    before = [cache.offset for cache in readers]
    for cache in readers:
        cache.rereading = True
    try:
        wrapped(*args, **kwargs)
        return True
    except Exception as error:  # the host app must keep running
        fall_back("reading a prompt chunk again", error, in_force(), instead="its rows are kept unscored")
        return False
    finally:
        for cache, offset in zip(readers, before):
            cache.rereading = False
            cache.trim(cache.offset - offset)
