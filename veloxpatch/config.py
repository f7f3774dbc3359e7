"""The ``VELOX_*`` settings: the core ones, every method's knobs, and the config they make.

Every way of switching veloxpatch on (launcher, environment, ``import veloxpatch.auto``, ``patch(config)``) goes
through these settings, so a value means the same and fails with the same message wherever it comes from.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from .registry import METHODS, knob_settings
from .settings import PREFIX, Budget, ConfigError, Memory, Setting, TierSize, boolean, choice, int_range, to_text

__all__ = ["PROCESS_WIDE", "Budget", "ConfigError", "Memory", "Setting", "TierSize", "VeloxConfig", "all_settings",
           "choice", "from_env", "int_range", "request_settings", "setting"]

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
COMPRESS_MODES = ("end", "chunk")
DRAFT_MODES = ("same", "none")
FLOAT32_MODES = ("auto", "on", "off")
BLAS_CHOICES = ("auto", "openblas", "none")
TIER_BITS = (2, 3, 4, 8, 16)


def _blas(text: str) -> str:
    """A choice, or the absolute path of a BLAS library (whether it exists is checked where it is used)."""
    value = text.strip()
    if value.lower() in BLAS_CHOICES or value == "":
        return value.lower() or "auto"
    if not os.path.isabs(value):
        raise ValueError
    return value


def _tier(text: str) -> int:
    """``off`` (or 0): no tier; else the bits its rows are kept at."""
    value = text.strip().lower()
    if value in ("off", "0", ""):
        return 0
    if int(value) not in TIER_BITS:
        raise ValueError
    return int(value)


def _method(text: str) -> str:
    """A registered method's name, or ``none`` (also when empty)."""
    return choice(lambda: ("none", "", *METHODS))(text) or "none"


CORE_SETTINGS: tuple[Setting, ...] = (
    Setting("VELOX_KV", _method, "none", lambda: "one of " + ", ".join(["none", *sorted(METHODS)])
            + " (a method's knobs are settings of their own: VELOX_QUANT_KEEP, --quant-keep)",
            "KV-cache compression method; unset or `none` passes every cache through."),
    Setting("VELOX_BUDGET", Budget.parse, "1024", "an integer >= 1 or a percentage in (0, 100]",
            "KV rows kept per layer: tokens (`1024`) or a share of the tokens seen (`25%`)."),
    Setting("VELOX_KV_MEMORY", Memory.parse, "off", "off, bytes (`2GB`, `512MiB`, `1000000`) or a percentage in "
            "(0, 100] of the device's memory",
            "Memory the KV cache may hold (every layer, mlx_lm's own slots too): turned into rows per layer from the "
            "model's KV layout when the cache list is built; with VELOX_BUDGET the stricter wins, and `end` mode "
            "compresses a prompt that would pass it; a speculative draft's caches share it with the model's. Methods "
            "that evict only."),
    Setting("VELOX_SINK", int_range(0, None), "4", "an integer >= 0",
            "First tokens of the context that are never evicted (attention sinks)."),
    Setting("VELOX_WINDOW", int_range(1, None), "32", "an integer >= 1",
            "Most recent tokens that are never evicted; query-aware methods score with them."),
    Setting("VELOX_TIER", _tier, "8", "off, or one of " + ", ".join(map(str, TIER_BITS)) + " (bits)",
            "Rows a compression drops are kept at this many bits instead of lost (16: unquantized): prompt chunks "
            "attend over them, and a prompt's selection can take them back (a follow-up question). Methods that "
            "evict only."),
    Setting("VELOX_TIER_SIZE", TierSize.parse, "3x", "a multiple of the budget (`3x`, `0.5x`) or `all`",
            "The most rows a layer's tier holds, in budgets of that layer (where more are dropped, the best by the "
            "method's score stay), or `all`: every row dropped (grows with the context). Under VELOX_KV_MEMORY the "
            "tier takes the bytes the budget leaves instead."),
    Setting("VELOX_COMPRESS", choice(COMPRESS_MODES), "chunk", "one of " + ", ".join(COMPRESS_MODES),
            "When to compress the prompt: after each prefill chunk (memory bounded while it is read; with a tier, "
            "retrieval as good as `end` in our measurements) or once at its end (the whole prompt's rows are held "
            "until then)."),
    Setting("VELOX_DRAFT_KV", choice(DRAFT_MODES), "same", "one of " + ", ".join(DRAFT_MODES),
            "Speculative decoding: the draft model's cache is compressed like the main one, or stays mlx_lm's."),
    Setting("VELOX_FLOAT32", choice(FLOAT32_MODES), "auto", "one of " + ", ".join(FLOAT32_MODES),
            "float16/bfloat16 weights loaded by mlx_lm run as float32 (`auto`: on the CPU backend, where that is "
            "faster)."),
    Setting("VELOX_BLAS", _blas, "auto", "one of " + ", ".join(BLAS_CHOICES) + ", or an absolute path",
            "`veloxpatch run` only: preload the system OpenBLAS (`auto`: on Linux when mlx runs on the CPU and it is "
            "found)."),
    Setting("VELOX_LOG", choice(LOG_LEVELS, upper=True), "WARNING", "one of " + ", ".join(LOG_LEVELS),
            "Log level of veloxpatch's own messages (stderr)."),
    Setting("VELOX_STRICT", boolean, "0", "a boolean (1/0, true/false, yes/no, on/off)",
            "Raise wherever veloxpatch would fall back to mlx_lm's own behaviour (a model or slot it cannot serve, an "
            "error of its own, batched generation on a changed mlx_lm layout, a feature the installed mlx-lm lacks "
            "where the settings use it: with a KV method on mlx-lm 0.28-0.30, which batch on their own caches only).",
            is_flag=True),
    Setting("VELOX_STATS", boolean, "0", "a boolean (1/0, true/false, yes/no, on/off)",
            "Print a one-line KV-cache summary to stderr when the process exits.", is_flag=True),
)


PROCESS_WIDE: dict[str, str] = {
    "kv_memory": "a memory target is planned from the model when a cache list is built, and a request the model "
                 "cannot hold within it could not be answered with an error before its answer starts",
    "float32": "the model's weights are cast once, when the model loads",
    "blas": "the launcher preloads the library when the process starts",
    "log": "veloxpatch's log is the process's",
    "strict": "whether a fallback is an error is decided for the whole process",
    "stats": "the summary is the process's, printed when it exits",
}
"""The settings a server request cannot change (by key), and why; every other may (:func:`request_settings`)."""


def all_settings() -> tuple[Setting, ...]:
    """Core settings followed by every registered method's knobs (a knob named like a core setting is refused)."""
    knobs = tuple(k for m in METHODS.values() for k in m.knobs)
    clash = sorted({k.name for k in knobs} & {s.name for s in CORE_SETTINGS})
    if clash:
        raise ValueError(f"method knobs take the names of core settings: {clash}")
    return CORE_SETTINGS + knobs


def setting(name: str) -> Setting:
    """Look a setting up by its variable name (``VELOX_BUDGET``)."""
    return {s.name: s for s in all_settings()}[name]


def request_settings() -> dict[str, Setting]:
    """The settings a server request may carry, by key (``budget``, ``snapkv_kernel``)."""
    return {s.key: s for s in all_settings() if s.key not in PROCESS_WIDE}


@dataclass(frozen=True)
class VeloxConfig:
    """The ``VELOX_*`` settings for ``patch(config)``: strings (``budget="25%"``) or values; knobs by key."""

    kv: str = "none"
    budget: Budget | int | str = "1024"
    kv_memory: Memory | str = "off"
    sink: int = 4
    window: int = 32
    tier: int | str = "8"
    tier_size: TierSize | str = "3x"
    compress: str = "chunk"
    draft_kv: str = "same"
    float32: str = "auto"
    blas: str = "auto"
    log: str = "WARNING"
    strict: bool = False
    stats: bool = False
    knobs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for s in CORE_SETTINGS:
            object.__setattr__(self, s.key, s.convert(getattr(self, s.key)))
        by_key = {s.key: s for s in all_settings() if s.method}
        unknown = sorted(set(self.knobs) - set(by_key))
        if unknown:
            raise ConfigError(f"unknown method knob(s) {unknown}; known: {sorted(by_key)}")
        object.__setattr__(self, "knobs", {k: s.convert(self.knobs.get(k, s.default)) for k, s in by_key.items()})
        assert isinstance(self.budget, Budget), "converted above"
        tokens = self.budget.tokens
        if self.enabled and tokens is not None and tokens < self.sink + self.window:
            raise ConfigError(f"VELOX_BUDGET={tokens} is not allowed: it must be at least VELOX_SINK + VELOX_WINDOW = "
                              f"{self.sink} + {self.window} = {self.sink + self.window}")
        if self.enabled and self.kv_memory and self.kv not in evicting_methods():
            raise ConfigError(f"VELOX_KV_MEMORY={self.kv_memory} is not allowed with VELOX_KV={self.kv}: it bounds the "
                              f"methods that evict rows ({', '.join(evicting_methods())}); {self.kv} keeps every token "
                              f"in a form of its own{METHODS[self.kv].cls.memory_instead}")

    @property
    def enabled(self) -> bool:
        return self.kv != "none"

    def cache_settings(self) -> tuple[Any, ...]:
        """What a cache list is built from, as one hashable value: equal for two configs whose lists are made alike."""
        if not self.enabled:
            return ("none",)
        knobs = sorted((s.key, self.knobs[s.key]) for s in knob_settings(self.kv, self.knobs).values())
        return (self.kv, self.budget, self.sink, self.window, self.tier, self.tier_size, self.compress, self.draft_kv,
                self.kv_memory, tuple(knobs))

    def described(self) -> str:
        """The settings that reach this method's caches, spelled as in the environment (the INFO line of a build)."""
        cls = METHODS[self.kv].cls
        core = ["VELOX_BUDGET"] if cls.uses_budget and not self.kv_memory else []
        core += ["VELOX_KV_MEMORY"] if self.kv_memory else []
        if cls.bounds_memory:
            core += ["VELOX_SINK", "VELOX_TIER", *(["VELOX_TIER_SIZE"] if self.tier else []), "VELOX_COMPRESS"]
        given = [f"{name}={to_text(getattr(self, setting(name).key))}" for name in [*core, "VELOX_WINDOW"]]
        given += [f"{s.name}={to_text(self.knobs[s.key])}" for s in knob_settings(self.kv, self.knobs).values()]
        return ", ".join(given)

    def to_env(self) -> dict[str, str]:
        """The same configuration as ``VELOX_*`` variables (for a child process)."""
        return {s.name: to_text(self.knobs[s.key] if s.method else getattr(self, s.key)) for s in all_settings()}

    def replace(self, **changes: Any) -> VeloxConfig:
        """A copy with some settings changed, validated again: core settings by name (``budget="25%"``), a method's
        knobs by key as well (``quant_keep="0.125x"``, or in ``knobs``); an unknown name is a ConfigError."""
        knob_keys = {s.key for s in all_settings() if s.method}
        knobs = {**self.knobs, **changes.pop("knobs", {})}
        knobs.update({key: changes.pop(key) for key in list(changes) if key in knob_keys})
        core = {f.name for f in fields(self)} - {"knobs"}
        unknown = sorted(set(changes) - core)
        if unknown:
            close = difflib.get_close_matches(unknown[0], sorted(core | knob_keys), n=1, cutoff=0.6)
            hint = f"did you mean {close[0]}? " if close else ""
            raise ConfigError(f"unknown setting {unknown[0]!r}: {hint}the settings are {', '.join(sorted(core))}, and "
                              f"the methods' knobs {', '.join(sorted(knob_keys))} (`veloxpatch info`)")
        return replace(self, **changes, knobs=knobs)


@dataclass
class LoadedConfig:
    """A config read from an environment, with where each value came from and what was wrong."""

    config: VeloxConfig
    sources: dict[str, str]
    warnings: list[str]


def from_env(environ: Mapping[str, str] | None = None) -> LoadedConfig:
    """Read and validate every ``VELOX_*`` variable; raise :class:`ConfigError` naming every bad value, one a line
    (then the rules across settings, such as the budget against sink + window). Warned: unknown names, and a setting
    given that the method does not use (``VELOX_TIER`` with one that drops no row)."""
    environ = os.environ if environ is None else environ
    core: dict[str, Any] = {}
    knobs: dict[str, Any] = {}
    sources: dict[str, str] = {}
    errors = []
    for s in all_settings():
        sources[s.name] = f"environment ({s.name})" if s.name in environ else "default"
        try:
            (knobs if s.method else core)[s.key] = s.convert(environ.get(s.name, s.default))
        except ConfigError as error:
            errors.append(str(error))
    if errors:
        raise ConfigError("\n".join(errors))
    config = VeloxConfig(**core, knobs=knobs)
    warnings = unknown_names(environ)
    if config.enabled and config.tier and "VELOX_TIER" in environ and config.kv not in evicting_methods():
        warnings.append(f"VELOX_TIER={config.tier} does nothing with VELOX_KV={config.kv}: it keeps the rows a method "
                        f"drops, and {config.kv} drops none (it keeps every token in a form of its own); it is for "
                        f"{', '.join(evicting_methods())}")
    return LoadedConfig(config, sources, warnings)


def evicting_methods() -> list[str]:
    """The registered methods that evict rows, by name: those VELOX_KV_MEMORY bounds and VELOX_TIER serves."""
    return sorted(m for m, e in METHODS.items() if e.cls.bounds_memory)


def unknown_names(environ: Mapping[str, str]) -> list[str]:
    """Warnings for ``VELOX_*`` names that are not settings, each with the closest valid name."""
    valid = [s.name for s in all_settings()]
    suffixes = [n[len(PREFIX):] for n in valid]  # the shared prefix would make everything "close"
    out = []
    for name in sorted(n for n in environ if n.startswith(PREFIX) and n not in valid):
        close = difflib.get_close_matches(name[len(PREFIX):], suffixes, n=1, cutoff=0.6)
        hint = f"; did you mean {PREFIX}{close[0]}?" if close else ""
        out.append(f"unknown setting {name}{hint} (see `veloxpatch info`)")
    return out
