"""patch / unpatch: bind our wrappers into mlx_lm, whenever it is imported, and undo it exactly.

wrapt post-import hooks fire when a defining module is imported (or at once if it already is). The wrapper goes to
the defining module and to every module already holding a copy of the original (``from .models.cache import
make_prompt_cache``), so mlx_lm's generate, server, chat and a user's own early import all see it; later imports copy
it from the definer. Hooks are registered once per process and check the state, so any order of import / patch /
unpatch works and nothing is wrapped twice. What is wrapped is grouped into features (:mod:`.features`), each decided
when its defining module is first seen after a patch.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import signal
import sys
import threading
from types import ModuleType
from typing import Any

import wrapt

from .. import ranks, stats
from ..caches import Runtime
from ..config import ConfigError, VeloxConfig, from_env
from ..cpu import float32_wanted
from ..fallback import StrictError, fall_back, notice
from ..log import configure as configure_logging
from ..log import log
from ..registry import METHODS
from ..settings import strict_requested
from . import batched, compat, features, version
from .state import STATE, swap


def patch(config: VeloxConfig | None = None, **settings: Any) -> bool:
    """Switch compressed caches (and ``VELOX_FLOAT32``) on for mlx_lm; True if mlx_lm is (or will be) patched.

    ``config`` or keyword settings (``patch(kv="snapkv", budget="25%")``, a method's knobs by key too:
    ``patch(kv="quant", quant_keep="0.125x")``); neither means the ``VELOX_*`` environment. Calling it again only
    swaps the config. mlx-lm older than :data:`.version.OLDEST` passes through with a warning, a newer one than the
    newest tested is patched with a warning, and each feature only where mlx_lm offers it whole: under ``strict`` each
    of these is a :class:`StrictError` instead, and nothing stays patched.
    """
    if config is None:
        config = VeloxConfig().replace(**settings) if settings else from_env().config
    elif settings:
        config = config.replace(**settings)
    configure_logging(config.log)
    if config.strict and METHODS.failures:  # each was said when it failed to load
        raise StrictError("; ".join(METHODS.failures) + ", but VELOX_STRICT is set")
    if not _version_accepted(config):
        return False
    with STATE.lock:
        STATE.config = config
        STATE.runtime = Runtime(batching=batched.batching_on, meta_apart=compat.meta_state_apart)  # for our caches
        _register_hooks()
        for name in features.MODULES:
            if name in sys.modules and STATE.active:
                _apply(sys.modules[name])
        if config.stats:
            _register_stats()
        return STATE.active


def unpatch() -> None:
    """Restore every original function wherever we bound ours; forget our cache classes."""
    with STATE.lock:
        STATE.config = None
        for swapped in STATE.swaps.values():
            swapped.bind(undo=True)
        STATE.swaps.clear()
        STATE.features.clear()
        cache_module = sys.modules.get("mlx_lm.models.cache")
        for cls in (info.cls for info in METHODS.values()):
            if cache_module is not None and vars(cache_module).get(cls.__name__) is cls:
                delattr(cache_module, cls.__name__)


def is_patched() -> bool:
    """True while a config is active (mlx_lm is patched now or will be when imported)."""
    return STATE.active


def active_config() -> VeloxConfig | None:
    """The config in force, or None when unpatched."""
    return STATE.config


def patch_from_env(serving: bool = False) -> bool:
    """The bootstrap: patch from ``VELOX_*``; a bad value is logged and the app runs unpatched. With neither a
    method nor ``VELOX_FLOAT32`` only mlx_lm's server (``serving``) is patched: its requests may ask for one."""
    try:
        loaded = from_env()
    except Exception as error:  # a bad value (ConfigError), or a method module that fails to import
        configure_logging("WARNING")
        reason = (error if isinstance(error, ConfigError)
                  else f"reading the settings failed ({type(error).__name__}: {error})")
        log.error("%s; running unpatched", reason)
        if strict_requested():
            raise
        return False
    configure_logging(loaded.config.log)
    for warning in loaded.warnings:
        log.warning(warning)
    if not (loaded.config.enabled or float32_wanted(loaded.config.float32) or serving):
        return False
    try:
        return patch(loaded.config)
    except Exception as error:
        if loaded.config.strict:
            raise
        log.error("patching mlx_lm failed (%s: %s); running unpatched", type(error).__name__, error)
        return False


def on_mlx_lm_import(module: ModuleType) -> None:
    """Lazy bootstrap entry (a wrapt hook on ``mlx_lm``, and on ``mlx_lm.server``, which is patched whatever the
    settings): patch only once mlx_lm is used."""
    if not STATE.active:
        patch_from_env(serving=module.__name__ == "mlx_lm.server")


def _version_accepted(config: VeloxConfig) -> bool:
    """False (said, or a StrictError) for an mlx-lm older than the floor or not installed; one newer than the
    newest tested is said once (refused under ``strict``)."""
    found = version.mlx_lm_version()
    if version.too_old(found):
        what = "is not installed" if found is None else f"{found} is older than {version.text(version.OLDEST)}"
        notice(f"mlx-lm {what}, the oldest veloxpatch patches; running unpatched", config, key="version")
        return False
    if version.newer_than_tested(found):
        notice(f"mlx-lm {found} is newer than {version.text(version.NEWEST_TESTED)}, the newest veloxpatch is tested "
               "with; patching each feature whose checks pass", config, key=f"version {found}")
    return True


@functools.cache
def _register_hooks() -> None:
    """Once per process: each hook checks the state."""
    for name in features.MODULES:
        wrapt.register_post_import_hook(_on_import, name)


def _on_import(module: ModuleType) -> None:
    with STATE.lock:
        if not STATE.active:
            return
        try:
            _apply(module)
        except StrictError:
            raise
        except Exception as error:
            fall_back(f"patching {module.__name__}", error, STATE.config)


def _apply(module: ModuleType) -> None:
    """Patch every feature ``module`` defines that the installed mlx_lm offers whole, deciding each once per patch.
    One that is off is said at each patch (a new config may use it), once: at INFO, or for an essential one a
    WARNING, and then nothing stays patched. Under ``VELOX_STRICT`` a :class:`StrictError` where the settings use
    the feature (``Feature.used``), and nothing stays half-patched."""
    try:
        for feature in (f for f in features.FEATURES if f.module == module.__name__):
            if feature.name not in STATE.features:
                STATE.features[feature.name] = features.problem(feature, module)
            problem = STATE.features[feature.name]
            if problem is None:
                _bind(feature, module)
            elif not feature.essential:
                refusing = STATE.config if feature.used(STATE.config) else None  # notice raises for a strict config
                notice(f"{feature.off}: {problem}", refusing, key=f"feature off: {feature.name}", level=logging.INFO)
            else:
                notice(f"the {feature.name} cannot be patched, so {feature.off}: {problem}; running unpatched",
                       STATE.config, key=f"feature off: {feature.name}")
                unpatch()
                return
    except StrictError:
        unpatch()
        raise


def _bind(feature: features.Feature, module: ModuleType) -> None:
    """Bind our wrapper for each of ``feature``'s names in ``module`` (each wrapped once per patch)."""
    for target in feature.targets:
        owner = features.owner_of(module, target) if "." in target.name else None
        swap(target.name, target.name.rpartition(".")[2], features.original(module, target), target.wrapper, owner)
    if module.__name__ == "mlx_lm.models.cache":
        for cls in (info.cls for info in METHODS.values()):  # load_prompt_cache looks classes up here by name
            setattr(module, cls.__name__, cls)


@functools.cache
def _register_stats() -> None:
    """The stats line at every normal end: at exit, and on SIGTERM (how systemd, docker and supervisors stop a
    server), whose default action skips ``atexit`` (only the main thread may set a handler; an app's own is left
    alone: its exit runs ``atexit``)."""
    atexit.register(_print_stats)
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _terminated)


def _terminated(signum: int, frame: Any) -> None:
    """The stats line, then the signal again under its default action: the process ends as it would have
    unpatched (killed by SIGTERM, status 143 in a shell), not by an exit of ours."""
    _print_stats()
    sys.stderr.flush()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _print_stats() -> None:
    """The summary line on exit; in a distributed run each rank's, named, and rank 0 adds the total."""
    config = STATE.config
    if config is None or not config.stats:
        return
    place = ranks.place()
    rank, size = place or (0, 1)
    print(stats.summary(config.kv, who=f" (rank {rank} of {size})" if place else ""), file=sys.stderr)
    if place is None:
        return
    numbers = stats.counts()
    total = ranks.summed(numbers)
    if rank == 0 and total is not None:
        total[0] = numbers[0]  # every rank runs the same generations
        print(stats.summary(config.kv, total, who=f" (all {size} ranks)"), file=sys.stderr)
