"""How much quantizing K and V, X, or XQuant's GQA latent perturbs attention, layer by layer, on a model.

    python bench/kv_quant_error.py --model FOLDER [--context 1024] [--seed 0] [--bits 3,4,5,6]

Reads one held-out perplexity text of about ``--context`` tokens through the model (llama-style layers:
``input_layernorm``, ``self_attn`` with ``q_proj``/``k_proj``/``v_proj``/``rope``) and, for every layer,
compares its causal attention output over the whole text with the one computed from stored forms of
its keys and values, each quantized with mlx's affine quantization (groups of 64 along the stored rows,
scales and biases in the model's dtype):

* ``kv``: K (after the rotation) and V, as mlx_lm's ``kv_bits`` cache keeps them;
* ``x``: the attention input X, K and V projected again (XQuant's form);
* ``latent``: XQuant's GQA latent, K's and V's projections on their weights' singular vectors
  (:func:`veloxpatch.methods.xquant.whitening`), rebuilt from it;
* ``latent K, kv V`` and ``kv K, latent V``: one of each, to tell where a difference comes from.

Prints a Markdown table: bytes per token and layer, and the relative error ``|o' - o| / |o|`` of the
attention output (mean and worst over the layers).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import mlx.core as mx
from mlx_lm import load

from veloxpatch.caches.store import decode, encode
from veloxpatch.eval.tasks import longtext_sample
from veloxpatch.methods.xquant import shaped, whitening

GROUP = 64
Rows = tuple[mx.array, mx.array]


def quantized(x: mx.array, bits: int) -> mx.array:
    """``x`` through mlx's affine quantization and back, as the caches store it."""
    return decode(encode(x, bits, GROUP), bits, GROUP)


def attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float) -> mx.array:
    """Causal attention over the whole text (keys and values shared by each KV head's query heads)."""
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask="causal")


class Layer:
    """One layer's attention input and the ways of storing its rows."""

    def __init__(self, module, x: mx.array) -> None:
        self.module, self.x = module, x
        self.raw = (module.k_proj(x), module.v_proj(x))
        self.bases = [whitening(p, x.shape[-1]) for p in (module.k_proj, module.v_proj)]
        b, n, _ = x.shape
        self.queries = module.rope(module.q_proj(x).reshape(b, n, module.n_heads, -1).transpose(0, 2, 1, 3))
        self.exact = shaped(module, *self.raw, 0)
        self.output = attention(self.queries, *self.exact, module.scale)

    def kv(self, bits: int) -> Rows:
        return tuple(quantized(r, bits) for r in self.exact)

    def x_form(self, bits: int) -> Rows:
        x = quantized(self.x, bits)
        return shaped(self.module, self.module.k_proj(x), self.module.v_proj(x), 0)

    def latent(self, bits: int) -> Rows:
        rebuilt = [quantized(r @ inverse, bits) @ basis for r, (basis, inverse) in zip(self.raw, self.bases)]
        return shaped(self.module, *rebuilt, 0)

    def error(self, rows: Rows) -> float:
        out = attention(self.queries, *rows, self.module.scale)
        return (mx.linalg.norm(out - self.output) / mx.linalg.norm(self.output)).item()


def forms(layer: Layer, bits: int) -> dict[str, Rows]:
    latent, kv = layer.latent(bits), layer.kv(bits)
    return {"kv": kv, "x": layer.x_form(bits), "latent": latent,
            "latent K, kv V": (latent[0], kv[1]), "kv K, latent V": (kv[0], latent[1])}


def widths(layer: Layer) -> dict[str, int]:
    kv = sum(r.shape[-1] for r in layer.raw)
    return {"kv": kv, "x": layer.x.shape[-1], "latent": kv, "latent K, kv V": kv, "kv K, latent V": kv}


def per_layer(model, tokens: mx.array, visit: Callable[[Layer], None]) -> None:
    """Run ``tokens`` through the model's layers, handing each layer's attention input to ``visit``."""
    h = model.model.embed_tokens(tokens)
    for block in model.model.layers:
        visit(Layer(block.self_attn, block.input_layernorm(h)))
        h = block(h, mask="causal")
        mx.eval(h)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bits", default="3,4,5,6")
    args = parser.parse_args()
    model, tokenizer = load(args.model)
    tokens = mx.array(tokenizer.encode(longtext_sample(tokenizer, args.context, args.seed)))[None]
    all_bits = [int(b) for b in args.bits.split(",")]
    errors: dict[tuple[str, int], list[float]] = {}
    sizes: dict[str, int] = {}

    def visit(layer: Layer) -> None:
        sizes.update(widths(layer))
        for bits in all_bits:
            for name, rows in forms(layer, bits).items():
                errors.setdefault((name, bits), []).append(layer.error(rows))

    per_layer(model, tokens, visit)
    scale_bytes = model.model.embed_tokens.weight.dtype.size
    print(f"attention output error of stored forms, {tokens.shape[1]} tokens, {len(model.model.layers)} layers, "
          f"groups of {GROUP}\n")
    print("| form | bits | bytes per token and layer | mean error | worst layer |\n|---|---|---|---|---|")
    for (name, bits), values in sorted(errors.items(), key=lambda item: (item[0][1], item[0][0])):
        width = sizes[name]
        nbytes = width * bits / 8 + 2 * width // GROUP * scale_bytes
        print(f"| {name} | {bits} | {nbytes:g} | {sum(values) / len(values):.4f} | {max(values):.4f} |")


if __name__ == "__main__":
    main()
