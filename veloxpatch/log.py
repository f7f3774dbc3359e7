"""veloxpatch's own logger: one stderr handler, host logging untouched, and messages said once."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("veloxpatch")
_said: set[str] = set()


def configure(level: str) -> None:
    """Give the ``veloxpatch`` logger one stderr handler at ``level``."""
    log.setLevel(level)
    if not any(getattr(h, "_velox", False) for h in log.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("veloxpatch: %(levelname)s: %(message)s"))
        handler._velox = True  # type: ignore[attr-defined]
        log.addHandler(handler)
        log.propagate = False


def once(key: str, level: int, message: str) -> bool:
    """Log ``message`` the first time ``key`` comes up in this process (repeats are noise); True if logged now."""
    if key in _said:
        return False
    _said.add(key)
    log.log(level, message)
    return True


def model_type(model: Any) -> str:
    """The mlx_lm model type of a model (or of one of its modules), as messages name it: the name of the
    module defining its class (``llama`` for ``mlx_lm.models.llama.Model``)."""
    return type(model).__module__.rpartition(".")[2]
