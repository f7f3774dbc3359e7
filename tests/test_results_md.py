"""bench/results_md.py: one row per variant when merged runs measured the same method with different n."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "results_md.py"


def load_script():
    spec = importlib.util.spec_from_file_location("results_md", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def row(method: str, share: float, samples: int, value: float) -> dict:
    return {"task": "passkey", "context": 1024, "method": method, "share": share, "samples": samples, "value": value}


def test_each_run_keeps_its_own_baseline_row_with_a_distinct_name() -> None:
    rows = [row("full", 1.0, 10, 0.9), row("snapkv", 0.5, 10, 0.8),
            row("full", 1.0, 3, 0.667), row("quantized", 0.5, 3, 1.0)]
    names = [line.split("|")[1].strip() for line in load_script().eval_tables(rows).splitlines()
             if line.startswith("| ") and not line.startswith("| method")]
    assert names == ["full", "full (quantized run)", "quantized", "snapkv"]
