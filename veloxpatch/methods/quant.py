"""Quant: every token kept at low bits, keys quantized per channel and values per token (KIVI, Liu et al.,
arXiv 2402.02750), the last ``VELOX_WINDOW`` tokens exact.

Why per channel: a few key channels are large in every token, so in mlx_lm's per-token groups (``kv_bits``) they set
each group's scale; here each channel of a block of tokens gets its own. Values, summed row by row, keep per-token
groups (docs/results.md, "Keys per channel").

A cross-layer cache of a group of one (:mod:`veloxpatch.caches.crosslayer`): after each prompt chunk and every block
of decode tokens (``VELOX_QUANT_GROUP``: 64 tokens, 32 under a share of the bytes), the exact rows older than the
window are quantized in whole blocks and join the layer's one fold. A prompt chunk attends over the fold
dequantized; a decode step multiplies it as held, by mlx's quantized matmul.

Fewer rows (``VELOX_QUANT_KEEP``), chosen before any question is asked: the second reading is
:mod:`veloxpatch.integration.rereading`'s, the shares over layers :func:`model_wise`'s. Each head keeps its rows in
whole blocks, with each row's two-byte position for trims. Each prompt, a chat's next turn too, is scored once read,
its rows chosen with those still exact when it began; rows an answer folds are all kept.

Forced by measurements (docs/results.md, "Rows to drop before the question"): until the second reading a prompt's
keys fold at ``HOLD_BITS`` and the kept keys are quantized to ``VELOX_QUANT_BITS`` once, from them; and heads keep
different numbers of rows, a *ragged* fold of one unpadded part per head (:func:`_fold_of`; a cache holding several
sequences keeps the same number per head).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, cast

import mlx.core as mx
from mlx.utils import tree_flatten

from ..caches import masks
from ..caches.crosslayer import CrossLayerCache, Fold
from ..caches.queries import QueryMemory
from ..caches.scored_attention import scored_attention
from ..caches.selection import best_rows, pool_rows
from ..caches.spec import CacheSpec
from ..caches.store import BITS, GROUPS, Parts, decode, encode, join, take_rows
from ..coordinators import members_of
from ..log import once
from ..registry import cache_class, method
from ..settings import Setting, choice, int_choice, number_range, odd_kernel, one_of_text, percent
from ..stats import at_16_bits

BUDGETS = ("layer", "model")  # VELOX_QUANT_BUDGETS: what one top-k of the rows to keep runs over
SCORES = ("repeat", "expected", "snapkv", "heads")  # VELOX_QUANT_SCORE: how the rows to keep are scored
CALIBRATION_ROWS = 512  # the fewest rows of every head a second reading scores to rate the heads (``score=heads``)

HOLD_BITS = 8  # the keys of a prompt awaiting its second reading (module doc: why not at VELOX_QUANT_BITS)


class BytesShare(float):
    """A share of the full cache's 16-bit bytes (``"0.125x"``), read back as it was written."""

    def __str__(self) -> str:
        return f"{float(self):g}x"


def group_choice(text: str) -> int | str:
    """``VELOX_QUANT_GROUP``: one of mlx's group sizes, or ``auto`` (:func:`block_size` decides)."""
    given = text.strip().lower()
    return given if given == "auto" else int_choice(GROUPS)(given)


def block_size(group: int | str, keep: float) -> int:
    """Tokens per block of ``VELOX_QUANT_GROUP`` (``group``) for a cache keeping ``keep``: ``auto`` is 32 under a share
    of the bytes, else 64 (why: the knob's help, :data:`KNOBS`)."""
    return group if isinstance(group, int) else 32 if isinstance(keep, BytesShare) else 64


def keep_share(text: str) -> float:
    """``VELOX_QUANT_KEEP``: a share of the rows (``"30%"``), or of the full cache's 16-bit bytes (``"0.125x"``)."""
    given = text.strip().lower()
    if not given.endswith("x"):
        return percent(given)
    value = float(given[:-1])
    if not 0 < value <= 1:
        raise ValueError(text)
    return BytesShare(value)


KNOBS = (
    Setting("VELOX_QUANT_BITS", int_choice(BITS), "4", one_of_text(BITS),
            "Quant: bits per element of every key and value older than the window."),
    Setting("VELOX_QUANT_GROUP", group_choice, "auto", "auto, or " + one_of_text(GROUPS),
            "Quant: tokens per block whose key channels share a scale and bias (and a value row's elements per "
            "group, or the largest of 32, 64 and 128 dividing the head dimension). `auto`: 32 where "
            "VELOX_QUANT_KEEP is a share of the bytes (the rows past the last whole block wait exact and count "
            "against it: smaller blocks keep a chat nearer its share), else 64 (fewer scales a row)."),
    Setting("VELOX_QUANT_KEEP", keep_share, "100%",
            "a percentage in (0, 100] of the rows, or a multiple in (0, 1] of the full cache's 16-bit bytes (`0.125x`)",
            "Quant: share of a prompt's quantized rows kept once the prompt is read: those the model attends to "
            "most while it reads the prompt a second time (KVzip's score, or VELOX_QUANT_SCORE's), each head its "
            "count by VELOX_QUANT_BUDGETS (the first VELOX_SINK tokens always stay); below 100% every prompt is read "
            "twice. Or a share of memory: `0.125x` keeps as many as make each layer hold an eighth of the full "
            "cache's 16-bit bytes for the tokens seen (every byte counted; a share every row fits at "
            "VELOX_QUANT_BITS keeps them all). Measured: docs/results.md, \"RULER at 4k on Qwen2.5\" (answers) and "
            "\"Decode\" (the second reading's time)."),
    Setting("VELOX_QUANT_POOL", odd_kernel, "1", "an odd integer in [1, 63]",
            "Quant, with VELOX_QUANT_KEEP: each row of a prompt scored as the best of this many neighbouring rows "
            "before the rows are chosen, so a kept row keeps the tokens around it; 1 scores each row alone."),
    Setting("VELOX_QUANT_BUDGETS", choice(BUDGETS), "model", "one of " + ", ".join(BUDGETS),
            "Quant, with VELOX_QUANT_KEEP: what one top-k of the rows to keep runs over. `model`: every layer's "
            "heads at once, on the raw scores (KVzip's non-uniform budgets), the model's total the same; `layer`: "
            "each layer keeps its share, spread over its heads (AdaKV: each head's scores over their sum)."),
    Setting("VELOX_QUANT_FLOOR", number_range(0, 1), "0.25", "a number in [0, 1]",
            "Quant, with VELOX_QUANT_BUDGETS=model: the share of each layer's own rows it keeps by its own top-k "
            "before one top-k over every layer's heads shares out the rest, so no layer is starved of the rows a "
            "question about several facts needs (docs/results.md); 0: the model-wise top-k alone."),
    Setting("VELOX_QUANT_SCORE", choice(SCORES), "repeat", "one of " + ", ".join(SCORES),
            "Quant, with VELOX_QUANT_KEEP: how a prompt's rows are scored: `repeat`, the most attention they get "
            "while the model reads the prompt a second time (KVzip); `expected`, without a second reading, the "
            "attention queries to come are expected to pay them, times the value's norm (Expected Attention, from the "
            "prompt's last VELOX_WINDOW queries); `snapkv`, the attention those queries paid them, pooled (SnapKV: for "
            "a prompt ending with its question); `heads`, KVzip's context-independent form: the first prompt of a "
            "model long enough is read twice and rates each KV head by its rows' mean score, later prompts are read "
            "once, the best-rated heads keeping their rows. `expected` is experimental (docs/results.md)."),
)


@method("quant", "Every token at VELOX_QUANT_BITS bits: keys per channel in blocks of tokens, values per token "
                 "(KIVI); the window stays exact.", KNOBS)
class QuantCache(CrossLayerCache):
    """Exact recent rows in the store; older rows, in whole blocks, in one quantized fold."""

    uses_budget = False
    budget_use = ("VELOX_BUDGET does not apply: it keeps every token, all but the exact window at VELOX_QUANT_BITS "
                  "bits (4 by default).")

    saved_scalars = ("chosen_end",)
    store_step = 8  # the exact rows' spare room, counted in a share of the bytes: 32 rows were 0.016 of a 2k cache
    rereads_prompt = True  # the model call may read a prompt twice for it (integration.rereading)
    memory_instead = (" (VELOX_QUANT_KEEP=0.125x keeps the rows that make it hold an eighth of the full cache's "
                      "16-bit bytes)")  # said where VELOX_KV_MEMORY is refused

    def __init__(self, spec: CacheSpec, bits: int = 4, group: int | str = "auto", keep: float | str = 1.0,
                 pool: int = 1, budgets: str = "model", floor: float = 0.25, score: str = "repeat") -> None:
        super().__init__(spec)
        self.bits, self.pool, self.budgets, self.floor, self.score = bits, pool, budgets, floor, score
        self.scorer: Any = None  # ``score`` expected or snapkv: that method's policy, built once (its rotary maps)
        self.keep = keep_share(keep) if isinstance(keep, str) else keep  # a string: a saved share of the bytes
        self.group_size = block_size(group, self.keep)
        self.rereading = False  # the model reads the prompt again: this cache scores its folded rows
        self.storing = True  # False while a chunk of that reading is read: attended over, not stored
        self.unscored: list[mx.array] = []  # the prompt chunks read since the last scoring (token ids)
        self.chosen_end = 0  # rows before this position were chosen by an earlier reading (or kept: every row)
        self.scores: mx.array | None = None  # (B, H, folded rows) the most attention the second reading paid
        self.scale = 1.0  # the attention's scale, seen at each prompt chunk (``score`` expected or snapkv)
        self.module: weakref.ref | None = None  # the layer's attention module, while ``score=expected`` chooses
        self.candidates: Candidates | None = None  # the prompt's rows to choose among, once read again
        self.rated: mx.array | None = None  # ``score=heads``: (H,) each head's rating by the last second reading

    def knob_values(self) -> dict[str, Any]:
        return {"bits": self.bits, "group": self.group_size,
                "keep": str(self.keep) if isinstance(self.keep, BytesShare) else self.keep, "pool": self.pool,
                "budgets": self.budgets, "floor": self.floor, "score": self.score}

    @classmethod
    def resolved_knobs(cls, values: dict[str, Any]) -> dict[str, Any]:
        """``group`` as :func:`block_size` decides it for ``keep`` (a journal's text ``"0.125x"`` too)."""
        keep = values.get("keep", 1.0)
        keep = keep_share(keep) if isinstance(keep, str) else keep
        return {**values, "group": block_size(values.get("group", "auto"), keep)}

    @property
    def scores_by_queries(self) -> bool:
        """Whether the prompt's last queries score its rows (``expected``, ``snapkv``): remembered as it is read."""
        return self.score in ("expected", "snapkv")

    @property
    def wants_rereading(self) -> bool:
        """Whether a prompt is read a second time: a share of the rows below all, or of the bytes below what every
        row holds at ``VELOX_QUANT_BITS`` (its bits and a 16-bit scale and bias per group)."""
        if isinstance(self.keep, BytesShare):
            return self.keep < ((self.bits + 32 / self.group_size) / 16 if self.bits < 16 else 1)
        return self.keep < 1

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """As every cache of folds, but a chunk of the second reading (:meth:`store_next_rows` false) is returned after
        the rows held, not stored (stored, every layer's rows of it would be alive at the end of the model's call)."""
        if self.storing:
            return super().update_and_fetch(keys, values)
        held_keys, held_values = self.rows()
        return (mx.concatenate([held_keys, keys.astype(held_keys.dtype)], axis=2),
                mx.concatenate([held_values, values.astype(held_values.dtype)], axis=2))

    def store_next_rows(self, store: bool) -> None:
        """Whether the next calls' rows are stored: not a chunk of the second reading's (only its lead's)."""
        self.storing = store

    def read_prompt_chunk(self, tokens: mx.array) -> None:
        """A prompt chunk is about to be read; it is read again before the next decode step."""
        self.unscored.append(tokens)

    def start_rereading(self) -> None:
        """The model is about to read the prompt again: the rows due fold first, so the reading scores them."""
        self._fold_if_due(1)
        self.rereading, self.unscored, self.scores = True, [], None

    def stop_rereading(self, read: bool) -> None:
        """The second reading is over and trimmed away; unless it failed midway (``read`` false), the prompt's rows
        and scores become :attr:`candidates` (under ``score=heads`` it also rates the heads: :attr:`rated`)."""
        read_again, self.rereading = self.rereading, False
        scores, self.scores = self.scores, None
        if self.store.capacity > self.store.rows:  # the room the second reading's rows took, given back
            self.store.drop_first(0, 0)
        self.rated = None
        if read and scores is not None and self.folds:
            self.candidates = self._candidates(scores, self.score == "heads" and not read_again)
            if self.score == "heads" and read_again:
                self.rated = _rating(self.candidates)

    def score_by_queries(self, module: Any) -> None:
        """Instead of a second reading (``expected``, ``snapkv``): the folded rows scored from the prompt's last
        queries (:meth:`_query_scores`); ``module``: the layer's attention module (its rotary embedding)."""
        self.module = None if module is None else weakref.ref(module)
        self._score_now(lambda: None if self.memory.queries is None else self._query_scores())

    def score_by_heads(self, rating: mx.array | None) -> None:
        """Instead of a second reading (``VELOX_QUANT_SCORE=heads``, once the model's heads are rated): each folded
        row scores its head's ``rating`` (H,), a newer row a hair more, so the best heads keep their rows and a
        head kept in part keeps its newest; None (a layer not rated) keeps every row."""
        def by_heads() -> mx.array | None:
            if rating is None:
                return None
            positions = self._key_positions()[..., : self.folded_rows()].astype(mx.float32)
            return rating.astype(mx.float32)[None, :, None] * (1 + 1e-3 * positions / max(self.offset, 1))
        self._score_now(by_heads)

    def _score_now(self, scores: Callable[[], mx.array | None]) -> None:
        """The rows due folded and scored by ``scores()`` (None: none can be), then :attr:`candidates` as after a
        second reading; the remembered queries go (they would count in the share of the bytes)."""
        self._fold_if_due(1)
        self.unscored = []
        self.scores = scores() if self.folds else None
        self.memory = QueryMemory()
        self.stop_rereading(self.scores is not None)

    def _query_scores(self) -> mx.array:
        """(B, H, folded rows) by the method's policy (found by id: a method does not import another's module):
        ``expected``, :meth:`.ExpectedAttention.rank` (rotated by :attr:`module`'s rotary embedding where it has
        one); ``snapkv``, :meth:`.SnapKV.rank` over every row held, the sinks and exact rows scored zero."""
        if self.scorer is None:
            self.scorer = cache_class("snapkv" if self.score == "snapkv" else "expected_attention").policy_class()
        folded = self.folded_rows()
        keys, values = self.rows()
        positions = self._key_positions()
        if self.score == "snapkv":  # the sinks and the exact rows are kept anyway: scored zero before pooling
            exact = mx.arange(positions.shape[-1]) >= folded
            return self.scorer.rank(self.memory, keys, positions, self.scale, exact | (positions < self.sink))[
                ..., :folded]
        return self.scorer.rank(self, keys[..., :folded, :], values[..., :folded, :], positions[..., :folded],
                                self.scale)

    @staticmethod
    def keep_chosen(caches: list[QuantCache]) -> None:
        """After :meth:`stop_rereading` of every layer of a sequence each keeps its best rows (:meth:`_keep_best`),
        by its own share or by :func:`model_wise`; held keys then settle at ``VELOX_QUANT_BITS``."""
        chosen = model_wise(caches) if caches and caches[0].budgets == "model" else None
        if chosen is not None:
            caches[0]._say_if_little([cast(Candidates, c.candidates) for c in caches])
        for i, cache in enumerate(caches):
            found, cache.candidates = cache.candidates, None
            if found is not None:
                if chosen is None:
                    cache._say_if_little([found])
                cache._keep_best(found, None if chosen is None else chosen[i])
            cache._settle()

    def folded_as(self) -> str | None:
        return f"at {self.bits} bits (keys per channel, values per token)"

    # ----------------------------------------------------------------- folding
    def group(self) -> tuple[int, ...]:
        return (self.layer,)

    def min_fold(self) -> int:
        return self.group_size

    def fold_unit(self) -> int:
        return self.group_size

    def joint(self, parts: list[tuple[mx.array, mx.array]]) -> tuple[list[Any], Any]:
        """Rows ``[start, end)`` (whole blocks) quantized: keys per channel, values per token."""
        ((keys, values),) = parts
        bits = HOLD_BITS if self.unscored and self.bits < HOLD_BITS else self.bits
        return [(self._keys_encoded(keys, bits), self._values_encoded(values))], None

    def _candidates(self, scores: mx.array, raw: bool) -> Candidates:
        """The last fold's rows (the prompt's) as :class:`Candidates` (``raw``: the scores are the heads' ratings)."""
        fold = self.folds[-1]
        positions = self.fold_positions(fold)
        held = positions.shape[-1]
        earlier = self.folded_rows() - held  # rows of earlier turns' folds, scored first
        real = positions >= 0  # not a hole (a ragged fold's shorter heads end in some)
        protected = real & ((positions < self.chosen_end) | (positions < self.sink))
        fresh = real & ~protected
        score = mx.where(fresh, scores[..., earlier: earlier + held].astype(mx.float32), 0)
        score = mx.where(fresh, pool_rows(score, self.pool, "max"), 0)
        keys, values = self.unfold(fold)
        count = int(fresh.sum())
        wanted, taken = self._wanted(count, int(protected.sum()), keys.shape[-1], values.shape[-1])
        return Candidates(positions, fresh, protected, score, count, wanted, taken, earlier, raw)

    def _keep_best(self, found: Candidates, picked: list[int] | None) -> None:
        """Rebuild the last fold (the prompt's, its keys at ``HOLD_BITS``) from each head's protected rows and the
        fresh rows ``picked`` for it (None: by the layer's own share), in whole blocks (B > 1: the same number per
        head), the kept keys quantized to ``VELOX_QUANT_BITS`` once. A later turn's rows join the earlier fold at
        once, head by head, so a short turn costs its share of the bytes, not a block per head."""
        fold, positions, fresh, protected = self.folds[-1], found.positions, found.fresh, found.protected
        held, real = positions.shape[-1], positions >= 0
        self.chosen_end = fold.end
        keys, values = self.unfold(fold)
        if positions.shape[0] == 1:
            normed = _normed(found)
            counts = self._head_counts(found, _head_picks(normed, found) if picked is None else picked)
        else:
            normed, count = found.score, int(fresh[0, 0].sum())
            kept = self._whole_blocks(held - count + found.share * count, held, found)
            counts = [kept] * positions.shape[1]
        if counts == _ints(real.sum(axis=-1).max(axis=0)):
            return  # every row stays (the keys settle at VELOX_QUANT_BITS later, as when nothing was read)
        heads: list[tuple[Any, ...] | None] = []
        for h, k in enumerate(counts):
            if not k:
                heads.append(None)
                continue
            chosen = best_rows(normed[:, h: h + 1], positions[:, h: h + 1], protected[:, h: h + 1], k)
            rows_k, rows_v = take_rows((keys[:, h: h + 1], values[:, h: h + 1]), chosen)
            heads.append((self._keys_encoded(rows_k, self.bits), self._values_encoded(rows_v),
                          _compact(mx.take_along_axis(positions[:, h: h + 1], chosen, axis=-1))))
        if not found.earlier:
            self.folds[-1] = _fold_of(fold.start, fold.end, cast(list[tuple[Any, ...]], heads), fold.group)
            return
        first = self.folds[-2]  # the earlier turns' one fold, at VELOX_QUANT_BITS (their keys settled, joined)
        joined = [a if b is None else self._head_joined(a, b) for a, b in zip(self._split(first), heads)]
        self.folds[-2:] = [_fold_of(first.start, fold.end, joined, fold.group)]

    def _wanted(self, fresh: int, protected: int, key_dim: int, value_dim: int) -> tuple[float, float]:
        """How many of the prompt's ``fresh`` rows (of every head) the layer's budget keeps, and the share of the
        16-bit bytes the rest takes. For a share of the bytes, as many as fit beside everything else the layer holds
        (counted as at 16 bits), each at ``VELOX_QUANT_BITS`` with its scales and position: below zero where the rest
        takes more. No room is reserved for the next turn's rows: that cost answers (docs/results.md,
        "Follow-up")."""
        if not isinstance(self.keep, BytesShare):
            return self.keep * fresh, 0.0
        batch, heads = self.store.row_positions().shape[:2]
        exact = batch * heads * (key_dim + value_dim) * 2  # one exact row of every head, at 16 bits
        full = self.offset * exact  # the full cache's 16-bit bytes for the tokens seen
        target = self.keep * full
        earlier = [a for _, a in tree_flatten([f.own for f in self.folds[:-1]])]
        besides = at_16_bits([*earlier, *self.store.fetch(), self.store.row_positions()]) \
            + self.store_step * exact  # and the room for the next row
        scales = 4 * key_dim / self.group_size + 4 * value_dim / (self._value_group(value_dim) or 32)
        row = (key_dim + value_dim) * self.bits / 8 + (scales if self.bits < 16 else 0) + 2
        return (target - besides - protected * row) / row, (besides + protected * row) / full

    def _say_if_little(self, found: list[Candidates]) -> None:
        """Warn once when a share of the bytes leaves a first prompt (of these layers) almost none of its rows. A
        later turn is not warned about: a short one (a question after a document) keeps its own share of the bytes,
        a few rows, by design, and the rows before it keep theirs."""
        fresh = sum(c.count for c in found)
        first = not any(c.earlier for c in found)
        if first and isinstance(self.keep, BytesShare) and sum(c.wanted for c in found) < 0.05 * fresh:
            once(f"quant share {self.keep}", logging.WARNING,
                 f"VELOX_QUANT_KEEP={self.keep}: at {self.offset} tokens the exact window and the unfinished block "
                 f"take {sum(c.taken for c in found) / len(found):.2f} of the 16-bit bytes "
                 "already, so the prompt keeps almost none of its rows (a larger share, or a longer prompt, keeps "
                 "more)")

    def _head_counts(self, found: Candidates, picked: list[int]) -> list[int]:
        """Rows each head of one sequence keeps, in whole blocks: its protected rows and the fresh rows ``picked``."""
        heads = found.fresh.shape[1]
        protected = _ints(found.protected.reshape(heads, -1).sum(axis=-1))
        real = _ints((found.fresh | found.protected).reshape(heads, -1).sum(axis=-1))
        return [self._whole_blocks(n + p, rows, found) for n, p, rows in zip(picked, protected, real)]

    def _whole_blocks(self, wanted: float, held: int, found: Candidates) -> int:
        """``wanted`` rows of a head rounded to whole blocks, at most the ``held`` rows, at least a block in the
        first fold (none where earlier turns' rows come first)."""
        g = self.group_size
        return min(held, max(0 if found.earlier else g, round(wanted / g) * g))

    def _settle(self) -> None:
        """Keys held at ``HOLD_BITS`` (a prompt whose second reading is over, failed or never came) quantized to
        ``VELOX_QUANT_BITS``, and the folds joined into one."""
        for i, fold in enumerate(self.folds):
            if self._fold_bits(fold) != self.bits:
                owns = [(self._keys_encoded(self._keys_decoded(own[0]), self.bits), *own[1:]) for own in _owns(fold)]
                self.folds[i] = replace(fold, own={"heads": tuple(owns)} if _ragged(fold) else owns[0])
        self._join()

    def _apply(self, start: int, end: int, group: tuple[int, ...], result: tuple[list[Any], Any], at: int) -> None:
        """The base's new fold, joined to the one held. Rows folded outside a prompt (an answer's) are all kept."""
        super()._apply(start, end, group, result, at)
        if not self.unscored:
            self.chosen_end = end
        self._join()

    def _join(self) -> None:
        """The last folds as one while their keys have the same bits: one fold per layer, or two while a prompt's
        keys are held at ``HOLD_BITS``. A ragged fold joins head by head."""
        while len(self.folds) > 1 and self._fold_bits(self.folds[-2]) == self._fold_bits(self.folds[-1]):
            first, last = self.folds[-2:]
            if _ragged(first) or _ragged(last):
                heads = [self._head_joined(a, b) for a, b in zip(self._split(first), self._split(last))]
                self.folds[-2:] = [_fold_of(first.start, last.end, heads, last.group)]
                continue
            pair = [first.own, last.own]
            if len(first.own) == 3 or len(last.own) == 3:  # rows dropped: every row's position kept
                pair = [(*fold.own[:2], self.fold_positions(fold)) for fold in (first, last)]
            self.folds[-2:] = [Fold(first.start, last.end, self._head_joined(*pair), None, last.group)]

    def _head_joined(self, first: tuple[Any, ...], last: tuple[Any, ...]) -> tuple[Any, ...]:
        """Two owns (keys, values, and positions if given) of consecutive rows at the same bits as one: held keys
        join along the tokens (the last axis of per-channel blocks), values along the rows."""
        own = (join(first[0], last[0], axis=2 if self.bits == 16 else -1), join(first[1], last[1]))
        if len(first) == 2:
            return own
        return (*own, _compact(mx.concatenate([first[2].astype(mx.int32), last[2].astype(mx.int32)], axis=-1)))

    def held_rows(self, fold: Fold) -> int:
        """Rows the fold holds per head: its range, or fewer where rows were dropped; a ragged fold's largest
        head's (as attention sees them, the others padded with holes)."""
        owns = _owns(fold)
        return max(own[2].shape[-1] for own in owns) if len(owns[0]) == 3 else fold.end - fold.start

    def fold_positions(self, fold: Fold) -> mx.array:
        """Each row's position; a ragged fold's shorter heads end in holes (-1), which attention masks."""
        owns = _owns(fold)
        if len(owns[0]) == 2:
            return super().fold_positions(fold)
        return _side_by_side([own[2].astype(mx.int32) for own in owns], self.held_rows(fold), -1)

    def unfold(self, fold: Fold) -> tuple[mx.array, mx.array]:
        """The fold's keys and values dequantized; a ragged fold's shorter heads padded with zero rows (holes)."""
        owns, width = _owns(fold), self.held_rows(fold)
        values = [self._values_decoded(own[1], own[2].shape[-1] if len(own) == 3 else width) for own in owns]
        return _side_by_side([self._keys_decoded(own[0]) for own in owns], width), _side_by_side(values, width)

    def has_holes(self) -> bool:
        """The store's holes, or a ragged fold's (its shorter heads padded to its largest)."""
        return super().has_holes() or any(_ragged(fold) for fold in self.folds)

    def _fold_bits(self, fold: Fold) -> int:
        """The bits of the fold's keys (the same in every head)."""
        return self._key_bits(_owns(fold)[0][0])

    def _split(self, fold: Fold) -> list[tuple[Any, ...]]:
        """The fold as one own per head (keys, values, positions, a head axis of one)."""
        if _ragged(fold):
            return [tuple(own) for own in _owns(fold)]
        positions = self.fold_positions(fold)
        return [(tuple(p[:, h: h + 1] for p in fold.own[0]), tuple(p[:, h: h + 1] for p in fold.own[1]),
                 _compact(positions[:, h: h + 1])) for h in range(positions.shape[1])]

    # ----------------------------------------------------------------- attention
    def attend_held(self, queries: mx.array, scale: float) -> mx.array | None:
        """Attention over the fold by mlx's quantized matmul (cheaper than dequantizing: ``bench/quantized_matmul.py``)
        and the exact rows, under one softmax; a ragged fold a head at a time. None at 16 bits, for values grouped
        across rows (the matmul takes them per row only), and for keys held at ``HOLD_BITS``."""
        fold = self.folds[0]
        if self.bits == 16 or len(self.folds) > 1 or self._fold_bits(fold) != self.bits:
            return None
        owns = _owns(fold)
        if any(own[1][0].shape[2] != own[0][0].shape[-1] * 32 // self.bits for own in owns):
            return None  # values in groups across rows (fewer packed rows than keys' tokens)
        exact_keys, exact_values = self.store.fetch()
        b, heads_q, n, dim = queries.shape
        heads = exact_keys.shape[1]
        q = (queries * scale).reshape(b, heads, heads_q // heads * n, dim)
        outs, at = [], 0
        for own in owns:
            h = slice(at, at + own[1][0].shape[1])
            outs.append(self._held_attention(q[:, h], own[0], own[1], exact_keys[:, h], exact_values[:, h], n))
            at = h.stop
        out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1)
        return out.reshape(b, heads_q, n, exact_values.shape[-1])

    def _held_attention(self, q: mx.array, keys: Parts, values: Parts, exact_keys: mx.array, exact_values: mx.array,
                        n: int) -> mx.array:
        """Scaled queries ``q`` (B, h, group x n, dim) over held folded rows, then the exact rows, in one softmax."""
        rows = exact_keys.shape[2]
        folded = self._times(q, keys, self.group_size)
        exact = q @ exact_keys.swapaxes(-1, -2)
        if n > 1:  # query r is token r % n of the step, which sees the exact rows up to its own
            seen = mx.arange(rows)[None] <= (rows - n + mx.arange(q.shape[2]) % n)[:, None]
            exact = mx.where(seen, exact, -mx.inf)
        probs = mx.softmax(mx.concatenate([folded, exact], axis=-1), axis=-1, precise=True).astype(q.dtype)
        at = folded.shape[-1]
        return self._times(probs[..., :at], values, self._value_group(exact_values.shape[-1])) + \
            probs[..., at:] @ exact_values

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any = None,
               sinks: mx.array | None = None) -> mx.array:
        """A chunk of the second reading attends over every row (:func:`scored_attention`) and folds nothing: each
        folded row scores the most attention any query of its head group pays it over the whole reading."""
        if not self.rereading or sinks is not None:
            if not self.unscored and self.schedule.decode_sized(queries.shape[2]):
                self._settle()  # a prompt's held keys whose second reading did not come (a saved cache, say)
            elif self.unscored and self.scores_by_queries:  # the queries the choice reads, and their scale
                self.memory.remember(queries, self.offset, self.window)
                self.scale = scale
            return super().attend(queries, keys, values, scale, mask, sinks)
        self.handed = None
        b, heads_q, n, dim = queries.shape
        heads = keys.shape[1]
        q = (queries * scale).reshape(b, heads, heads_q // heads, n, dim)
        real = (self._key_positions() >= 0)[:, :, None, None, : keys.shape[2] - n] if self.has_holes() else None
        best = mx.zeros((b, heads, self.folded_rows()), mx.float32) if self.scores is None else self.scores
        out, self.scores = scored_attention(q, keys, values, real, best)
        masks.forget_issued(self, members_of(self))
        return out.reshape(b, heads_q, n, -1)

    def _times(self, x: mx.array, parts: Parts, group: int | None) -> mx.array:
        """``x`` times the matrix ``parts`` holds quantized along its last axis; on the CPU a half-precision product
        runs in float32, cast back (mlx's CPU kernel is far slower in half: ``bench/quantized_matmul.py``)."""
        packed, scales, biases = parts
        dtype = x.dtype
        if dtype in (mx.float16, mx.bfloat16) and mx.default_device() == mx.cpu:
            x, scales, biases = (a.astype(mx.float32) for a in (x, scales, biases))
        out = mx.quantized_matmul(x, packed, scales, biases, transpose=False, group_size=group, bits=self.bits)
        return out.astype(dtype)

    # ----------------------------------------------------------------- the formats
    def _keys_encoded(self, keys: mx.array, bits: int) -> Parts:
        """(B, H, T, d) keys as per-channel blocks: quantized along the tokens, (B, H, d, T)."""
        return (keys,) if bits == 16 else encode(mx.swapaxes(keys, 2, 3), bits, self.group_size)

    def _keys_decoded(self, parts: Parts) -> mx.array:
        if len(parts) == 1:
            return parts[0]
        return mx.swapaxes(decode(parts, self._key_bits(parts), self.group_size), 2, 3)

    def _key_bits(self, parts: Parts) -> int:
        """The bits of keys held as ``parts`` (``HOLD_BITS`` while a prompt waits)."""
        if len(parts) == 1:
            return 16
        packed, scales = parts[:2]
        return packed.shape[-1] * 32 // (scales.shape[-1] * self.group_size)

    def _value_group(self, width: int) -> int | None:
        """Elements per value group: the knob's, else the largest of mlx's sizes dividing the head (None: none
        does, and groups of 32 run over consecutive rows' elements)."""
        return next((g for g in (self.group_size, *sorted(GROUPS, reverse=True)) if width % g == 0), None)

    def _values_encoded(self, values: mx.array) -> Parts:
        """(B, H, T, d) values quantized per token (T a multiple of 32 where no group divides d)."""
        if self.bits == 16:
            return (values,)
        b, h, t, d = values.shape
        group = self._value_group(d)
        rows = values if group is not None else values.reshape(b, h, t * d // 32, 32)
        return encode(rows, self.bits, group or 32)

    def _values_decoded(self, parts: Parts, tokens: int) -> mx.array:
        """The values of ``tokens`` tokens back as (B, H, tokens, d)."""
        if len(parts) == 1:
            return parts[0]
        packed = parts[0]
        width = packed.shape[-1] * 32 // self.bits if packed.shape[2] == tokens else packed.shape[2] * 32 // tokens
        out = decode(parts, self.bits, self._value_group(width) or 32)
        return out.reshape(*out.shape[:2], tokens, width)

    # ----------------------------------------------------------------- the cache protocol
    def _cut(self, own: Any, rows: int, held: int) -> tuple[Any, ...]:
        """The encodings ``own`` of ``held`` rows (keys, values, positions if any) cut to their first ``rows``."""
        keys, values = own[:2]
        values = tuple(part[..., : part.shape[2] * rows // held, :] for part in values)
        extra = (own[2][..., :rows],) if len(own) == 3 else ()
        if self.bits == 16:
            return (tuple(part[..., :rows, :] for part in keys), values, *extra)
        packed, scales, biases = keys
        blocks = rows // self.group_size
        width = rows * self._key_bits(keys) // 32
        return ((packed[..., :width], scales[..., :blocks], biases[..., :blocks]), values, *extra)

    def cut_to(self, prefix: int) -> None:
        """A new end among the quantized rows keeps the fold's whole blocks before it and the cut block's prefix as
        exact rows. Where rows were dropped, each head keeps its own blocks wholly before the new end (none if some
        head keeps none; in a batch, those of every head), kept rows after them dropped too (a rare path)."""
        if not self.folds or prefix >= self.folds[-1].end:
            super().cut_to(prefix)
            return
        self._settle()
        fold, g = self.folds[0], self.group_size
        positions = self.fold_positions(fold)
        before = ((positions >= 0) & (positions < prefix)).sum(axis=-1)
        if _ragged(fold) or (len(fold.own) == 3 and positions.shape[0] == 1):  # one sequence's heads apart
            kept = [rows // g * g for rows in _ints(before[0])]
            heads = [self._cut(own, k, own[2].shape[-1]) for own, k in zip(self._split(fold), kept)]
            self._exact_again(fold, prefix, prefix)
            self.folds = [_fold_of(0, prefix, heads, fold.group)] if min(kept) else []
            return
        rows = int(before.min()) // g * g
        self._exact_again(fold, rows if len(fold.own) == 2 else prefix, prefix)
        end = prefix if len(fold.own) == 3 else rows
        self.folds = [Fold(0, end, self._cut(fold.own, rows, self.held_rows(fold)), None, fold.group)] if rows else []


@dataclass(frozen=True)
class Candidates:
    """A layer's prompt rows once read again (the last fold's): each row's position, whether it is to be chosen among
    (``fresh``) or kept anyway (``protected``: an earlier reading's, a sink), its score (0 where not fresh), the fresh
    rows of every head (``count``), how many the layer's own budget wants, the share of the 16-bit bytes its other rows
    take, the rows of earlier folds, and whether the scores compare across heads as they are (the heads' ratings)."""

    positions: mx.array
    fresh: mx.array
    protected: mx.array
    score: mx.array
    count: int
    wanted: float
    taken: float
    earlier: int
    raw: bool = False

    @property
    def kept(self) -> int:
        """The fresh rows the layer's own budget keeps."""
        return round(min(max(self.wanted, 0.0), self.count))

    @property
    def share(self) -> float:
        """The share of the fresh rows the layer's own budget keeps."""
        return min(max(self.wanted, 0.0), self.count) / max(self.count, 1)


def model_wise(caches: list[QuantCache]) -> list[list[int]] | None:
    """Per layer, the fresh rows each head keeps when every layer's rows of one sequence compete (KVzip's
    non-uniform budgets): each layer keeps ``VELOX_QUANT_FLOOR`` of its own share by its own top-k (scaled to fit
    the pooled room), then one top-k of the raw scores over every layer's other rows shares out the rest of the
    room, shrunk while heads rounded up to whole blocks would hold more than the layers by their own shares.
    None (each layer by its own share) where a layer has no candidates or holds several sequences."""
    found = [c.candidates for c in caches]
    if not found or any(c is None or c.positions.shape[0] != 1 for c in found):
        return None
    layers = cast(list[Candidates], found)

    def held(picks: list[list[int]]) -> int:
        return sum(sum(cache._head_counts(c, p)) for cache, c, p in zip(caches, layers, picks))

    def top(total: int) -> list[list[int]]:  # the floor, and the rest by one top-k over the rows it left
        rest = _top_per_head(left, total)
        return [[a + b for a, b in zip(f, r)] for f, r in zip(floors, rest)]

    normed = [_normed(c) for c in layers]
    most = held([_head_picks(n, c) for n, c in zip(normed, layers)])  # what each layer would hold by its own share
    total = min(max(sum(round(c.wanted) for c in layers), 0), sum(c.count for c in layers))  # the layers' room pooled
    part = caches[0].floor * total / max(sum(c.kept for c in layers), 1)  # of each layer's own: below the pooled room
    floors = [_top_per_head([(c.fresh, n)], round(part * c.kept))[0] for n, c in zip(normed, layers)]
    left = [(c.fresh, _unless_taken(c.fresh, c.score, f)) for c, f in zip(layers, floors)]  # ranked once, not per try
    total = max(total - sum(map(sum, floors)), 0)
    picks = top(total)
    while (over := held(picks) - most) > 0 and total > 0:
        total = max(0, total - over)
        picks = top(total)
    return picks


def _rating(found: Candidates) -> mx.array | None:
    """``score=heads``: each head's mean score over its fresh rows of one sequence, where every head has
    :data:`CALIBRATION_ROWS` of them (None where not): a head that pays each row of the document attention as
    the model says it again rates high, one that looks at a few rows (the sinks are not fresh) low."""
    count = found.fresh[0].sum(axis=-1)
    if found.positions.shape[0] != 1 or int(count.min()) < CALIBRATION_ROWS:
        return None
    return found.score[0].sum(axis=-1) / count


def _normed(found: Candidates) -> mx.array:
    """Each head's scores over their sum (AdaKV), so a head that spreads its attention competes with one that
    spikes; raw scores as they are (the heads' ratings, which the sum would cancel)."""
    if found.raw:
        return found.score
    return found.score / mx.maximum(found.score.sum(axis=-1, keepdims=True), 1e-30)


def _head_picks(normed: mx.array, found: Candidates) -> list[int]:
    """The fresh rows each head of one sequence keeps by the layer's own share: one top-k over its heads (AdaKV)."""
    return _top_per_head([(found.fresh, normed)], found.kept)[0]


def _top_per_head(layers: list[tuple[mx.array, mx.array]], total: int) -> list[list[int]]:
    """Per layer of (fresh, score) pairs (1, heads, rows), how many of each head's fresh rows are among the ``total``
    best of them all: exactly ``total`` by one top-k (a threshold would keep every row tied at a saturated score)."""
    flat = mx.concatenate([mx.where(fresh, score, -1).reshape(-1) for fresh, score in layers])
    total = min(total, flat.size)
    picked = mx.zeros(flat.shape, mx.int32)
    if total > 0:
        picked = picked.at[mx.argpartition(-flat, kth=total - 1)[:total]].add(1)
    out, at = [], 0
    for fresh, _ in layers:
        out.append(_ints(picked[at: at + fresh.size].reshape(fresh.shape[1], -1).sum(axis=-1)))
        at += fresh.size
    return out


def _unless_taken(fresh: mx.array, score: mx.array, taken: list[int]) -> mx.array:
    """``score`` (1, heads, rows) with each head's best ``taken[head]`` fresh rows set below every fresh row's (to
    :func:`_top_per_head` they are not fresh: chosen already)."""
    if not any(taken):
        return score
    rank = mx.argsort(mx.argsort(-mx.where(fresh, score, -1), axis=-1), axis=-1)
    return mx.where(rank >= mx.array(taken)[None, :, None], score, -1)


def _ragged(fold: Fold) -> bool:
    """Whether the fold's heads hold different numbers of rows (its own ``{"heads": [...]}``, :func:`_fold_of`)."""
    return isinstance(fold.own, dict)


def _owns(fold: Fold) -> list[Any]:
    """The fold's owns (keys, values, and positions where rows were dropped): one per head of a ragged fold (lists once
    loaded from a file, tuples before), else the fold's own alone."""
    return list(fold.own["heads"]) if _ragged(fold) else [fold.own]


def _side_by_side(heads: list[mx.array], width: int, fill: int = 0) -> mx.array:
    """Per-head arrays (B, 1, rows, ...) padded to ``width`` rows with ``fill``, joined on the head axis."""
    if len(heads) == 1:
        return heads[0]
    return mx.concatenate([mx.pad(a, [(0, 0), (0, 0), (0, width - a.shape[2])] + [(0, 0)] * (a.ndim - 3),
                                  constant_values=fill) for a in heads], axis=1)


def _fold_of(start: int, end: int, heads: list[tuple[Any, ...]], group: tuple[int, ...]) -> Fold:
    """A fold of rows ``[start, end)`` from one own per head (keys, values, positions): dense where every head
    holds as many rows, else ragged (not padded: each head's keys quantize in blocks of its own rows)."""
    if len({head[2].shape[-1] for head in heads}) == 1:
        own = tuple(join(*(head[i] for head in heads), axis=1) for i in range(2))
        positions = mx.concatenate([head[2].astype(mx.int32) for head in heads], axis=1)
        return Fold(start, end, (*own, _compact(positions)), None, group)
    return Fold(start, end, {"heads": tuple(tuple(head) for head in heads)}, None, group)


def _ints(x: mx.array) -> list[int]:
    return cast(list[int], x.tolist())


def _compact(positions: mx.array) -> mx.array:
    """Row positions as held in a fold: two bytes each while they fit."""
    return positions.astype(mx.uint16 if int(positions.max()) < 2**16 else mx.int32)
