"""What a quality or speed run compares: every registry method, and what mlx_lm users already have.

Each variant makes its cache list the way a user's app would get it: our methods through ``veloxpatch.patch`` and
mlx_lm's own ``make_prompt_cache`` (the real shim), mlx_lm's alternatives as mlx_lm builds them. mlx_lm ignores
``max_kv_size`` for models that define ``make_cache`` (llama does), so the rotating variant builds the
``RotatingKVCache(max_size, keep=4)`` list mlx_lm would have built; quantization goes through mlx_lm's own
``maybe_quantize_kv_cache`` (``kv_bits`` in ``generate_step``) from the first token on.

A method may carry knob overrides, written ``snapkv[kernel=15]`` (several: ``snapkv[kernel=15,pool=max]``, knob names
without the method prefix); they reach ``veloxpatch.patch`` as the method's knobs and show in the variant's name and
label (``snapkv[kernel=15]@0.25``). A variant without knobs keeps its plain label. ``window`` sets ``VELOX_WINDOW`` for
any method (``xquant[window=1]``): it counts in a variant's identity only where given, so journals written before it
stay valid.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass
from typing import Any

import veloxpatch
from veloxpatch.config import Setting, setting
from veloxpatch.methods.quant import BytesShare
from veloxpatch.registry import METHODS, cache_class, knob_settings

Knobs = tuple[tuple[str, Any], ...]  # (knob name without the method prefix, value), sorted by name

# core settings a variant may set for itself, beside its method's knobs: snapkv[window=8],
# snapkv[tier=4,compress=chunk,tier_size=3x]
GENERAL = {name: setting(f"VELOX_{name.upper()}") for name in ("window", "tier", "compress", "tier_size")}
# what a variant gets of those it does not set: the methods compared in SnapKV's one-shot mode without a tier (the
# papers' setting, the one a prompt's prefill can be shared in, and the one every journal line written before the
# default became `chunk` with a tier measured); the users' default is `snapkv[compress=chunk,tier=8]`
BASELINE = {"compress": "end", "tier": "off"}
# a token budget may not be smaller than the rows every method protects (default sink + window)
PROTECTED = int(setting("VELOX_SINK").default) + int(setting("VELOX_WINDOW").default)

QUANT_BITS = (8, 4, 2)  # the widths mlx_lm users pick with --kv-bits; a tie goes to the wider one
MLX_BITS = (2, 3, 4, 5, 6, 8)  # every width mlx quantizes to: ``quantized[bits=5]`` asks for one


@dataclass(frozen=True)
class KVLayout:
    """What the byte arithmetic of quantization needs: element width and head dimension."""

    dtype_bits: int
    head_dim: int

    @classmethod
    def of(cls, model: Any) -> KVLayout:
        from mlx.utils import tree_flatten

        args = model.args
        head_dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
        return cls(tree_flatten(model.parameters())[0][1].dtype.size * 8, head_dim)

    @property
    def group(self) -> int:
        """mlx_lm's default group of 64, or 32 when the head dimension is not a multiple of 64."""
        if self.head_dim % 32:
            raise ValueError(f"the quantized variant needs head_dim divisible by 32 (mlx's smallest group); "
                             f"this model has head_dim {self.head_dim}")
        return 64 if self.head_dim % 64 == 0 else 32

    def share(self, bits: int) -> float:
        """Bytes of a quantized row relative to the unquantized one: the values plus a scale and a bias per
        group, which mlx keeps in the rows' own dtype (float32 rows: float32 scales)."""
        return (bits + 2 * self.dtype_bits / self.group) / self.dtype_bits

    def bits_for(self, share: float) -> int:
        """The kv_bits whose bytes come closest to ``share`` of the unquantized cache (ties: more bits)."""
        return min(QUANT_BITS, key=lambda b: abs(self.share(b) - share))


def identity(label: str, knobs: dict[str, Any] | None) -> str:
    """What a variant measures: its method and share with every knob value, however the label spells the
    knobs (``snapkv[kernel=31]@0.25`` is ``snapkv@0.25`` once 31 is the default). None: a journal line
    written before knobs were kept, which matches nothing."""
    base = re.sub(r"\[.*\]", "", label)
    return f"{base} {json.dumps(knobs, sort_keys=True)}"


def line_identity(label: str, knobs: dict[str, Any] | None) -> str:
    """:func:`identity` of a journal line: a knob its method gained after the line was written counts at its default
    (a new knob's default keeps what the method did before), so the line still matches the variant it measured."""
    with contextlib.suppress(ValueError):  # a method or knob that is no more: the line matches nothing now
        knobs = None if knobs is None else {**Variant.of(label.split("@")[0]).knob_values(), **knobs}
    return identity(label, knobs)


def split_specs(text: str) -> list[str]:
    """``"snapkv,snapkv[kernel=15,pool=max],full"`` -> its items: a comma before a ``]`` with no ``[`` between
    (inside brackets) does not split."""
    return [item.strip() for item in re.split(r",(?![^\[]*\])", text) if item.strip()]


def _settings(method: str, given: dict[str, str]) -> dict[str, Setting]:
    """The knobs that reach ``method``'s caches (those of the methods it builds on too), resolved with the
    method's own knobs among ``given`` (squeeze's policy decides whether snapkv's apply)."""
    own = {k.key[len(method) + 1:]: k for k in METHODS[method].knobs}
    chosen = {own[n].key: own[n].convert(v) for n, v in given.items() if n in own}
    return knob_settings(method, chosen)


def parse_spec(spec: str) -> tuple[str, Knobs]:
    """``"snapkv[kernel=15]"`` -> ("snapkv", (("kernel", 15),)); knobs are checked against the settings that
    reach the method (``pyramidkv[kernel=31]`` is SnapKV's kernel) and parsed by them. ValueError (a
    ConfigError for a bad value) names what is wrong."""
    found = re.fullmatch(r"\s*([\w-]+)\s*(?:\[(.*)\])?\s*", spec)
    if not found:
        raise ValueError(f"{spec!r} is not METHOD or METHOD[knob=value,...]")
    method, body = found.group(1), found.group(2)
    if body is None:
        return method, ()
    given: dict[str, str] = {}
    for part in body.split(","):
        name, equals, value = (x.strip() for x in part.partition("="))
        if not equals:
            raise ValueError(f"{spec!r}: {part.strip()!r} is not KNOB=VALUE")
        given[name] = value
    if method == "quantized":  # mlx_lm's quantized cache at a width of the user's choosing, whatever the share
        bits = given.get("bits", "")  # (whose column it is reported in); else the share picks among the usual widths
        if set(given) != {"bits"} or not bits.isdigit() or int(bits) not in MLX_BITS:
            raise ValueError(f"{spec!r}: the quantized variant takes one knob, bits, one of "
                             f"{', '.join(map(str, MLX_BITS))}")
        return method, (("bits", int(bits)),)
    if method not in METHODS:
        raise ValueError(f"{spec!r}: only compression methods and quantized[bits=N] have knobs")
    settings = {**_settings(method, given), **GENERAL}
    unknown = sorted(set(given) - set(settings))
    if unknown:
        raise ValueError(f"{spec!r}: {', '.join(unknown)} is not a knob of {method} here "
                         f"({', '.join(sorted(settings))})")
    return method, tuple(sorted((n, _plain(settings[n].convert(v))) for n, v in given.items()))


def _plain(value: Any) -> Any:
    """A knob's parsed value as a journal line keeps it (JSON): numbers, text and booleans as they are, a richer
    value (``tier_size=all``: a TierSize; ``keep=0.125x``: a share of the bytes, not of the rows) as the text that
    parses back to it."""
    plain = value is None or isinstance(value, (bool, int, float, str)) and not isinstance(value, BytesShare)
    return value if plain else str(value)


@dataclass(frozen=True)
class Variant:
    """A cache configuration: ``method`` is a registry id, ``full``, ``rotating`` or ``quantized``;
    ``knobs`` overrides some of a registry method's knobs."""

    method: str
    share: float = 1.0
    knobs: Knobs = ()

    @classmethod
    def of(cls, spec: str, share: float = 1.0) -> Variant:
        """The variant a ``--methods`` item names (``snapkv``, ``snapkv[kernel=15]``) at ``share``."""
        method, knobs = parse_spec(spec)
        return cls(method, share, knobs)

    @property
    def name(self) -> str:
        """The method with its knob overrides, as written on the command line: ``snapkv[kernel=15]``."""
        return f"{self.method}[{','.join(f'{k}={v}' for k, v in self.knobs)}]" if self.knobs else self.method

    def budget(self, context: int) -> int:
        """Rows this variant may keep of ``context`` tokens: at least sink + window."""
        return context if self.method == "full" else max(round(self.share * context), PROTECTED)

    def knob_values(self) -> dict[str, Any]:
        """Every knob that reaches this variant's caches, defaults included: what a journal matches besides the
        label, so a changed default is measured again (mlx_lm's own caches have none but ``quantized[bits=N]``)."""
        if self.method not in METHODS:
            return dict(self.knobs)
        settings = _settings(self.method, {k: str(v) for k, v in self.knobs})
        values = {**{n: k.convert(k.default) for n, k in sorted(settings.items())}, **dict(self.knobs)}
        return cache_class(self.method).resolved_knobs(values)

    def identity(self) -> str:
        """The label and every knob value: two variants measure the same thing only if these are equal."""
        return identity(self.label(), self.knob_values())

    def label(self) -> str:
        return "full" if self.method == "full" else f"{self.name}@{self.share:g}"

    def settings(self, budget: int | str, compress: str | None = None,
                 unset: dict[str, str] = BASELINE) -> dict[str, Any]:
        """``veloxpatch.patch`` keyword arguments for this registry method at ``budget`` (rows, or a setting's
        text), ``unset`` giving the general settings it does not set (the comparisons' baseline by default)."""
        extra = {} if compress is None else {"compress": compress}
        settings = _settings(self.method, {k: str(v) for k, v in self.knobs})
        knobs = {settings[k].key: v for k, v in self.knobs if k not in GENERAL}
        general = {**unset, **{k: v for k, v in self.knobs if k in GENERAL}}
        return {"kv": self.method, "budget": budget, "knobs": knobs, **general, **extra}

    def caches(self, model: Any, context: int, compress: str | None = None, budget: int | None = None) -> list[Any]:
        """The cache list for one run (patching or unpatching mlx_lm as the variant needs);
        ``compress`` overrides ``VELOX_COMPRESS`` and ``budget`` the rows (our methods', the rotating cache's)."""
        import mlx_lm.models.cache as mlx_cache  # looked up after (un)patching, as an app's call would be

        rows = self.budget(context) if budget is None else budget
        if self.method in METHODS:
            veloxpatch.patch(**self.settings(rows, compress))
            return mlx_cache.make_prompt_cache(model)
        veloxpatch.unpatch()
        caches = mlx_cache.make_prompt_cache(model)
        if self.method == "rotating":
            return [mlx_cache.RotatingKVCache(max_size=rows, keep=4) if type(c) is mlx_cache.KVCache else c
                    for c in caches]
        return caches

    def twin_key(self) -> tuple[str, Knobs, float]:
        """What tells this variant's measurements apart: a method whose caches ignore the budget (MiniCache,
        XQuant, mlx_lm's quantized cache at the width it names) measures the same at every share, so its share
        does not count."""
        return self.method, self.knobs, 0.0 if self.ignores_budget() else self.share

    def ignores_budget(self) -> bool:
        """Whether the share changes nothing this variant holds (see :meth:`twin_key`)."""
        return (self.method in METHODS and not cache_class(self.method).uses_budget) or (
            self.method == "quantized" and "bits" in dict(self.knobs))

    def generate_kwargs(self, layout: KVLayout) -> dict[str, Any]:
        """Extra ``generate_step`` arguments (kv_bits for the quantized variant)."""
        if self.method != "quantized":
            return {}
        bits = dict(self.knobs).get("bits") or layout.bits_for(self.share)
        return {"kv_bits": bits, "kv_group_size": layout.group, "quantized_kv_start": 0}


def variants(methods: list[str], shares: list[float]) -> list[Variant]:
    """The full cache once, then each method (registry ids, ``rotating``, ``quantized``, each registry id
    possibly with knobs: ``snapkv[kernel=15]``) at each share < 1."""
    return [Variant("full"), *(Variant.of(spec, s) for spec in methods for s in shares if s < 1.0)]


def known_methods() -> list[str]:
    """Every registry method, then mlx_lm's own alternatives."""
    return sorted(METHODS) + ["rotating", "quantized"]
