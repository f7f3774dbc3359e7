"""Which rows a cache can drop before it knows the question: scores measured on a real model, with and without
keys per channel at low bits on top (the bytes ``quant`` would hold for the rows kept).

    python bench/agnostic_selection.py --model FOLDER [--context 4096] [--tasks niah_single_2,niah_multikey_3,vt]
        [--samples 1] [--seed 0] [--keep 0.5,0.35] [--bits 16,4] [--scorers window,repeat,expected,keynorm]
        [--pool 0,7] [--model-wise] [--floor 0.5] [--out FOLDER]

For each RULER example the full cache reads the context (the question left out, the field's protocol). Each scorer
then rates every row of every layer's key heads, without the question:

* ``window``: the attention the context's last 64 queries pay a row (SnapKV's observation window, question-free);
* ``repeat``: the most attention any query pays a row while the model reads "repeat the context" and the context
  again on top of the cache, then trimmed away (KVzip's reconstruction score, Kim et al., arXiv 2505.23416);
* ``bare``: ``repeat`` without the instruction, the context read again as it is (what ``VELOX_QUANT_KEEP`` reads:
  a model call has no tokenizer), and ``bare-chunked``: each 512-token chunk read again right after it is read
  (what a first version of ``VELOX_QUANT_KEEP`` did), and ``bare-trimmed``: the context read again in 2048-token
  chunks, each trimmed away before the next is read (what ``VELOX_QUANT_KEEP`` does to bound the peak), and
  ``bare-led``: the same, each chunk read after the ``LEAD`` tokens before it (trimmed with it);
* ``expected``: the attention a query drawn from the last 128 queries' mean and per-channel variance is expected
  to pay it, times its value's norm (Expected Attention, Devoto et al., arXiv 2510.00636; RoPE not rotated forward);
  ``expected-rope``: the same from the queries' statistics before the rotation (each recorded query rotated back by
  its position), rotated forward over the next ``FUTURE`` positions (their mean rotation for the mean, the mean of
  the rotated covariances for the variance term), as the paper does;
* ``keynorm``: a small key norm (Devoto et al., arXiv 2406.11430).

Each layer keeps its first 4 and last 32 rows and, of the rest, the best ``--keep`` share of the context, either the
same number per head or (``head-wise``) one top-k over the layer's heads (AdaKV), or (``--model-wise``) one top-k over
every layer's heads on the raw scores (KVzip's non-uniform budgets: layers keep different numbers), or (``--floor F``,
``floored F``) that after each layer's head-wise top-k took the share F of its rows; with ``--pool W``
a row scores the best of its W neighbours (``pooled W``: a high row's neighbours kept with it). The question and
reference answer are read on top, the dropped rows masked out per head (with ``--bits`` under 16 every row first
quantized per channel in 64-token blocks and back, values per token, as ``quant`` holds them; ``4/2``: keys at 4 bits,
values at 2). Printed per variant: the mean KL of the next-token distributions from the full cache's over those
tokens, and answers right (greedy, 64 tokens or the eval's answer length if longer; runs before 2026-12-05 gave 32),
with the bytes held as a share of the 16-bit full cache's. Two more options follow ``VELOX_QUANT_KEEP`` step by step:
``--score-bits 4`` (a list; keys/values as ``8/4``) reads the context again over rows already at those bits (scorers
named "... from 4"), and ``--held-bits N`` (a list: each a variant) holds every row at N bits first and then quantizes
each head's kept keys to ``--bits`` in blocks of the rows kept (``quant``'s fold rebuilt from them: ``--held-bits 4``
quantizes 4-bit rows a second time). ``--head-wise`` leaves out the same number per head; ``--same-bytes`` reads
``--keep`` at the first of ``--bits`` and keeps, at the others, the share holding the same bytes (fewer bits, more
rows). With ``--out`` each example's rows are appended to ``rows.jsonl`` there as it finishes, and a rerun skips the
examples it holds.
"""

from __future__ import annotations

import argparse
import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm import load
from mlx_lm.models import base
from mlx_lm.models.cache import make_prompt_cache

from kv_quant_schemes import kl_after, per_channel, ruler_arguments, with_scheme
from veloxpatch.caches.selection import pool_rows
from veloxpatch.eval import ruler

SINK, RECENT, WINDOW, STATS = 4, 32, 64, 128
LEAD = 256  # tokens ``bare-led`` reads again before each chunk but the first
FUTURE = 512  # positions after the context whose queries ``expected-rope`` expects
ANSWER = 64  # greedy tokens an answer may take at least: at 32 the full cache's own uuid answers scored wrong
REPEAT = "\n\nRepeat the previous context exactly.\n"


class Attention:
    """Stands in for mlx_lm's attention in the model's module: records what a reading phase asks for, per layer
    (in call order), and masks each head's dropped rows while the question is read."""

    def __init__(self, layers: int, sdpa: Callable[..., mx.array]) -> None:
        self.layers, self.sdpa, self.calls = layers, sdpa, 0
        self.record: str | None = None  # "max" or "sum": the attention queries pay the rows below ``limit``
        self.queries = False  # keep the queries themselves
        self.limit = 0
        self.found: dict[int, Any] = {}
        self.seen: dict[int, list[mx.array]] = {}
        self.keep: list[mx.array] | None = None  # per layer: (kv heads, context rows) bool

    def __call__(self, queries: mx.array, keys: mx.array, values: mx.array, cache: Any, scale: float,
                 mask: Any, sinks: Any = None) -> mx.array:
        layer, self.calls = self.calls % self.layers, self.calls + 1
        if self.record:
            self._record(layer, self._weights(queries, keys, scale, mask)[..., : self.limit])
        if self.queries:
            self.seen.setdefault(layer, []).append(queries[0])
        if self.keep is not None:
            mask = self._kept(layer, queries, keys, mask)
        return self.sdpa(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    def _weights(self, queries: mx.array, keys: mx.array, scale: float, mask: Any) -> mx.array:
        """Attention weights (kv heads, group * queries, keys) of one sequence."""
        b, hq, n, d = queries.shape
        heads = keys.shape[1]
        logits = (queries * scale).reshape(heads, hq // heads, n, d) @ keys[0].swapaxes(-1, -2)[:, None]
        logits = mx.where(_causal(n, keys.shape[2]) if mask is not None else True, logits, -mx.inf)
        return mx.softmax(logits, axis=-1, precise=True).reshape(heads, -1, keys.shape[2])

    def _record(self, layer: int, weights: mx.array) -> None:
        got = weights.max(axis=1) if self.record == "max" else weights.sum(axis=1)
        held = self.found.get(layer)
        self.found[layer] = got if held is None else (mx.maximum(held, got) if self.record == "max" else held + got)
        mx.eval(self.found[layer])

    def _kept(self, layer: int, queries: mx.array, keys: mx.array, mask: Any) -> mx.array:
        assert self.keep is not None
        keep = self.keep[layer]
        rows, n = keys.shape[2], queries.shape[2]
        keep = mx.concatenate([keep, mx.ones((keep.shape[0], rows - keep.shape[1]), dtype=mx.bool_)], axis=1)
        keep = mx.repeat(keep, queries.shape[1] // keep.shape[0], axis=0)[:, None, :]
        return keep & _causal(n, rows) if n > 1 else keep[None]


def _causal(n: int, rows: int) -> mx.array:
    """(n, rows): the last ``n`` rows are the queries' own, each seeing those up to itself."""
    return mx.arange(rows)[None] <= (rows - n + mx.arange(n))[:, None]


def read(model: Any, cache: list, tokens: list[int], chunk: int = 1024) -> None:
    for start in range(0, len(tokens), chunk):
        model(mx.array(tokens[start: start + chunk])[None], cache=cache)
        mx.eval([c.state for c in cache])


def scores(model: Any, tokenizer: Any, attention: Attention, context: list[int],
           scorers: list[str], score_bits: list[str]) -> tuple[list, dict[str, list]]:
    """The full cache of ``context`` and each scorer's (kv heads, rows) per layer (the second readings once over
    its rows at each of ``score_bits``: "16", "4" or keys/values "8/4"; named "<scorer> from 8/4" but at 16)."""
    cache = make_prompt_cache(model)
    attention.limit, out = len(context), {}
    body = _chunked(model, cache, attention, context[: -STATS]) if "bare-chunked" in scorers else None
    if body is None:
        read(model, cache, context[: -STATS])
    attention.queries, attention.seen = True, {}
    read(model, cache, context[-STATS: -WINDOW])
    attention.record, attention.found = "sum", {}
    read(model, cache, context[-WINDOW:])
    out["window"] = [attention.found[i] for i in range(len(cache))]
    attention.record = None
    queries = {i: mx.concatenate(q, axis=1) for i, q in attention.seen.items()}
    attention.queries = False
    if body is not None:
        attention.limit = len(context)
        tail = _read_again(model, cache, attention, context[-STATS:])
        out["bare-chunked"] = [mx.concatenate([b, t[:, -STATS:]], axis=1) for b, t in zip(body, tail)]
    for spec in score_bits:
        key_bits, value_bits = widths(spec)
        again = cache if spec == "16" else with_scheme(cache, lambda k: per_channel(k, key_bits),
                                                        lambda v: per_token(v, value_bits))
        named = "" if spec == "16" else f" from {spec}"
        for name, prefix in (("repeat", tokenizer.encode(REPEAT, add_special_tokens=False)), ("bare", [])):
            if name in scorers:
                out[name + named] = _read_again(model, again, attention, prefix + context)
        if "bare-trimmed" in scorers:
            out["bare-trimmed" + named] = _read_again(model, again, attention, context, 2048)
        if "bare-led" in scorers:
            out["bare-led" + named] = _read_again(model, again, attention, context, 2048, LEAD)
    out["expected"] = [_expected(queries[i], c) for i, c in enumerate(cache)]
    if "expected-rope" in scorers:
        out["expected-rope"] = [_expected_rope(queries[i], c, _rope(model, i), len(context))
                                for i, c in enumerate(cache)]
    out["keynorm"] = [-mx.linalg.norm(c.keys[0, :, : c.offset], axis=-1) for c in cache]
    return cache, {name: got for name, got in out.items() if name.split(" from ")[0] in scorers}


def _read_again(model: Any, cache: list, attention: Attention, extra: list[int],
                trimmed: int = 0, lead: int = 0) -> list[mx.array]:
    """Per layer, the most attention each row gets while ``extra`` is read on top of the cache (then trimmed; with
    ``trimmed``, in chunks of that many tokens, each trimmed before the next, and read after the ``lead`` tokens
    before it)."""
    attention.record, attention.found = "max", {}
    step = trimmed or len(extra)
    for start in range(0, len(extra), step):
        chunk = extra[max(start - lead, 0): start + step]
        read(model, cache, chunk, 512)
        for c in cache:
            c.trim(len(chunk))
    attention.record = None
    return [attention.found[i] for i in range(len(cache))]


def _chunked(model: Any, cache: list, attention: Attention, tokens: list[int]) -> list[mx.array]:
    """Read ``tokens`` in 512-token chunks, each read again at once: per layer, each row's most attention from the
    second reading of its own chunk."""
    found: list[list[mx.array]] = []
    for start in range(0, len(tokens), 512):
        read(model, cache, tokens[start: start + 512], 512)
        attention.limit = cache[0].offset
        found.append([r[:, start:] for r in _read_again(model, cache, attention, tokens[start: start + 512])])
    return [mx.concatenate([f[i] for f in found], axis=1) for i in range(len(cache))]


def _expected(queries: mx.array, layer: Any) -> mx.array:
    """Expected attention of a query ~ N(mean, diag var) of ``queries`` (hq, n, d), per kv head, times ||v||."""
    keys, values = layer.keys[0, :, : layer.offset], layer.values[0, :, : layer.offset]
    heads, d = keys.shape[0], keys.shape[-1]
    scale = d ** -0.5
    mean, var = queries.mean(axis=1), queries.var(axis=1)  # (hq, d)
    mean, var = mean.reshape(heads, -1, d), var.reshape(heads, -1, d)
    logits = scale * (mean @ keys.swapaxes(-1, -2)) + 0.5 * scale**2 * (var @ (keys**2).swapaxes(-1, -2))
    return mx.softmax(logits, axis=-1).mean(axis=1) * mx.linalg.norm(values, axis=-1)


def _rope(model: Any, layer: int) -> Any:
    """The layer's ``nn.RoPE`` (its ``dims``, ``base``, ``scale``, ``traditional``)."""
    return model.layers[layer].self_attn.rope


def _pairs(x: mx.array, traditional: bool) -> tuple[mx.array, mx.array]:
    """The two halves of each rotated pair of channels: interleaved (traditional) or the two halves."""
    if traditional:
        return x[..., 0::2], x[..., 1::2]
    half = x.shape[-1] // 2
    return x[..., :half], x[..., half:]


def _expected_rope(queries: mx.array, layer: Any, rope: Any, end: int) -> mx.array:
    """Expected attention of the next :data:`FUTURE` positions' queries, per kv head, times ||v||: ``queries``
    (hq, n, d), rotated at positions ``end - n`` .. ``end - 1``, rotated back, their mean and per-channel variance
    taken, then rotated forward over positions ``end`` .. ``end + FUTURE - 1`` (closed forms per channel pair)."""
    keys, values = layer.keys[0, :, : layer.offset], layer.values[0, :, : layer.offset]
    heads, d = keys.shape[0], keys.shape[-1]
    n = queries.shape[1]
    assert rope.dims == d, "partial rotary embeddings are not handled"
    freqs = rope.base ** (-mx.arange(0, rope.dims, 2, dtype=mx.float32) / rope.dims)  # (d/2,)
    at = (mx.arange(end - n, end, dtype=mx.float32) * rope.scale)[:, None] * freqs
    q1, q2 = _pairs(queries.astype(mx.float32), rope.traditional)
    cos, sin = mx.cos(at), mx.sin(at)
    p1, p2 = q1 * cos + q2 * sin, q2 * cos - q1 * sin  # rotated back: before RoPE
    m1, m2, a, b = p1.mean(axis=1), p2.mean(axis=1), p1.var(axis=1), p2.var(axis=1)  # (hq, d/2)
    future = (mx.arange(end, end + FUTURE, dtype=mx.float32) * rope.scale)[:, None] * freqs
    c, s = mx.cos(future), mx.sin(future)
    cbar, sbar, c2, s2, cs = c.mean(0), s.mean(0), (c * c).mean(0), (s * s).mean(0), (c * s).mean(0)
    mean1, mean2 = m1 * cbar - m2 * sbar, m1 * sbar + m2 * cbar
    k1, k2 = _pairs(keys.astype(mx.float32), rope.traditional)  # (heads, rows, d/2)
    group = queries.shape[0] // heads

    def per_kv(x: mx.array) -> mx.array:  # (hq, d/2) -> (heads, group, d/2)
        return x.reshape(heads, group, -1)

    mean = per_kv(mean1) @ k1.swapaxes(-1, -2) + per_kv(mean2) @ k2.swapaxes(-1, -2)
    spread = (per_kv(a * c2 + b * s2) @ (k1 * k1).swapaxes(-1, -2)
              + per_kv(a * s2 + b * c2) @ (k2 * k2).swapaxes(-1, -2)
              + 2 * per_kv((a - b) * cs) @ (k1 * k2).swapaxes(-1, -2))
    scale = d ** -0.5
    logits = scale * mean + 0.5 * scale**2 * spread
    return mx.softmax(logits, axis=-1).mean(axis=1) * mx.linalg.norm(values, axis=-1)


def kept(score: mx.array, share: float, headwise: bool, pool: int = 0) -> mx.array:
    """(heads, rows) bool: the first and last rows, and the best of the rest (``share`` of all rows), each row
    scored as the best of its ``pool`` neighbours (``quant``'s ``VELOX_QUANT_POOL``; 0 or 1: alone)."""
    heads, rows = score.shape
    middle = _middle(score, pool)
    per_head = max(int(share * rows) - SINK - RECENT, 0)
    if headwise:
        flat = middle / mx.maximum(middle.sum(axis=1, keepdims=True), 1e-30) if middle.min() >= 0 else middle
        cut = mx.sort(flat.reshape(-1))[-per_head * heads] if per_head else mx.inf
        chosen = flat >= cut
    else:
        chosen = middle >= (mx.sort(middle, axis=1)[:, -per_head:-per_head + 1] if per_head else mx.inf)
    return _edged(chosen)


def kept_model_wise(scores: list[mx.array], share: float, pool: int = 0, floor: float = 0.0) -> list[mx.array]:
    """Per layer, (heads, rows) bool: every layer's first and last rows, and of the rest the best by one top-k over
    every layer's heads (KVzip's non-uniform budgets: its raw scores, so a layer that needs more rows takes them),
    as many rows in all as :func:`kept` keeps; with ``floor``, that share of each layer's rows chosen first by the
    layer's own head-wise top-k (a layer the model-wise top-k would starve keeps some)."""
    middles = [_middle(score, pool) for score in scores]
    heads, rows = scores[0].shape
    flat = mx.concatenate([m.reshape(-1) for m in middles])
    total = min(max(int(share * rows) - SINK - RECENT, 0) * heads * len(scores), flat.size)
    chosen = mx.zeros(flat.shape, mx.bool_)
    if floor:
        chosen = mx.concatenate([kept(s, share * floor, True, pool)[:, SINK: rows - RECENT].reshape(-1)
                                 for s in scores])
        total -= int(chosen.sum())
        flat = mx.where(chosen, -mx.inf, flat)
    if total > 0:  # exactly ``total`` by one top-k: a threshold would keep every row tied at a saturated score
        chosen = chosen.at[mx.argpartition(-flat, kth=total - 1)[:total]].add(True)
    out, at = [], 0
    for m in middles:
        out.append(_edged(chosen[at: at + m.size].reshape(m.shape)))
        at += m.size
    return out


def _middle(score: mx.array, pool: int) -> mx.array:
    """The scores of the rows between the first and the last (pooled over ``pool`` neighbours), float32."""
    return pool_rows(score[:, SINK: score.shape[1] - RECENT].astype(mx.float32), max(pool, 1), "max")


def _edged(chosen: mx.array) -> mx.array:
    """The middle rows ``chosen``, with the first and last rows kept."""
    edge = mx.ones((chosen.shape[0], SINK), dtype=mx.bool_), mx.ones((chosen.shape[0], RECENT), dtype=mx.bool_)
    return mx.concatenate([edge[0], chosen, edge[1]], axis=1)


def per_token(x: mx.array, bits: int) -> mx.array:
    """Values quantized per token (groups of 64 along the head, 32 where 64 does not divide it) and back."""
    group = 64 if x.shape[-1] % 64 == 0 else 32
    return mx.dequantize(*mx.quantize(x, group_size=group, bits=bits), group_size=group, bits=bits).astype(x.dtype)


def answer(model: Any, tokenizer: Any, cache: list, question: list[int], tokens: int) -> str:
    logits = model(mx.array(question)[None], cache=cache)
    out: list[int] = []
    for _ in range(tokens):
        token = int(logits[0, -1].argmax())
        if token in tokenizer.eos_token_ids:
            break
        out.append(token)
        logits = model(mx.array([[token]]), cache=cache)
    return tokenizer.decode(out)


def requantized(keys: mx.array, keep: mx.array, bits: int) -> mx.array:
    """``keys`` (1, H, T, d) with each head's kept rows quantized per channel to ``bits`` in blocks of the rows kept
    (as ``quant`` rebuilds its fold); dropped rows as they were (masked anyway)."""
    out = np.array(keys.astype(mx.float32))
    mask = np.array(keep)
    for head in range(out.shape[1]):
        rows = np.nonzero(mask[head])[0]
        again = per_channel(mx.array(out[:, head: head + 1, rows]).astype(keys.dtype), bits)
        out[:, head, rows] = np.array(again.astype(mx.float32))[:, 0]
    return mx.array(out).astype(keys.dtype)


def widths(spec: str) -> tuple[int, int]:
    """``--bits``' entry as (key bits, value bits): ``4``, or keys/values as ``4/2``."""
    key_bits, value_bits = (int(b) for b in (spec.split("/") + [spec])[:2])
    return key_bits, value_bits


def cost(spec: str) -> float:
    """Bits an element of a row holds at ``spec``, its group's scale and bias counted (16: a dense row)."""
    return sum(16 if b == 16 else b + 0.5 for b in widths(spec)) / 2


def variant(model: Any, tokenizer: Any, attention: Attention, cache: list, keep: list | None, bits: str,
            example: ruler.Example, question: list[int], rest: list[int], reference: mx.array,
            held_bits: int = 0) -> tuple[float, bool]:
    """(KL over ``rest``, answer right) with ``keep``'s rows (all: None) at ``bits`` (:func:`widths`) per element
    (with ``held_bits``, held at those first and the kept keys quantized to their bits after)."""
    copied = copy.deepcopy(cache)
    key_bits, value_bits = widths(bits)
    if cost(bits) < 16:
        twice = bool(held_bits) and keep is not None
        for i, c in enumerate(copied):
            k, v = c.keys[..., : c.offset, :], c.values[..., : c.offset, :]
            c.keys = per_channel(k, held_bits if twice else key_bits)
            c.values = per_token(per_token(v, held_bits if twice else value_bits), value_bits)
            if twice:
                assert keep is not None
                c.keys = requantized(c.keys, keep[i], key_bits)
    attention.keep = keep
    _, kl = kl_after(model, copied, rest, reference)
    for c in copied:
        c.trim(len(rest))
    tokens = max(len(tokenizer.encode(example.answer)) + 8, example.tokens, ANSWER)
    right = ruler.score(answer(model, tokenizer, copied, question, tokens), example)
    attention.keep = None
    return kl, right


def main() -> None:
    parser = ruler_arguments(__doc__.split("\n\n")[0], 4096, "16,4")
    parser.add_argument("--keep", default="0.5,0.35")
    parser.add_argument("--scorers", default="window,repeat,expected,keynorm")
    parser.add_argument("--score-bits", default="16", help="comma-separated: 16, 4, or keys/values as 8/4")
    parser.add_argument("--held-bits", default="0", help="comma-separated; 0: quantized once")
    parser.add_argument("--pool", default="0", help="comma-separated: rows scored as the best of this many "
                        "neighbours (0: each row alone); each a variant")
    parser.add_argument("--head-wise", action="store_true", help="rows chosen head-wise only (as the shim does)")
    parser.add_argument("--model-wise", action="store_true", help="also rows chosen by one top-k over every "
                        "layer's heads, raw scores (KVzip's non-uniform budgets)")
    parser.add_argument("--floor", default="", help="comma-separated shares: also rows chosen model-wise after "
                        "each layer's head-wise top-k took that share of its rows (layout 'floored F')")
    parser.add_argument("--same-bytes", action="store_true", help="--keep is a share at the first of --bits; at "
                        "the others, the share holding the same bytes")
    parser.add_argument("--seed", type=int, default=0, help="the first example (seeds SEED .. SEED+SAMPLES-1)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    model, tokenizer = load(args.model)
    module = __import__(type(model).__module__, fromlist=["x"])
    attention = Attention(len(model.layers), base.scaled_dot_product_attention)
    module.scaled_dot_product_attention = attention
    journal = args.out / "rows.jsonl" if args.out else None
    rows = [json.loads(line) for line in journal.read_text().splitlines()] if journal and journal.exists() else []
    for task in args.tasks.split(","):
        for seed in range(args.seed, args.seed + args.samples):
            if any(r["task"] == task and r["seed"] == seed for r in rows):
                continue  # measured by an earlier run: the journal is resumable
            found = one_example(model, tokenizer, attention, task, seed, args)
            rows += found
            if journal:
                journal.parent.mkdir(parents=True, exist_ok=True)
                with journal.open("a") as sink:
                    sink.writelines(json.dumps(r) + "\n" for r in found)
    print(table(rows))


def one_example(model: Any, tokenizer: Any, attention: Attention, task: str, seed: int,
                args: argparse.Namespace) -> list[dict[str, Any]]:
    example = ruler.example(task, tokenizer, args.context, seed, "heldout")
    context = tokenizer.encode(example.context)
    question = tokenizer.encode(example.prompt)[len(context):]
    rest = tokenizer.encode(example.prompt + example.answer)[len(context):]
    cache, found = scores(model, tokenizer, attention, context, args.scorers.split(","),
                           args.score_bits.split(","))
    reference, _ = kl_after(model, copy.deepcopy(cache), rest, None)
    out = []
    all_bits = args.bits.split(",")
    for bits in all_bits:
        for name, share, layout, pool in _plans(found, args, bits, all_bits[0]):
            keep = None if name == "full" else _chosen(found[name], share, layout, pool)
            for held_bits in map(int, args.held_bits.split(",")) if keep is not None and cost(bits) < 16 else [0]:
                kl, right = variant(model, tokenizer, attention, cache, keep, bits, example, question, rest,
                                    reference, held_bits)
                label = name + ("" if layout == "per head" else f" {layout}") + \
                    (f" pooled {pool}" if pool > 1 else "") + (f" held at {held_bits}" if held_bits else "")
                held = share * cost(bits) / 16
                out.append({"task": task, "seed": seed, "scorer": label, "keep": share, "bits": bits,
                            "bytes": held, "kl": kl, "right": right})
                print(f"{task} {seed}: {label} keep {share} at {bits} bits ({held:.3f} of the bytes): "
                      f"KL {kl:.4f}, {'right' if right else 'wrong'}", flush=True)
    return out


def _chosen(scores: list[mx.array], share: float, layout: str, pool: int) -> list[mx.array]:
    """Each layer's kept rows under ``layout``: the same number per head, head-wise, or model-wise."""
    if layout == "model-wise":
        return kept_model_wise(scores, share, pool)
    if layout.startswith("floored "):
        return kept_model_wise(scores, share, pool, float(layout.split()[1]))
    return [kept(s, share, layout == "head-wise", pool) for s in scores]


def _plans(found: dict[str, list], args: argparse.Namespace, bits: str,
           first: str) -> list[tuple[str, float, str, int]]:
    """The variants at ``bits``: the full cache, then each scorer at each share of ``--keep`` (with
    ``--same-bytes`` a share of the first of ``--bits``, scaled to the bytes it holds there), both per head and
    head-wise (``--head-wise``: head-wise alone), and with ``--model-wise`` model-wise too, at each ``--pool``."""
    ratio = cost(first) / cost(bits) if args.same_bytes and cost(bits) < 16 else 1.0
    layouts = ["head-wise"] if args.head_wise else ["per head", "head-wise"]
    layouts += ["model-wise"] if args.model_wise else []
    layouts += [f"floored {f}" for f in args.floor.split(",") if f]
    return [("full", 1.0, "per head", 0)] + [
        (name, round(min(float(share) * ratio, 1.0), 3), layout, pool) for name in found
        for share in args.keep.split(",") for layout in layouts for pool in map(int, args.pool.split(","))]


def table(rows: list[dict[str, Any]]) -> str:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["scorer"], r["keep"], r["bits"]), []).append(r)
    lines = ["| scorer | rows kept | bits | bytes (16-bit share) | mean KL | right |", "|---|---|---|---|---|---|"]
    for (scorer, share, bits), got in groups.items():
        lines.append(f"| {scorer} | {share:g} | {bits} | {got[0]['bytes']:.3f} | "
                     f"{sum(r['kl'] for r in got) / len(got):.4f} | {sum(r['right'] for r in got)}/{len(got)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
