"""What veloxpatch does for mlx's CPU backend, where speed is lost outside the KV cache.

mlx's Linux wheel bundles a reference BLAS; the system OpenBLAS, preloaded, runs its matmuls about
30x faster. A library can only be preloaded when a process starts, so this is the launcher's job
(``VELOX_BLAS``): ``import veloxpatch.auto`` comes too late. The CPU backend also runs float16
matmuls about 10x slower than float32, hence ``VELOX_FLOAT32`` (applied by the patching layer).
"""

from __future__ import annotations

import os
import platform
import re
from collections.abc import Callable
from dataclasses import dataclass

from .config import ConfigError

# Debian/Ubuntu (libopenblas0-pthread, -openmp), Fedora (openblas-threads), Arch; the ILP64 builds
# (libopenblas64*) are left out: their symbols carry a suffix and would not replace mlx's.
SEARCH = (
    "/usr/lib/{arch}-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/{arch}-linux-gnu/openblas-openmp/libblas.so.3",
    "/usr/lib/{arch}-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblasp.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)
AUTO_ARCHES = ("x86_64", "aarch64")


@dataclass(frozen=True)
class BlasChoice:
    """The library ``veloxpatch run`` preloads (None: none), and why, in words for ``info``."""

    path: str | None
    reason: str


def cpu_backend() -> bool:
    """True when mlx computes on the CPU by default (no Metal or CUDA device)."""
    import mlx.core as mx

    return mx.default_device() == mx.cpu


def float32_wanted(mode: str) -> bool:
    """Whether ``VELOX_FLOAT32=mode`` converts weights here (``auto``: only on the CPU backend)."""
    return mode == "on" or (mode == "auto" and cpu_backend())


def choose_blas(value: str, system: str | None = None, arch: str | None = None,
                on_cpu: Callable[[], bool] = cpu_backend) -> BlasChoice:
    """What ``VELOX_BLAS=value`` preloads here; ConfigError when an explicit library is missing."""
    system = system or platform.system()
    arch = arch or platform.machine()
    if value == "none":
        return BlasChoice(None, "VELOX_BLAS=none")
    if value not in ("auto", "openblas"):
        if not os.path.isfile(value):
            raise ConfigError(f"VELOX_BLAS={value!r}: no such file")
        return BlasChoice(value, "VELOX_BLAS is a path")
    if system != "Linux":
        if value == "openblas":
            raise ConfigError(f"VELOX_BLAS='openblas' is for Linux; mlx on {system} brings its own BLAS")
        return BlasChoice(None, f"not Linux ({system}): mlx brings its own BLAS")
    candidates = [p.format(arch=arch) for p in SEARCH]
    found = next((p for p in candidates if os.path.isfile(p)), None)
    if value == "openblas":
        if found is None:
            raise ConfigError(f"VELOX_BLAS='openblas': OpenBLAS not found; looked in {', '.join(candidates)} "
                              "(Debian/Ubuntu: apt-get install libopenblas0-pthread), or give its path")
        return BlasChoice(found, "VELOX_BLAS=openblas")
    if arch not in AUTO_ARCHES:
        return BlasChoice(None, f"auto preloads only on {', '.join(AUTO_ARCHES)}, not {arch}")
    if not on_cpu():
        return BlasChoice(None, "mlx's default device is not the CPU")
    if found is None:
        return BlasChoice(None, "no system OpenBLAS found (Debian/Ubuntu: apt-get install libopenblas0-pthread)")
    return BlasChoice(found, "VELOX_BLAS=auto: Linux, CPU backend, found")


def preloaded(env: dict[str, str]) -> list[str]:
    """The entries of ``LD_PRELOAD`` (ld.so separates them by colons or spaces)."""
    return [p for p in re.split(r"[:\s]+", env.get("LD_PRELOAD", "")) if p]


def is_preloaded(env: dict[str, str], library: str) -> bool:
    """True when ``LD_PRELOAD`` in ``env`` already names ``library`` (under any of its paths)."""
    return any(os.path.realpath(p) == os.path.realpath(library) for p in preloaded(env))


def with_preload(env: dict[str, str], library: str) -> dict[str, str]:
    """``env`` with ``library`` after the user's own preloads, unless it is already there (nested runs)."""
    if is_preloaded(env, library):
        return env
    return {**env, "LD_PRELOAD": ":".join([*preloaded(env), library])}


def blas_in_use(env: dict[str, str]) -> str:
    """The BLAS this process runs mlx's matmuls on, for a result's record: a preloaded OpenBLAS, or the wheel's."""
    found = [p for p in preloaded(env) if "blas" in os.path.basename(p).lower()]
    return f"preloaded {found[0]}" if found else "mlx's bundled BLAS"
