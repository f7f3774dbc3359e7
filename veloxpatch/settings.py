"""What a ``VELOX_*`` setting is: its parser, default, allowed values and doc, and the parsers they share.

The bottom of the package (it imports nothing else of veloxpatch), so the registry, the config and the light
bootstrap can all use it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")
PREFIX = "VELOX_"
TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off", "")


class ConfigError(ValueError):
    """A setting has a value that is not allowed; the message names the setting, value and rule."""


class StrictError(RuntimeError):
    """Raised under ``VELOX_STRICT`` where veloxpatch would fall back to mlx_lm's own behaviour (:mod:`.fallback`)."""


@dataclass(frozen=True)
class Budget:
    """KV rows a layer keeps: a fixed number of tokens, or a fraction of the tokens it has seen."""

    tokens: int | None = None
    fraction: float | None = None

    @classmethod
    def parse(cls, text: str) -> Budget:
        """``"1024"`` -> 1024 tokens, ``"25%"`` -> a quarter of the tokens seen; ValueError otherwise."""
        text = text.strip()
        if text.endswith("%"):
            return cls(fraction=float(percent(text)))
        return cls(tokens=int_range(1, None)(text))

    def resolve(self, seen: int) -> int:
        """Rows to keep after ``seen`` tokens (a fraction rounds up, so 100% never evicts)."""
        if self.tokens is not None:
            return self.tokens
        assert self.fraction is not None, "a budget is tokens or a fraction"
        return math.ceil(self.fraction * seen)

    def __str__(self) -> str:
        if self.tokens is not None:
            return str(self.tokens)
        assert self.fraction is not None, "a budget is tokens or a fraction"
        return f"{self.fraction * 100:g}%"


UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


@dataclass(frozen=True)
class Memory:
    """An amount of memory: bytes (``2GB``, ``512MiB``), a share of the device's (``25%``), or none (``off``)."""

    bytes: int | None = None
    fraction: float | None = None
    text: str = field(default="", compare=False)  # as the user wrote it, for messages

    @classmethod
    def parse(cls, text: str) -> Memory:
        """``"off"`` -> none, ``"25%"`` -> a quarter of the device's memory, ``"1.5GiB"`` -> bytes."""
        given = text.strip()
        text = given.lower().replace(" ", "")
        if text in ("off", "0", "none", ""):
            return cls()
        if text.endswith("%"):
            return cls(fraction=float(percent(text)), text=given)
        number = text.rstrip("kmgtib")
        unit = text[len(number):]
        if unit not in UNITS:
            raise ValueError(text)
        amount = float(number) * UNITS[unit]
        if not math.isfinite(amount) or amount < 1:
            raise ValueError(text)
        return cls(bytes=int(amount), text=given)

    def __bool__(self) -> bool:
        return self.bytes is not None or self.fraction is not None

    def resolve(self, device: int) -> int:
        """Bytes, a share of ``device`` bytes where it is one."""
        if self.bytes is not None:
            return self.bytes
        assert self.fraction is not None, "resolved only when set (off has neither)"
        return int(self.fraction * device)

    def __str__(self) -> str:
        if self.text:
            return self.text
        if self.fraction is not None:
            return f"{self.fraction * 100:g}%"
        return "off" if self.bytes is None else str(self.bytes)


@dataclass(frozen=True)
class TierSize:
    """The most rows a tier holds per layer: ``budgets`` times the layer's budget (``3x``), or all (None)."""

    budgets: float | None = 3.0

    @classmethod
    def parse(cls, text: str) -> TierSize:
        """``"3x"`` (or ``"3"``) -> three budgets, ``"all"`` -> no bound."""
        value = text.strip().lower()
        return cls(None if value == "all" else number_range(0, above=True)(value.removesuffix("x")))

    def rows(self, keep: int) -> int | None:
        """Rows beside a store of ``keep`` rows; None: no bound."""
        return None if self.budgets is None else int(self.budgets * keep)

    def __str__(self) -> str:
        return "all" if self.budgets is None else f"{self.budgets:g}x"


def size_text(n: float) -> str:
    """Bytes as a user reads them (``512 MiB``)."""
    for unit in ("B", "KiB", "MiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _checked(convert: Callable[[str], T], allowed: Callable[[T], bool]) -> Callable[[str], T]:
    """A parser: ``convert`` the text, and refuse (ValueError) a value not ``allowed``."""

    def parse(text: str) -> T:
        value = convert(text)
        if not allowed(value):
            raise ValueError(text)
        return value

    return parse


def int_range(lo: int, hi: int | None) -> Callable[[str], int]:
    """A parser taking an integer in ``[lo, hi]`` (no upper bound when ``hi`` is None)."""
    return _checked(int, lambda value: lo <= value and (hi is None or value <= hi))


def odd_kernel(text: str) -> int:
    """A pooling width over neighbouring rows: an odd integer in [1, 63] (the row in the middle)."""
    return _checked(int, lambda value: 1 <= value <= 63 and value % 2 == 1)(text)


def int_choice(options: tuple[int, ...]) -> Callable[[str], int]:
    """A parser taking exactly one of the integers ``options``."""
    return _checked(int, lambda value: value in options)


def one_of_text(options: tuple[int, ...]) -> str:
    """What :func:`int_choice` allows, in words for messages and docs."""
    return "one of " + ", ".join(map(str, options))


def number_range(lo: float, hi: float | None = None, above: bool = False) -> Callable[[str], float]:
    """A parser taking a finite number at least ``lo`` (more than ``lo`` when ``above``) and at most ``hi``."""
    return _checked(float, lambda value: math.isfinite(value) and (value > lo if above else value >= lo)
                    and (hi is None or value <= hi))


class Share(float):
    """A fraction that reads back as the percentage it was written as (``str(Share(0.4)) == "40%"``)."""

    def __str__(self) -> str:
        return f"{self * 100:g}%"


def percent(text: str) -> Share:
    """A share written as a percentage in (0, 100] (``"40%"``), as a fraction."""
    if not text.endswith("%"):
        raise ValueError(text)
    return Share(number_range(0, 100, above=True)(text[:-1]) / 100)


def choice(options: tuple[str, ...] | Callable[[], tuple[str, ...]], upper: bool = False) -> Callable[[str], str]:
    """A parser taking one of ``options`` in any case (a function, for choices that grow as methods register)."""
    return _checked(lambda text: text.strip().upper() if upper else text.strip().lower(),
                    lambda value: value in (options() if callable(options) else options))


def boolean(text: str) -> bool:
    """``1/0``, ``true/false``, ``yes/no``, ``on/off`` (and empty: false)."""
    return choice(TRUE + FALSE)(text) in TRUE


def strict_requested() -> bool:
    """``VELOX_STRICT`` from the environment alone, for code that runs before a config (bootstrap, plugins)."""
    return os.environ.get("VELOX_STRICT", "").strip().lower() in TRUE


@dataclass(frozen=True)
class Setting:
    """One ``VELOX_*`` variable: how to parse it, its default, what is allowed, one line of doc."""

    name: str
    parse: Callable[[str], Any]
    default: str
    allowed: str | Callable[[], str]
    doc: str
    method: str | None = None
    is_flag: bool = False

    @property
    def key(self) -> str:
        """Attribute/knob name: ``VELOX_SNAPKV_KERNEL`` -> ``snapkv_kernel``."""
        return self.name[len(PREFIX):].lower()

    @property
    def allowed_text(self) -> str:
        """What values are allowed, in words (computed for settings whose choices grow)."""
        return self.allowed() if callable(self.allowed) else self.allowed

    @property
    def option(self) -> str:
        """Launcher option: ``VELOX_SNAPKV_KERNEL`` -> ``--snapkv-kernel``."""
        return "--" + self.key.replace("_", "-")

    def convert(self, value: Any) -> Any:
        """Parse a string (or check a Python value) or raise :class:`ConfigError`."""
        text = to_text(value)
        try:
            return self.parse(text)
        except (ValueError, TypeError):
            raise ConfigError(f"{self.name}={text!r} is not allowed: expected {self.allowed_text}") from None


def to_text(value: Any) -> str:
    """A Python value as the environment would spell it (booleans as 1/0)."""
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)
