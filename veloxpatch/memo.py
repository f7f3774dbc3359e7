"""Results kept while their model lives: the probe's verdict, how a model is split across ranks, what its
ranks agreed. Keyed by the model's id, which Python reuses once the model is gone, so each entry is
dropped when its model is collected."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

T = TypeVar("T")


def per_model(table: dict[tuple[int, Hashable], Any], model: Any, key: Hashable, compute: Callable[[], T]) -> T:
    """``table``'s entry for ``model`` and ``key``, computed by ``compute()`` the first time."""
    full = (id(model), key)
    if full not in table:
        table[full] = compute()
        weakref.finalize(model, table.pop, full, None)
    return table[full]


def kept(table: dict[tuple[int, Hashable], Any], model: Any, key: Hashable) -> Any:
    """``table``'s entry for ``model`` and ``key``, None where :func:`per_model` has computed none yet."""
    return table.get((id(model), key))
