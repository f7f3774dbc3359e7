"""What every compression method is built from: the row store, the cache base and its parts. The methods live in
:mod:`veloxpatch.methods`; nothing here knows any of them (``make_cache`` asks the registry by id).
"""

from .base import CompressedKVCache
from .spec import CacheSpec, Runtime, make_cache

__all__ = ["CacheSpec", "CompressedKVCache", "Runtime", "make_cache"]
