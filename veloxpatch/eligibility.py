"""Which cache slots of a model our caches can serve, decided by what the model does.

A model's source does not say whether compression is safe: multi-head latent attention attends over keys
up-projected from a stored latent, with its rotary scores in the mask and queries of another width when decoding;
some models read a cache directly (``keys_and_values``) or hand one layer's KV to other layers. So the builder
probes each model once, with a few dummy tokens:

1. a slot is served only if, at every forward, its layer stored rows in it once and attended once, through the
   routed function, over as many rows as it got back (else it stays mlx_lm's, and the others are probed again);
2. with those slots ours and a budget no probe reaches, the logits equal mlx_lm's own;
3. at a budget below the probe's length (prefill and decode compressions), nothing raises (failing 2 or 3 leaves
   the whole model to mlx_lm).

The probe's cost does not grow with depth: it runs a prefix of the layers holding every kind of layer
(:mod:`veloxpatch.structure`), or the whole model where that cannot stand (a model split across ranks, whose ranks
must run the same forwards). Each verdict carries the reason, in words a user can act on, and any error raised
(logged at WARNING by the builder); ``VELOX_STRICT`` makes any verdict that leaves a slot to mlx_lm an error.
"""

from __future__ import annotations

import copy
import traceback
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import mlx.core as mx

from . import structure
from .caches import CompressedKVCache, make_cache
from .caches.memory import SlotLayout, layout_of
from .config import Budget, VeloxConfig
from .coordinators import Coordinator, Span
from .log import log
from .memo import kept, per_model
from .registry import name_of

# token chunks fed to the model: two prefill chunks, then decode steps (ids valid in any vocabulary)
EXACT_CHUNKS = ((1, 2), (3, 4), (5,))
# at budget 2 (decode headroom 8): a short prompt, decode steps up to a compression, then a prefill
# chunk longer than the headroom (compressed as a chunk, or at the next step when compressing at the end)
EVICTING_CHUNKS = ((1, 2, 3, 4, 5, 6, 7, 1), (2,), (3,), (4, 5, 6, 7, 1, 2, 3, 4, 5), (6,))
NEVER: dict[str, Any] = {"budget": Budget(tokens=1 << 30), "sink": 4, "window": 32}  # the probe's sizes
TINY: dict[str, Any] = {"budget": Budget(tokens=2), "sink": 1, "window": 1}

_verdicts: dict[tuple[int, Any], Verdict] = {}


@dataclass(frozen=True)
class Verdict:
    """The slots that get our caches; why each other candidate slot (or the model) stays mlx_lm's."""

    slots: tuple[int, ...]
    left: dict[int, str] = field(default_factory=dict)
    reason: str = ""
    error: BaseException | None = None  # what was raised, its traceback dropped (it would keep the model alive)
    trace: str = ""  # that traceback, as text
    layouts: tuple[SlotLayout, ...] = ()  # what every slot of the list held per token in the probe (VELOX_KV_MEMORY)

    def describe(self, candidates: int) -> str:
        """One line for a user: what runs compressed and what does not, and why."""
        if not self.slots:
            return f"{self.reason}; running unpatched"
        text = f"compressed on {len(self.slots)} of {candidates} full-attention cache slots"
        return text + "".join(f"; slot {i} stays mlx_lm's: {why}" for i, why in sorted(self.left.items()))


def assemble(caches: list[Any], slots: Iterable[int], make: Callable[[], CompressedKVCache], method: str,
             span: Span = Span()) -> list[Any]:
    """``caches`` with ``slots`` replaced by fresh ``make()`` caches joined to one coordinator over ``span`` (the
    list's layers in the whole model); a cache object that fills several slots (layers sharing their KV) gets one."""
    out = list(caches)
    replaced: dict[int, CompressedKVCache] = {}
    coordinator: Coordinator | None = None
    for i in slots:
        if id(caches[i]) not in replaced:
            cache = replaced[id(caches[i])] = make()
            coordinator = coordinator or type(cache).coordinator_class(method, span)
            coordinator.join(cache)
        out[i] = replaced[id(caches[i])]
    return out


def verdict(model: Any, caches: list[Any], slots: tuple[int, ...], config: VeloxConfig, whole: bool) -> Verdict:
    """The probe's verdict for ``model`` under ``config`` (kept while the model lives); never raises. ``caches`` is
    a fresh list from mlx_lm, ``slots`` its plain ``KVCache`` slots; ``whole`` probes every layer. The route must be
    patched; the probe evaluates the model (the builder asks :func:`probed` and ``structure.unevaluated`` first)."""
    return per_model(_verdicts, model, _key(slots, config), lambda: _probe(model, caches, slots, config, whole))


def probed(model: Any, slots: tuple[int, ...], config: VeloxConfig) -> bool:
    """Whether :func:`verdict` has a verdict kept for ``model``, ``slots`` and ``config`` (no probe would run)."""
    return kept(_verdicts, model, _key(slots, config)) is not None


def _key(slots: tuple[int, ...], config: VeloxConfig) -> Hashable:
    return slots, config.kv, config.compress, tuple(sorted(config.knobs.items()))


def _probe(model: Any, caches: list[Any], slots: tuple[int, ...], config: VeloxConfig, whole: bool) -> Verdict:
    """The verdict from a prefix of the layers holding every kind where it stands for the model, else from all; an
    error raised makes the verdict. Its caches never reach the app, nor the statistics (:mod:`veloxpatch.stats`)."""
    try:
        found = None if whole else _probe_prefix(model, caches, slots, config)
        return found if found is not None else _probe_list(model, caches, slots, config, _plain_run(model, caches))
    except Exception as error:  # the builder says it (or raises under strict): the app runs on mlx_lm's caches
        return Verdict((), reason=f"the probe could not run the model ({type(error).__name__}: {error})",
                       **_raised(error))


def _probe_prefix(model: Any, caches: list[Any], slots: tuple[int, ...], config: VeloxConfig) -> Verdict | None:
    """The verdict of the shortest prefix of the layers holding every kind (:func:`veloxpatch.structure.prefix`),
    for every slot of the list; None where it cannot stand for the model (the whole model is then probed)."""
    try:
        part = structure.prefix(model, caches)
    except Exception as error:  # a layer stack unlike mlx_lm's: not a reason to turn the model away
        log.debug("probing every layer of %s: its layers could not be read (%r)", type(model).__name__, error)
        return None
    if part is None or part.length >= len(caches):
        return None
    short = caches[: part.length]
    try:
        shallow = structure.shortened(model, part.length)
        plain = _plain_run(shallow, short)
    except Exception as error:  # e.g. a forward counting layers of its own: the model is probed whole
        log.debug("probing every layer of %s: a forward over %d layers raised %r", type(model).__name__,
                  part.length, error)
        return None
    found = _probe_list(shallow, short, tuple(i for i in slots if i < part.length), config, plain)
    fate = [found.left.get(i, i in found.slots) for i in range(part.length)]  # served, or why not
    if any(fate[i] != fate[part.kinds[i]] for i in range(part.length)):  # a kind's first slot is no later
        log.debug("probing every layer of %s: layers of one kind fared differently", type(model).__name__)
        return None
    return replace(found, slots=tuple(i for i in slots if part.kinds[i] in found.slots),
                   left={i: found.left[part.kinds[i]] for i in slots if part.kinds[i] in found.left},
                   layouts=tuple(structure.widen(found.layouts, part)) if found.layouts else ())


def _plain_run(model: Any, caches: list[Any]) -> tuple[list[Any], list[mx.array]]:
    """mlx_lm's caches after the exact chunks, and the logits of each forward."""
    plain = copy.deepcopy(caches)
    return plain, list(_forwards(model, plain, EXACT_CHUNKS))


def _probe_list(model: Any, caches: list[Any], slots: tuple[int, ...], config: VeloxConfig,
                plain: tuple[list[Any], list[mx.array]]) -> Verdict:
    """Drop the slots the model misuses until the rest pass, then check outputs and eviction (``plain``: mlx_lm's)."""
    left: dict[int, str] = {}
    candidates = list(slots)
    while candidates:
        run = _Run(model, caches, candidates, config, NEVER, EXACT_CHUNKS, plain[1])
        blamed = run.misused()
        if not blamed and run.error is not None:
            return Verdict((), left, f"raises {type(run.error).__name__}: {run.error}", **_raised(run.error))
        left.update(blamed)
        candidates = [i for i in candidates if i not in blamed]
        if not blamed:
            break
    if not candidates:
        return Verdict((), left, "; ".join(dict.fromkeys(left.values())))
    if run.differs:
        return Verdict((), left, run.why_outputs_differ())
    evicting = _Run(model, caches, candidates, config, TINY, EVICTING_CHUNKS)
    problems = list(evicting.misused().values()) + ([repr(evicting.error)] if evicting.error else [])
    if problems:
        raised = _raised(evicting.error) if evicting.error is not None else {}
        return Verdict((), left, f"fails once rows are evicted ({problems[0]})", **raised)
    return Verdict(tuple(candidates), left, layouts=_layouts(plain[0], run))


def _layouts(plain: list[Any], run: _Run) -> tuple[SlotLayout, ...]:
    """Every slot's layout as mlx_lm's caches held it, plus one remembered query's bytes where our cache served it."""
    out = []
    for cache, served in zip(plain, run.caches):
        layout, q = layout_of(cache), getattr(getattr(served, "memory", None), "queries", None)
        out.append(layout if q is None else replace(layout, query_bytes=q.shape[1] * q.shape[3] * q.dtype.size))
    return tuple(out)


def _raised(error: BaseException) -> dict[str, Any]:
    """A verdict's record of ``error``: the error without its traceback (whose frames would keep the model alive)
    and that traceback as text."""
    trace = "".join(traceback.format_exception(error))
    chained: BaseException | None = error
    while chained is not None:
        chained.__traceback__ = None
        chained = chained.__cause__ or chained.__context__
    return {"error": error, "trace": trace}


class _Run:
    """One probe run with watched caches in ``slots``: its forwards, whether their logits differ from ``expected``
    (when given; each let go once compared, as a wide vocabulary's add up), its error, and per-slot records."""

    def __init__(self, model: Any, caches: list[Any], slots: list[int], config: VeloxConfig,
                 sizes: dict[str, Any], chunks: tuple[tuple[int, ...], ...],
                 expected: list[mx.array] | None = None) -> None:
        self.caches = assemble(copy.deepcopy(caches), slots, lambda: make_cache(config, **sizes), config.kv)
        self.watches = {i: _Watch(self.caches[i]) for i in slots}
        self.forwards = 0
        self.differs = False
        self.error: Exception | None = None
        try:
            for logits in _forwards(model, self.caches, chunks):
                self.differs = self.differs or (expected is not None and not _close(expected[self.forwards], logits))
                self.forwards += 1
        except Exception as error:
            self.error = error
        finally:
            for watch in self.watches.values():
                watch.detach()

    def misused(self) -> dict[int, str]:
        """Slots whose layer did not store once and attend once over the rows it got back."""
        forwards = None if self.error is not None else self.forwards
        found = {i: w.misuse(forwards) for i, w in self.watches.items()}
        if isinstance(self.error, AttributeError):
            for i, watch in self.watches.items():
                if self.error.obj is watch.cache:
                    found[i] = f"the model reads the cache directly (`{self.error.name}`)"
        return {i: why for i, why in found.items() if why}

    def why_outputs_differ(self) -> str:
        """The likeliest reason this run's logits differ from those with mlx_lm's caches."""
        if any(w.score_mask for w in self.watches.values()):
            return "its attention mask carries scores (as multi-head latent attention's rotary part does)"
        return "its outputs differ from those with mlx_lm's own caches"


def _forwards(model: Any, caches: list[Any], chunks: tuple[tuple[int, ...], ...]) -> Iterator[mx.array]:
    """The model's logits for each chunk (evaluated), fed in order as prefill chunks and decode steps."""
    for chunk in chunks:
        logits = model(mx.array([chunk]), cache=caches)
        mx.eval(logits)
        yield logits


def _close(expected: mx.array, got: mx.array) -> bool:
    """Equal up to rounding: the same kernels run, so only the spelling of a mask can move bits."""
    a, b = expected.astype(mx.float32), got.astype(mx.float32)
    tolerance = 1e-4 if expected.dtype == mx.float32 else 2e-2
    return a.shape == b.shape and bool(mx.abs(a - b).max() <= tolerance * (1 + mx.abs(a).max()))


def _same_rows(keys: mx.array, stored: mx.array) -> bool:
    """Whether attended keys are the stored rows, up to repeated heads and dtype (per-row means agree)."""
    means = [k.astype(mx.float32).mean(axis=(1, 3)) for k in (keys, stored)]
    return bool(mx.allclose(means[0], means[1], rtol=1e-2, atol=1e-3))


class _Watch:
    """Counts a probe cache's stores and attention calls (instance-level wrappers, undone by detach)."""

    def __init__(self, cache: CompressedKVCache) -> None:
        self.cache = cache
        self.stores = self.attends = 0
        self.fetched: tuple[mx.array, mx.array] | None = None
        self.other_rows = self.derived_keys = self.score_mask = False
        # on the instance, by setattr: mypy reads assigning to a method as a mistake
        setattr(cache, "update_and_fetch", self._update_and_fetch)
        setattr(cache, "attend", self._attend)

    def detach(self) -> None:
        """Drop the wrappers (and the cycles through them) and leave the coordinator."""
        del self.cache.update_and_fetch, self.cache.attend
        assert self.cache.coordinator is not None, "a probe's caches are coordinated"
        self.cache.coordinator.members.clear()

    def _update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.stores += 1
        self.fetched = type(self.cache).update_and_fetch(self.cache, keys, values)
        return self.fetched

    def _attend(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any = None,
                sinks: mx.array | None = None) -> mx.array:
        self.attends += 1
        if self.fetched is None:  # attended before anything was stored: not this layer's own rows
            self.other_rows = True
        else:
            stored = self.fetched[0]
            rows = stored.shape[-2]
            self.other_rows = self.other_rows or keys.shape[-2] != rows or values.shape[-2] != rows
            self.derived_keys = self.derived_keys or not self.other_rows and not _same_rows(keys, stored)
        self.score_mask = self.score_mask or (isinstance(mask, mx.array) and mx.issubdtype(mask.dtype, mx.floating))
        return type(self.cache).attend(self.cache, queries, keys, values, scale, mask, sinks)

    def misuse(self, forwards: int | None) -> str:
        """Why this slot cannot be served ('' if it can); ``forwards`` is None after an exception."""
        if self.attends > self.stores:
            return "its KV is shared with other layers"
        if forwards is not None and self.stores and not self.attends:
            return "its attention does not go through mlx_lm's routed function"
        if self.other_rows:
            return "its attention runs over other rows than the cache stores"
        if self.derived_keys and self.cache.uses_queries:
            return (f"it attends over keys computed from the stored rows (multi-head latent attention), "
                    f"which {name_of(self.cache)} cannot score against its queries")
        if forwards is not None and (self.stores, self.attends) != (forwards, forwards):
            return f"it was stored to {self.stores} and attended {self.attends} times in {forwards} forward passes"
        return ""
