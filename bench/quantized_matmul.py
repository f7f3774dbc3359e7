"""Quantized KV attention on mlx's CPU backend: the quantized matmul vs dequantize-then-dense.

    python bench/quantized_matmul.py      (preload OpenBLAS as docs/how-it-works.md says, for a fair dense figure)

Times mlx_lm's quantized attention product (64 queries x 1024 keys, head_dim 32, 4 and 8 bits, group 32, as for
the shipped model) against the same product on unquantized fp16 keys, and against dequantizing the keys first and
then running the dense product (what veloxpatch's quantized caches do), median of 20 after a warm-up.
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


if __name__ == "__main__":
    main()
