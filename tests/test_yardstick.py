"""bench/yardstick.py: the equal-bytes table counts only examples every variant finished, pools them, and shows the
share of the full cache's 16-bit bytes each variant held."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import bench_script


def load_script():
    return bench_script("yardstick")


def sample(task: str, seed: int, label: str, value: float, kv16: float | None) -> str:
    return json.dumps({"task": task, "seed": seed, "label": label, "value": value, "kv16_bytes": kv16})


def test_pooled_over_finished_examples_with_shares(tmp_path: Path) -> None:
    lines = [sample("a", 0, "full", 1.0, 100.0), sample("a", 0, "snapkv@0.25", 0.0, 25.0),
             sample("a", 0, "quantized[bits=4]@0.25", 1.0, 28.0), sample("a", 0, "quantized[bits=4]@0.5", 1.0, 28.0),
             sample("b", 0, "full", 1.0, 200.0), sample("b", 0, "snapkv@0.25", 1.0, 48.0),
             sample("b", 0, "quantized[bits=4]@0.25", 0.0, 56.0),
             sample("b", 1, "full", 1.0, 200.0)]  # an example only the full cache finished: not counted
    (tmp_path / "eval.samples.jsonl").write_text("\n".join(lines) + "\n")
    script = load_script()
    samples = script.load(tmp_path)
    assert script.complete(samples) == {("a", 0), ("b", 0)}
    rows = {r["variant"]: r for r in script.rows(samples, per_task=True)}
    assert list(rows) == ["full", "quantized[bits=4]", "snapkv@0.25"]
    assert rows["snapkv@0.25"]["bytes (16-bit share)"] == "0.245" and rows["snapkv@0.25"]["a"] == "0.00"
    assert rows["quantized[bits=4]"]["accuracy"].startswith("0.50 [") and rows["full"]["accuracy"].endswith("n=2")


def test_a_method_keeping_every_token_is_one_row_and_a_chosen_few_count_their_own_examples(tmp_path: Path) -> None:
    lines = [sample("a", 0, "full", 1.0, 100.0), sample("a", 0, "quant[bits=3]@0.25", 1.0, 23.0),
             sample("a", 0, "quant[bits=3]@0.5", 1.0, 23.0), sample("a", 0, "snapkv@0.25", 0.0, 25.0),
             sample("b", 0, "full", 1.0, 100.0), sample("b", 0, "quant[bits=3]@0.25", 0.0, 23.0),
             sample("b", 0, "quant[bits=3]@0.5", 0.0, 23.0)]  # snapkv was dropped from the run before b
    (tmp_path / "eval.samples.jsonl").write_text("\n".join(lines) + "\n")
    script = load_script()
    samples = script.load(tmp_path)
    assert sorted(samples) == ["full", "quant[bits=3]", "snapkv@0.25"]
    assert script.complete(samples) == {("a", 0)}
    chosen = {name: by_key for name, by_key in samples.items() if name in {"full", "quant[bits=3]"}}
    assert script.complete(chosen) == {("a", 0), ("b", 0)}
    rows = {r["variant"]: r for r in script.rows(chosen, per_task=False)}
    assert rows["quant[bits=3]"]["accuracy"].startswith("0.50 [")
    assert rows["quant[bits=3]"]["bytes (16-bit share)"] == "0.230"


def test_examples_without_16_bit_bytes_are_tabled_with_no_share(tmp_path: Path) -> None:
    lines = [sample("a", 0, "full", 1.0, None), sample("a", 0, "snapkv@0.25", 0.0, None),
             sample("b", 0, "full", 1.0, 100.0), sample("b", 0, "snapkv@0.25", 1.0, 30.0)]
    (tmp_path / "eval.samples.jsonl").write_text("\n".join(lines) + "\n")
    script = load_script()
    rows = {r["variant"]: r for r in script.rows(script.load(tmp_path), per_task=False)}
    assert rows["snapkv@0.25"]["bytes (16-bit share)"] == "0.300" and rows["snapkv@0.25"]["accuracy"].endswith("n=2")
    (tmp_path / "eval.samples.jsonl").write_text("\n".join(lines[:2]) + "\n")
    rows = {r["variant"]: r for r in script.rows(script.load(tmp_path), per_task=False)}
    assert rows["snapkv@0.25"]["bytes (16-bit share)"] == "n/a"


def test_folders_table_as_one_journal_the_first_answer_kept_and_a_difference_said(tmp_path: Path, capsys) -> None:
    first, second = tmp_path / "one", tmp_path / "two"
    first.mkdir(), second.mkdir()
    (first / "eval.samples.jsonl").write_text("\n".join([
        sample("a", 0, "full", 1.0, 100.0), sample("a", 0, "snapkv@0.25", 0.0, 25.0)]) + "\n")
    (second / "eval.samples.jsonl").write_text("\n".join([
        sample("a", 0, "full", 0.0, 100.0), sample("b", 0, "full", 1.0, 100.0),
        sample("b", 0, "snapkv@0.25", 1.0, 25.0)]) + "\n")
    script = load_script()
    samples = script.load(first, second)
    assert script.complete(samples) == {("a", 0), ("b", 0)}
    assert samples["full"]["a", 0]["value"] == 1.0, "the first folder's answer"
    assert "full on ('a', 0) answered 1.0 in one folder and 0.0" in capsys.readouterr().err
