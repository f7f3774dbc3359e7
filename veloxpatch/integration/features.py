"""What veloxpatch replaces in mlx_lm, grouped into features, and whether the installed mlx_lm offers each.

mlx-lm changes between minors (``BatchGenerator.insert_segments`` appeared in 0.31, ``batch_generate``'s parameters
changed in 0.32), so nothing is patched by version: a feature is patched where every name it wraps exists and takes
the parameters its wrapper reads (``inspect.signature``, without a model), and otherwise not at all, so that no
feature is ever half mlx_lm's and half ours. Two features are the shim itself (``essential``): without the attention
route or the prompt caches nothing can be compressed, so either being off leaves the whole of mlx_lm as it is.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from ..cpu import float32_wanted
from . import batched, compat, float32, server, threads, version, wrappers
from .layer_io import POSITIONAL


@dataclass(frozen=True)
class Target:
    """One name of an mlx_lm module that veloxpatch replaces (a function, or ``Class.method``), its wrapper, and the
    parameters that wrapper reads: a changed signature turns the feature off instead of reaching it."""

    name: str
    wrapper: Callable[[Any], Any]
    leading: tuple[str, ...] = ()
    """The first positional parameters, in this order: the wrapper reads them by position."""
    keyword_only: tuple[str, ...] = ()
    """Parameters the wrapper reads from the call's keywords alone (so they must be keyword-only)."""
    named: tuple[str, ...] = ()
    """Parameters the wrapper binds by name (``inspect.signature(...).bind``)."""

    def problem(self, function: Callable) -> str | None:
        """What in ``function``'s parameters this wrapper cannot work with; None if nothing."""
        found = inspect.signature(function).parameters
        positional = [p.name for p in found.values() if p.kind in POSITIONAL]
        missing = [n for n in self.named if n not in found]
        loose = [n for n in self.keyword_only if n not in found or found[n].kind is not inspect.Parameter.KEYWORD_ONLY]
        if positional[:len(self.leading)] != list(self.leading):
            wanted = f"start with ({', '.join(self.leading)})"
        elif missing or loose:
            wanted = f"take {', '.join(missing)} by name" if missing else f"take {', '.join(loose)} as keyword-only"
        else:
            return None
        return f"{self.name}{compat.parameters(function)} does not {wanted}"


@dataclass(frozen=True)
class Feature:
    """Names of one defining module patched together, or (where any is missing or different) none of them."""

    name: str
    module: str
    targets: tuple[Target, ...]
    off: str
    """What happens while it is off, said in the one line that says so."""
    essential: bool = False
    """Off means the whole shim passes through (nothing can be compressed without it)."""
    layouts: tuple[str, ...] = ()
    """Private layouts of mlx_lm its wrappers rely on (:data:`.compat.SERVER_LAYOUTS`); one that differs: off."""
    used: Callable[[Any], bool] = lambda config: True
    """Whether a config's settings use what it does: under ``VELOX_STRICT`` a feature off is refused only then
    (with only ``VELOX_FLOAT32`` at work, batched generation off leaves nothing uncompressed)."""


FEATURES: tuple[Feature, ...] = (
    Feature("attention route", "mlx_lm.models.base", (
        Target("scaled_dot_product_attention", wrappers.scaled_dot_product_attention, leading=wrappers.SDPA_PARAMS),
    ), off="attention cannot reach compressed caches", essential=True),
    Feature("prompt caches", "mlx_lm.models.cache", (
        Target("make_prompt_cache", wrappers.make_prompt_cache, leading=("model",)),
        Target("load_prompt_cache", wrappers.load_prompt_cache),
    ), off="no compressed cache can be built", essential=True),
    Feature("generation start", "mlx_lm.generate", (
        Target("generate_step", wrappers.generation_start, leading=("prompt", "model"), keyword_only=("prompt_cache",)),
        Target("speculative_generate_step", wrappers.speculative_start,
               named=("model", "draft_model", "prompt_cache")),
    ), off="generations start on caches as they are (coordinators not reset, the draft's caches compressed too, "
           "no generation counted)", used=lambda config: config.enabled),
    Feature("batched generation", "mlx_lm.generate", (
        Target("BatchGenerator.insert_segments", batched.batch_insert_segments,
               named=("segments", "caches", "all_tokens")),
    ), off="batched generation stays mlx_lm's", used=lambda config: config.enabled),
    Feature("settings per request", "mlx_lm.server", (
        Target("APIHandler.validate_model_parameters", server.validate_model_parameters, leading=("self",)),
        Target("APIHandler.handle_completion", server.handle_completion, leading=("self", "request")),
        Target("ResponseGenerator.generate", server.generate, leading=("self", "request", "generation_args")),
        Target("ResponseGenerator._is_batchable", server.is_batchable, leading=("self", "args")),
        Target("ResponseGenerator._serve_single", server.serve_single, leading=("self", "request")),
        Target("APIHandler.generate_response", server.with_usage, leading=("self",)),
        Target("APIHandler.completion_usage_response", server.with_usage, leading=("self",)),
        Target("LRUPromptCache.fetch_nearest_cache", server.fetch_nearest_cache, leading=("self", "model", "tokens")),
        Target("LRUPromptCache.insert_cache", server.insert_cache,
               leading=("self", "model", "tokens", "prompt_cache")),
    ), off='the server serves every request with the process\'s settings (a request\'s "velox" field and X-Velox-* '
           'headers are ignored, and its usage says nothing of its KV cache)',
        layouts=tuple(compat.SERVER_LAYOUTS)),
    Feature("clean stop", "mlx_lm.server", (
        Target("ResponseGenerator.stop_and_join", threads.joined, leading=("self",)),
        Target("ResponseGenerator.join", threads.joined, leading=("self",)),
    ), off="a server stopped by SIGINT may abort as it exits (mlx's per-thread random key, integration/threads.py)"),
    Feature("float32 load", "mlx_lm.utils", (
        Target("load_model", float32.load_model, leading=("model_path", "lazy")),
    ), off="VELOX_FLOAT32 has no effect: models keep their dtype", used=lambda config: float32_wanted(config.float32)),
)
"""Every feature, in the order ``veloxpatch info`` lists them."""

MODULES = tuple(dict.fromkeys(f.module for f in FEATURES))
"""The defining modules veloxpatch hooks."""


def owner_of(module: ModuleType, target: Target) -> Any:
    """Where ``target`` is defined in ``module``: the module, or the class its name starts with (None: missing)."""
    owner_name, _, _ = target.name.rpartition(".")
    return getattr(module, owner_name, None) if owner_name else module


def original(module: ModuleType, target: Target) -> Any:
    """What ``module`` defines under ``target``'s name (for a method, on the class itself: an inherited one is not
    that class's to replace); None if nothing."""
    owner = owner_of(module, target)
    return None if owner is None else vars(owner).get(target.name.rpartition(".")[2])


def problem(feature: Feature, module: ModuleType) -> str | None:
    """Why ``feature`` cannot be patched in ``module`` (a name missing, parameters its wrapper cannot work with, a
    layout changed), for the first that fails; None when it can."""
    for target in feature.targets:
        function = original(module, target)
        if function is None:
            return f"{target.name} is not in mlx-lm {version.mlx_lm_version()}"
        try:
            found = target.problem(function)
        except (TypeError, ValueError) as error:  # inspect.signature cannot read it
            found = f"{target.name} has no readable signature ({error})"
        if found is not None:
            return f"{found} (mlx-lm {version.mlx_lm_version()})"
    return next((f"{name} is not the layout veloxpatch knows ({found}; mlx-lm {version.mlx_lm_version()})"
                 for name in feature.layouts if (found := compat.check(name)) is not None), None)


def survey() -> dict[str, str | None]:
    """Why each feature would not be patched (None: it would), importing its module (``veloxpatch info``)."""
    return {f.name: problem(f, importlib.import_module(f.module)) for f in FEATURES}
