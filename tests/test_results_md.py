"""bench/results_md.py: one row per variant when merged runs measured the same method with different n."""

from __future__ import annotations

from conftest import bench_script


def load_script():
    return bench_script("results_md")


def row(method: str, share: float, samples: int, value: float) -> dict:
    return {"task": "passkey", "context": 1024, "method": method, "share": share, "samples": samples, "value": value}


def test_each_run_keeps_its_own_baseline_row_with_a_distinct_name() -> None:
    rows = [row("full", 1.0, 10, 0.9), row("snapkv", 0.5, 10, 0.8),
            row("full", 1.0, 3, 0.667), row("quantized", 0.5, 3, 1.0)]
    names = [line.split("|")[1].strip() for line in load_script().eval_tables(rows).splitlines()
             if line.startswith("| ") and not line.startswith("| method")]
    assert names == ["full", "full (quantized run)", "quantized", "snapkv"]


def test_accuracy_cells_show_their_interval_and_n_and_knob_variants_get_their_own_rows() -> None:
    rows = [row("full", 1.0, 10, 0.8), row("snapkv", 0.5, 10, 1.0), row("snapkv[kernel=15]", 0.5, 10, 0.0),
            {**row("full", 1.0, 10, 12.5), "task": "perplexity"}]
    text = load_script().eval_tables(rows)
    accuracy = text.split("**perplexity")[0]
    lines = {line.split("|")[1].strip(): line for line in accuracy.splitlines() if line.startswith("| ")}
    assert "0.80 [0.49, 0.94] n=10" in lines["full"]
    assert "1.00 [0.72, 1.00] n=10" in lines["snapkv"] and "0.00 [0.00, 0.28] n=10" in lines["snapkv[kernel=15]"]
    assert "12.5 (n=10)" in text and "[" not in text.split("**perplexity")[1]


def test_the_plot_draws_each_method_at_its_defaults_from_the_largest_run(tmp_path) -> None:
    script = load_script()
    rows = [row("full", 1.0, 10, 0.6), row("snapkv", 0.5, 10, 0.7), row("snapkv", 0.25, 10, 0.5),
            row("snapkv[kernel=7]", 0.5, 10, 0.4), row("full", 1.0, 3, 0.667), row("quantized", 0.5, 3, 1.0),
            {**row("full", 1.0, 10, 12.5), "task": "perplexity"}]
    n, cells = script.panel_cells(rows, "passkey", 1024)
    assert n == 10 and sorted((r["method"], r["share"]) for r in cells) == [
        ("full", 1.0), ("snapkv", 0.25), ("snapkv", 0.5)]
    (path,) = script.panels(rows, tmp_path)  # one figure: perplexity has none
    assert path == tmp_path / "passkey_1024.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_bench_table_shows_the_reading_peak_where_the_run_measured_it() -> None:
    script = load_script()
    older = {"context": 256, "variant": "vanilla", "budget": 256, "prefill_s": 1.0, "decode_tok_s": 9.0,
             "decode_vs_vanilla": 1.0, "kv_bytes": 2**20, "kv_vs_vanilla": 1.0, "peak_bytes": 2**21}
    assert "read_MiB" not in script.bench_table([older])
    newer = {**older, "read_peak_bytes": 3 * 2**19, "read_vs_vanilla": 1.0}
    header, _, row = script.bench_table([newer]).splitlines()[:3]
    assert header.split("|")[-3:-1] == [" read_MiB ", " read_vs_vanilla "] and "| 1.5 | 1 |" in row
