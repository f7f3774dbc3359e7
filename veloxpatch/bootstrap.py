"""The light part of the bootstrap that runs at start-up of every Python process of the app.

It imports only wrapt (and the stdlib-only settings module): the real work (config validation, importing mlx,
binding wrappers) is deferred to a post-import hook on ``mlx_lm``, so subprocesses that never touch mlx_lm pay
nothing and an app that does gets patched before its first call. It never raises unless VELOX_STRICT.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from types import TracebackType
from typing import Any

from .settings import ConfigError, strict_requested  # stdlib only: this module must stay light

ExceptHook = Callable[[type[BaseException], BaseException, TracebackType | None], Any]  # sys.excepthook's type


def _read(name: str) -> str:
    return os.environ.get(name, "").strip().lower()


def install() -> None:
    """Arrange for mlx_lm to be patched from ``VELOX_*`` when it is imported (without a KV method, for
    ``VELOX_FLOAT32`` unless it is off), and mlx_lm's server whatever the settings: a request may ask for a method."""
    everything = not (_read("VELOX_KV") in ("", "none") and _read("VELOX_FLOAT32") == "off")
    sys.excepthook = _config_errors_exit_2(sys.excepthook)
    try:
        import wrapt

        if everything:
            wrapt.register_post_import_hook("veloxpatch.integration:on_mlx_lm_import", "mlx_lm")
        wrapt.register_post_import_hook("veloxpatch.integration:on_mlx_lm_import", "mlx_lm.server")
    except Exception as error:  # the host app must start regardless
        if strict_requested():
            raise
        print(f"veloxpatch: ERROR: bootstrap failed ({error}); running unpatched", file=sys.stderr)


def _config_errors_exit_2(previous: ExceptHook) -> ExceptHook:
    """An excepthook under which a setting the app's model cannot take (a :class:`ConfigError` raised while its
    caches are built, e.g. ``VELOX_KV_MEMORY`` below what one layer needs) ends the process as a bad launcher
    option does: its message and exit status 2. Anything else goes to the hook the app had."""

    def hook(kind: type[BaseException], error: BaseException, trace: TracebackType | None) -> Any:
        if not isinstance(error, ConfigError):
            return previous(kind, error, trace)
        print(f"veloxpatch: error: {error}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(2)

    return hook
