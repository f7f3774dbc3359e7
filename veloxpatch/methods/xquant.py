"""XQuant (Tomar et al., arXiv 2508.10395): cache the quantized layer input X and rematerialise K and V from it.

A layer's keys and values are two projections of one input, the attention module's X (the block input after its
norm): ``K = rope(k_norm(X W_k))`` and ``V = X W_v``. XQuant keeps X, quantized (``mx.quantize`` along the hidden
dimension), instead of K and V, and recomputes K and V with the layer's own projections when attention needs them:
more arithmetic for fewer bytes.

XQuant-CL (on by default, docs/results.md "Perplexity"): a group's first layer (the anchor) keeps its X, held once
for the group (``shared_parts``), the others only ``X_l - X̂_anchor``, taken against the anchor's reconstruction so a
layer's error is its own delta's alone. The anchor publishes its rows through the coordinator in every forward; a
layer that finds none leaves the group and keeps its own X from then on. Where a list's members are not adjacent
layers (sliding-window or hybrid models) the premise is weaker.

The GQA latent (the paper's variant for grouped-query attention) is X on the left singular vectors of ``W_k`` and of
``W_v``, as wide as K and V; K and V are rebuilt as ``latent S V^T``, then key norm and rotation. It is computed as the
projection's output times ``V S^-1`` (:func:`whitening`): two kv-width square matrices per layer, not the hidden x
kv-width ``U``. Against mlx_lm's ``kv_bits`` at equal bytes the gain is in the keys, and it decodes several times
slower (docs/results.md, "Perplexity"; ``bench/kv_quant_error.py``). On models split across ranks:
docs/distributed.md.

At the first step K and V rebuilt from X are compared with the model's own: a module that computes them otherwise
(or lacks ``k_proj``, ``v_proj``, ``rope`` or ``n_kv_heads``) leaves the layer with exact rows, said once.
Deviations from the paper, and why:

* The last ``VELOX_WINDOW`` tokens keep their exact K and V beside their X (released on
  :mod:`veloxpatch.caches.crosslayer`'s schedule, in segments of at least a window): the next tokens attend to them
  most, and exact rows cost no recomputation.
* There is no fused kernel: K and V of every released row are recomputed at every step in plain mlx.
* XQuant-CL's X is the attention input after each layer's norm (the only X the projections take), not the residual
  stream, whose updates are small (on SmolLM2 adjacent layers' normed inputs differ by 0.3-0.4 of their norm, the
  residual stream by 0.04-0.3). Each delta is against its group's anchor, so errors never add up along the stack.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import replace
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from .. import stats
from ..caches.crosslayer import CrossLayerCache, Fold
from ..caches.spec import CacheSpec
from ..caches.store import BITS, GROUPS, Parts, decode, encode, join
from ..log import model_type, once
from ..memo import per_model
from ..registry import method
from ..settings import Setting, choice, int_choice, int_range, one_of_text

K_NORMS = ("k_norm", "k_layernorm")  # the key norms of qwen3, gemma3, olmo2 / lfm2
LATENT_MODES = ("auto", "on", "off")


KNOBS = (
    Setting("VELOX_XQUANT_BITS", int_choice(BITS), "4", one_of_text(BITS),
            "XQuant: bits per element of the cached layer input X (mlx's affine quantization; 16 keeps X "
            "unquantized)."),
    Setting("VELOX_XQUANT_GROUP", int_choice(GROUPS), "64", one_of_text(GROUPS),
            "XQuant: elements of X per quantization group (one scale and bias each)."),
    Setting("VELOX_XQUANT_CL", int_range(1, 64), "4", "an integer in [1, 64]",
            "XQuant-CL: consecutive layers whose first keeps X and the others their delta from it (1: off)."),
    Setting("VELOX_XQUANT_CL_BITS", int_choice(BITS), "3", one_of_text(BITS),
            "XQuant-CL: bits per element of a layer's delta from its group's first layer."),
    Setting("VELOX_XQUANT_LATENT", choice(LATENT_MODES), "auto", "one of " + ", ".join(LATENT_MODES),
            "XQuant: cache the paper's GQA latent (X on the singular vectors of W_k and W_v) instead of X: `auto` "
            "where it is narrower than X (grouped-query attention), `on` always, `off` never; XQuant-CL does not "
            "apply to latents."),
)


@method("xquant", "Caches each layer's quantized attention input X and recomputes K and V from it with the "
                   "layer's own projections; for grouped-query attention the paper's latent (X on W_k's and "
                   "W_v's singular vectors) instead; XQuant-CL keeps deltas of X from a group's first layer "
                   "(deviation: the window stays exact).", KNOBS)
class XQuantCache(CrossLayerCache):
    """Every token's X in one fold, whose range ``[0, end)`` is the released rows (its X covers every token seen);
    K and V of the released rows are rebuilt from it when attention runs, or kept exact where they cannot be."""

    wants_layer_io = True
    saved_scalars = ("exact", "grouped", "latent_on", "hidden")
    uses_budget = False
    budget_use = ("VELOX_BUDGET does not apply: it keeps every token, all but the exact window at VELOX_XQUANT_BITS "
                  "bits (4 by default).")

    def __init__(self, spec: CacheSpec, bits: int = 4, group: int = 64, cl: int = 4, cl_bits: int = 3,
                 latent: str = "auto") -> None:
        super().__init__(spec)
        self.bits, self.group_size, self.cl, self.cl_bits, self.latent = bits, group, cl, cl_bits, latent
        self.latent_on = False  # decided at the first step: the layer keeps the GQA latent, not X
        self.hidden = 0  # the width of X (the latent's bases are computed for it)
        self.grouped = cl > 1  # False once the layer has left its XQuant-CL group
        self.module: weakref.ref | None = None  # the attention module whose input this layer sees
        self.incoming: mx.array | None = None  # this step's X, until its rows arrive
        self.exact = False  # K and V cannot be rebuilt here: released rows stay exact (mlx_lm's bytes)
        self.checked = False  # the rebuild was compared with the model's own K and V once

    def knob_values(self) -> dict[str, Any]:
        return {"bits": self.bits, "group": self.group_size, "cl": self.cl, "cl_bits": self.cl_bits,
                "latent": self.latent}

    # ----------------------------------------------------------------- the layer's input
    def see_attention_input(self, normed: mx.array, module: Any) -> None:
        """Keep the step's X and the module that will project it (found again after a copy or a load)."""
        self.module = weakref.ref(module)
        self.incoming = normed

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Store the step's exact rows, then encode its X (after storing: the coordinator counts the forward there)."""
        x, self.incoming = self.incoming, None
        fetched = super().update_and_fetch(keys, values)
        if not self.exact:
            self._take(x, keys, values)
        return fetched

    def _take(self, x: mx.array | None, keys: mx.array, values: mx.array) -> None:
        """Add ``x`` as the X of the new rows, checking the rebuild against them the first time."""
        if x is None or x.shape[:2] != (keys.shape[0], keys.shape[2]):
            self._go_exact("no layer input reached it with its keys and values")
            return
        if not self.checked:
            self.checked = True
            self.hidden = x.shape[-1]
            kv = keys.shape[1] * keys.shape[3] + values.shape[1] * values.shape[3]  # K's and V's numbers per token
            if not self.folds:  # a cache loaded with rows keeps the form they were saved in
                self.latent_on = self.latent == "on" or (self.latent == "auto" and kv < self.hidden)  # narrower: GQA
                self.grouped = self.grouped and not self.latent_on
            why = self._mismatch(x, keys, values, kv)
            if why:
                self._go_exact(why)
                return
            self._say_form(kv)
        group = self.group()
        if self.latent_on:  # always alone: each layer's latent is in its own bases
            self._add_own("l", self._latent(x))
        elif len(group) == 1:
            self._add_own("x", x)
        elif self.layer == group[0]:
            self._add_anchor(x)
        else:
            self._add_delta(x)
        if not self.schedule.decode_sized(x.shape[1]):
            # a prompt chunk's encoding, evaluated now: left lazy, every layer's X of the chunk (tokens x
            # hidden, wider than the rows it stands for) stays alive until the whole forward is evaluated
            fold = self.folds[0]
            mx.eval([a for _, a in tree_flatten((fold.own, fold.shared)) if isinstance(a, mx.array)])

    def _mismatch(self, x: mx.array, keys: mx.array, values: mx.array, kv: int) -> str:
        """Why K and V rebuilt from ``x`` (the rows just stored) are not the model's own ('' when they are)."""
        width, name = (kv, "latent") if self.latent_on else (x.shape[-1], "input")
        if width % self.group_size and {self.bits, self.cl_bits if self.grouped else 16} != {16}:
            return f"its {name} width {width} is not a multiple of VELOX_XQUANT_GROUP={self.group_size}"
        offset = self.offset - keys.shape[2]
        try:
            rebuilt = self._from_latent(self._latent(x), offset) if self.latent_on else self._remat(x, offset)
        except (AttributeError, TypeError, ValueError) as error:
            return f"its attention's k_proj, v_proj, key norm, rope and n_kv_heads cannot rebuild K and V ({error})"
        if not all(a.shape == b.shape and _close(a, b) for a, b in zip(rebuilt, (keys, values))):
            return "K and V computed from its input with its projections differ from the model's own"
        return ""

    def _go_exact(self, why: str) -> None:
        """From now on released rows stay exact, as mlx_lm's cache holds them (those released so far rebuilt once)."""
        if self.folds and self.folded_rows():
            keys, values = self.unfold(self.folds[0])
            self.folds = [Fold(0, self.folded_rows(), {"k": keys, "v": values}, None, (self.layer,))]
        else:
            self.folds = []
        self.exact, self.grouped = True, False
        name = self._model_name()
        once(f"xquant exact {name} {why}", logging.INFO,
             f"xquant: {name} keeps exact K and V, as mlx_lm's cache does: {why}")

    def _say_form(self, kv: int) -> None:
        """Which form this model's layers keep, said once (``auto`` decides it per model)."""
        name = self._model_name()
        if self.latent_on:
            text = f"the GQA latent ({kv} numbers per token and layer; X would be {self.hidden})"
        else:
            text = f"the attention input X ({self.hidden} numbers per token and layer; K and V are {kv})"
        once(f"xquant form {name} {self.latent_on}", logging.INFO, f"xquant: {name} keeps {text}")

    def _model_name(self) -> str:
        """The model's mlx_lm type (``llama``, from its attention module's class), for the log."""
        module = None if self.module is None else self.module()
        return "a layer" if module is None else model_type(module)

    # ----------------------------------------------------------------- encoding X
    def joint(self, parts: list[mx.array]) -> tuple[list[Any], Any]:
        """One step's X of a layer alone, encoded (a group needs no fan-in: the anchor publishes within the forward)."""
        return [{"x": self._encode(parts[0], self.bits)}], None

    def _add_own(self, key: str, rows: mx.array) -> None:
        """A layer alone: the step's X (``x``) or latent (``l``) joins its own."""
        self._set_fold({key: join(self._held(key), self._encode(rows, self.bits), axis=1)}, None)

    def _add_anchor(self, x: mx.array) -> None:
        """The group's first layer: its X joins the shared part, and the step's rows are published."""
        step = self._encode(x, self.bits)
        shared = {"x": join(self._held("x", shared=True), step, axis=1)}
        self._set_fold(None, shared)
        assert self.coordinator is not None, "an anchor is in a group"
        self.coordinator.publish(("xquant", self.layer), (shared, self._decode(step, self.bits), self.offset))

    def _add_delta(self, x: mx.array) -> None:
        """A later layer of a group: its delta from the anchor's rows of this forward (or it leaves)."""
        found = self.coordinator.latest(("xquant", self.group()[0])) if self.coordinator is not None else None
        if found is None or found[2] != self.offset or found[1].shape != x.shape:
            self._leave_group()
            self._add_own("x", x)
            return
        shared, anchor, _ = found
        self._set_fold({"d": join(self._held("d"), self._encode(x - anchor, self.cl_bits), axis=1)}, shared)

    def _leave_group(self) -> None:
        """Keep this layer's own X from now on (its rows so far rebuilt from the anchor's and the delta)."""
        self.grouped = False
        if self.folds:
            x = self._x_hat(self.folds[0], None)
            self.folds = [Fold(0, self.folded_rows(), {"x": self._encode(x, self.bits)}, None, (self.layer,))]
        once(f"xquant leaves {self.layer}", logging.INFO,
             f"xquant: layer {self.layer} found no rows of its XQuant-CL anchor in this forward; it keeps its own X")

    def _held(self, key: str, shared: bool = False) -> Parts | None:
        """The encoded X this layer holds under ``key`` (None before its first step)."""
        if not self.folds:
            return None
        part = self.folds[0].shared if shared else self.folds[0].own
        return None if part is None else part.get(key)

    def _set_fold(self, own: Any, shared: Any) -> None:
        """The layer's fold with new parts (its range unchanged; a new object, so copies share nothing)."""
        fold = self.folds[0] if self.folds else Fold(0, 0, None, None, self.group())
        self.folds = [replace(fold, own=own, shared=shared, group=self.group())]

    def _encode(self, x: mx.array, bits: int) -> Parts:
        """X as stored, by the row store's encoding (16 bits: unquantized)."""
        return encode(x, None if bits == 16 else bits, self.group_size)

    def _decode(self, parts: Parts, bits: int, rows: int | None = None) -> mx.array:
        """Rows ``[0, rows)`` of encoded X (every row when None), dequantized."""
        return decode(tuple(p[:, :rows] for p in parts), None if bits == 16 else bits, self.group_size)

    def _x_hat(self, fold: Fold, rows: int | None) -> mx.array:
        """The fold's X, rows ``[0, rows)``, as dequantized: its own, or the anchor's plus this layer's delta."""
        own = fold.own or {}
        if "x" in own:
            return self._decode(own["x"], self.bits, rows)
        anchor = self._decode(fold.shared["x"], self.bits, rows)
        return anchor + self._decode(own["d"], self.cl_bits, rows) if "d" in own else anchor

    # ----------------------------------------------------------------- rebuilding K and V
    def _remat(self, x: mx.array, offset: int) -> tuple[mx.array, mx.array]:
        """K and V of rows whose input is ``x`` (B, n, hidden), the first at position ``offset``."""
        module = self._module()
        return shaped(module, module.k_proj(x), module.v_proj(x), offset)

    def _latent(self, x: mx.array) -> mx.array:
        """The GQA latent of rows whose input is ``x`` (the paper's ``X U``, :func:`whitening`), keys' then values'."""
        module = self._module()
        parts = [(proj(x).astype(mx.float32) @ inverse) for proj, (_, inverse) in
                 zip((module.k_proj, module.v_proj), _whitenings(module, self.hidden))]
        return mx.concatenate(parts, axis=-1).astype(x.dtype)

    def _from_latent(self, latent: mx.array, offset: int) -> tuple[mx.array, mx.array]:
        """K and V of rows whose latent is ``latent`` (B, n, k width + v width), the first at ``offset``."""
        module = self._module()
        (k_basis, _), (v_basis, _) = _whitenings(module, self.hidden)
        at = k_basis.shape[0]
        wide = latent.astype(mx.float32)
        return shaped(module, (wide[..., :at] @ k_basis).astype(latent.dtype),
                       (wide[..., at:] @ v_basis).astype(latent.dtype), offset)

    def _module(self) -> Any:
        module = None if self.module is None else self.module()
        if module is None:
            raise RuntimeError("xquant: rows kept as X need their layer's attention module, which is found when "
                               "the model runs with veloxpatch's layer hooks (make_prompt_cache or a generation's "
                               "start installs them); run the model through one first")
        return module

    def unfold(self, fold: Fold) -> tuple[mx.array, mx.array]:
        """The released rows ``[0, end)``: rebuilt from their X, or as kept (a layer that cannot rebuild)."""
        own = fold.own or {}
        if "k" in own:
            return own["k"], own["v"]
        if "l" in own:
            return self._from_latent(self._decode(own["l"], self.bits, fold.end), 0)
        return self._remat(self._x_hat(fold, fold.end), 0)

    # ----------------------------------------------------------------- releasing exact rows
    def group(self) -> tuple[int, ...]:
        """XQuant-CL's block of consecutive members (this layer alone when off, left or exact)."""
        return self.block(self.cl) if self.grouped else (self.layer,)

    def folded_as(self) -> str | None:
        """What a released row is kept as, in words for the stats line (None: exact)."""
        if self.exact:
            return None
        held = "unquantized" if self.bits == 16 else f"{self.bits}-bit"
        if self.latent_on:
            return f"as a {held} GQA latent (K and V rebuilt from it)"
        group = self.group()
        if len(group) > 1 and self.layer != group[0]:
            deltas = "unquantized" if self.cl_bits == 16 else f"{self.cl_bits}-bit"
            return f"as {deltas} deltas from their group's {held} X (XQuant-CL; K and V rebuilt from it)"
        return f"as {held} X (K and V rebuilt from it)"

    def min_fold(self) -> int:
        """Release in segments of at least a window: the store is not compacted at every decode step."""
        return max(self.window, 1)

    def _fold_if_due(self, n: int) -> None:
        """Release the exact rows older than the window when due (crosslayer's schedule): their X is held
        already, so releasing is dropping them from the store (an exact layer moves them to its fold)."""
        start, end = self.folded_rows(), self.offset - self.window
        if not self.schedule.folds(n) or end - start < self.min_fold():
            return
        if self.exact:
            rows = dict(zip("kv", self._exact(start, end)))
            if self.folds:
                rows = {k: mx.concatenate([self.folds[0].own[k], x], axis=2) for k, x in rows.items()}
            self.folds = [Fold(0, end, rows, None, (self.layer,))]
        else:
            self.folds = [replace(self.folds[0], end=end)]
        stats.count(self, "folds")
        self.store.drop_first(end - start, self.min_fold())

    # ----------------------------------------------------------------- the cache protocol
    def cut_to(self, prefix: int) -> None:
        """Their X goes; when the new end falls among the released rows, the prefix's released rows become exact rows
        again (rebuilt, as crosslayer's contract says), their X kept."""
        fold = self.folds[0] if self.folds and not self.exact else None
        super().cut_to(prefix)
        if fold is None or prefix == 0 < fold.end:  # crosslayer's trim dropped it (an exact layer's, or every row)
            return
        own, shared = (_cut(part, prefix) for part in (fold.own, fold.shared))
        self.folds = [replace(fold, end=fold.end if prefix >= fold.end else 0, own=own, shared=shared)]
        self.linked = False  # a group's layers cut copies of the shared X: linked again at the next step


_WHITENINGS: dict[tuple[int, Any], Any] = {}


def _whitenings(module: Any, hidden: int) -> list[tuple[mx.array, mx.array]]:
    """:func:`whitening` of the module's key and value projections, computed once per module."""
    return per_model(_WHITENINGS, module, ("xquant latent", hidden),
                     lambda: [whitening(proj, hidden) for proj in (module.k_proj, module.v_proj)])


def whitening(proj: Any, hidden: int) -> tuple[mx.array, mx.array]:
    """``(M, M^-1)`` for a projection ``y = x W^T (+ b)`` from ``hidden`` wide inputs: with ``W^T = U S V^T``,
    ``M = S V^T`` and ``M^-1 = V S^-1``, so ``y M^-1`` is the paper's latent ``x U`` (plus ``b M^-1``, which
    rides along) and the latent times ``M`` is ``y`` again. ``W^T`` is read by projecting the identity, so
    any linear layer works (quantized ones too); ``V`` and ``S`` come from ``eigh(W W^T)``, out x out,
    each vector's sign fixed (largest entry positive) so a loaded cache meets the bases it was saved with."""
    eye = mx.eye(hidden, dtype=mx.float32)
    transposed = (proj(eye) - proj(mx.zeros((1, hidden), mx.float32))).astype(mx.float32)
    energies, vectors = mx.linalg.eigh(transposed.T @ transposed, stream=mx.cpu)
    biggest = mx.take_along_axis(vectors, mx.argmax(mx.abs(vectors), axis=0)[None], axis=0)
    vectors = vectors * mx.where(biggest < 0, -1.0, 1.0)
    scales = mx.sqrt(mx.maximum(energies, 1e-12 * energies.max()))
    return (scales[:, None] * vectors.T, vectors / scales[None, :])


def shaped(module: Any, keys: mx.array, values: mx.array, offset: int) -> tuple[mx.array, mx.array]:
    """Projected rows (B, n, width) as attention takes them: keys through the module's key norm and rotary
    embedding (the first row at position ``offset``), both (B, kv_heads, n, head_dim)."""
    b, n, _ = keys.shape
    keys = _key_normed(module, keys.reshape(b, n, module.n_kv_heads, -1))
    keys = module.rope(keys.transpose(0, 2, 1, 3), offset=offset)
    values = values.reshape(b, n, module.n_kv_heads, -1).transpose(0, 2, 1, 3)
    return keys, values


def _key_normed(module: Any, keys: mx.array) -> mx.array:
    """Keys (B, n, heads, head_dim) through the module's key norm: over each head (qwen3, gemma3, lfm2) or
    over all heads at once (olmo2), as its width says; unchanged without one (the first step's check
    catches a norm applied otherwise)."""
    norm: Any = next((getattr(module, name) for name in K_NORMS if hasattr(module, name)), None)
    width = getattr(norm, "weight", mx.zeros((0,))).shape[-1]
    if width == keys.shape[-1]:
        return norm(keys)
    if width == keys.shape[-2] * keys.shape[-1]:
        return norm(keys.reshape(*keys.shape[:2], -1)).reshape(keys.shape)
    return keys


def _cut(part: dict[str, Parts] | None, rows: int) -> dict[str, Parts] | None:
    """Encoded X keeping its first ``rows`` rows (copies: a slice would hold the whole buffer)."""
    if part is None:
        return None
    return {key: tuple(mx.contiguous(p[:, :rows]) for p in parts) for key, parts in part.items()}


def _close(a: mx.array, b: mx.array) -> bool:
    """Equal up to rounding: the same projections on the same input, batched differently."""
    tolerance = 1e-4 if b.dtype == mx.float32 else 2e-2
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return bool(mx.abs(a - b).max() <= tolerance * (1 + mx.abs(b).max()))
