"""Models split across ranks by ``mlx.distributed``: what each rank's cache list spans, and that every rank runs with
the same settings.

mlx_lm splits a model two ways (``sharded_load``), which may be combined: tensor parallel (``model.shard(group)``:
every rank holds every layer with a share of its heads) and pipeline parallel (``model.model.pipeline(group)``: rank
r holds a span of layers, the later ones on the lower ranks, and ``make_cache`` returns caches for those only).

Each rank builds its own list, so per-head choices are local. What depends on the whole model is agreed once per
model by one all-gather over the world group (:func:`agree`): settings that differ are an error on every rank; a rank
whose probe failed leaves every rank unpatched (a cache's collectives must be met by every rank); the pipeline stages
give each list its :class:`~veloxpatch.coordinators.Span`. That collective is safe because every rank builds caches
at the same point of the program (as mlx_lm's distributed apps do), so every rank must run veloxpatch.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx

from .config import CORE_SETTINGS, ConfigError, VeloxConfig
from .coordinators import Span, drain_streams
from .memo import kept, per_model

# settings that may differ per rank: they change nothing in the caches (strict must agree: a strict rank raising
# inside a build that its peers go on with would leave them waiting in a collective)
LOCAL_SETTINGS = ("log", "stats", "blas", "float32")


class RanksDisagree(ConfigError):
    """The ranks of a distributed run have different settings: raised on every rank, never fallen back
    from (each rank would otherwise run a different method, silently)."""


@dataclass(frozen=True)
class Split:
    """How a model is split: its pipeline stage, whether it is split at all, and its tensor-parallel group."""

    stage: int = 0
    split: bool = False
    tensor: Any = None


_agreed: dict[tuple[int, Any], tuple[bool, Span]] = {}
_splits: dict[tuple[int, Any], Split] = {}
_placed: list[tuple[int, int]] = []  # (rank, ranks) once this process took part in an agreement


def agreement(model: Any, config: VeloxConfig, ready: bool, members: int) -> tuple[bool, Span]:
    """:func:`agree` for ``model`` under ``config``, once per model and settings (later builds, e.g. a
    chat's next prompt cache, reuse it without traffic); ``(ready, Span())`` on a model not split."""
    split = split_of(model)
    if not split.split:
        return ready, Span()
    local = {s.name for s in CORE_SETTINGS if s.key in LOCAL_SETTINGS}
    settings = tuple((name, value) for name, value in config.to_env().items() if name not in local)
    return per_model(_agreed, model, settings, lambda: agree(split, settings, ready, members))


def is_split(model: Any) -> bool:
    """Whether ``model`` is split across ranks (its forwards hold collectives every rank must meet alike)."""
    return split_of(model).split


def split_of(model: Any) -> Split:
    """Whether ``model`` is split across ranks, found once per model from its modules (sharded linear layers with a
    group of more than one rank; a pipelined layer stack), and its pipeline stage."""
    if (known := kept(_splits, model, None)) is not None:
        return known
    from mlx.nn.layers import distributed

    sharded = (distributed.AllToShardedLinear, distributed.ShardedToAllLinear,
               distributed.QuantizedAllToShardedLinear, distributed.QuantizedShardedToAllLinear)
    tensor, pipeline, stage = None, False, 0
    for _, module in model.named_modules():
        if isinstance(module, sharded) and module.group.size() > 1:
            tensor = module.group
        if getattr(module, "pipeline_size", 1) > 1:
            pipeline, stage = True, module.pipeline_rank
    return per_model(_splits, model, None, lambda: Split(stage, tensor is not None or pipeline, tensor))


def agree(split: Split, settings: tuple[tuple[str, str], ...], ready: bool, members: int) -> tuple[bool, Span]:
    """One all-gather over every rank: raises RanksDisagree if a value of ``settings`` differs between ranks; returns
    whether every rank's probe passed and this rank's span (first served layer, served layers in the model)."""
    mine = [zlib.crc32(value.encode()) & 0x7FFFFFFF for _, value in settings] + [int(ready), split.stage, members]
    drain_streams()
    rows = cast(list[list[int]], mx.distributed.all_gather(mx.array([mine], dtype=mx.int32), stream=mx.cpu).tolist())
    world = mx.distributed.init()
    _placed[:] = [(world.rank(), world.size())]
    n = len(settings)
    differ = [(name, value) for i, (name, value) in enumerate(settings) if len({row[i] for row in rows}) > 1]
    if differ:
        said = ", ".join(f"{name}={value}" for name, value in differ)
        raise RanksDisagree(f"the ranks of this distributed run have different settings: rank {world.rank()} has "
                            f"{said}, another rank not; start every rank with the same VELOX_* settings "
                            f"(veloxpatch run mlx.launch ... passes them to every rank)")
    stages = {row[n + 1]: row[n + 2] for row in rows}  # tensor-parallel peers share a stage
    first = sum(count for stage, count in stages.items() if stage > split.stage)
    return all(row[n] for row in rows), Span(first, sum(stages.values()), True, split.tensor)


def place() -> tuple[int, int] | None:
    """(rank, ranks) once caches were built for a model split across ranks in this process, else None."""
    return _placed[0] if _placed else None


def summed(numbers: list[int]) -> list[int] | None:
    """``numbers`` summed over every rank (every rank calls this at exit), or None if a rank is gone
    (its connection lost: the summary of the others is not the run's)."""
    try:
        drain_streams()
        return cast(list[int], mx.distributed.all_sum(mx.array(numbers, dtype=mx.int64), stream=mx.cpu).tolist())
    except RuntimeError:
        return None
