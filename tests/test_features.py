"""Patching by what the installed mlx_lm offers: each feature all ours or all mlx_lm's, said once; the version gate."""

from __future__ import annotations

import logging
import sys
from typing import Any

import mlx_lm.generate  # noqa: F401  (imported before any snapshot of what is bound where)
import mlx_lm.models.llama  # noqa: F401  (so is tiny()'s model, a holder of the attention function)
import mlx_lm.server  # noqa: F401  (the defining module of the settings per request)
import pytest
from click.testing import CliRunner

import veloxpatch
from conftest import tiny
from veloxpatch.cli import main
from veloxpatch.fallback import StrictError
from veloxpatch.integration import features, version
from veloxpatch.integration.state import STATE


def bindings() -> dict[str, Any]:
    """Every module-level binding and class attribute a feature names, where mlx_lm defines it and in every
    module that holds a copy: what a patch changes and an unpatch must give back, exactly."""
    found: dict[str, Any] = {}
    for feature in features.FEATURES:
        module = sys.modules[feature.module]
        for target in feature.targets:
            owner = features.owner_of(module, target)
            attr = target.name.rpartition(".")[2]
            if "." in target.name:
                found[target.name] = vars(owner).get(attr) if owner is not None else None
                continue
            for name, holder in list(sys.modules.items()):
                if name.startswith("mlx_lm") and attr in getattr(holder, "__dict__", {}):
                    found[f"{name}.{attr}"] = vars(holder)[attr]
    return found


def offered(target: str) -> bool:
    """Whether the installed mlx_lm offers the feature of ``target`` (older ones lack some: the matrix runs these
    tests on every supported minor)."""
    feature = next(f for f in features.FEATURES if any(t.name == target for t in f.targets))
    return features.survey()[feature.name] is None


def wrapped(name: str, before: dict[str, Any]) -> bool:
    """Whether the binding ``name`` is now our wrapper of what it was before."""
    now = bindings()[name]
    return now is not before[name] and getattr(now, "__wrapped__", None) is before[name]


def test_a_missing_target_leaves_its_feature_to_mlx_lm_and_patches_the_rest(monkeypatch, records) -> None:
    from mlx_lm.models.cache import make_prompt_cache

    generate = sys.modules["mlx_lm.generate"]
    monkeypatch.delattr(generate.BatchGenerator, "insert_segments", raising=False)  # none before 0.31
    before = bindings()
    assert veloxpatch.patch(kv="snapkv", budget=64, log="INFO")
    cache = sys.modules["mlx_lm.models.cache"].make_prompt_cache(tiny("llama"))[0]
    assert type(cache).__name__ == "SnapKVCache"
    assert not hasattr(cache, "merge"), "with batched generation off mlx_lm cannot merge our caches into its batches"
    for name in ("mlx_lm.models.base.scaled_dot_product_attention", "mlx_lm.generate.generate_step",
                 "mlx_lm.generate.speculative_generate_step", "mlx_lm.utils.load_model",
                 "mlx_lm.models.cache.load_prompt_cache"):
        assert wrapped(name, before) is offered(name.rpartition(".")[2]), name
    assert make_prompt_cache is before["mlx_lm.models.cache.make_prompt_cache"]  # this test's own early copy
    off = [r.getMessage() for r in records if "batched generation" in r.getMessage()]
    assert off == [f"batched generation stays mlx_lm's: BatchGenerator.insert_segments is not in mlx-lm "
                   f"{version.mlx_lm_version()}"]
    assert [r.levelno for r in records if "batched generation" in r.getMessage()] == [logging.INFO]
    assert STATE.features["batched generation"] is not None and STATE.features["prompt caches"] is None
    veloxpatch.unpatch()
    assert bindings() == before
    with pytest.raises(StrictError, match="insert_segments is not in mlx-lm .*, but VELOX_STRICT is set"):
        veloxpatch.patch(kv="snapkv", budget=64, strict=True)
    assert not veloxpatch.is_patched() and bindings() == before, "a strict refusal leaves nothing patched"


def test_under_strict_a_feature_off_is_refused_where_the_settings_use_it(monkeypatch, records) -> None:
    """Batched generation off (as on mlx-lm 0.28-0.30) is refused with a KV method, whose batches would run on
    mlx_lm's caches uncompressed, and only said with no method; float32 load off is refused where VELOX_FLOAT32
    asks for float32 only."""
    generate, utils = sys.modules["mlx_lm.generate"], sys.modules["mlx_lm.utils"]
    monkeypatch.delattr(generate.BatchGenerator, "insert_segments", raising=False)
    with pytest.raises(StrictError, match="insert_segments is not in mlx-lm .*, but VELOX_STRICT is set"):
        veloxpatch.patch(kv="snapkv", budget=64, strict=True)
    before = bindings()
    assert veloxpatch.patch(kv="none", float32="on", strict=True, log="INFO")
    assert STATE.features["batched generation"] is not None and wrapped("mlx_lm.utils.load_model", before)
    assert [r.levelno for r in records if "batched generation stays mlx_lm's" in r.getMessage()] == [logging.INFO]
    with pytest.raises(StrictError, match="insert_segments is not in mlx-lm"):  # patched again, now with a method
        veloxpatch.patch(kv="snapkv", budget=64, strict=True)
    assert not veloxpatch.is_patched() and bindings() == before

    def load_model(model_path):  # no lazy: float32 load is off
        raise AssertionError("never called here")

    monkeypatch.setattr(utils, "load_model", load_model)
    assert veloxpatch.patch(kv="none", float32="off", strict=True)
    assert STATE.features["float32 load"] is not None and bindings()["mlx_lm.utils.load_model"] is load_model
    veloxpatch.unpatch()
    refused = r"VELOX_FLOAT32 has no effect: models keep their dtype: load_model\(model_path\) .*VELOX_STRICT"
    with pytest.raises(StrictError, match=refused):
        veloxpatch.patch(kv="none", float32="on", strict=True)
    assert not veloxpatch.is_patched()


def test_insert_segments_without_an_argument_its_wrapper_binds_leaves_batching_to_mlx_lm(monkeypatch) -> None:
    generate = sys.modules["mlx_lm.generate"]

    def insert_segments(self, segments, max_tokens=None, caches=None, tokens=None):  # all_tokens renamed
        raise AssertionError("never called here")

    monkeypatch.setattr(generate.BatchGenerator, "insert_segments", insert_segments, raising=False)
    assert features.survey()["batched generation"] == (
        "BatchGenerator.insert_segments(self, segments, max_tokens, caches, tokens) does not take all_tokens by name "
        f"(mlx-lm {version.mlx_lm_version()})")


def test_a_changed_signature_leaves_the_whole_feature_to_mlx_lm(monkeypatch, records) -> None:
    generate = sys.modules["mlx_lm.generate"]

    def speculative_generate_step(prompt, model, *, prompt_cache=None):  # no draft model any more
        yield from ()

    monkeypatch.setattr(generate, "speculative_generate_step", speculative_generate_step)
    before = bindings()
    assert veloxpatch.patch(kv="snapkv", budget=64, log="INFO")
    assert bindings()["mlx_lm.generate.speculative_generate_step"] is speculative_generate_step
    assert bindings()["mlx_lm.generate.generate_step"] is before["mlx_lm.generate.generate_step"], "all or nothing"
    assert wrapped("BatchGenerator.insert_segments", before) is offered("BatchGenerator.insert_segments")
    assert STATE.features["generation start"] == (
        "speculative_generate_step(prompt, model, prompt_cache) does not take draft_model by name "
        f"(mlx-lm {version.mlx_lm_version()})")
    [said] = [r for r in records if r.getMessage().startswith("generations start")]
    assert said.levelno == logging.INFO
    assert said.getMessage().startswith("generations start on caches as they are")
    veloxpatch.unpatch()
    assert bindings() == before


def test_an_essential_feature_off_leaves_all_of_mlx_lm_as_it_is(monkeypatch, records) -> None:
    base = sys.modules["mlx_lm.models.base"]

    def scaled_dot_product_attention(queries, keys, values, scale, mask=None):  # no cache parameter
        raise AssertionError("never called here")

    monkeypatch.setattr(base, "scaled_dot_product_attention", scaled_dot_product_attention)
    before = bindings()
    assert veloxpatch.patch(kv="snapkv", budget=64) is False
    assert not veloxpatch.is_patched() and bindings() == before
    [said] = [r for r in records if r.levelno == logging.WARNING]
    assert said.getMessage().startswith("the attention route cannot be patched, so attention cannot reach "
                                        "compressed caches: scaled_dot_product_attention(queries, keys, values, "
                                        "scale, mask) does not start with (queries, keys, values, cache, scale, "
                                        "mask, sinks)")
    with pytest.raises(StrictError, match="attention route cannot be patched"):
        veloxpatch.patch(kv="snapkv", budget=64, strict=True)
    assert bindings() == before


def test_a_server_without_a_private_method_keeps_every_request_on_the_process_settings(monkeypatch, records) -> None:
    server = sys.modules["mlx_lm.server"]
    monkeypatch.delattr(server.ResponseGenerator, "_is_batchable")
    before = bindings()
    assert veloxpatch.patch(kv="snapkv", budget=64, log="INFO")
    assert bindings()["LRUPromptCache.insert_cache"] is before["LRUPromptCache.insert_cache"], "all or nothing"
    assert bindings()["APIHandler.validate_model_parameters"] is before["APIHandler.validate_model_parameters"]
    assert wrapped("mlx_lm.models.cache.make_prompt_cache", before)
    [said] = [r for r in records if "process's settings" in r.getMessage()]
    assert said.levelno == logging.INFO and said.getMessage() == (
        "the server serves every request with the process's settings (a request's \"velox\" field and X-Velox-* "
        "headers are ignored, and its usage says nothing of its KV cache): ResponseGenerator._is_batchable is not in "
        f"mlx-lm {version.mlx_lm_version()}")
    veloxpatch.unpatch()
    assert bindings() == before


def test_a_changed_server_layout_keeps_every_request_on_the_process_settings(monkeypatch, records) -> None:
    from veloxpatch.integration import compat

    monkeypatch.setattr(compat, "ARGUMENTS_AT", 1)
    before = bindings()
    assert veloxpatch.patch(kv="snapkv", budget=64, log="INFO")
    assert bindings()["ResponseGenerator._serve_single"] is before["ResponseGenerator._serve_single"]
    assert STATE.features["settings per request"].startswith(
        "the server's queued request is not the layout veloxpatch knows (generate queues the arguments at [2], "
        "not at [1]")
    veloxpatch.unpatch()
    assert bindings() == before


def test_the_installed_mlx_lm_offers_the_shim_and_the_newest_tested_every_feature() -> None:
    found = features.survey()
    assert all(found[f.name] is None for f in features.FEATURES if f.essential), found
    if version.parse(version.mlx_lm_version())[:2] >= version.NEWEST_TESTED:
        assert found == {f.name: None for f in features.FEATURES}


@pytest.mark.parametrize("found", ["0.33.0", "1.0.2"])
def test_newer_than_the_newest_tested_is_patched_with_one_warning(monkeypatch, records, found: str) -> None:
    monkeypatch.setattr(version, "mlx_lm_version", lambda: found)
    assert veloxpatch.patch(kv="snapkv", budget=64)
    assert veloxpatch.patch(kv="snapkv", budget=128)
    assert type(sys.modules["mlx_lm.models.cache"].make_prompt_cache(tiny("llama"))[0]).__name__ == "SnapKVCache"
    warnings = [r.getMessage() for r in records if r.levelno >= logging.WARNING]
    assert warnings == [f"mlx-lm {found} is newer than 0.32, the newest veloxpatch is tested with; patching each "
                        "feature whose checks pass"]
    veloxpatch.unpatch()
    with pytest.raises(StrictError, match=f"mlx-lm {found} is newer than 0.32.*VELOX_STRICT"):
        veloxpatch.patch(kv="snapkv", budget=64, strict=True)
    assert not veloxpatch.is_patched()


@pytest.mark.parametrize("found", ["0.27.1", "0.26.4", None])
def test_older_than_the_floor_passes_through(monkeypatch, records, found: str | None) -> None:
    monkeypatch.setattr(version, "mlx_lm_version", lambda: found)
    before = bindings()
    assert veloxpatch.patch(kv="snapkv", budget=64) is False
    assert not veloxpatch.is_patched() and bindings() == before
    [said] = [r.getMessage() for r in records if r.levelno >= logging.WARNING]
    assert said.endswith("the oldest veloxpatch patches; running unpatched")
    with pytest.raises(StrictError, match="oldest veloxpatch patches"):
        veloxpatch.patch(kv="snapkv", budget=64, strict=True)


def test_tested_patch_releases_and_the_floor(monkeypatch) -> None:
    assert not version.too_old("0.28.1") and not version.newer_than_tested("0.32.9")
    assert version.newer_than_tested("0.33.0.dev1") and version.too_old("0.27.9") and version.too_old("0.28.0")


def test_info_lists_each_feature(monkeypatch) -> None:
    monkeypatch.delattr(sys.modules["mlx_lm.generate"].BatchGenerator, "insert_segments", raising=False)
    out = CliRunner().invoke(main, ["info"], env={"VELOX_KV": "snapkv"}).output
    assert "features:\n  attention route           on\n  prompt caches             on\n" in out
    assert (f"  batched generation        off: BatchGenerator.insert_segments is not in mlx-lm "
            f"{version.mlx_lm_version()}\n  settings per request") in out


def test_our_caches_answer_mlx_lm_0_28s_len_and_stay_true_when_empty() -> None:
    """mlx-lm 0.28/0.29 sort a batch's sequences by ``cache_length``, the ``len`` of each cache."""
    veloxpatch.patch(kv="snapkv", budget=64)
    caches = sys.modules["mlx_lm.models.cache"].make_prompt_cache(tiny("llama"))
    assert [len(c) for c in caches] == [c.size() for c in caches] == [0] * len(caches)
    assert all(caches)
