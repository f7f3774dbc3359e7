"""patch / unpatch in every import order, idempotent and exactly reversible."""

from __future__ import annotations

import textwrap
import threading
import time

import pytest
from mlx_lm.models.cache import make_prompt_cache

import veloxpatch
from conftest import random_tokens, run_python, tiny, unless_offered
from veloxpatch.caches import Runtime
from veloxpatch.integration import batched, compat, wrappers
from veloxpatch.registry import METHODS

# Prints the class of a tiny llama's first cache slot and whether attention is routed.
PROBE = textwrap.dedent("""
    def probe(tag):
        import sys, mlx.core as mx, mlx_lm.models.cache as c, mlx_lm.models.base as b, mlx_lm.models.llama as llama
        from mlx_lm.models.llama import Model, ModelArgs
        import veloxpatch.integration.wrappers as w
        args = ModelArgs(model_type="llama", hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                         num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=50)
        # the make_prompt_cache generate calls: its own copy (mlx-lm 0.32), else the
        # cache module's (0.28-0.31 call cache.make_prompt_cache)
        calls = sys.modules["mlx_lm.generate"]
        calls = calls if hasattr(calls, "make_prompt_cache") else c
        routed = llama.scaled_dot_product_attention is b.scaled_dot_product_attention
        wrapped = hasattr(b.scaled_dot_product_attention, "__wrapped__")
        double = hasattr(getattr(b.scaled_dot_product_attention, "__wrapped__", None), "__wrapped__")
        model = Model(args)
        mx.eval(model.parameters())  # the probe never evaluates a model the app has not
        print(tag, type(calls.make_prompt_cache(model)[0]).__name__, routed, wrapped, double)
""")


def run_order(body: str) -> list[str]:
    result = run_python(PROBE + textwrap.dedent(body))
    assert result.returncode == 0, result.stderr
    return result.stdout.split("\n")[:-1]


def test_patch_before_mlx_lm_is_imported() -> None:
    out = run_order("""
        import sys, veloxpatch
        veloxpatch.patch(kv="snapkv", budget=64)
        assert "mlx_lm" not in sys.modules
        import mlx_lm
        probe("after")
    """)
    assert out == ["after SnapKVCache True True False"]


def test_patch_after_import_rebinds_every_copy() -> None:
    out = run_order("""
        import mlx_lm
        from mlx_lm.models.cache import make_prompt_cache   # a user's own early binding
        import mlx_lm.models.cache as c, mlx_lm.models.llama, veloxpatch
        original = make_prompt_cache
        veloxpatch.patch(kv="streamingllm", budget=64)
        probe("patched")
        print(make_prompt_cache is c.make_prompt_cache, make_prompt_cache is original)
        veloxpatch.unpatch()
        probe("unpatched")
        print(make_prompt_cache is c.make_prompt_cache, make_prompt_cache is original)
    """)
    assert out == ["patched StreamingLLMCache True True False", "True False",
                   "unpatched KVCache True False False", "True True"]


def test_repeated_patch_and_unpatch_never_double_wrap() -> None:
    out = run_order("""
        import mlx_lm, veloxpatch
        import mlx_lm.models.base as b
        original = b.scaled_dot_product_attention
        for _ in range(3):
            veloxpatch.patch(kv="snapkv", budget=64)
            veloxpatch.patch(kv="snapkv", budget=128)
        probe("twice")
        assert veloxpatch.active_config().budget.tokens == 128
        veloxpatch.unpatch(); veloxpatch.unpatch()
        print(b.scaled_dot_product_attention is original, veloxpatch.is_patched())
        veloxpatch.patch(kv="snapkv", budget=64)
        probe("again")
    """)
    assert out == ["twice SnapKVCache True True False", "True False", "again SnapKVCache True True False"]


def test_unpatch_before_import_leaves_mlx_lm_original() -> None:
    out = run_order("""
        import veloxpatch
        veloxpatch.patch(kv="snapkv", budget=64)
        veloxpatch.unpatch()
        import mlx_lm
        probe("never")
    """)
    assert out == ["never KVCache True False False"]


def test_patch_and_unpatch_change_no_class_of_ours() -> None:
    """What patch() decides reaches our caches through the builder, as each cache's runtime, never as a class
    attribute set from outside the class (issue 35): every class of our caches is the same across patch and
    unpatch."""
    classes = {k for info in METHODS.values() for k in info.cls.__mro__ if k.__module__.startswith("veloxpatch.")}
    before = {k: dict(vars(k)) for k in classes}
    veloxpatch.patch(kv="snapkv", budget=64)
    caches = make_prompt_cache(tiny("llama"))
    assert {k: dict(vars(k)) for k in classes} == before
    assert caches[0].runtime == Runtime(batching=batched.batching_on, meta_apart=compat.meta_state_apart)
    veloxpatch.unpatch()
    assert {k: dict(vars(k)) for k in classes} == before
    assert not hasattr(caches[0], "merge")


def test_none_method_passes_every_cache_through() -> None:
    model = tiny("llama")
    assert veloxpatch.patch(kv="none")
    assert type(make_prompt_cache(model)[0]).__name__ == "KVCache"


def broken_build(monkeypatch) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(wrappers.builder, "build", broken)


def test_a_failure_while_building_falls_back(monkeypatch) -> None:
    model = tiny("llama")
    broken_build(monkeypatch)
    veloxpatch.patch(kv="snapkv", budget=64)
    assert type(make_prompt_cache(model)[0]).__name__ == "KVCache"


@unless_offered("batched generation")  # off, a method under strict is refused at patch (tests/test_features.py)
def test_a_failure_while_building_is_an_error_under_strict(monkeypatch) -> None:
    model = tiny("llama")
    broken_build(monkeypatch)
    veloxpatch.patch(kv="snapkv", budget=64, strict=True)
    with pytest.raises(RuntimeError, match="boom"):
        make_prompt_cache(model)


def test_auto_import_patches_from_the_environment() -> None:
    code = "import veloxpatch.auto, veloxpatch; print(veloxpatch.is_patched(), veloxpatch.active_config().budget)"
    ok = run_python(code, env={"VELOX_KV": "snapkv", "VELOX_BUDGET": "25%"})
    assert ok.stdout.strip() == "True 25%", ok.stderr
    bad = run_python("import veloxpatch.auto, veloxpatch; print(veloxpatch.is_patched())",
                     env={"VELOX_KV": "snapkv", "VELOX_SINK": "-1"})
    assert bad.returncode == 0 and bad.stdout.strip() == "False"
    assert "VELOX_SINK='-1' is not allowed" in bad.stderr
    strict = run_python("import veloxpatch.auto", env={"VELOX_KV": "snapkv", "VELOX_SINK": "-1", "VELOX_STRICT": "1"})
    assert strict.returncode != 0 and "VELOX_SINK" in strict.stderr


def test_generating_while_other_threads_patch_and_unpatch() -> None:
    """Generation keeps going, with mlx_lm's exact tokens, while the bindings change under it.

    The budget exceeds the sequence, so whichever caches and attention route each step meets
    (ours or mlx_lm's, patched or not), the tokens must be mlx_lm's own.
    """
    import mlx_lm.models.base as base
    import mlx_lm.models.cache as cache
    from mlx_lm.generate import generate_step

    originals = (base.scaled_dot_product_attention, cache.make_prompt_cache)
    model = tiny("llama")
    prompt = random_tokens(40, 5)
    expected = [int(t) for t, _ in generate_step(prompt, model, max_tokens=8)]
    churning = threading.Event()
    results: list[list[int]] = []
    errors: list[BaseException] = []

    def churn() -> None:
        for _ in range(25):
            veloxpatch.patch(kv="snapkv", budget=512)
            time.sleep(0.002)  # let generation steps meet the patched bindings too
            veloxpatch.unpatch()

    def generate() -> None:
        try:
            while churning.is_set() or not results:
                results.append([int(t) for t, _ in generate_step(prompt, model, max_tokens=8)])
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=churn) for _ in range(4)]
    churning.set()
    generator = threading.Thread(target=generate)
    generator.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    churning.clear()
    generator.join()
    assert not errors, errors
    assert results and all(tokens == expected for tokens in results)
    assert (base.scaled_dot_product_attention, cache.make_prompt_cache) == originals
    veloxpatch.patch(kv="snapkv", budget=64)
    assert base.scaled_dot_product_attention.__wrapped__ is originals[0]
    assert cache.make_prompt_cache.__wrapped__ is originals[1]


@unless_offered("batched generation")
def test_batched_generation_runs_on_compressed_caches_while_patched_only(model_dir) -> None:
    """batch_generate keeps each sequence on compressed caches of its own while patched, mlx_lm's after."""
    from mlx_lm import batch_generate, load
    from mlx_lm.generate import BatchGenerator

    model, tokenizer = load(str(model_dir))
    prompts = [random_tokens(60, 1).tolist(), random_tokens(75, 2).tolist()]
    original_insert = vars(BatchGenerator)["insert_segments"]
    veloxpatch.patch(kv="snapkv", budget=40, window=8)
    done = batch_generate(model, tokenizer, prompts, max_tokens=5, return_prompt_caches=True)
    assert [type(c[0]).__name__ for c in done.caches] == ["SnapKVCache"] * 2
    assert [c[0].size() < c[0].offset for c in done.caches] == [True, True]
    veloxpatch.unpatch()
    plain = batch_generate(model, tokenizer, prompts, max_tokens=5, return_prompt_caches=True)
    assert [type(c[0]).__name__ for c in plain.caches] == ["KVCache"] * 2
    assert vars(BatchGenerator)["insert_segments"] is original_insert
