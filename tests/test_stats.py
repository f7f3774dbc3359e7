"""The VELOX_STATS line says what the caches hold: rows kept against tokens seen, in which form (exact, folded,
quantized), whether the budget applies, and the bytes against a dense cache's (xquant's own line is in
test_xquant.py)."""

from __future__ import annotations

import pytest
from mlx_lm.models.cache import make_prompt_cache

import veloxpatch
from conftest import greedy, random_tokens, tiny
from veloxpatch import stats
from veloxpatch.eval.random_model import build, config_for


@pytest.fixture(autouse=True)
def fresh_totals(monkeypatch) -> None:
    monkeypatch.setattr(stats, "totals", stats._Totals())


def test_an_evicting_method_says_its_compressions_and_the_exact_rows_it_keeps() -> None:
    model = tiny("llama", layers=4)
    veloxpatch.patch(kv="snapkv", budget=64, window=8)
    caches = make_prompt_cache(model)
    greedy(model, random_tokens(300, 1), caches, steps=3, chunk=100)
    kept, seen = sum(c.size() for c in caches), sum(c.offset for c in caches)
    line = stats.summary("snapkv", caches=caches)
    assert f"4 layer cache(s) built, {stats.totals.compressions} compression(s) | " in line, line
    assert stats.totals.compressions and "fold(s)" not in line and "does not apply" not in line
    assert f"live: {kept}/{seen} rows kept ({100 * kept / seen:.1f}%) | KV " in line, line


def test_rows_quantized_by_kv_bits_are_said_so() -> None:
    model = build(config_for("llama", hidden_size=128, num_hidden_layers=2), 0)  # head_dim 32: quantizable
    veloxpatch.patch(kv="snapkv", budget=64, window=8)
    caches = [c.to_quantized(group_size=32, bits=8) for c in make_prompt_cache(model)]
    greedy(model, random_tokens(200, 2), caches, steps=2, chunk=100)
    kept = sum(c.size() for c in caches)
    assert f"rows kept ({100 * kept / sum(c.offset for c in caches):.1f}%): {kept} at 8 bits (kv_bits), 0 exact | " \
        in stats.summary("snapkv", caches=caches)


@pytest.mark.parametrize("method, form", [("xkv", "as low-rank factors (a token basis per group of 4 layers)"),
                                          ("minicache", "merged across a pair of layers (their most dissimilar "
                                                        "tokens exact)")])
def test_a_cross_layer_method_says_its_folds_and_the_rows_it_folded(method: str, form: str) -> None:
    model = tiny("llama", layers=4)
    veloxpatch.patch(kv=method, budget=64, window=8)
    caches = make_prompt_cache(model)
    greedy(model, random_tokens(300, 3), caches, steps=3, chunk=100)
    folded = sum(c.folded_rows() for c in caches)
    seen = sum(c.offset for c in caches)
    line = stats.summary(method, caches=caches)
    assert folded and f"built, {stats.totals.folds} fold(s) | live: {seen}/{seen} rows kept (100.0%" in line, line
    assert f"{folded} {form}, {seen - folded} exact | KV" in line, line
    assert ("VELOX_BUDGET does not apply" in line) == (method == "minicache"), line


@pytest.mark.parametrize("method", ["snapkv", "xkv"])
def test_the_probe_counts_nothing_and_restores_nothing(monkeypatch, method: str) -> None:
    """Only the caches the builder hands to the app count: the probe's caches, their compressions and folds never
    touch the totals, not even while the probe runs (issue 35: it saved and restored them)."""
    writes: list[str] = []

    class Watched(stats._Totals):
        def __setattr__(self, name: str, value: int) -> None:
            writes.append(name)
            super().__setattr__(name, value)

    monkeypatch.setattr(stats, "totals", Watched())
    writes.clear()  # the dataclass's own __init__
    veloxpatch.patch(kv=method, budget=64, window=8)
    model = tiny("llama", layers=4)
    caches = make_prompt_cache(model)  # probed: a fresh model (the probe evicts at a budget of 2)
    assert writes == ["caches_built"] * 4 and vars(stats.totals) == vars(stats._Totals(caches_built=4))
    greedy(model, random_tokens(300, 1), caches, steps=1, chunk=100)
    assert stats.totals.compressions + stats.totals.folds > 0, "the app's caches count"


def test_rows_summed_over_ranks_are_said_without_words_this_rank_does_not_know() -> None:
    # generations, built, compressions, folds, seen, kept, other, bytes, dense: as ranks.summed gives them
    line = stats.summary("xquant", [1, 8, 0, 8, 2000, 2000, 1800, 2**20, 4 * 2**20], who=" (all 2 ranks)", caches=[])
    assert line == ("veloxpatch (all 2 ranks): xquant | 1 generation(s), 8 layer cache(s) built, 8 fold(s) | live: "
                    "2000/2000 rows kept (100.0%): 1800 folded or quantized, 200 exact | KV 1.00 MiB vs 4.00 MiB "
                    "dense (25.0%)")
