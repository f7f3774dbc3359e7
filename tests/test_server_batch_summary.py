"""bench/server_batch.py's summary of a run: rates, their ratio, answers equal alone and the bytes per sequence."""

from __future__ import annotations

import argparse
from pathlib import Path

from conftest import bench_script


def test_the_server_batch_summary_gives_the_16_bit_share_where_the_server_says_it(model_dir: Path) -> None:
    """bench/server_batch.py's summary: each batched answer's ``usage.velox`` bytes as a 16-bit model holds them, over
    mlx_lm's cache's, beside the float32 bytes (a usage without them, from an older server, gives none)."""
    batch = bench_script("server_batch")
    velox = {"rows_kept": 40, "share_kept": 0.5, "kv_bytes": 300, "dense_kv_bytes": 2000, "kv_bytes_16bit": 200,
             "dense_kv_bytes_16bit": 1000}
    answer = {"choices": [{"text": "42"}], "usage": {"velox": velox}}
    older = {"choices": [{"text": "41"}], "usage": {"velox": {k: velox[k] for k in list(velox)[:4]}}}
    args = argparse.Namespace(model=str(model_dir), concurrency=2, kv="quant", budget="100%", out=None)
    result = batch.summary(args, {"plain": [4.0], "ours": [2.0]}, [("a", answer), ("b", older)],
                           [answer, answer])
    assert result["share_16bit"] == [0.2] and result["kv_bytes"] == [300, 300]
    assert result["ratio"] == 2.0 and result["equal_alone"] == 1
