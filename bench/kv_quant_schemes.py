"""Which way of quantizing a real model's keys keeps its answers: per token (mlx_lm's ``kv_bits``), per channel
in blocks of tokens (KIVI, veloxpatch's ``quant``), or per token after a Hadamard rotation of the head dimension.

    python bench/kv_quant_schemes.py --model FOLDER [--context 2048] [--tasks niah_single_2,niah_multikey_3,vt]
        [--samples 1] [--bits 4,3,2]

For each RULER example the full cache reads the context (the question left out), then each scheme replaces every
layer's keys and values by what it would give back (quantized and dequantized; values always per token, in groups
of 64 along the head), and the question and reference answer are read on top. Printed: the mean KL divergence of
the next-token distributions over those tokens from the full cache's, per example and averaged, and the bits each
scheme holds per element (scales and biases at 16 bits). A scheme's error here is the cache's error alone: no
eviction, the same context for all.
"""

from __future__ import annotations

import argparse
import copy
import math
from collections.abc import Callable

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from veloxpatch.eval import ruler

GROUP = 64
Scheme = Callable[[mx.array, mx.array], tuple[mx.array, mx.array]]


def round_trip(x: mx.array, bits: int) -> mx.array:
    """``x`` quantized along its last axis in groups of 64 and back."""
    return mx.dequantize(*mx.quantize(x, group_size=GROUP, bits=bits), group_size=GROUP, bits=bits).astype(x.dtype)


def per_channel(x: mx.array, bits: int) -> mx.array:
    """(B, H, T, d) quantized per channel in blocks of 64 tokens (the last block padded with its last row)."""
    tokens = x.shape[2]
    pad = -tokens % GROUP
    if pad:
        x = mx.concatenate([x, mx.repeat(x[..., -1:, :], pad, axis=2)], axis=2)
    return mx.swapaxes(round_trip(mx.swapaxes(x, 2, 3), bits), 2, 3)[..., :tokens, :]


def hadamard(n: int) -> mx.array:
    """The orthonormal Sylvester-Hadamard matrix of order ``n`` (a power of two)."""
    h = mx.array([[1.0]])
    while h.shape[0] < n:
        h = mx.concatenate([mx.concatenate([h, h], 1), mx.concatenate([h, -h], 1)], 0)
    return h / math.sqrt(n)


def rotated(x: mx.array, bits: int) -> mx.array:
    """Per token after rotating the head dimension by a Hadamard matrix, rotated back."""
    h = hadamard(x.shape[-1]).astype(x.dtype)
    return round_trip(x @ h, bits) @ h.T


SCHEMES: dict[str, Callable[[mx.array, int], mx.array]] = {
    "per token (kv_bits)": round_trip, "keys per channel (quant)": per_channel, "per token, rotated": rotated}


def kl_after(model, cache: list, tokens: list[int], reference: mx.array | None) -> tuple[mx.array, float]:
    """Log-probabilities over ``tokens`` read on a copy of ``cache``, and their mean KL from ``reference``."""
    logits = model(mx.array(tokens)[None], cache=cache)[0].astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if reference is None:
        return logp, 0.0
    return logp, float((mx.exp(reference) * (reference - logp)).sum(axis=-1).mean())


def with_scheme(cache: list, keys: Callable[[mx.array], mx.array], values: Callable[[mx.array], mx.array]) -> list:
    """A copy of a full cache list with every layer's rows replaced."""
    out = copy.deepcopy(cache)
    for layer in out:
        k, v = layer.keys[..., : layer.offset, :], layer.values[..., : layer.offset, :]
        layer.keys, layer.values = keys(k), values(v)
    return out


def ruler_arguments(description: str, context: int, bits: str) -> argparse.ArgumentParser:
    """The options of a script measuring a cache's error on RULER examples of a real model."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", required=True)
    parser.add_argument("--context", type=int, default=context)
    parser.add_argument("--tasks", default="niah_single_2,niah_multikey_3,vt")
    parser.add_argument("--samples", type=int, default=1)
    parser.add_argument("--bits", default=bits)
    return parser


def main() -> None:
    args = ruler_arguments(__doc__.split("\n\n")[0], 2048, "4,3,2").parse_args()
    model, tokenizer = load(args.model)
    widths = [int(b) for b in args.bits.split(",")]
    found: dict[tuple[str, int], list[float]] = {}
    for task in args.tasks.split(","):
        for seed in range(args.samples):
            example = ruler.example(task, tokenizer, args.context, seed, "heldout")
            context = tokenizer.encode(example.context)
            rest = tokenizer.encode(example.prompt + example.answer)[len(context):]
            cache = make_prompt_cache(model)
            for start in range(0, len(context), 1024):
                model(mx.array(context[start: start + 1024])[None], cache=cache)
                mx.eval([c.state for c in cache])
            reference, _ = kl_after(model, copy.deepcopy(cache), rest, None)
            for name, scheme in SCHEMES.items():
                for bits in widths:
                    changed = with_scheme(cache, lambda k, s=scheme, b=bits: s(k, b),
                                          lambda v, b=bits: round_trip(v, b))
                    _, kl = kl_after(model, changed, rest, reference)
                    found.setdefault((name, bits), []).append(kl)
                    print(f"{task} seed {seed}: {name} at {bits} bits: KL {kl:.4f}", flush=True)
    print("\n| keys | bits | bits held per element | mean KL from the full cache | examples |\n|---|---|---|---|---|")
    for (name, bits), kls in found.items():
        print(f"| {name} | {bits} | {bits + 32 / GROUP:g} | {sum(kls) / len(kls):.4f} | {len(kls)} |")


if __name__ == "__main__":
    main()
