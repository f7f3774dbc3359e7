"""Compressed caches under mlx.distributed: two ranks on loopback (``mlx.launch --backend ring``), a
tiny random llama split by heads (tensor parallel) and a tiny random ministral3 split by layers
(pipeline parallel: llama has no ``pipeline`` in mlx_lm; ministral3 is a llama-style model that has).

Every registered method, coordinator and cross-layer ones included, under both splits: at a budget
above the context the tokens equal the unpatched split run and the model run whole in one process;
at a small budget every rank's caches hold at most budget + headroom rows (cross-layer ones fold
instead) and the ranks agree on the tokens; with a 4-bit tier (VELOX_TIER) the evicting ones keep every
dropped row in it. Settings that differ between ranks are an error on every rank before any generation.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from conftest import EVICTING, run_group
from serving import free_port
from test_launcher import LAUNCHER, MLX_LAUNCH
from veloxpatch.eval import zoo
from veloxpatch.eval.random_model import build, write_byte_tokenizer, write_model_dir
from veloxpatch.registry import METHODS

WORKER = Path(__file__).with_name("ranks_worker.py")


def launch(*args: str, timeout: int = 240) -> dict[Any, Any]:
    """Run the worker on two ranks; each rank's result, by rank (and the whole output under "output")."""
    out = Path(tempfile.mkdtemp(prefix="ranks-"))
    _, output = run_group([MLX_LAUNCH, "-n", "2", "--backend", "ring", "--starting-port", str(free_port(2)),
                           "--python", sys.executable, str(WORKER), *args, str(out)], timeout)
    results = [json.loads(path.read_text()) for path in sorted(out.glob("rank*.json"))]
    shutil.rmtree(out)
    assert len(results) == 2, f"expected a result from each rank:\n{output[-3000:]}"
    return {**{r["rank"]: r for r in results}, "output": output}


def pipeline_dir(path: Path) -> Path:
    """A ministral3 folder ``sharded_load`` can pipeline (it reads the weight index to pick files)."""
    path.mkdir(parents=True)
    vocab = write_byte_tokenizer(path)
    config = zoo.small_config("ministral3")
    for part in (config, config["text_config"]):
        part.update(vocab_size=vocab, num_hidden_layers=4)
    (path / "config.json").write_text(json.dumps(config))
    weights = dict(tree_flatten(build(config).parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": dict.fromkeys(weights,
                                                                                             "model.safetensors")}))
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict[int, dict]]:
    root = tmp_path_factory.mktemp("ranks")
    llama = write_model_dir(root / "llama", num_hidden_layers=4)
    return {"tensor": launch("tp", str(llama), "methods"),
            "pipeline": launch("pp", str(pipeline_dir(root / "ministral3")), "methods")}


@pytest.mark.parametrize("split", ["tensor", "pipeline"])
def test_the_split_runs_equal_the_whole_model_unpatched(runs, split: str) -> None:
    for rank in (runs[split][0], runs[split][1]):
        assert rank["size"] == 2 and rank["plain_agree"]
        assert rank["plain"] == rank["single"], f"{split} rank {rank['rank']}: the split model differs from one process"


@pytest.mark.parametrize("split", ["tensor", "pipeline"])
@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_on_every_rank(runs, split: str, method: str) -> None:
    for rank in (runs[split][0], runs[split][1]):
        got = rank["methods"][method]
        case = f"{method}, {split} parallel, rank {rank['rank']}"
        assert got["exact"] == rank["plain"], f"{case}: tokens differ at a budget above the context"
        assert got["ours"] >= 2, f"{case}: not compressed ({got})"
        assert got["agree"], f"{case}: the ranks generated different tokens"
        if got["cross_layer"]:
            assert got["folded"] and got["sizes"] == got["offsets"], f"{case}: {got}"
        else:
            assert got["evicted"] and max(got["sizes"]) <= 16, f"{case}: rows exceed budget + headroom: {got}"


@pytest.mark.parametrize("split", ["tensor", "pipeline"])
def test_every_evicting_method_with_a_tier_on_every_rank(runs, split: str) -> None:
    """VELOX_TIER=4 at the small budget: the rows each rank's caches drop go to its tier (store and tier together
    hold every token once), the store stays within budget + headroom, and the ranks agree on the tokens and, for
    TOVA's whole-layer choice, on the rows kept and tiered."""
    for method in EVICTING:
        for rank in (runs[split][0], runs[split][1]):
            got, case = rank["tier"][method], f"{method} with a tier, {split} parallel, rank {rank['rank']}"
            assert got["agree"] and got["evicted"] and max(got["sizes"]) <= 16, f"{case}: {got}"
            assert len(got["tier_rows"]) == got["ours"] >= 2 and min(got["tier_rows"]) > 0, f"{case}: {got}"
            assert [s + t for s, t in zip(got["sizes"], got["tier_rows"])] == got["offsets"], f"{case}: rows lost"
    if split == "tensor":
        tova = [runs[split][rank]["tier"]["tova"] for rank in (0, 1)]
        assert tova[0]["kept"] == tova[1]["kept"] and tova[0]["tier_kept"] == tova[1]["tier_kept"], tova


def test_tovas_choice_for_a_whole_layer_is_the_same_on_every_rank(runs) -> None:
    """TOVA keeps one set of positions per layer, from the mean over all its heads: split by heads, the ranks
    average their means (one all-sum per compression) and keep the same positions."""
    kept = [runs["tensor"][rank]["methods"]["tova"]["kept"] for rank in (0, 1)]
    assert kept[0] == kept[1] and len(kept[0]) <= 16, kept


def test_different_settings_on_two_ranks_are_an_error_on_both(tmp_path) -> None:
    ranks = launch("tp", str(write_model_dir(tmp_path / "llama", num_hidden_layers=2)), "mismatch")
    for rank, result in ((0, ranks[0]), (1, ranks[1])):
        assert result["error"] is not None, f"rank {rank} built caches with settings another rank does not share"
        assert "VELOX_BUDGET=" + str(64 + 64 * rank) in result["error"]


def test_every_rank_prints_its_stats_line_and_rank_0_the_sum(tmp_path) -> None:
    output = launch("pp", str(pipeline_dir(tmp_path / "ministral3")), "stats")["output"]
    lines = {line.split(":")[0]: line for line in output.splitlines() if line.startswith("veloxpatch (")}
    assert set(lines) == {"veloxpatch (rank 0 of 2)", "veloxpatch (rank 1 of 2)", "veloxpatch (all 2 ranks)"}, output
    assert "2 layer cache(s) built" in lines["veloxpatch (rank 1 of 2)"]  # its own stage's layers
    assert "4 layer cache(s) built" in lines["veloxpatch (all 2 ranks)"]


def test_mlx_lms_own_distributed_benchmark_runs_compressed_on_every_rank(tmp_path) -> None:
    """The real app, launched the way a user launches it: ``veloxpatch run ... mlx.launch ... -m mlx_lm
    benchmark --pipeline`` (which loads with ``sharded_load``), SqueezeAttention's reports pooled across the
    stages. (Tensor parallelism runs every method through the worker above.)"""
    folder = pipeline_dir(tmp_path / "ministral3")
    command = [LAUNCHER, "run", "--kv", "squeeze", "--budget", "48", "--window", "8", "--stats",
               MLX_LAUNCH, "-n", "2", "--backend", "ring", "--starting-port", str(free_port(2)),
               "--python", sys.executable, "--", "-m", "mlx_lm", "benchmark", "--model", str(folder),
               "--prompt-tokens", "200", "--generation-tokens", "8", "--num-trials", "1", "--prefill-step-size", "64",
               "--pipeline"]
    code, output = run_group(command, timeout=180)
    assert code == 0 and "Averages:" in output, output[-3000:]
    lines = [line for line in output.splitlines() if line.startswith("veloxpatch (rank")]
    assert len(lines) == 2 and all("squeeze |" in line and " 0 compression(s)" not in line for line in lines), output


def test_a_list_spanning_part_of_the_model_counts_depth_over_the_whole_model() -> None:
    """Two layers of a four-layer model (a pipeline stage) get the budgets and pairs that layers 2
    and 3 get in one process: PyramidKV's pyramid and MiniCache's starting depth."""
    from veloxpatch.caches import make_cache
    from veloxpatch.config import VeloxConfig
    from veloxpatch.coordinators import Span
    from veloxpatch.eligibility import assemble

    def layers(kv: str, count: int, span: Span = Span()) -> list:
        config = VeloxConfig(kv=kv, budget=48, sink=2, window=4)
        caches = assemble([type("Slot", (), {})() for _ in range(count)], range(count),
                          lambda: make_cache(config), kv, span)
        for cache in caches:
            cache.offset = 100
        return caches

    whole, stage = layers("pyramidkv", 4), layers("pyramidkv", 2, Span(2, 4, True))
    assert [c.target() for c in stage] == [c.target() for c in whole[2:]]
    assert stage[0].target() != whole[0].target()
    whole, stage = layers("minicache", 4), layers("minicache", 2, Span(2, 4, True))
    assert [c.group() for c in whole] == [(0,), (1,), (2, 3), (2, 3)]
    assert [c.group() for c in stage] == [(0, 1), (0, 1)]
    assert [c.group() for c in layers("minicache", 2, Span(1, 4, True))] == [(0,), (1,)]  # partner on another rank
