"""The compression methods: one file each, found by id, with their knobs.

A method is a cache class decorated with :func:`method` in a module of its own. The first read of :data:`METHODS`
imports every module of ``veloxpatch.methods``, then every entry point of that group, so a method can ship as a
package of its own::

    [project.entry-points."veloxpatch.methods"]
    mymethod = "mypackage.mymethod"

This is plugin discovery by name, not an import of a higher layer: the registry knows no method.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import pkgutil
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from .log import log
from .settings import PREFIX, Setting, StrictError, strict_requested

BUILTIN = "veloxpatch.methods"
ENTRY_POINTS = "veloxpatch.methods"

C = TypeVar("C", bound=type)


@dataclass(frozen=True)
class MethodInfo:
    """A registered method. ``composes``: the methods whose knobs also reach its caches (ids, or a function of the
    knobs: SqueezeAttention's chosen policy); ``policy``: its row policy can pick the rows inside another method."""

    name: str
    description: str
    knobs: tuple[Setting, ...]
    cls: type[Any]  # a CompressedKVCache subclass (below the caches layer, the registry cannot name it)
    composes: tuple[str, ...] | Callable[[Mapping[str, Any]], tuple[str, ...]] = ()
    policy: bool = False

    def composed(self, knobs: Mapping[str, Any]) -> tuple[str, ...]:
        """The methods whose knobs reach this one's caches under ``knobs`` (by full key)."""
        return self.composes(knobs) if callable(self.composes) else self.composes


class MethodTable(Mapping[str, MethodInfo]):
    """Every method by id, loaded on first read under a lock. A built-in method that fails to import is a bug: every
    read raises it. A plugin that fails is rolled back, named in one WARNING and kept in :attr:`failures` (an app
    not using it keeps running); under ``VELOX_STRICT`` (the environment's) loading ends in a :class:`StrictError`."""

    def __init__(self) -> None:
        self._infos: dict[str, MethodInfo] = {}
        self._loaded = self._loading = False
        self._lock = threading.RLock()
        self.failures: list[str] = []

    def __getitem__(self, name: str) -> MethodInfo:
        self.load()
        if name not in self._infos and self._loading and importlib.util.find_spec(f"{BUILTIN}.{name}") is not None:
            importlib.import_module(f"{BUILTIN}.{name}")  # a method built on a built-in one, asked for by id
        return self._infos[name]

    def __iter__(self) -> Iterator[str]:
        self.load()
        return iter(list(self._infos))

    def __len__(self) -> int:
        self.load()
        return len(self._infos)

    def add(self, info: MethodInfo) -> None:
        """Register ``info``; a second method of the same id, or a knob another method has, is refused."""
        if info.name in self._infos:
            raise ValueError(f"a method named {info.name!r} is already registered "
                             f"(by {self._infos[info.name].cls.__module__})")
        taken = {k.name for m in self._infos.values() for k in m.knobs}
        clash = [k.name for k in info.knobs if k.name in taken]
        if clash:
            raise ValueError(f"method {info.name!r} registers settings that already exist: {clash}")
        self._infos[info.name] = info

    def remove(self, name: str) -> None:
        """Forget a method (a plugin rolled back, a test's throwaway one)."""
        self._infos.pop(name, None)

    def load(self) -> None:
        """Import every built-in method module, then every plugin's entry point (once per process)."""
        if self._loaded:
            return
        with self._lock:
            if self._loaded or self._loading:
                return
            self._loading = True
            try:
                package = importlib.import_module(BUILTIN)
                for found in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
                    importlib.import_module(f"{BUILTIN}.{found.name}")
                for entry in sorted(importlib.metadata.entry_points(group=ENTRY_POINTS), key=lambda e: e.name):
                    self._load_plugin(entry)
                self._loaded = True
            finally:
                self._loading = False
        if self.failures and strict_requested():
            raise StrictError("; ".join(self.failures) + ", but VELOX_STRICT is set")

    def _load_plugin(self, entry: importlib.metadata.EntryPoint) -> None:
        """Load one plugin's entry point; one that registers no method under its own name is rolled back."""
        before = set(self._infos)
        try:
            entry.load()
            if entry.name not in self._infos:
                raise ValueError(f"it registered no method named {entry.name!r}")
        except Exception as error:
            for name in set(self._infos) - before:
                self.remove(name)
            message = f"method plugin {entry.name!r} ({entry.value}) is not loaded: {type(error).__name__}: {error}"
            self.failures.append(message)
            log.warning(message)


METHODS = MethodTable()


def method(name: str, description: str, knobs: tuple[Setting, ...] = (), *,
           composes: tuple[str, ...] | Callable[[Mapping[str, Any]], tuple[str, ...]] = (),
           policy: bool = False) -> Callable[[C], C]:
    """Class decorator: register a cache class as method ``name`` with its knobs (``VELOX_<NAME>_*``, made its own)."""

    def register(cls: C) -> C:
        for knob in knobs:
            if not knob.name.startswith(f"{PREFIX}{name.upper()}_"):
                raise ValueError(f"knob {knob.name} of {name} must be {PREFIX}{name.upper()}_*")
        if policy and getattr(cls, "policy_class", None) is None:
            raise ValueError(f"method {name!r} is offered as a policy (policy=True) but its class has no policy_class")
        owned = tuple(replace(knob, method=name) for knob in knobs)  # each knob says whose it is
        METHODS.add(MethodInfo(name, description, owned, cls, composes, policy))
        return cls

    return register


def cache_class(name: str) -> type[Any]:
    return METHODS[name].cls


def name_of(cache: Any) -> str:
    """The method ``cache`` is a cache of: the name its class (or the nearest base registered) has in the table, ``""``
    for a class none of whose bases is registered."""
    names = {info.cls: name for name, info in METHODS.items()}
    return next((names[kind] for kind in type(cache).__mro__ if kind in names), "")


def policies() -> tuple[str, ...]:
    """The methods whose row policy can pick the rows inside another method, sorted."""
    return tuple(sorted(name for name, info in METHODS.items() if info.policy))


def knob_settings(kv: str, knobs: Mapping[str, Any]) -> dict[str, Setting]:
    """Every knob reaching ``kv``'s caches by its constructor's name for it: ``kv``'s own, then those of every method
    it is built on, through those built on others in turn (each once)."""
    found: dict[str, Setting] = {}
    done: set[str] = set()
    todo = [kv]
    while todo:
        name = todo.pop(0)
        if name in done:
            continue
        done.add(name)
        todo.extend(METHODS[name].composed(knobs))
        for knob in METHODS[name].knobs:
            short = knob.key[len(name) + 1:]
            if short in found:
                raise ValueError(f"{kv}: knob {short!r} comes from both {found[short].name} and {knob.name}")
            found[short] = knob
    return found
