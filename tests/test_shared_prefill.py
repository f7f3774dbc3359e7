"""The eval's shared prefills are exact: every method at two budgets, and the full cache, decode the same tokens
into the same final cache as a fresh list through mlx_lm's generate_step on the whole prompt; a method whose
prefill cannot be shared is caught by the check, not measured wrongly. Also knob variants and intervals."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from click.testing import CliRunner

from veloxpatch.caches import make_cache
from veloxpatch.caches.evicting import Policy
from veloxpatch.cli import main
from veloxpatch.config import from_env
from veloxpatch.eval import harness, sharing, tasks
from veloxpatch.eval.report import accuracy_text, wilson
from veloxpatch.eval.variants import Variant, parse_spec, split_specs
from veloxpatch.methods.snapkv import SnapKVCache
from veloxpatch.registry import METHODS, method

STEP = 100  # the prompt's tokens before the last go in as chunks of 100, 100 and over 64: all prefill-sized
BUDGETS = (48, 96)
DECODE = 10


@pytest.fixture(scope="module")
def loaded(model_dir: Path) -> tuple[Any, mx.array]:
    """The tests' tiny random model (byte tokens) and a passkey prompt of about 290 tokens."""
    from mlx_lm import load

    model, tokenizer = load(str(model_dir))
    prompt, _ = tasks.passkey_example(tokenizer, 294, 3, "heldout")
    tokens = mx.array(tokenizer.encode(prompt))
    assert (tokens.size - 1) % STEP > 64, "all chunks longer than the decode headroom"
    return model, tokens


def plain(model: Any, tokens: mx.array, variant: Variant, budget: int, step: int) -> tuple[list[int], list[Any]]:
    """A fresh cache list through mlx_lm's generate_step on the whole prompt (the eval's old path)."""
    from mlx_lm.generate import generate_step

    caches = variant.caches(model, tokens.size, budget=budget)
    out = [t for t, _ in generate_step(tokens, model, max_tokens=DECODE, prompt_cache=caches, prefill_step_size=step)]
    return out, caches


def check_exact(model: Any, tokens: mx.array, variant: Variant, budgets: tuple[int, ...], step: int = STEP) -> str:
    """The harness's path for ``variant`` (the mode the rule and the check give it) equals the plain path."""
    mode = sharing.modes(model, [variant])[variant]
    if mode == sharing.PLAIN:
        return mode
    got = list(sharing.run(model, tokens, [sharing.Request(variant, b, mode) for b in budgets], DECODE, step))
    assert [g.request.budget for g in sorted(got, key=lambda g: g.request.budget)] == sorted(budgets)
    for result in got:
        expected, caches = plain(model, tokens, variant, result.request.budget, step)
        assert result.tokens == expected, (variant, result.request.budget)
        assert result.kv_bytes == sum(c.nbytes for c in caches), "final KV bytes"
        if variant.method != "full":
            assert all(sharing._state_equal(a.state, b.state) for a, b in zip(result.caches, caches)), "final KV"
        if step == STEP:
            assert result.shared, "every chunk is prefill-sized: the prefill really was shared"
    return mode


@pytest.mark.parametrize("name", sorted(METHODS))
def test_every_method_decodes_the_same_from_a_shared_prefill(loaded: tuple[Any, mx.array], name: str) -> None:
    model, tokens = loaded
    mode = check_exact(model, tokens, Variant(name, 0.25), BUDGETS)
    assert mode in (sharing.SHARED, sharing.OWN, sharing.PLAIN)
    if name in ("snapkv", "streamingllm"):
        assert mode == sharing.SHARED, "no prefill state of their own: they take over the source's prefill"


def test_the_full_cache_is_the_source_prefill_never_evicting(loaded: tuple[Any, mx.array]) -> None:
    model, tokens = loaded
    assert check_exact(model, tokens, Variant("full"), (sharing.HUGE,)) == sharing.SHARED
    assert check_exact(model, tokens, Variant.of("snapkv[kernel=15]", 0.25), BUDGETS) == sharing.SHARED


def test_a_short_last_chunk_runs_plain_and_stays_exact(loaded: tuple[Any, mx.array]) -> None:
    """Two long chunks and one of 1 or 2 tokens: that one is decode-sized, so a plain run compresses mid-prompt."""
    model, tokens = loaded
    step = (tokens.size - 2) // 2
    check_exact(model, tokens, Variant("snapkv", 0.25), BUDGETS, step=step)
    got = list(sharing.run(model, tokens, [sharing.Request(Variant("snapkv"), 48, sharing.SHARED)], DECODE, step))
    assert not got[0].shared


@pytest.fixture
def hidden_state_methods() -> Iterator[None]:
    """Two methods the declared rule calls shareable though their prompt leaves state the base does not hold."""

    class ByHiddenState(Policy):
        """Recency, or its reverse, as the cache's hidden state says."""

        def score(self, cache, keys: mx.array, positions: mx.array, scale: float) -> mx.array:
            return positions.astype(mx.float32) * (1 if cache.newest_first() else -1)

    @method("hidden", "test: counts its forwards in target()")
    class Hidden(SnapKVCache):
        policy_class = ByHiddenState
        seen = 0

        def target(self) -> int:
            self.seen += 1
            return super().target()

        def newest_first(self) -> bool:
            return self.seen > 1  # a prompt chunk came first

    @method("budgetmemo", "test: remembers the budget its prompt's first chunk saw")
    class BudgetMemo(SnapKVCache):
        policy_class = ByHiddenState
        seen: tuple[int, ...] = ()

        def target(self) -> int:
            self.seen += (self.budget.resolve(self.offset),)
            return super().target()

        def newest_first(self) -> bool:
            return self.seen[0] < 1000 and len(self.seen) > 1

    yield
    for name in ("hidden", "budgetmemo"):
        METHODS.remove(name)


def test_a_method_the_rule_misjudges_is_caught(loaded: tuple[Any, mx.array], hidden_state_methods: None,
                                               monkeypatch) -> None:
    model, tokens = loaded
    for name in ("hidden", "budgetmemo"):  # said to leave what SnapKV's prompt leaves, which they do not
        monkeypatch.setitem(sharing.PROMPT_STATE, name, "window")
    assert sharing.candidate(Variant("hidden")) == sharing.SHARED == sharing.candidate(Variant("budgetmemo"))
    assert check_exact(model, tokens, Variant("hidden", 0.25), BUDGETS) == sharing.OWN, "state travels in a copy"
    assert check_exact(model, tokens, Variant("budgetmemo", 0.25), BUDGETS) == sharing.PLAIN, "state needs its budget"


def test_what_a_prompt_leaves_sends_each_method_to_its_prefill() -> None:
    """The eval knows what reading a prompt leaves in a method's caches (``sharing.PROMPT_STATE``): only methods
    whose prompt leaves its rows, and at most the window of queries, share a prefill; state of their own
    (accumulated attention, reports, folds, the newest query alone), or a method it does not know, means a prefill of
    their own."""
    shared = {name for name in METHODS if sharing.candidate(Variant(name)) == sharing.SHARED}
    assert shared == {"chunkkv", "pyramidkv", "snapkv", "streamingllm"}
    assert {name for name in METHODS if sharing.candidate(Variant(name)) == sharing.OWN} == set(METHODS) - shared
    assert sharing.candidate(Variant("rotating", 0.5)) == sharing.PLAIN == sharing.candidate(Variant("quantized", 0.5))
    assert sharing.PROMPT_STATE[sharing.SOURCE] == "window", "the source leaves what every shareable method takes"


# ----------------------------------------------------------------------------- knobs
def test_knob_variants_parse_label_and_reach_the_caches(loaded: tuple[Any, mx.array]) -> None:
    assert split_specs("snapkv, snapkv[kernel=15,pool=max],streamingllm") == [
        "snapkv", "snapkv[kernel=15,pool=max]", "streamingllm"]
    assert parse_spec("snapkv[pool=max, kernel=15]") == ("snapkv", (("kernel", 15), ("pool", "max")))
    variant = Variant.of("snapkv[kernel=15]", 0.25)
    assert variant.label() == "snapkv[kernel=15]@0.25" and Variant.of("snapkv", 0.25).label() == "snapkv@0.25"
    assert Variant.of("snapkv", 0.25) == Variant("snapkv", 0.25), "old labels and variants unchanged"
    model, _ = loaded
    caches = variant.caches(model, 1000)
    assert {c.policy.kernel for c in caches} == {15} and {str(c.budget) for c in caches} == {"250"}
    for bad, why in (("snapkv[kernal=15]", "kernel"), ("snapkv[kernel=8]", "odd"), ("rotating[keep=4]", "knobs")):
        with pytest.raises(ValueError, match=why):
            parse_spec(bad)


def test_a_variant_sets_its_tier_and_when_it_compresses(loaded: tuple[Any, mx.array]) -> None:
    model, _ = loaded
    variant = Variant.of("snapkv[tier=4,compress=chunk]", 0.25)
    assert variant.label() == "snapkv[compress=chunk,tier=4]@0.25"
    caches = variant.caches(model, 1000)
    assert {(c.tier.bits, c.schedule.mode) for c in caches} == {(4, "chunk")}
    assert {c.tier for c in Variant.of("snapkv", 0.25).caches(model, 1000)} == {None}
    assert "tier" not in Variant.of("snapkv", 0.25).knob_values(), "journals written before it stay valid"
    with pytest.raises(ValueError, match="VELOX_TIER"):
        parse_spec("snapkv[tier=5]")


def test_a_variant_sets_the_window_of_any_method_and_counts_it_only_where_given(loaded: tuple[Any, mx.array]) -> None:
    model, _ = loaded
    variant = Variant.of("xquant[window=1]", 0.25)
    assert variant.label() == "xquant[window=1]@0.25" and variant.knob_values()["window"] == 1
    assert "window" not in Variant.of("xquant", 0.25).knob_values(), "journals written before it stay valid"
    assert {c.window for c in variant.caches(model, 1000)} == {1}
    assert {c.window for c in Variant.of("snapkv[window=8,kernel=15]", 0.25).caches(model, 1000)} == {8}
    with pytest.raises(ValueError, match="VELOX_WINDOW"):
        parse_spec("xquant[window=0]")


def test_methods_built_on_snapkv_take_its_knobs(loaded: tuple[Any, mx.array]) -> None:
    """pyramidkv is SnapKV with other budgets, squeeze's snapkv policy is SnapKV's class: the kernel reaches
    both, from a variant and from the environment; under another policy it is refused, naming what is."""
    model, _ = loaded
    for spec in ("pyramidkv[kernel=5]", "squeeze[kernel=5]"):
        assert {c.policy.kernel for c in Variant.of(spec, 0.25).caches(model, 1000)} == {5}, spec
    config = from_env({"VELOX_KV": "pyramidkv", "VELOX_SNAPKV_KERNEL": "9"}).config
    assert make_cache(config).policy.kernel == 9
    assert Variant.of("squeeze[policy=h2o]", 0.25).knob_values() == {"policy": "h2o", "signal": "cosine",
                                                                      "strength": 0.5}
    with pytest.raises(ValueError, match=r"kernel is not a knob of squeeze here "
                                         r"\(compress, policy, signal, strength, tier, tier_size, window\)"):
        parse_spec("squeeze[policy=h2o,kernel=31]")


def test_a_journal_line_counts_for_the_same_knobs_under_any_spelling(tmp_path: Path) -> None:
    """A line names its knob values: ``snapkv[kernel=31]`` measured counts for ``snapkv`` while 31 is the
    default, a line measured under another default (or before knobs were kept) counts for nothing."""
    journal = harness.Journal(tmp_path / "eval.cells.jsonl", {"model": "m"})
    sample = harness.Sample(1.0, 10, 20)
    journal.add_sample("niah_single", 2048, Variant.of("snapkv[kernel=31]", 0.25), 0, sample)
    journal.add_sample("niah_single", 2048, Variant.of("snapkv[kernel=7]", 0.25), 1, sample)
    with journal.samples_path.open("a") as handle:
        handle.write(json.dumps({"task": "niah_single", "context": 2048, "label": "snapkv@0.25", "seed": 2,
                                 "value": 1.0, "kv_bytes": 10, "peak_bytes": 20, "key": {"model": "m"}}) + "\n")
    plain = Variant.of("snapkv", 0.25).identity()
    assert {seed for (_, _, ident, seed) in journal.samples() if ident == plain} == {0}


def test_a_journal_line_written_before_its_method_gained_a_knob_counts_at_that_knobs_default(tmp_path: Path) -> None:
    """``quant[bits=3]`` measured before ``VELOX_QUANT_KEEP`` existed (its line names bits and group only) counts for
    ``quant[bits=3]`` now (keep at its default, 100%: what it did then), not for ``quant[bits=3,keep=30%]``."""
    journal = harness.Journal(tmp_path / "eval.cells.jsonl", {"model": "m"})
    with journal.samples_path.open("a") as handle:
        handle.write(json.dumps({"task": "niah_single", "context": 2048, "label": "quant[bits=3]@0.25", "seed": 0,
                                 "knobs": {"bits": 3, "group": 64}, "value": 1.0, "kv_bytes": 10,
                                 "peak_bytes": 20, "key": {"model": "m"}}) + "\n")
    found = {ident for (_, _, ident, _) in journal.samples()}
    assert found == {Variant.of("quant[bits=3]", 0.25).identity()}
    assert Variant.of("quant[bits=3,keep=30%]", 0.25).identity() not in found


def test_cells_keep_old_journal_lines_and_add_knobs_and_intervals() -> None:
    old = {"task": "passkey", "context": 1024, "method": "snapkv", "share": 0.25, "label": "snapkv@0.25",
           "metric": "accuracy", "value": 0.8, "kv_bytes": 1.0, "peak_bytes": 2.0, "samples": 10}
    cell = harness.Cell.from_row(old)
    assert cell.variant == Variant("snapkv", 0.25) and cell.row()["label"] == "snapkv@0.25"
    assert (round(cell.row()["ci95_low"], 2), round(cell.row()["ci95_high"], 2)) == (0.49, 0.94)
    knobbed = harness.Cell.from_row({**old, "method": "snapkv[kernel=15]", "label": "snapkv[kernel=15]@0.25"})
    assert knobbed.variant == Variant("snapkv", 0.25, (("kernel", 15),))
    assert knobbed.row()["method"] == "snapkv[kernel=15]" and knobbed.row()["label"] == "snapkv[kernel=15]@0.25"


def test_wilson_intervals() -> None:
    assert tuple(round(x, 3) for x in wilson(8, 10)) == (0.490, 0.943)
    low, high = wilson(0, 10)
    assert low == 0 and round(high, 3) == 0.278
    assert wilson(10, 10)[1] == 1 and round(wilson(10, 10)[0], 3) == 0.722
    assert accuracy_text(0.8, 10) == "0.80 [0.49, 0.94] n=10"
    assert accuracy_text(2 / 3, 3) == "0.67 [0.21, 0.94] n=3"


# ----------------------------------------------------------------------------- the eval end to end
def test_eval_shares_prefills_with_the_same_results_and_resumes_inside_a_cell(model_dir: Path, tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    args = ["eval", "--model", str(model_dir), "--tasks", "passkey", "--contexts", "160", "--samples", "2",
            "--budgets", "100%,50%,25%", "--methods", "snapkv,snapkv[kernel=3],streamingllm,rotating", "--no-plots"]
    shared = CliRunner().invoke(main, args + ["--out", str(tmp_path / "shared")])
    assert shared.exit_code == 0, shared.output
    assert "snapkv[kernel=3]@0.25" in shared.output and "] n=2" in shared.output
    alone = CliRunner().invoke(main, args + ["--out", str(tmp_path / "alone"), "--no-share-prefill"])
    assert alone.exit_code == 0, alone.output

    def rows(name: str) -> list[dict]:
        return json.loads((tmp_path / name / "eval.json").read_text())["rows"]

    keep = ("label", "value", "kv_bytes", "samples", "ci95_low", "ci95_high")
    assert [{k: r[k] for k in keep} for r in rows("shared")] == [{k: r[k] for k in keep} for r in rows("alone")]
    samples = (tmp_path / "shared" / "eval.samples.jsonl").read_text().splitlines()
    assert len(samples) == 2 * 9, "one line per (example, variant)"

    (tmp_path / "shared" / "eval.cells.jsonl").unlink()  # killed after its examples, before its cells

    def must_not_run(*_: Any) -> None:
        raise AssertionError("a finished example was measured again")

    monkeypatch.setattr(harness, "measure", must_not_run)
    again = CliRunner().invoke(main, args + ["--out", str(tmp_path / "shared")])
    assert again.exit_code == 0, again.output
    assert [{k: r[k] for k in keep} for r in rows("shared")] == [{k: r[k] for k in keep} for r in rows("alone")]
    fewer = [a if a != "2" else "1" for a in args]  # a run stopped after its first example, reported as such
    once = CliRunner().invoke(main, fewer + ["--out", str(tmp_path / "shared")])
    assert once.exit_code == 0 and "] n=1" in once.output, once.output


@pytest.mark.parametrize("name", sorted(n for n, m in METHODS.items() if not m.cls.uses_budget))
def test_a_method_said_to_ignore_its_budget_does(loaded: tuple[Any, mx.array], name: str) -> None:
    """What lets the eval measure it once for every share: the same tokens and rows at two budgets."""
    model, tokens = loaded
    (first, a), (second, b) = (plain(model, tokens, Variant(name, 0.5), budget, STEP) for budget in BUDGETS)
    assert first == second
    assert all(sharing._state_equal(x.state[:-1], y.state[:-1]) for x, y in zip(a, b)), "rows (meta names the budget)"


def test_eval_measures_a_budget_free_method_once_per_example(model_dir: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    measured: list[str] = []
    each = harness.retrievals

    def counting(*args: Any) -> Any:
        measured.extend(v.label() for v in args[2])
        return each(*args)

    monkeypatch.setattr(harness, "retrievals", counting)
    result = CliRunner().invoke(main, ["eval", "--model", str(model_dir), "--tasks", "passkey", "--contexts", "160",
                                       "--samples", "2", "--budgets", "100%,50%,25%", "--methods", "xquant,snapkv",
                                       "--no-plots", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert sorted(measured) == sorted(["full", "xquant@0.5", "snapkv@0.5", "snapkv@0.25"] * 2)
    rows = {r["label"]: r for r in json.loads((tmp_path / "eval.json").read_text())["rows"]}
    assert {k: v for k, v in rows["xquant@0.25"].items() if k not in ("label", "share")} == \
        {k: v for k, v in rows["xquant@0.5"].items() if k not in ("label", "share")}


def test_bad_knobs_are_refused_on_the_command_line(model_dir: Path) -> None:
    result = CliRunner().invoke(main, ["eval", "--model", str(model_dir), "--methods", "snapkv[kernal=3]"])
    assert result.exit_code == 2 and "kernel" in result.output and "pool" in result.output


def test_a_variant_alone_in_its_group_runs_plain(loaded: tuple[Any, mx.array]) -> None:
    model, _ = loaded
    found = sharing.plan(model, [Variant("full"), Variant("rotating", 0.5), Variant("h2o", 0.5)]
                         if "h2o" in METHODS else [Variant("full"), Variant("rotating", 0.5)])
    assert set(found.values()) == {sharing.PLAIN}, "nothing to share a prefill with"
    found = sharing.plan(model, [Variant("full"), Variant("snapkv", 0.5), Variant("rotating", 0.5)])
    assert found == {Variant("full"): sharing.SHARED, Variant("snapkv", 0.5): sharing.SHARED,
                     Variant("rotating", 0.5): sharing.PLAIN}


def test_a_runs_peak_leaves_out_what_earlier_runs_left_in_cycles() -> None:
    """A cache list and its coordinator refer to each other: dropped, only the collector frees them. Left, an earlier
    variant's caches counted in the next variant's peak (1.2 to 3.2 MB per example on the shipped model)."""
    before = mx.get_active_memory()
    left: dict[str, Any] = {"rows": mx.zeros((16, 1024, 1024))}  # 64 MiB
    mx.eval(left["rows"])
    left["self"] = left
    del left
    sharing.fresh_reading()
    mx.eval(mx.ones((1024,)))  # the run's first allocation: the peak counts what is held then
    assert mx.get_peak_memory() < before + 32 * 2**20


def test_a_journal_line_counts_for_the_block_size_auto_decides(tmp_path: Path) -> None:
    """``VELOX_QUANT_GROUP=auto`` is 64 keeping every row and 32 under a share of the bytes: lines measured with those
    sizes named count for the default, a share of the bytes measured in blocks of 64 does not."""
    journal = harness.Journal(tmp_path / "eval.cells.jsonl", {"model": "m"})
    with journal.samples_path.open("a") as handle:
        for seed, knobs in enumerate([{"bits": 4, "group": 64}, {"group": 32, "keep": "0.125x"},
                                      {"group": 64, "keep": "0.125x"}]):
            label = "quant@0.25" if seed == 0 else "quant[keep=0.125x]@0.25"
            handle.write(json.dumps({"task": "niah_single", "context": 2048, "label": label, "seed": seed,
                                     "knobs": knobs, "value": 1.0, "kv_bytes": 10, "peak_bytes": 20,
                                     "key": {"model": "m"}}) + "\n")
    seeds = {ident: seed for (_, _, ident, seed) in journal.samples()}
    assert seeds.get(Variant.of("quant", 0.25).identity()) == 0
    assert seeds.get(Variant.of("quant[keep=0.125x]", 0.25).identity()) == 1
    assert seeds.get(Variant.of("quant[keep=0.125x,group=64]", 0.25).identity()) == 2
