"""Compression methods: one file each, registered by id with their knobs.

Importing this package registers every method with :mod:`veloxpatch.config`, so ``VELOX_KV``
and the method knobs validate. Adding a method means adding a file here and one import line
below; the patching code does not change.
"""

from __future__ import annotations

from typing import Callable, TypeVar

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


def make_cache(config: VeloxConfig) -> CompressedKVCache:
    """A fresh cache of the configured method, with its knobs."""
    cls = CACHE_CLASSES[config.kv]
    prefix = f"{config.kv}_"
    knobs = {k[len(prefix):]: v for k, v in config.knobs.items() if k.startswith(prefix)}
    return cls(config.budget, config.sink, config.window, config.compress, **knobs)


from . import chunkkv, h2o, pyramidkv, snapkv, squeeze, streamingllm, tova  # noqa: E402  (registers the methods)

__all__ = ["CACHE_CLASSES", "METHODS", "CompressedKVCache", "make_cache", "method", "chunkkv", "h2o", "pyramidkv",
           "snapkv", "squeeze", "streamingllm", "tova"]
