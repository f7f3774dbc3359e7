"""What a long chunk's attention costs on mlx's CPU backend, and where: mlx's blocks against numpy's softmax.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 python bench/cpu_softmax.py

Qwen2.5-0.5B's shapes (14 query heads over 2 KV heads of 64, float32), a 512-query prompt chunk, median of 5 after
a warm-up:

* ``exp`` alone over one such chunk's logits against 2560 rows (18M values), by mlx and by numpy;
* a prompt chunk's causal attention over 2048 and 4096 rows in ``caches/blocks.py``'s blocks of queries: mlx's
  fused attention per block (what ran before) against ``causal_on_host`` (mlx's matmul, numpy's softmax);
* a second reading's chunk over 2048 earlier rows, scoring them (``caches/scored_attention.py``): mlx's blocks
  against the CPU's.

Each numpy figure comes with its largest difference from mlx's output.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np

from veloxpatch.caches import blocks, scored_attention

HEADS, GROUP, DIM, CHUNK = 2, 7, 64, 512


def median_seconds(fn: Callable[[], Any], runs: int = 5) -> float:
    fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def normal(*shape: int) -> mx.array:
    x = mx.random.normal(shape)
    mx.eval(x)
    return x


def exp_alone() -> None:
    logits = normal(1, HEADS, GROUP * CHUNK, 2560) * 4 - 8
    on_host = np.asarray(logits)
    out = np.empty_like(on_host)
    mlx_s = median_seconds(lambda: mx.eval(mx.exp(logits)))
    numpy_s = median_seconds(lambda: np.exp(on_host, out=out))
    print(f"exp over {logits.size / 1e6:.0f}M float32: mlx {mlx_s * 1e3:.1f} ms, numpy {numpy_s * 1e3:.1f} ms "
          f"({mlx_s / numpy_s:.1f}x)")


def prompt_chunk(rows: int) -> None:
    queries = normal(1, HEADS * GROUP, CHUNK, DIM) * 0.1
    keys, values = normal(1, HEADS, rows, DIM), normal(1, HEADS, rows, DIM)
    size = max(blocks.MIN_BLOCK, blocks.SCORE_BYTES // (4 * HEADS * GROUP * rows))

    def by_mlx() -> mx.array:
        parts = []
        for start in range(0, CHUNK, size):
            stop = min(CHUNK, start + size)
            seen = rows - CHUNK + stop
            parts.append(mx.fast.scaled_dot_product_attention(queries[:, :, start:stop], keys[:, :, :seen],
                                                              values[:, :, :seen], scale=0.125, mask="causal"))
            mx.eval(parts[-1])
        return mx.concatenate(parts, axis=2)

    def by_numpy() -> mx.array:
        return scored_attention.causal_on_host(queries, keys, values, 0.125, size)

    difference = float(mx.abs(by_mlx() - by_numpy()).max())
    mlx_s, numpy_s = median_seconds(by_mlx), median_seconds(by_numpy)
    print(f"prompt chunk of {CHUNK} over {rows} rows, blocks of {size}: mlx {mlx_s:.3f} s, numpy's softmax "
          f"{numpy_s:.3f} s ({mlx_s / numpy_s:.2f}x), largest difference {difference:.1e}")


def second_reading(past: int = 2048) -> None:
    q = normal(1, HEADS, GROUP, CHUNK, DIM) * 0.0125
    keys, values = normal(1, HEADS, past + CHUNK, DIM), normal(1, HEADS, past + CHUNK, DIM)
    best = mx.zeros((1, HEADS, past))

    def by_mlx() -> tuple[mx.array, mx.array]:
        out = scored_attention._blocks(mx, q, keys, values, None, best, scored_attention.QUERY_BLOCK)
        mx.eval(out)
        return out

    def by_numpy() -> tuple[mx.array, mx.array]:
        return scored_attention.scored_attention(q, keys, values, None, best)

    (out_a, best_a), (out_b, best_b) = by_mlx(), by_numpy()
    difference = max(float(mx.abs(out_a - out_b).max()), float(mx.abs(best_a - best_b).max()))
    mlx_s, numpy_s = median_seconds(by_mlx), median_seconds(by_numpy)
    print(f"second reading's chunk of {CHUNK} over {past} earlier rows, scored: mlx {mlx_s:.3f} s, numpy's "
          f"softmax {numpy_s:.3f} s ({mlx_s / numpy_s:.2f}x), largest difference {difference:.1e}")


def main() -> None:
    mx.random.seed(0)
    exp_alone()
    for rows in (2048, 4096):
        prompt_chunk(rows)
    second_reading()


if __name__ == "__main__":
    main()
