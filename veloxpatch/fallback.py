"""What happens where veloxpatch cannot do what it was asked: mlx_lm's own behaviour, said once, or an error.

A shim lives inside someone else's app, so by default a failure of ours (a model the probe turns away, a
method that raises, a hook that fails) leaves the app on mlx_lm's own behaviour: one log line per (place,
error type), the traceback at DEBUG. ``VELOX_STRICT`` turns every such fallback into a :class:`StrictError`
naming the method, the model type and the original error (chained), so nothing runs uncompressed unseen.
"""

from __future__ import annotations

import logging
import traceback
from typing import Any

from .log import log, model_type, once
from .settings import StrictError

__all__ = ["StrictError", "fall_back", "notice"]


def notice(message: str, config: Any, *, key: str, error: BaseException | None = None, level: int = logging.WARNING,
           trace: str = "") -> None:
    """A fallback, said in ``message``: under ``config.strict`` a :class:`StrictError` chained to ``error`` (``trace``,
    a traceback as text, in its message); else logged once per ``key`` at ``level``, the traceback at DEBUG."""
    if getattr(config, "strict", False):
        raise StrictError(f"{message}, but VELOX_STRICT is set" + (f"\n{trace}" if trace else "")) from error
    if once(f"fall back: {key}", level, message):
        if not trace and error is not None and error.__traceback__ is not None:
            trace = "".join(traceback.format_exception(error))
        if trace:
            log.debug("%s", trace)


def fall_back(what: str, error: BaseException, config: Any, *, model: Any = None,
              instead: str = "running unpatched mlx_lm") -> None:
    """``what`` raised ``error`` in our code, for ``config``'s method (on ``model``): :func:`notice` it, once per
    (place, method and model, error type), saying what happens ``instead``."""
    method = getattr(config, "kv", None) or "veloxpatch"
    subject = method if model is None else f"{method} on {model_type(model)}"
    notice(f"{what} failed for {subject} ({type(error).__name__}: {error}); {instead}", config,
           key=f"{what}: {subject}: {type(error).__name__}", error=error)
