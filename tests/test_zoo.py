"""Every model type mlx_lm ships: served exactly, or left alone with one INFO line saying why.

For each type, built tiny with random weights (``veloxpatch.eval.zoo``), and each method: greedy
tokens at a budget above the context equal unpatched mlx_lm's, and a budget far below the prompt
really evicts and raises nothing, compressing between prefill chunks or at the prompt's end. A
40-token prompt in 16-token prefill chunks makes chunked prefill (and compression between chunks)
happen. The small budget runs each method in one compress mode per type, and each evicting one with or without a
4-bit tier (VELOX_TIER, which then holds every row the store dropped), alternating over methods and types, so every
(method, mode, tier) meets a quarter of the zoo at a quarter of the time.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import mlx.core as mx
import pytest
from click.testing import CliRunner
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

import veloxpatch
import veloxpatch.log
from conftest import EVICTING, random_tokens
from veloxpatch import builder, eligibility, structure
from veloxpatch.caches import CacheSpec, CompressedKVCache
from veloxpatch.caches.crosslayer import CrossLayerCache
from veloxpatch.cli import main
from veloxpatch.config import COMPRESS_MODES, VeloxConfig
from veloxpatch.eligibility import assemble
from veloxpatch.eval import zoo
from veloxpatch.eval.random_model import build
from veloxpatch.integration import layer_io
from veloxpatch.registry import METHODS, cache_class

# model types whose forward cannot run a prefix of their layers, so the probe runs all of them
PROBED_WHOLE = {"kimi_k3": "its forward walks range(self.num_layers), not its layer list"}
SMALL_BUDGET = dict(budget=8, sink=2, window=4)
# zoo models have two layers: pair them both; a 44-token run quantizes one block of 32
SMALL_KNOBS = {"minicache": {"minicache_start": 0.0}, "quant": {"quant_group": 32}}


def greedy(model, caches, steps: int = 4) -> list[int]:
    prompt = random_tokens(40, 3)
    return [t for t, _ in generate_step(prompt, model, max_tokens=steps, prefill_step_size=16, prompt_cache=caches)]


@pytest.fixture
def info_lines(monkeypatch):
    """veloxpatch's INFO messages from this test (messages said once before are said again)."""
    monkeypatch.setattr(veloxpatch.log, "_said", set())
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("veloxpatch")
    logger.addHandler(handler)
    yield lines
    logger.removeHandler(handler)


@pytest.mark.parametrize("model_type", zoo.model_types())
def test_every_model_type_runs_exactly_compressed_or_unpatched(model_type: str, info_lines: list[str]) -> None:
    reason = zoo.unbuildable(model_type)
    if reason:
        pytest.skip(reason)
    model = build(zoo.small_config(model_type))
    expected = greedy(model, make_prompt_cache(model))
    offset = zoo.model_types().index(model_type)
    for i, method in enumerate(sorted(METHODS)):
        compress = COMPRESS_MODES[(i + offset) % len(COMPRESS_MODES)]
        tier = ("off", "4")[(i + offset) // len(COMPRESS_MODES) % 2]
        case = f"{method}, compressing at {compress}, tier {tier}"
        veloxpatch.patch(kv=method, compress=compress, budget=4096, log="INFO")
        caches = make_prompt_cache(model)
        assert greedy(model, caches) == expected, f"{case}: tokens differ at a budget above the context"
        if not any(isinstance(c, CompressedKVCache) for c in caches):
            said = [line for line in info_lines if line.startswith((f"{model_type} with {method}: ", f"{model_type}: "))
                    and line.endswith("running unpatched")]
            assert len(said) == 1, f"{case}: left unpatched without one INFO line naming {model_type}: {info_lines}"
            continue
        veloxpatch.patch(kv=method, compress=compress, log="INFO", knobs=SMALL_KNOBS.get(method, {}),
                         tier=tier if method in EVICTING else "off", tier_size="all", **SMALL_BUDGET)
        caches = make_prompt_cache(model)
        greedy(model, caches)
        ours = [c for c in caches if isinstance(c, CompressedKVCache)]
        if isinstance(ours[0], CrossLayerCache):
            assert any(c.folds for c in ours) or len(ours) == 1, f"{case}: nothing was folded"  # (1: no pair)
            assert all(c.size() == c.offset for c in ours), f"{case}: a fold lost rows"
            continue
        assert any(c.evicted for c in ours), f"{case}: nothing was evicted at budget {SMALL_BUDGET['budget']}"
        assert max(c.size() for c in ours) <= 16, f"{case}: rows exceed budget + decode headroom"
        if tier != "off":
            assert all(c.tier.rows > 0 and c.size() + c.tier.rows == c.offset for c in ours), f"{case}: rows lost"


# the names configs give their number of layers
DEPTH_KEYS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "num_transformer_layers")


def deep_config(model_type: str, times: int = 3) -> dict[str, Any]:
    """:func:`zoo.small_config` with ``times`` as many layers: each layer count of the config multiplied, each
    per-layer list repeated and each list of layer indexes continued, so that every kind of layer recurs deeper down
    (the eligibility probe's prefix of the layers is checked against all of them on it)."""
    config = zoo.small_config(model_type)
    named = [key for key in DEPTH_KEYS if key in zoo.OVERRIDES.get(model_type, {})]
    layers = config[(named or ["num_hidden_layers"])[0]]

    def deeper(value: Any, key: str) -> Any:
        if isinstance(value, dict):
            return {k: deeper(v, k) for k, v in value.items()}
        if (key in DEPTH_KEYS and value == layers) or (isinstance(value, list) and len(value) == layers):
            return value * times
        if isinstance(value, list) and value and all(type(i) is int and 0 <= i < layers for i in value):
            return [i + layers * r for r in range(times) for i in value]
        return value

    return deeper(config, "")


@pytest.mark.parametrize("model_type", zoo.model_types())
def test_every_model_type_gets_the_same_verdict_from_a_prefix_of_its_layers_as_from_all(model_type: str,
                                                                                      records) -> None:
    """Built three times as deep, where the probe runs a prefix holding every kind of layer twice (one method per
    type, in turn): slots served, slots left and why, the reason, the layouts, as a probe of every layer finds."""
    reason = zoo.unbuildable(model_type)
    if reason:
        pytest.skip(reason)
    model = build(deep_config(model_type))
    caches = builder.mlx_caches(model)
    slots = builder.candidate_slots(caches)
    if not slots:
        pytest.skip("no plain full-attention KVCache slot: nothing to probe")
    method = sorted(METHODS)[zoo.model_types().index(model_type) % len(METHODS)]
    config = VeloxConfig(kv=method, log="DEBUG")
    veloxpatch.patch(config)
    layer_io.prepare(model, config)
    found, whole = (eligibility._probe(model, caches, slots, config, whole) for whole in (False, True))
    assert (found.slots, found.left, found.reason, found.layouts, type(found.error)) == (
        whole.slots, whole.left, whole.reason, whole.layouts, type(whole.error)), method
    part = structure.prefix(model, caches)
    if part is not None and part.length < len(caches):
        whole_said = [r for r in records if "probing every layer" in r.getMessage()]
        assert bool(whole_said) == (model_type in PROBED_WHOLE), "the prefix was not used" if whole_said else ""


def test_the_line_for_a_model_left_unpatched_names_it_the_method_and_why(info_lines: list[str]) -> None:
    veloxpatch.patch(kv="snapkv", budget=4096, log="INFO")
    make_prompt_cache(build(zoo.small_config("gemma2")))
    assert info_lines == [("gemma2 with snapkv: its attention does not go through mlx_lm's routed function; "
                           "running unpatched")]


def test_models_that_misuse_a_cache_keep_mlx_lms_in_that_slot_only() -> None:
    """afm7 reads its last cache with ``keys_and_values``; gemma3n's only full-attention cache is
    also read that way by the layers sharing it. Those slots stay mlx_lm's; the others are ours."""
    veloxpatch.patch(kv="snapkv", budget=4096)
    afm7 = [type(c).__name__ for c in make_prompt_cache(build(zoo.small_config("afm7")))]
    gemma3n = [type(c).__name__ for c in make_prompt_cache(build(zoo.small_config("gemma3n")))]
    assert afm7 == ["SnapKVCache", "KVCache"]
    assert gemma3n == ["RotatingKVCache", "KVCache"]


def test_a_cache_object_filling_several_slots_gets_one_replacement() -> None:
    """Layers sharing one KV cache object must keep sharing: one compressed cache, not two."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    shared, other = KVCache(), RotatingKVCache(max_size=8)
    out = assemble([shared, other, shared, KVCache()], [0, 2, 3], lambda: cache_class("snapkv")(CacheSpec(4096)),
                   "snapkv")
    assert out[0] is out[2] and out[3] is not out[0] and out[1] is other
    assert out[0].coordinator.members == [out[0], out[3]]


def test_the_support_table_names_every_model_type() -> None:
    table = zoo.support_table(["llama", "gemma2", "olmo"])
    assert table.splitlines()[0].startswith("| model type |")
    rows = {line.split("|")[1].strip(): line for line in table.splitlines()[2:]}
    assert "compressed on 2 of 2" in rows["llama"]
    assert "does not go through mlx_lm's routed function" in rows["gemma2"]
    assert "not built: needs the ai2-olmo package" in rows["olmo"]


def test_info_says_per_method_what_happens_to_a_model_folder(tmp_path) -> None:
    config = zoo.small_config("gemma3n")
    (tmp_path / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(tmp_path / "model.safetensors"), dict(tree_flatten(build(config).parameters())))
    result = CliRunner().invoke(main, ["info", "--model", str(tmp_path)], env={"VELOX_KV": "snapkv"})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    n = len(METHODS)
    assert lines[-n - 1] == f"model {tmp_path} (gemma3n):"
    assert all("reads the cache directly (`keys_and_values`); running unpatched" in line for line in lines[-n:])
