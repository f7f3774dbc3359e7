"""Shared fixtures: patch state is process-wide, so every test leaves mlx_lm unpatched."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

import veloxpatch
from veloxpatch.eval.random_model import ARCHS, build, config_for, write_model_dir

VOCAB = 97


def tiny(arch: str, seed: int = 0):
    """A 3-4 layer random-weight model of ``arch`` (mlx_lm's own class)."""
    return build(config_for(arch), seed)


def random_tokens(n: int, seed: int) -> mx.array:
    return mx.random.randint(0, VOCAB, (n,), key=mx.random.key(seed))


@pytest.fixture(autouse=True)
def clean_patch():
    veloxpatch.unpatch()
    yield
    veloxpatch.unpatch()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    # head_dim 32: the smallest mlx can quantize, so the eval's quantized variant applies
    return write_model_dir(tmp_path_factory.mktemp("tiny") / "model", hidden_size=128, intermediate_size=192)


__all__ = ["ARCHS", "random_tokens", "run_python", "tiny"]


def run_python(code: str, env: dict[str, str] | None = None, cwd: Path | None = None,
               args: list[str] | None = None) -> subprocess.CompletedProcess:
    """Run code in a fresh interpreter (patch state and import order start clean)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("VELOX_")}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-c", code, *(args or [])], env=full_env, cwd=cwd,
                          capture_output=True, text=True, timeout=120)
