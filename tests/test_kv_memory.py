"""VELOX_KV_MEMORY: the bytes a cache list may hold, as rows per layer from the model's KV layout; checked against
what the process holds (mx.get_active_memory()), not only the caches' own byte counts."""

from __future__ import annotations

import gc
import subprocess
import sys

import mlx.core as mx
import pytest
from mlx_lm.generate import speculative_generate_step
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

import veloxpatch
from conftest import EVICTING, greedy, random_tokens, tiny, without_velox
from veloxpatch.assets import model_path as shipped_model_path
from veloxpatch.caches.memory import SLACK, MemoryPlan, SlotLayout
from veloxpatch.config import ConfigError, VeloxConfig, from_env
from veloxpatch.eval.random_model import build, config_for
from veloxpatch.settings import Memory


def wide(seed: int = 3) -> object:
    """A random llama whose head_dim (32) mlx can quantize in groups of 32 (the tier's)."""
    model = build(config_for("llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=256), seed)
    mx.eval(model.parameters())
    return model


def held_after(model, tokens: mx.array, chunk: int = 256) -> tuple[int, int, list]:
    """(active bytes held after a greedy run over ``tokens`` beyond what was held before, peak over that, caches)."""
    gc.collect()
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    caches = make_prompt_cache(model)
    greedy(model, tokens, caches, steps=8, chunk=chunk)
    gc.collect()
    return mx.get_active_memory() - base, mx.get_peak_memory() - base, caches


@pytest.mark.parametrize("text, expected", [
    ("2GB", Memory(bytes=2 * 10**9)), ("512MiB", Memory(bytes=512 * 2**20)), ("1.5 GiB", Memory(bytes=3 * 2**29)),
    ("1000000", Memory(bytes=10**6)), ("25%", Memory(fraction=0.25)), ("off", Memory()),
])
def test_kv_memory_takes_bytes_with_units_or_a_share_of_the_device(text: str, expected: Memory) -> None:
    assert Memory.parse(text) == expected
    assert str(VeloxConfig(kv="snapkv", kv_memory=text).kv_memory) == text, "messages show it as written"


@pytest.mark.parametrize("bad", ["2XB", "-1GB", "0%", "101%", "lots", "1e400", "2bk"])
def test_a_bad_kv_memory_names_the_setting_the_value_and_what_is_allowed(bad: str) -> None:
    with pytest.raises(ConfigError, match=rf"VELOX_KV_MEMORY='{bad}' is not allowed: expected off, bytes .*percentage"):
        from_env({"VELOX_KV": "snapkv", "VELOX_KV_MEMORY": bad})


@pytest.mark.parametrize("method", ["xkv", "minicache", "xquant", "quant"])
def test_kv_memory_is_refused_for_a_method_that_does_not_evict(method: str) -> None:
    with pytest.raises(ConfigError, match=rf"VELOX_KV_MEMORY=1GB is not allowed with VELOX_KV={method}: .*snapkv"):
        VeloxConfig(kv=method, kv_memory="1GB")


def test_quants_refusal_names_its_own_share_of_the_bytes() -> None:
    with pytest.raises(ConfigError, match=r"own \(VELOX_QUANT_KEEP=0.125x keeps the rows that make it hold an eighth"):
        VeloxConfig(kv="quant", kv_memory="1GB")


LAYER = SlotLayout(heads=2, key_dim=64, value_dim=64, itemsize=4, query_bytes=4 * 64 * 4)


def plan(total: int, **kw) -> MemoryPlan:
    args = {"ours": (LAYER,) * 3, "others": (), "queries": 32, "floor": 36, **kw}
    return MemoryPlan(total, str(total), **args)


def test_the_smallest_memory_a_plan_names_is_the_smallest_it_takes() -> None:
    smallest = plan(10**7).smallest()
    assert plan(smallest).keep_cap(1) >= 36
    with pytest.raises(ConfigError, match=rf"VELOX_KV_MEMORY={smallest - 1} is not allowed here: it must be at "
                                          rf"least {smallest} bytes .* 36 rows"):
        plan(smallest - 1)


def test_a_plan_pays_for_the_slots_left_to_mlx_lm_and_scales_with_the_batch() -> None:
    rotating = SlotLayout(heads=2, key_dim=64, value_dim=64, itemsize=4, rows=512)
    alone, shared = plan(2**22), plan(2**22, others=(rotating, SlotLayout(fixed=4096)))
    assert shared.fixed == 512 * LAYER.row_bytes + 4096 and shared.unbounded == 0
    assert shared.keep_cap(1) < alone.keep_cap(1)
    row = 3 * LAYER.stored_row_bytes
    for p in (alone, shared):
        for batch in (1, 2, 4):
            keep = p.keep_cap(batch)
            held = batch * (keep + min(64, max(8, keep // 8)) + SLACK) * row + (p.total - p._available(batch))
            assert held <= p.total, (batch, keep)
            assert held + batch * 2 * row > p.total, "it leaves no whole row unused beyond the headroom rounding"
    assert plan(2**22, others=(SlotLayout(2, 64, 64, 4),)).unbounded == 1, "a plain slot mlx_lm keeps grows"
    assert alone.vanilla_tokens() == 2**22 // (3 * LAYER.row_bytes)


def test_a_tier_takes_what_the_store_leaves() -> None:
    p = plan(2**22, tier_bits=4)
    keep = 1024
    rows = p.tier_rows(keep, 1)
    used = (keep + 64 + SLACK) * 3 * LAYER.stored_row_bytes + rows * 3 * LAYER.tier_row_bytes(4)
    assert used <= p._available(1) < used + 3 * LAYER.tier_row_bytes(4)
    assert LAYER.tier_row_bytes(4) < LAYER.stored_row_bytes / 5
    assert plan(2**22).tier_rows(keep, 1) == 0


@pytest.mark.parametrize("mode, tier", [("end", "off"), ("chunk", "off"), ("end", "4"), ("chunk", "2")])
def test_a_prompt_whose_vanilla_kv_exceeds_the_target_runs_under_it(mode: str, tier: str) -> None:
    """2048 tokens: mlx_lm's caches hold 4x the target; ours hold it, in what the process holds after the run."""
    model = wide()
    tokens = random_tokens(2048, 1)
    vanilla, vanilla_peak, _ = held_after(model, tokens)
    target = vanilla // 4
    veloxpatch.patch(kv="snapkv", budget="50%", compress=mode, tier=tier, kv_memory=str(target))
    held, peak, caches = held_after(model, tokens)
    assert sum(c.nbytes for c in caches) <= target
    assert held <= target * 1.02, (held, target)
    assert peak < vanilla_peak * 0.6, "the prompt is read within the target (plus a step's rows), in either mode"
    if tier != "off":
        assert all(0 < c.tier.rows <= c.memory_plan.tier_rows(c.target(), 1) for c in caches)


def test_a_model_and_its_draft_hold_the_target_together() -> None:
    """Speculative decoding reads the same tokens into the model's list and the draft's, each planned for the whole
    target when it was built: they share one plan, and both together hold the target, in what the process holds."""
    model, draft = wide(), wide(seed=4)
    tokens = random_tokens(1536, 5)
    target = 1536 * SlotLayout(2, 32, 32, 4).row_bytes * len(model.layers) // 4  # a quarter of the model's own KV
    veloxpatch.patch(kv="snapkv", budget="100%", compress="chunk", tier="4", kv_memory=str(target))

    def speculate(caches) -> list[int]:
        return [t for t, _, _ in speculative_generate_step(tokens, model, draft, num_draft_tokens=3, max_tokens=12,
                                                           prefill_step_size=256, prompt_cache=caches)]

    gc.collect()
    mx.clear_cache()
    base = mx.get_active_memory()
    caches = make_prompt_cache(model) + make_prompt_cache(draft)  # as the server builds them
    answer = speculate(caches)
    gc.collect()
    assert len({id(c.memory_plan) for c in caches}) == 1 and len(caches[0].memory_plan.ours) == 2 * len(model.layers)
    assert all(c.evicted and c.tier.rows > 0 for c in caches)
    assert sum(c.nbytes for c in caches) <= target
    assert mx.get_active_memory() - base <= target * 1.02
    assert speculate(None) == answer, "a generation that builds its own lists shares the plan alike"


def test_a_target_that_holds_the_model_but_not_its_draft_too_is_an_error_naming_the_smallest() -> None:
    model, draft = wide(), wide(seed=4)
    veloxpatch.patch(kv="snapkv", kv_memory="1GB")
    alone = make_prompt_cache(model)[0].memory_plan.smallest()
    target = alone * 3 // 2  # each list fits on its own
    veloxpatch.patch(kv="snapkv", kv_memory=str(target))
    caches = make_prompt_cache(model) + make_prompt_cache(draft)
    with pytest.raises(ConfigError, match=rf"VELOX_KV_MEMORY={target} is not allowed here: it must be at least "):
        next(speculative_generate_step(random_tokens(64, 6), model, draft, num_draft_tokens=2, max_tokens=2,
                                       prompt_cache=caches))


def test_the_stricter_of_budget_and_memory_wins() -> None:
    model = wide()
    tokens = random_tokens(1200, 2)
    veloxpatch.patch(kv="snapkv", budget=100, kv_memory="1GiB")
    _, _, caches = held_after(model, tokens)
    assert {c.target() for c in caches} == {100}
    veloxpatch.patch(kv="snapkv", budget=100, kv_memory="200KB")
    _, _, caches = held_after(model, tokens)
    cap = caches[0].memory_plan.keep_cap(1)
    assert 36 <= cap < 100 and {c.target() for c in caches} == {cap}


@pytest.mark.parametrize("method", EVICTING)
def test_every_evicting_method_holds_the_target(method: str) -> None:
    model = tiny("qwen3", seed=2, layers=4)
    tokens = random_tokens(600, 3)
    veloxpatch.patch(kv=method, budget="100%", kv_memory="0.25MiB", window=8)
    _, _, caches = held_after(model, tokens, chunk=128)
    assert sum(c.nbytes for c in caches) <= 2**18 and all(c.memory_plan is not None for c in caches)
    assert any(c.evicted for c in caches), "the target, not the budget, made it compress"


def test_sliding_window_slots_are_paid_for_at_their_full_size() -> None:
    model = tiny("gemma3_text")
    veloxpatch.patch(kv="snapkv", kv_memory="4MiB")
    caches = make_prompt_cache(model)
    ours = [c for c in caches if hasattr(c, "memory_plan")]
    windows = [c for c in caches if isinstance(c, RotatingKVCache)]
    assert ours and windows
    plan_ = ours[0].memory_plan
    assert plan_.fixed == sum(c.max_size for c in windows) * plan_.others[0].row_bytes and plan_.unbounded == 0


def run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "veloxpatch", *args], capture_output=True, text=True,
                          env=without_velox(), timeout=300)


def test_a_memory_too_small_for_the_model_exits_2_naming_the_smallest_that_works() -> None:
    model = str(shipped_model_path())
    out = run(["run", "--kv", "snapkv", "--kv-memory", "10KB", "-m", "mlx_lm", "generate", "--model", model,
               "--prompt", "hello", "--max-tokens", "4"])
    assert out.returncode == 2, out.stderr[-2000:]
    assert "VELOX_KV_MEMORY=10KB is not allowed here: it must be at least" in out.stderr
    assert "Traceback" not in out.stderr


def test_info_says_how_many_rows_and_tokens_fit() -> None:
    model = str(shipped_model_path())
    env = {**without_velox(), "VELOX_KV": "snapkv", "VELOX_KV_MEMORY": "64MiB"}
    out = subprocess.run([sys.executable, "-m", "veloxpatch", "info", "--model", model], capture_output=True,
                         text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(x for x in out.stdout.splitlines() if x.strip().startswith("snapkv "))
    assert "VELOX_KV_MEMORY=64MiB (64.0 MiB): each of 4 compressed layers keeps at most" in line
    assert "tokens of context in it" in line
    assert "VELOX_KV_MEMORY" not in next(x for x in out.stdout.splitlines() if x.strip().startswith("xkv "))
    out = subprocess.run([sys.executable, "-m", "veloxpatch", "info", "--model", model], capture_output=True,
                         text=True, env={**env, "VELOX_KV_MEMORY": "10KB"}, timeout=300)
    assert out.returncode == 2 and "must be at least" in out.stdout
