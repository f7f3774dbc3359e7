"""A real ``mlx_lm server`` on a loopback port for tests (``veloxpatch.eval.serving``), started without this
process's VELOX_* settings: a test says which the server gets."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from conftest import without_velox
from veloxpatch.eval import serving
from veloxpatch.eval.serving import post

__all__ = ["post", "processed", "running"]


@contextlib.contextmanager
def running(command: list[str], log: Path, env: dict[str, str] | None = None) -> Iterator[str]:
    """Start ``command`` plus ``--host 127.0.0.1 --port P`` with ``env`` over this environment less its VELOX_*;
    yield its URL; stop it afterwards."""
    with serving.running(command, log, {**without_velox(), **(env or {})}) as url:
        yield url


def processed(body: dict) -> int:
    """The prompt tokens a completion had to read: the rest came from the server's prompt cache (mlx_lm's usage
    says how many, in the single and in the batched path alike)."""
    usage = body["usage"]
    return usage["prompt_tokens"] - usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
