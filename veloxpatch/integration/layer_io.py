"""Layer input and output: what each attention module receives and returns, and its decoder block's input.

The attention route sees rotated queries, keys and values only; some methods need the hidden states around it
(SqueezeAttention compares the residual stream before and after self-attention, XQuant keeps the attention input and
recomputes K and V from it). A cache class asks for them with ``wants_layer_io``, and :func:`prepare` hooks the model.

mlx_lm's models name their modules differently (``self_attn``, ``attention``, ...) but every one hands the layer's
cache down to its attention, so the modules are found by signature: the attention module is an innermost module whose
``__call__`` takes a ``cache``, its decoder block the nearest ancestor whose ``__call__`` takes one too. Python looks
``__call__`` up on the type, so the classes defining it are wrapped (once, undone by ``unpatch``). For a cache of ours
asking for this (a batch of ours hands each sequence its part, :meth:`SequenceBatch.tell`), each hook its class
defines is called:

- ``see_block_input(hidden)``: the decoder block's input (the residual stream), before the block runs;
- ``see_attention_input(normed, module)``: the attention module's input and the module, before it runs, so before
  ``update_and_fetch`` (XQuant recomputes K and V with the module's own projections);
- ``see_attention(normed, output)``: its input and output, after it has run, so after ``attend``.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import wrapt

from ..caches import CompressedKVCache
from ..caches.batch import SequenceBatch
from ..config import VeloxConfig
from ..fallback import fall_back
from ..log import model_type, once
from ..memo import per_model
from ..registry import cache_class
from .state import STATE, in_force, swap

POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
Wrapper = Callable[[Callable[..., Any], Any, tuple, dict], Any]
_FOUND: dict[tuple[int, Any], dict[type, Wrapper]] = {}  # per model: a server builds caches at every request


@dataclass(frozen=True)
class Parameters:
    """Where a ``__call__`` takes its input (the first argument after ``self``) and its cache, read once from the
    signature: binding every call with ``inspect`` would cost every call of the model."""

    input_name: str
    cache_index: int | None  # position among the arguments after self; None: keyword only

    @classmethod
    def of(cls, function: Callable[..., Any]) -> Parameters | None:
        """The parameters of an unbound ``__call__``; None when it takes no cache or no positional input."""
        try:
            params = list(inspect.signature(function).parameters.values())[1:]
        except (TypeError, ValueError):  # a call with no signature Python can read (compiled)
            return None
        names = [p.name for p in params]
        if "cache" not in names or params[0].kind not in POSITIONAL:
            return None
        index = names.index("cache")
        positional = all(p.kind in POSITIONAL for p in params[: index + 1])
        return cls(params[0].name, index if positional else None)

    def cache(self, args: tuple, kwargs: dict) -> Any:
        """The cache this call got (None if left to its default)."""
        if "cache" in kwargs:
            return kwargs["cache"]
        index = self.cache_index
        return args[index] if index is not None and index < len(args) else None

    def input(self, args: tuple, kwargs: dict) -> Any:
        """The call's input: the hidden state it runs on."""
        return args[0] if args else kwargs[self.input_name]


def prepare(model: Any, config: VeloxConfig) -> None:
    """Hook ``model`` when ``config``'s method reads layer inputs and outputs, before the builder probes it (the
    probe's caches then see what the method's will)."""
    if cache_class(config.kv).wants_layer_io:
        install(model)


def install(model: Any) -> bool:
    """Capture layer inputs and outputs on ``model``'s classes (each wrapped once, undone by ``unpatch``);
    False, said once at INFO, when no attention module and decoder block can be found."""
    found = per_model(_FOUND, model, "layer io", lambda: hooked_classes(model))
    return wrap_calls(model, found, "layer io", "no attention module with a decoder block takes a `cache` argument; "
                      "methods that read layer inputs and outputs run without them")


def hooked_classes(model: Any) -> dict[type, Wrapper]:
    """The classes defining the ``__call__`` of every attention module and its decoder block, with their wrappers."""
    takers = _cache_takers(model)
    block_of = {name: next((a for a in _ancestors(name) if a in takers), None) for name in takers}
    enclosing = set(block_of.values())
    found: dict[type, Wrapper] = {}
    for name, block in block_of.items():
        if name not in enclosing and block is not None:
            found.setdefault(takers[name][0], partial(_attention, takers[name][1]))
            found.setdefault(takers[block][0], partial(_block, takers[block][1]))
    return found


def _cache_takers(model: Any) -> dict[str, tuple[type, Parameters]]:
    """Dotted module path -> :func:`defined_call`, for every module of ``model`` whose ``__call__`` takes a cache."""
    modules = model.named_modules()
    per_class = {cls: defined_call(cls) for cls in {type(module) for _, module in modules}}
    return {name: found for name, module in modules if (found := per_class[type(module)]) is not None}


def defined_call(cls: type) -> tuple[type, Parameters] | None:
    """The class in ``cls``'s MRO that defines the ``__call__`` it runs, and its parameters (None if it
    takes no cache): wrapping that class once serves every subclass that inherits it."""
    owner = next((c for c in cls.__mro__ if "__call__" in vars(c)), None)
    if owner is None:
        return None
    params = Parameters.of(vars(owner)["__call__"])
    return None if params is None else (owner, params)


def _ancestors(name: str) -> Iterator[str]:
    """The dotted paths above a module's, nearest first (``a.b.c``: ``a.b``, ``a``, the root ``''``)."""
    while name:
        name = name.rpartition(".")[0]
        yield name


def wrap_calls(model: Any, found: dict[type, Wrapper], purpose: str, without: str) -> bool:
    """Bind each wrapper of ``found`` around its class's ``__call__`` once for ``purpose`` (undone by ``unpatch``);
    False, said once at INFO with what runs ``without`` them, where ``found`` is empty."""
    if not found:
        name = model_type(model)
        once(f"{purpose} {name}", logging.INFO, f"{name}: {without}")
        return False
    with STATE.lock:
        for owner, wrapper in found.items():
            swap(f"{purpose} {owner.__module__}.{owner.__qualname__} at {id(owner):#x}", "__call__",
                 vars(owner)["__call__"], partial(wrapt.FunctionWrapper, wrapper=wrapper), owner)
    return True


def _listener(params: Parameters, args: tuple, kwargs: dict) -> CompressedKVCache | SequenceBatch | None:
    """The call's cache when it is one of ours (or a batch of ours) that wants layer inputs and outputs."""
    cache = params.cache(args, kwargs)
    return cache if isinstance(cache, (CompressedKVCache, SequenceBatch)) and cache.wants_layer_io else None


def _block(params: Parameters, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """A decoder block's ``__call__``: its input (the residual stream) goes to the cache first."""
    cache = _listener(params, args, kwargs)
    if cache is not None:
        _tell(cache, "see_block_input", params.input(args, kwargs))
    return wrapped(*args, **kwargs)


def _attention(params: Parameters, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """An attention module's ``__call__``: its input and the module go to the cache before it runs (the cache has
    them when it stores the step's rows), its input and output once it has run."""
    cache = _listener(params, args, kwargs)
    if cache is not None:
        _tell(cache, "see_attention_input", params.input(args, kwargs), instance)
    output = wrapped(*args, **kwargs)
    if cache is not None:
        out = output[0] if isinstance(output, tuple) else output
        _tell(cache, "see_attention", params.input(args, kwargs), out)
    return output


def _tell(cache: CompressedKVCache | SequenceBatch, hook: str, *args: Any) -> None:
    """Call the cache's ``hook`` where its class defines it; a failure there leaves the model's step untouched."""
    call = partial(cache.tell, hook) if isinstance(cache, SequenceBatch) else getattr(cache, hook, None)
    if call is None:
        return
    try:
        call(*args)
    except Exception as error:  # the host app must keep running
        fall_back(f"the layer input/output hook {hook}", error, in_force(),
                  instead="the model's step runs on without it")
