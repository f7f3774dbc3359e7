"""Compression methods: one file each, registered by id with their knobs.

Importing this package registers every method with :mod:`veloxpatch.config`, so ``VELOX_KV``
and the method knobs validate. Adding a method means adding a file here and one import line
below; the patching code does not change.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, TypeVar

from ..config import METHODS, MethodInfo, Setting, VeloxConfig, register_method
from .base import CompressedKVCache

CACHE_CLASSES: dict[str, type[CompressedKVCache]] = {}

C = TypeVar("C", bound=type[CompressedKVCache])


def method(name: str, description: str, knobs: tuple[Setting, ...] = ()) -> Callable[[C], C]:
    """Class decorator: register a cache class as method ``name`` with its knobs."""

    def register(cls: C) -> C:
        cls.method = name
        for knob in knobs:
            if not knob.name.startswith(f"VELOX_{name.upper()}_") or knob.method != name:
                raise ValueError(f"knob {knob.name} of {name} must be VELOX_{name.upper()}_* with method={name!r}")
        register_method(MethodInfo(name, description, knobs))
        CACHE_CLASSES[name] = cls
        return cls

    return register


def cache_class(kv: str, knobs: Mapping[str, Any]) -> type[CompressedKVCache]:
    """The class that builds ``kv``'s caches under these knobs (by full key: ``squeeze_policy``)."""
    return CACHE_CLASSES[kv].built_as(knobs)


def knob_settings(kv: str, knobs: Mapping[str, Any]) -> dict[str, Setting]:
    """Every knob that reaches ``kv``'s caches, by the name its constructor takes (``kernel``).

    A method built on another takes that one's knobs too: ``pyramidkv`` and ``squeeze`` with the
    ``snapkv`` policy pool as ``VELOX_SNAPKV_KERNEL`` says; the methods come from the class's bases."""
    cls = cache_class(kv, knobs)
    names = [vars(c)["method"] for c in cls.__mro__ if vars(c).get("method")]
    found: dict[str, Setting] = {}
    for name in names:
        for knob in METHODS[name].knobs:
            short = knob.key[len(name) + 1:]
            if short in found:
                raise ValueError(f"{kv}: knob {short!r} comes from both {found[short].name} and {knob.name}")
            found[short] = knob
    return found


def make_cache(config: VeloxConfig) -> CompressedKVCache:
    """A fresh cache of the configured method, with its knobs (and those of the methods it builds on)."""
    settings = knob_settings(config.kv, config.knobs)
    knobs = {short: config.knobs[knob.key] for short, knob in settings.items()}
    return CACHE_CLASSES[config.kv](config.budget, config.sink, config.window, config.compress, **knobs)


from . import chunkkv, h2o, minicache, pyramidkv, snapkv, squeeze, streamingllm, tova, xkv, xquant  # noqa: E402  (registers the methods)

__all__ = ["CACHE_CLASSES", "METHODS", "CompressedKVCache", "cache_class", "knob_settings", "make_cache", "method",
           "chunkkv", "h2o", "minicache", "pyramidkv", "snapkv", "squeeze", "streamingllm", "tova", "xkv",
           "xquant"]
