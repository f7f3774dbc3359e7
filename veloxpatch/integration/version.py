"""Which mlx_lm versions veloxpatch patches: a floor, and the newest one it was tested with.

``pyproject.toml`` has no upper cap, so installing veloxpatch never moves the app's mlx-lm; what is patched is
decided at run time, feature by feature (:mod:`.features`), with one warning above the newest tested minor.
"""

from __future__ import annotations

import importlib.metadata
import itertools
import re

OLDEST = (0, 28, 1)
"""The oldest mlx-lm release veloxpatch patches (pyproject's ``mlx-lm>=0.28.1``); older ones pass through. 0.28.0
rebuilds a saved prompt cache by calling a class of its own module with no arguments, and has no
``from_state``: our caches could be saved, never loaded."""

NEWEST_TESTED = (0, 32)
"""The newest mlx-lm minor the test suite ran on."""


def text(release: tuple[int, ...]) -> str:
    """``(0, 32)`` -> ``"0.32"``."""
    return ".".join(map(str, release))


def mlx_lm_version() -> str | None:
    """Installed mlx-lm version, without importing it (None if not installed)."""
    try:
        return importlib.metadata.version("mlx-lm")
    except importlib.metadata.PackageNotFoundError:
        return None


def parse(version: str) -> tuple[int, ...]:
    """Leading numeric release parts: ``"0.32.2.dev1"`` -> (0, 32, 2)."""
    leading = (re.sub(r"\D.*", "", piece) for piece in version.split(".")[:3])  # each part's leading digits
    return tuple(int(digits) for digits in itertools.takewhile(bool, leading))


def too_old(version: str | None) -> bool:
    """True for a version below :data:`OLDEST`, or none at all."""
    return version is None or parse(version) < OLDEST


def newer_than_tested(version: str | None) -> bool:
    """True for a minor above :data:`NEWEST_TESTED` (a patch release of a tested minor counts as tested); False
    for None (not installed: :func:`too_old`)."""
    return version is not None and parse(version)[:2] > NEWEST_TESTED


def describe(version: str | None) -> str:
    """What veloxpatch makes of ``version``, as ``veloxpatch info`` says it."""
    if too_old(version):
        return f"older than {text(OLDEST)}: passes through"
    if newer_than_tested(version):
        return f"newer than the newest tested, {text(NEWEST_TESTED)}: patched where its checks pass"
    return f"tested range {text(OLDEST)} to {text(NEWEST_TESTED)}"
