"""Quantized KV attention on mlx's CPU backend: the quantized matmul vs dequantize-then-dense.

    python bench/quantized_matmul.py      (preload OpenBLAS as docs/how-it-works.md says, for a fair dense figure)

Times mlx_lm's quantized attention product (64 queries x 1024 keys, head_dim 32, 4 and 8 bits, group 32, as for
the shipped model) against the same product on unquantized fp16 keys, and against dequantizing the keys first and
then running the dense product (what veloxpatch's caches with ``kv_bits`` do), median of 20 after a warm-up.

Then the decode step of ``quant`` (float32, SmolLM2-135M's shapes: 9 query heads over 3 KV heads of 64, one query,
8192 rows): both products of attention, ``q K^T`` with the keys held per channel (quantized along the tokens) and
``p V`` with the values per token, each by mlx's quantized matmul as ``quant`` runs them (``transpose=False``),
against dequantizing first and against the dense products, at 2, 3, 4 and 8 bits, groups of 64.

Last, the same two products at 4 bits over Qwen2.5-0.5B's 2 KV heads at 8192 rows, with 1, 3 and 7 query rows per
KV head (a decode step's GQA group: 7 on Qwen2.5-0.5B, 3 on SmolLM2): whether the quantized matmul's cost grows
with the rows multiplied (it unpacks the keys again for each) where the dense product's barely does.

And by dtype: the same two products at 4 bits (Qwen2.5-0.5B's 2 KV heads, 7 query rows each, 4096 rows) with the
queries and scales in float32, float16 and bfloat16, as given and cast to float32 around the product (what ``quant``
does on the CPU for a half-precision model since 2026-12-06), against the dense product in that dtype.
"""

from __future__ import annotations

import statistics
import time

import mlx.core as mx


def median_seconds(fn, runs: int = 20) -> float:
    mx.eval(fn())
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    keys = mx.random.normal((1, 2, 1, 1024, 32)).astype(mx.float16)
    queries = mx.random.normal((1, 2, 4, 64, 32)).astype(mx.float16)
    dense = median_seconds(lambda: queries @ keys.swapaxes(-1, -2))
    print(f"dense fp16      {dense * 1e3:8.2f} ms")
    for bits in (8, 4):
        packed = mx.quantize(keys, group_size=32, bits=bits)
        quant = median_seconds(lambda: mx.quantized_matmul(queries, *packed, transpose=True, group_size=32, bits=bits))
        print(f"quantized {bits} bit {quant * 1e3:8.2f} ms  ({quant / dense:.0f}x dense)")
        unpacked = median_seconds(
            lambda: queries @ mx.dequantize(*packed, group_size=32, bits=bits).swapaxes(-1, -2))
        print(f"dequant+dense {bits} {unpacked * 1e3:8.2f} ms  ({unpacked / dense:.1f}x dense)")


def decode_step() -> None:
    """``quant``'s decode-step products against dequantize-then-dense and dense (module doc)."""
    queries = mx.random.normal((1, 3, 3, 64))
    keys_t, values = mx.random.normal((1, 3, 64, 8192)), mx.random.normal((1, 3, 8192, 64))
    weights = mx.softmax(queries @ keys_t, axis=-1)
    dense = median_seconds(lambda: (queries @ keys_t, weights @ values))
    print(f"decode step, dense float32 {dense * 1e3:8.2f} ms")
    for bits in (2, 3, 4, 8):
        k, v = mx.quantize(keys_t, group_size=64, bits=bits), mx.quantize(values, group_size=64, bits=bits)
        mx.eval(k, v)
        direct = median_seconds(lambda: (
            mx.quantized_matmul(queries, *k, transpose=False, group_size=64, bits=bits),
            mx.quantized_matmul(weights, *v, transpose=False, group_size=64, bits=bits)))
        rebuilt = median_seconds(lambda: (
            queries @ mx.dequantize(*k, group_size=64, bits=bits),
            weights @ mx.dequantize(*v, group_size=64, bits=bits)))
        print(f"  {bits} bits: quantized matmul {direct * 1e3:7.2f} ms ({direct / dense:.1f}x dense), "
              f"dequantize + dense {rebuilt * 1e3:7.2f} ms ({rebuilt / dense:.1f}x dense)")


def group_rows() -> None:
    """``quant``'s two decode-step products at 4 bits against dense, by query rows per KV head (module doc)."""
    for rows in (1, 3, 7):
        queries, keys_t = mx.random.normal((1, 2, rows, 64)), mx.random.normal((1, 2, 64, 8192))
        values = mx.random.normal((1, 2, 8192, 64))
        weights = mx.softmax(queries @ keys_t, axis=-1)
        k, v = mx.quantize(keys_t, group_size=64, bits=4), mx.quantize(values, group_size=64, bits=4)
        mx.eval(k, v)
        dense = median_seconds(lambda: (queries @ keys_t, weights @ values))
        direct = median_seconds(lambda: (
            mx.quantized_matmul(queries, *k, transpose=False, group_size=64, bits=4),
            mx.quantized_matmul(weights, *v, transpose=False, group_size=64, bits=4)))
        print(f"{rows} query rows per KV head: dense {dense * 1e3:6.2f} ms, quantized matmul {direct * 1e3:6.2f} ms "
              f"({direct / dense:.1f}x dense)")


def by_dtype() -> None:
    """``quant``'s two decode-step products at 4 bits per dtype, as given and as float32 (module doc)."""
    for dtype in (mx.float32, mx.float16, mx.bfloat16):
        queries, keys_t, values = (mx.random.normal(shape).astype(dtype)
                                   for shape in ((1, 2, 7, 64), (1, 2, 64, 4096), (1, 2, 4096, 64)))
        weights = mx.softmax(queries @ keys_t, axis=-1)
        k, v = mx.quantize(keys_t, group_size=64, bits=4), mx.quantize(values, group_size=64, bits=4)
        mx.eval(k, v, weights)

        def product(x: mx.array, parts: tuple[mx.array, ...], wide: bool) -> mx.array:
            packed, scales, biases = parts
            if wide:
                x, scales, biases = (a.astype(mx.float32) for a in (x, scales, biases))
            out = mx.quantized_matmul(x, packed, scales, biases, transpose=False, group_size=64, bits=4)
            return out.astype(dtype)

        dense = median_seconds(lambda: (queries @ keys_t, weights @ values))
        given = median_seconds(lambda: (product(queries, k, False), product(weights, v, False)))
        wide = median_seconds(lambda: (product(queries, k, True), product(weights, v, True)))
        print(f"{dtype}: dense {dense * 1e3:7.2f} ms, quantized matmul as given {given * 1e3:7.2f} ms "
              f"({given / dense:.1f}x dense), as float32 {wide * 1e3:7.2f} ms ({wide / dense:.1f}x dense)")


if __name__ == "__main__":
    main()
    decode_step()
    group_rows()
    by_dtype()
