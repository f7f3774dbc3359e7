"""The one place that names what mlx_lm keeps private and veloxpatch's batched generation and server touch.

Each function here says which layout it assumes (for :mod:`.batched`, ``BatchGenerator``'s and the cache classes';
for :mod:`.server`, how a request is queued). :data:`LAYOUTS` and :data:`SERVER_LAYOUTS` check each against the
installed mlx_lm without a model, so that a changed mlx_lm turns the feature that needs it off instead of corrupting
it.

mlx_lm is imported on first use (:func:`_mlx_lm`): importing veloxpatch never imports it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import pickle
from collections.abc import Callable
from types import ModuleType, SimpleNamespace
from typing import Any

import mlx.core as mx

from .._version import __version__

CACHES_AT = 3
"""Where a waiting sequence's cache list sits in its tuple in ``BatchGenerator._unprocessed_sequences`` (uid,
segments, max_tokens, caches, ...), where ``_make_batch`` reads it back."""

PROTOCOL = {
    "KVCache": {"merge": "(caches)"},
    "BatchKVCache": {"merge": "(caches)", "prepare": "(self, left_padding, lengths, right_padding)",
                     "finalize": "(self)", "filter": "(self, batch_indices)", "extend": "(self, other)",
                     "extract": "(self, idx)"},
}
"""mlx_lm's cache methods as mlx_lm calls them: ``KVCache.merge`` (overridden by :mod:`.batched`'s subclass), and
the batch-cache protocol ``SequenceBatch`` answers."""


def _mlx_lm(name: str) -> ModuleType:
    """``mlx_lm.<name>``, imported at first use (``import_module``: ``mlx_lm.generate`` is also a function's name)."""
    return importlib.import_module(f"mlx_lm.{name}")


# --------------------------------------------------------------------- BatchGenerator
def new_sequence_caches(generator: Any) -> list:
    """The cache list ``insert_segments`` makes for a sequence that brings none."""
    return _mlx_lm("models.cache").make_prompt_cache(generator.model, generator.max_kv_size)


def waiting_cache_lists(generator: Any) -> list:
    """The cache list of each sequence waiting in ``generator`` (:data:`CACHES_AT`)."""
    return [sequence[CACHES_AT] for sequence in generator._unprocessed_sequences]


def running_caches(generator: Any) -> list[list]:
    """The lists of batch caches (one per layer) already running in ``generator``, the prompt batch's and the
    generation batch's: the lists themselves, which mlx_lm extends, filters and extracts from as it goes."""
    return [generator._prompt_batch.prompt_cache, generator._generation_batch.prompt_cache]


def replace_waiting_caches(generator: Any, replace: Callable[[Any], Any]) -> None:
    """Put ``replace(caches)`` in place of each waiting sequence's cache list (:func:`waiting_cache_lists`)."""
    waiting = generator._unprocessed_sequences
    for k, sequence in enumerate(waiting):
        waiting[k] = (*sequence[:CACHES_AT], replace(sequence[CACHES_AT]), *sequence[CACHES_AT + 1:])


# --------------------------------------------------------------------- KVCache and BatchKVCache
def cache_class(name: str) -> type[Any]:
    """mlx_lm's ``models.cache.<name>`` (``KVCache``, ``BatchKVCache``)."""
    return getattr(_mlx_lm("models.cache"), name)


def kv_cache_holding(cls: type, keys: Any, values: Any, rows: int) -> Any:
    """A new ``cls`` (a ``KVCache``) holding the first ``rows`` rows of ``keys``/``values`` (None: none) as new
    arrays: ``offset`` is the rows held, which ``BatchKVCache.merge`` reads through ``size``."""
    cache = cls()
    if keys is not None:
        cache.keys, cache.values, cache.offset = keys[..., :rows, :], values[..., :rows, :], rows
    return cache


@functools.cache
def meta_state_apart() -> bool:
    """Whether mlx_lm's ``save_prompt_cache`` keeps each cache's ``meta_state`` apart (as strings) from its
    ``state`` (arrays only) and its ``load_prompt_cache`` hands both to ``from_state`` (mlx-lm 0.28-0.31), read
    from ``_BaseCache.from_state``'s parameters; mlx-lm 0.32 saves the state alone, strings and numbers in it."""
    return "meta_state" in inspect.signature(_mlx_lm("models.cache")._BaseCache.from_state).parameters


def batch_size(batch: Any) -> int:
    """The sequences a ``BatchKVCache`` holds: its ``offset`` is an array with one entry per sequence."""
    return batch.offset.shape[0]


# --------------------------------------------------------------------- the server
ARGUMENTS_AT = 2
"""Where the generation arguments sit in the tuple ``ResponseGenerator.generate`` queues, (response queue,
request, arguments): the tuple ``_serve_single`` gets."""

CARRIED = "_veloxpatch_request"
"""The attribute veloxpatch adds to mlx_lm's objects of one request (handler, ``CompletionRequest``, arguments)."""


def carry(holder: Any, value: Any) -> None:
    """Attach ``value`` to one of mlx_lm's per-request objects (:data:`CARRIED`)."""
    setattr(holder, CARRIED, value)


def carried(holder: Any) -> Any:
    """What :func:`carry` attached to ``holder``; None if nothing."""
    return getattr(holder, CARRIED, None)


def _check_queued_request() -> str | None:
    """``ResponseGenerator.generate`` (on a stand-in whose queue answers at once with an error) queues the
    arguments at :data:`ARGUMENTS_AT`, which keep an attribute through pickling; ``CompletionRequest`` takes one."""
    server = _mlx_lm("server")
    queued: list[tuple] = []

    def put(item: tuple) -> None:
        queued.append(item)
        item[0].put(LookupError("veloxpatch's layout check"))  # generate raises it: nothing waits

    stand_in = SimpleNamespace(requests=SimpleNamespace(put=put), generation_available=lambda: True,
                               _await_response=lambda queue: queue.get())

    arguments, request = (cls(**dict.fromkeys(f.name for f in dataclasses.fields(cls)))
                          for cls in (server.GenerationArguments, server.CompletionRequest))
    with contextlib.suppress(LookupError):
        inspect.unwrap(server.ResponseGenerator.generate)(stand_in, request, arguments)
    if len(queued) != 1 or not isinstance(queued[0], tuple) or len(queued[0]) <= ARGUMENTS_AT:
        return f"generate queued {queued!r}, not one (response queue, request, arguments) tuple"
    if queued[0][ARGUMENTS_AT] is not arguments or queued[0][1] is not request:
        return f"generate queues the arguments at {[i for i, x in enumerate(queued[0]) if x is arguments]}, " \
               f"not at [{ARGUMENTS_AT}]"
    carry(arguments, "probe")
    if carried(pickle.loads(pickle.dumps(arguments))) != "probe":
        return f"{type(arguments).__name__} does not keep an attribute through pickling"
    try:
        carry(request, "probe")
    except (AttributeError, TypeError) as error:
        return f"CompletionRequest cannot carry an attribute ({error})"
    return None


SERVER_LAYOUTS: dict[str, Callable[[], str | None]] = {
    "the server's queued request": _check_queued_request,
}
"""Each layout of ``mlx_lm.server`` the settings per request rely on, by name, and its check."""


# --------------------------------------------------------------------- checking the layouts
def parameters(function: Callable) -> str:
    """``function``'s parameter names as ``(a, b, *args, **kwargs)``, as :data:`PROTOCOL` writes them."""
    prefix: dict[inspect._ParameterKind, str] = {inspect.Parameter.VAR_POSITIONAL: "*",
                                                 inspect.Parameter.VAR_KEYWORD: "**"}
    names = [prefix.get(p.kind, "") + p.name for p in inspect.signature(function).parameters.values()]
    return f"({', '.join(names)})"


def _check_generator_attributes() -> str | None:
    """A ``BatchGenerator`` keeps ``model``, ``max_kv_size`` and its running batch caches as lists."""
    with contextlib.closing(_mlx_lm("generate").BatchGenerator(None, max_kv_size=7)) as generator:
        if (getattr(generator, "model", "missing"), getattr(generator, "max_kv_size", "missing")) != (None, 7):
            return "BatchGenerator(model, max_kv_size=...) keeps no .model and .max_kv_size"
        for batch in ("_prompt_batch", "_generation_batch"):
            caches = getattr(getattr(generator, batch, None), "prompt_cache", None)
            if not isinstance(caches, list):
                return f"BatchGenerator.{batch}.prompt_cache is {type(caches).__name__}, not a list of batch caches"
    return None


def _check_waiting_sequences() -> str | None:
    """An inserted sequence waits as a tuple with its cache list at :data:`CACHES_AT`, and its prefill group is
    merged by its first cache's ``merge`` into the group's ``prompt_cache``."""
    merged: list = []

    class Probe:
        @classmethod
        def merge(cls, caches: list) -> str:
            merged.append(caches)
            return "merged"

    caches = [Probe()]
    generate = _mlx_lm("generate")
    with contextlib.closing(generate.BatchGenerator(None)) as generator:  # over no model: runs nothing
        inspect.unwrap(generate.BatchGenerator.insert_segments)(generator, [[[1, 2]]], caches=[caches])
        waiting = list(generator._unprocessed_sequences)
        if len(waiting) != 1 or not isinstance(waiting[0], tuple):
            return f"one inserted sequence waits as {[type(w).__name__ for w in waiting]}, not one tuple"
        at = [i for i, item in enumerate(waiting[0]) if item is caches]
        if at != [CACHES_AT]:
            return f"a waiting sequence holds its cache list at {at}, not at [{CACHES_AT}]"
        group = generator._make_batch(1)
    if merged != [caches] or group.prompt_cache != ["merged"]:
        return "a prefill group is not merged by its first sequence's cache's merge into .prompt_cache"
    return None


def _check_protocol() -> str | None:
    """Every method :data:`PROTOCOL` lists exists on mlx_lm's class with those parameters."""
    for base, methods in PROTOCOL.items():
        for name, expected in methods.items():
            method = getattr(cache_class(base), name, None)
            found = "missing" if method is None else parameters(method)
            if found != expected:
                return f"{base}.{name} is {found}, not {expected}"
    return None


def _check_batch_offsets() -> str | None:
    """``BatchKVCache.offset`` holds one position per sequence through ``merge``, ``extend`` and ``filter``, and
    ``extract`` gives one sequence's own rows back as a ``KVCache``: how a running batch is split."""
    cache_module = _mlx_lm("models.cache")

    def rows(n: int) -> Any:
        return kv_cache_holding(cache_module.KVCache, mx.zeros((1, 1, n, 1)), mx.zeros((1, 1, n, 1)), n)

    batch = cache_module.BatchKVCache.merge([rows(2), rows(1)])
    if not isinstance(batch.offset, mx.array) or batch.offset.tolist() != [2, 1]:
        return f"merging sequences of 2 and 1 rows gives offset {batch.offset}, not one position per sequence"
    batch.extend(cache_module.BatchKVCache.merge([rows(3)]))
    batch.filter([1, 2])
    if batch_size(batch) != 2 or batch.offset.tolist() != [1, 3]:
        return f"extend then filter leaves offset {batch.offset}, not the kept sequences' positions"
    one = batch.extract(0)
    if one.keys.shape[2] != 1 or one.size() != 1:
        return "extract does not give back one sequence's own rows as a KVCache"
    return None


LAYOUTS: dict[str, Callable[[], str | None]] = {
    "BatchGenerator's state": _check_generator_attributes,
    "BatchGenerator._unprocessed_sequences": _check_waiting_sequences,
    "the KVCache/BatchKVCache protocol": _check_protocol,
    "BatchKVCache.offset": _check_batch_offsets,
}
"""Each layout batched generation relies on, by name, and its check (None, or what was found instead)."""


def check(name: str) -> str | None:
    """What the installed mlx_lm has instead of layout ``name`` (of :data:`LAYOUTS` or :data:`SERVER_LAYOUTS`),
    None if it has it; a check that raises has found a different layout too, and what it raised is said."""
    try:
        return {**LAYOUTS, **SERVER_LAYOUTS}[name]()
    except Exception as error:
        return f"{type(error).__name__}: {error}"


@functools.cache
def layout_problem() -> str | None:
    """Every layout of :data:`LAYOUTS` the installed mlx_lm does not have, said in one line; None if it has them
    all. Checked once per process: mlx_lm's classes do not change under a running app."""
    changed = [f"{name} is not the layout veloxpatch {__version__} knows ({what})"
               for name in LAYOUTS if (what := check(name)) is not None]
    return "; ".join(changed) or None
