"""What the builder reads of a model without running it: whether the app has evaluated its parameters yet, and which
of its layers are of one kind.

Both serve the eligibility probe, which must cost little and change nothing. mlx is lazy: a model built from a
config (mlx-lm's own tests build a 35B one and only look at output shapes) or loaded with ``lazy=True`` holds no
weights until something evaluates them, which a probe forward would do. And a forward over every layer costs as much
as the app's own, so on a deep model the probe runs the shortest prefix of the layers holding every kind of layer
(:data:`REPEATS` of each), and what it finds for a kind holds for each layer of that kind. Two layers are of one kind
when alike in every way the model's code can tell them apart by: module classes, parameter shapes and dtypes, plain
attributes (a layer's own index aside), and the class and plain attributes of the cache mlx_lm gives them.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

# layers of each kind the prefix holds (where the model has that many): two, so that whatever joins layers (a
# coordinator's schedule, cross-layer groups) runs between layers of one kind as in the whole model
REPEATS = 2
_PLAIN = (bool, int, float, str, type(None))


def unevaluated(model: Any) -> bool:
    """Whether any parameter of ``model`` is still a lazy computation: mlx has no flag for it, but ``mx.export_to_dot``
    writes an unevaluated array with the operations making it (edges, ``->``), an evaluated one as a lone node."""
    return any(_pending(array) for _, array in tree_flatten(model.parameters()))


def _pending(array: mx.array) -> bool:
    """Whether ``array`` is not evaluated yet (its graph has an operation in it)."""
    out = io.StringIO()
    mx.export_to_dot(out, array)
    return "->" in out.getvalue()


@dataclass(frozen=True)
class Prefix:
    """The first ``length`` layers (and slots of mlx_lm's cache list) hold every kind of layer of the model;
    ``kinds[i]`` is the first slot of slot ``i``'s kind, for every slot of the whole list."""

    length: int
    kinds: tuple[int, ...]


def prefix(model: Any, caches: Sequence[Any]) -> Prefix | None:
    """The shortest prefix of ``model``'s layers holding :data:`REPEATS` layers of each kind (all of a kind the model
    has fewer of), or None when the model's layers do not map one to one onto ``caches`` (the slots then cannot be
    told apart by their layers: layers sharing caches, caches that are not per layer)."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, (list, tuple)) or len(layers) != len(caches):
        return None
    kinds = _kinds([_features(layer) for layer in layers], [_cache_kind(cache) for cache in caches])
    places: dict[Hashable, list[int]] = {}  # each kind's layers, in order
    for i, kind in enumerate(kinds):
        places.setdefault(kind, []).append(i)
    length = max((at[min(REPEATS, len(at)) - 1] + 1 for at in places.values()), default=0)
    return Prefix(length, tuple(places[kind][0] for kind in kinds))


def _kinds(layers: list[dict[Hashable, Any]], caches: list[Hashable]) -> list[Hashable]:
    """Each layer's kind, from its features without those that count the layers (``layer_idx``, a layer number:
    every layer has its own, which is its place, not its kind) and its cache's kind."""
    counting = {key for features in layers for key in features if _counts(key, layers)}
    return [(tuple(sorted((k, v) for k, v in features.items() if k not in counting)), cache)
            for features, cache in zip(layers, caches)]


def _counts(key: Hashable, layers: list[dict[Hashable, Any]]) -> bool:
    """Whether the layers having ``key`` (two at least) have it as an integer equal to their index plus a constant."""
    values = [(i, features[key]) for i, features in enumerate(layers) if key in features]
    return len(values) > 1 and all(type(v) is int for _, v in values) and len({v - i for i, v in values}) == 1


def _features(layer: Any) -> dict[Hashable, Any]:
    """What the model's code can tell ``layer`` apart by: its modules' classes and plain attributes, its
    parameters' shapes and dtypes."""
    if not hasattr(layer, "named_modules"):
        return {"": repr(layer)}
    found: dict[Hashable, Any] = {}
    for path, module in layer.named_modules():
        found[(path, "class")] = type(module).__qualname__
        found.update(((path, name), value) for name, value in _plain(module))
    found.update(((name, "parameter"), (tuple(a.shape), str(a.dtype))) for name, a in tree_flatten(layer.parameters()))
    return found


def _cache_kind(cache: Any) -> Hashable:
    """A cache's class and plain attributes, with those of the caches it holds (``CacheList``)."""
    inner = getattr(cache, "caches", ())
    held = tuple(_cache_kind(c) for c in inner) if isinstance(inner, (list, tuple)) else ()
    return type(cache).__qualname__, _plain(cache), held


def _plain(obj: Any) -> tuple[tuple[str, Any], ...]:
    """``obj``'s plain attributes: numbers, strings, None, and tuples or lists of them."""
    items = list(vars(obj).items()) if hasattr(obj, "__dict__") else []
    if isinstance(obj, dict):  # an mlx module keeps its lists and tuples in itself, not in __dict__
        items += obj.items()
    return tuple(sorted((name, tuple(v) if isinstance(v, list) else v) for name, v in items if _is_plain(v)))


def _is_plain(value: Any) -> bool:
    return isinstance(value, _PLAIN) or (isinstance(value, (tuple, list)) and all(isinstance(v, _PLAIN) for v in value))


def shortened(model: Any, length: int) -> Any:
    """A view of ``model`` whose layer stack holds its first ``length`` layers (a forward walks every layer, whatever
    the cache list), or ``model`` where the stack is not among its modules. The view shares every module and
    parameter; ``model`` is left untouched (the app may be running it in another thread)."""
    path = _path_to(model, model.layers)
    if path is None:
        return model
    view = node = copy.copy(model)
    for key in path[:-1]:
        child = copy.copy(node[key])
        node[key] = child  # an mlx module holds its children as items of itself
        node = child
    node[path[-1]] = model.layers[:length]
    return view


def _path_to(module: Any, target: Any, depth: int = 3) -> list[str] | None:
    """The keys leading from ``module`` through its child modules (``depth`` at most) to ``target``."""
    for key, value in module.items():
        if value is target:
            return [key]
        found = _path_to(value, target, depth - 1) if isinstance(value, nn.Module) and depth > 0 else None
        if found is not None:
            return [key, *found]
    return None


def widen(values: Iterable[Any], part: Prefix) -> list[Any]:
    """Per-slot ``values`` of the prefix for every slot of the whole list: one past it takes its kind's first one's."""
    known = list(values)
    return [known[i] if i < part.length else known[part.kinds[i]] for i in range(len(part.kinds))]
