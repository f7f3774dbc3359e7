"""``veloxpatch eval`` and ``bench`` end to end on tiny settings: they run and write their files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from veloxpatch.cli import main
from veloxpatch.eval.commands import demo_rows
from veloxpatch.eval.variants import KVLayout, Variant


def test_eval_writes_table_json_csv_and_plots(model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "eval"
    result = CliRunner().invoke(main, ["eval", "--model", str(model_dir), "--contexts", "160", "--samples", "1",
                                       "--budgets", "100%,25%", "--methods", "snapkv,rotating,quantized",
                                       "--seed", "7", "--out", str(out)])
    assert result.exit_code == 0, result.output
    written = json.loads((out / "eval.json").read_text())
    assert written["meta"]["spec"]["seed"] == 7
    rows = written["rows"]
    labels = {(r["task"], r["label"]) for r in rows}
    for task in ("passkey", "multikey", "perplexity"):
        assert {(task, "full"), (task, "snapkv@0.25"), (task, "rotating@0.25"), (task, "quantized@0.25")} <= labels
    ppl = {r["label"]: r for r in rows if r["task"] == "perplexity"}
    assert all(r["value"] > 1 for r in ppl.values())
    assert ppl["snapkv@0.25"]["kv_bytes"] < ppl["full"]["kv_bytes"]
    assert (out / "eval.csv").read_text().startswith("task,context,method,share,label,metric,value")
    assert (out / "perplexity_160.png").stat().st_size > 1000
    assert "snapkv@0.25" in result.output


def test_a_tier_size_knob_is_journalled_and_a_rerun_skips_it(model_dir: Path, tmp_path: Path) -> None:
    """``snapkv[tier_size=all]`` (a setting parsed into an object) runs, is written to the journal as its text, and a
    second run with the same arguments finds it there instead of measuring it again."""
    out = tmp_path / "eval"
    args = ["eval", "--model", str(model_dir), "--tasks", "passkey", "--contexts", "160", "--samples", "1",
            "--budgets", "25%", "--methods", "snapkv[compress=chunk,tier=8,tier_size=all]", "--out", str(out),
            "--no-plots"]
    first = CliRunner().invoke(main, args)
    assert first.exit_code == 0, first.output
    lines = [json.loads(line) for line in (out / "eval.samples.jsonl").read_text().splitlines()]
    assert {line["knobs"].get("tier_size") for line in lines if line["label"] != "full"} == {"all"}
    again = CliRunner().invoke(main, args)
    assert again.exit_code == 0, again.output
    assert len((out / "eval.samples.jsonl").read_text().splitlines()) == len(lines)


def test_bench_compares_every_method_with_vanilla(model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench"
    result = CliRunner().invoke(main, ["bench", "--model", str(model_dir), "--contexts", "200", "--budget", "48",
                                       "--methods", "snapkv,streamingllm,rotating,quantized", "--new-tokens", "4",
                                       "--repeats", "1", "--out", str(out)])
    assert result.exit_code == 0, result.output
    rows = {r["variant"]: r for r in json.loads((out / "bench.json").read_text())["rows"]}
    assert set(rows) == {"vanilla@ctx=48", "vanilla", "snapkv", "streamingllm", "rotating", "quantized"}
    assert rows["vanilla"]["decode_vs_vanilla"] == 1.0
    assert rows["snapkv"]["kv_bytes"] < rows["vanilla"]["kv_bytes"]
    assert all(r["prefill_s"] > 0 and r["decode_tok_s"] > 0 for r in rows.values())
    assert rows["snapkv"]["prefill"] == "shared:snapkv" and rows["rotating"]["prefill"] == "own"
    # mlx_lm quantizes as it generates: a whole run of its own, at 4 bits for a quarter of the rows' bytes
    assert rows["quantized"]["prefill"] == "plain" and rows["quantized"]["kv_bytes"] < rows["vanilla"]["kv_bytes"] / 3
    assert "peak_bytes:" in result.output


def test_shared_bench_matches_the_plain_bench(model_dir: Path) -> None:
    """Shared prefills change what is timed, not what runs: per case the same greedy tokens and KV bytes as
    a plain run (two prompt chunks, each longer than any decode headroom); a short last chunk runs plain."""
    from mlx_lm import load

    from veloxpatch.eval.bench import BenchSpec, cases, measure, run_bench
    from veloxpatch.registry import METHODS

    model, _ = load(str(model_dir))
    spec = BenchSpec([200], 48, sorted(METHODS) + ["rotating"], new_tokens=6, repeats=1, prefill_step=100)
    shared = {m.index: m for m in measure(model, spec)}
    plain = {m.index: m for m in measure(model, BenchSpec(**{**vars(spec), "share_prefill": False}))}
    assert sorted(shared) == sorted(plain) == list(range(len(cases(spec))))
    for i, m in shared.items():
        assert (m.label, m.tokens, m.timing.kv_bytes) == (plain[i].label, plain[i].tokens, plain[i].timing.kv_bytes)
        assert plain[i].prefill == "plain" and len(m.tokens) == 6
    how = {m.label: m.prefill for m in shared.values()}
    assert how == {"vanilla@ctx=48": "plain", "vanilla": "own", "rotating": "own",
                   **{k: "own" for k in ("expected_attention", "h2o", "minicache", "quant", "squeeze", "tova", "xkv",
                                           "xquant")},
                   **{k: "shared:snapkv" for k in ("chunkkv", "pyramidkv", "snapkv", "streamingllm")}}
    # 199 = 3 x 64 + 7: a chunk short enough to be a decode step, so the shared methods run plain
    rows = run_bench(model, BenchSpec([200], 48, ["snapkv", "h2o"], new_tokens=3, repeats=1, prefill_step=64))
    assert [(r["variant"], r["prefill"]) for r in rows] == [("vanilla@ctx=48", "plain"), ("vanilla", "own"),
                                                            ("snapkv", "plain"), ("h2o", "own")]
    assert all(r["peak_bytes"] == max(r["prefill_peak_bytes"], r["decode_peak_bytes"]) > 0 for r in rows)


def test_bad_arguments_are_refused(model_dir: Path) -> None:
    result = CliRunner().invoke(main, ["eval", "--model", str(model_dir), "--methods", "snapkv,h2o2"])
    assert result.exit_code == 2 and "h2o2" in result.output and "streamingllm" in result.output
    result = CliRunner().invoke(main, ["eval", "--model", str(model_dir), "--budgets", "50%,150%"])
    assert result.exit_code == 2 and "'150%' not allowed" in result.output
    result = CliRunner().invoke(main, ["eval", "--model", str(model_dir / "missing")])
    assert result.exit_code == 2 and "is not an mlx_lm model folder" in result.output


def test_quantized_variant_matches_bytes_to_the_budget() -> None:
    fp16 = KVLayout(dtype_bits=16, head_dim=64)
    assert [fp16.bits_for(s) for s in (0.5, 0.25, 0.125)] == [8, 4, 2]
    assert KVLayout(dtype_bits=16, head_dim=32).group == 32
    # head_dim 32: 4 and 2 bits are equally far from 25% (0.3125 vs 0.1875); the wider one wins
    assert [KVLayout(dtype_bits=16, head_dim=32).bits_for(s) for s in (0.5, 0.25, 0.125)] == [8, 4, 2]
    # float32 rows carry float32 scales and biases: 8 bits is 9/32 of a row, 4 bits 5/32, 2 bits 3/32
    fp32 = KVLayout(dtype_bits=32, head_dim=64)
    assert [fp32.share(b) for b in (8, 4, 2)] == [9 / 32, 5 / 32, 3 / 32]
    assert [fp32.bits_for(s) for s in (0.5, 0.25, 0.125)] == [8, 8, 4]  # 12.5%: 4 and 2 bits tie, the wider wins
    with pytest.raises(ValueError, match="head_dim divisible by 32"):
        KVLayout(dtype_bits=16, head_dim=16).group
    assert Variant("quantized", 0.25).generate_kwargs(fp16) == {"kv_bits": 4, "kv_group_size": 64,
                                                                "quantized_kv_start": 0}
    assert Variant("snapkv", 0.01).budget(1000) == 36
    five = Variant.of("quantized[bits=5]", 0.125)
    assert five.generate_kwargs(fp16)["kv_bits"] == 5 and five.label() == "quantized[bits=5]@0.125"
    assert five.identity() != Variant.of("quantized", 0.125).identity()
    with pytest.raises(ValueError, match="one of 2, 3, 4, 5, 6, 8"):
        Variant.of("quantized[bits=7]")


def test_demo_runs_vanilla_then_compressed(model_dir: Path) -> None:
    from mlx_lm import load

    model, tokenizer = load(str(model_dir))
    rows, answer = demo_rows(model, tokenizer, "snapkv", "40", context=300, seed=1)
    assert [r["run"] for r in rows] == ["vanilla", "snapkv@40"] and answer.isdigit()
    # 40 rows, their decode headroom and remembered queries, and the default tier (3 budgets' bytes at 8 bits)
    assert rows[1]["kv_MiB"] < 0.4 * rows[0]["kv_MiB"], "the second run really is compressed"
    result = CliRunner().invoke(main, ["demo", "--model", str(model_dir), "--context", "300"])
    assert result.exit_code == 0 and "passkey prompt" in result.output, result.output
    assert "\nquant " in result.output and "quant@" not in result.output, "the default, without a budget it ignores"


def test_demo_takes_knobs_from_the_spec_and_the_environment(model_dir: Path, monkeypatch) -> None:
    from mlx_lm import load

    model, tokenizer = load(str(model_dir))
    four = demo_rows(model, tokenizer, "quant", "25%", context=300, seed=1)[0][1]["kv_MiB"]
    rows, _ = demo_rows(model, tokenizer, "quant[bits=16]", "25%", context=300, seed=1)
    assert rows[1]["run"] == "quant[bits=16]" and rows[1]["kv_MiB"] > 2 * four, "the rows at 16 bits, not 4"
    monkeypatch.setenv("VELOX_QUANT_BITS", "16")
    assert demo_rows(model, tokenizer, "quant", "25%", context=300, seed=1)[0][1]["kv_MiB"] == rows[1]["kv_MiB"]
    monkeypatch.setenv("VELOX_QUANT_BITS", "9")
    result = CliRunner().invoke(main, ["demo", "--model", str(model_dir), "--context", "300"])
    assert result.exit_code != 0 and "VELOX_QUANT_BITS='9' is not allowed" in result.output, result.output
    monkeypatch.delenv("VELOX_QUANT_BITS")
    for kv, said in (("quant[kep=3]", "kep is not a knob of quant"), ("full", "'full' is not a method")):
        result = CliRunner().invoke(main, ["demo", "--model", str(model_dir), "--kv", kv])
        assert result.exit_code == 2 and said in result.output, result.output


def test_eval_seed_picks_the_held_out_examples() -> None:
    from veloxpatch.eval import tasks
    from veloxpatch.eval.harness import EvalSpec, examples

    def chars(text: str) -> int:
        return len(text) // 3

    got = examples("passkey", chars, 200, EvalSpec(samples=2, seed=1000))
    assert got == [tasks.passkey_example(chars, 200, s, "heldout") for s in (1000, 1001)]
    assert got[0] != tasks.passkey_example(chars, 200, 0, "heldout")


def test_a_benchs_server_settings_are_velox_names_with_values() -> None:
    """``--set VELOX_NAME=VALUE`` of the server benches: a value may hold ``=``; another form is refused by name."""
    from serving import env_settings

    assert env_settings(["VELOX_QUANT_KEEP=0.125x", "VELOX_X=a=b"]) == {"VELOX_QUANT_KEEP": "0.125x", "VELOX_X": "a=b"}
    for bad in ("VELOX_QUANT_KEEP", "QUANT_KEEP=1"):
        with pytest.raises(SystemExit, match=f"--set '{bad}'"):
            env_settings(["VELOX_WINDOW=8", bad])
