"""XQuant: K and V rebuilt from the quantized layer input, exact where lossless, physical bytes, saving, trimming,
the cross-layer deltas, and the exact fallback for attention it cannot rebuild."""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import BatchGenerator, speculative_generate_step
from mlx_lm.models.cache import KVCache, load_prompt_cache, make_prompt_cache, save_prompt_cache

import veloxpatch
import veloxpatch.log
from conftest import (
    assert_a_rejected_draft_leaves_no_trace,
    assert_round_trip,
    drain,
    greedy,
    random_tokens,
    speculated,
    tiny,
)
from veloxpatch import stats
from veloxpatch.caches import CacheSpec
from veloxpatch.config import Budget
from veloxpatch.eval.random_model import build, config_for
from veloxpatch.methods.xquant import XQuantCache

# the archs whose attention has k_proj, v_proj, rope and n_kv_heads (qwen3, gemma3 and lfm2 a key norm, qwen2 biases)
REBUILT = ("gemma3_text", "llama", "lfm2", "mistral", "qwen2", "qwen3")


def same_model(arch: str, layers: int | None = None):
    """``tiny(arch)``, the same every time (qwen2's biases come from the global generator)."""
    mx.random.seed(0)
    return tiny(arch, layers=layers)


def xquant_caches(model, compress: str = "end", log: str = "WARNING", **knobs) -> list:
    """Patched for xquant with ``knobs`` (short names) and window 8; the model's cache list."""
    veloxpatch.patch(kv="xquant", window=8, compress=compress, log=log,
                     knobs={f"xquant_{k}": v for k, v in knobs.items()})
    return make_prompt_cache(model)


def relative(a: mx.array, b: mx.array) -> float:
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return float(mx.linalg.norm(a - b) / mx.linalg.norm(b))


def x_rows(cache: XQuantCache) -> int:
    """Tokens whose X the cache holds (its own, its delta, or as a group's anchor)."""
    fold = cache.folds[0]
    return next(part[0].shape[1] for part in (*(fold.own or {}).values(), *(fold.shared or {}).values()))


def bytes_of(tree) -> int:
    return sum(a.nbytes for _, a in tree_flatten(tree) if isinstance(a, mx.array))


@pytest.mark.parametrize("arch", REBUILT)
def test_lossless_and_eight_bit_x_decode_mlx_lms_tokens_from_rebuilt_rows(arch: str) -> None:
    """Unquantized X (window 8) and 8-bit X (the default window, test_exactness's prompt) decode mlx_lm's tokens,
    every prefill chunk after the first attending over rebuilt rows (``chunk``). Random weights make greedy
    tokens fragile: with window 8, or on other prompts, 8 bits flip some of llama's, mistral's and qwen2's tokens, as
    mlx_lm's own 8-bit KV cache does; the key norms of qwen3, gemma3 and lfm2 damp it."""
    model = same_model(arch)
    prompt = random_tokens(150, 1)
    expected = greedy(model, prompt)
    # XQuant-CL's deltas (on by default) at the same bits; the GQA latent (forced: these models' K and V are as
    # wide as X) unquantized
    for bits, window, latent in ((16, 8, "off"), (8, 32, "off"), (16, 8, "on")):
        veloxpatch.patch(kv="xquant", window=window, compress="chunk",
                         knobs={"xquant_bits": bits, "xquant_cl_bits": bits, "xquant_latent": latent})
        caches = make_prompt_cache(model)
        assert greedy(model, prompt, caches) == expected, f"{bits} bits, latent {latent}"
        ours = [c for c in caches if isinstance(c, XQuantCache)]
        assert ours and all(c.folded_rows() and not c.exact for c in ours), "rows before the window are rebuilt"
        assert all(c.latent_on == (latent == "on") for c in ours)
        assert all(c.size() == c.offset and c.store.rows < 2 * window for c in ours), "exact: window + segment"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_rebuilt_keys_and_values_are_the_models_own_within_the_quantization_error(arch: str) -> None:
    """One 120-token chunk: every layer attends over exact rows, so every layer's X is the model's own; then
    (``chunk``: released after the chunk) the rows, 112 rebuilt from X and 8 exact, against mlx_lm's cache."""
    model = same_model(arch)
    prompt = random_tokens(120, 2)[None]
    truth = make_prompt_cache(model)
    model(prompt, cache=truth)
    # X alone; 3-bit deltas after the first layer (random weights: the layers' inputs are unalike, the deltas as
    # large as X itself); unquantized; the GQA latent (forced) at 4 bits and unquantized
    for bits, cl, latent, bound in ((4, 1, "off", 0.15), (4, 4, "off", 0.35), (16, 1, "off", 1e-5),
                                    (4, 4, "on", 0.15), (16, 4, "on", 1e-5)):
        caches = xquant_caches(model, "chunk", bits=bits, cl=cl, latent=latent)
        model(prompt, cache=caches)
        assert all(len(c.folds) == 1 and c.folded_rows() == 112 for c in caches)
        errors = [(relative(c.keys, t.keys[..., :120, :]), relative(c.values, t.values[..., :120, :]))
                  for c, t in zip(caches, truth)]
        assert max(max(e) for e in errors) < bound, f"{bits} bits, CL {cl}, latent {latent}: (keys, values) " \
                                                    f"relative errors {errors}"
        if bits == 4:
            assert min(min(e) for e in errors) > 1e-3, "4-bit X really is quantized"
        veloxpatch.unpatch()


def test_nbytes_is_every_tokens_packed_x_with_its_scales_and_the_exact_rows() -> None:
    model = tiny("llama", layers=4)
    caches = xquant_caches(model, bits=4, group=32, cl=1)
    greedy(model, random_tokens(300, 3), caches, steps=3, chunk=100)
    hidden = model.args.hidden_size
    for cache in caches:
        (fold,) = cache.folds
        assert fold.own["x"][0].shape[1] == cache.offset and fold.end == cache.offset - cache.store.rows
        assert bytes_of(fold.own) / cache.offset == hidden * 4 / 8 + 2 * (hidden // 32) * 4, "4 bits, scale, bias"
        assert cache.nbytes == cache.store.nbytes + bytes_of(fold.own), "the store's spare rows included"


def gqa_model(quantized: bool = False):
    """A tiny llama whose K and V together are half as wide as X (one KV head of four), as in SmolLM2;
    ``quantized``: its linear layers 8-bit (mlx's QuantizedLinear)."""
    mx.random.seed(0)
    model = build(config_for("llama", num_key_value_heads=1, num_hidden_layers=4))
    if quantized:
        nn.quantize(model, group_size=32, bits=8)
    return model


@pytest.mark.parametrize("quantized", [False, True])
def test_the_latent_is_taken_where_k_and_v_are_narrower_than_x_and_rebuilds_the_models_rows(quantized: bool) -> None:
    """``auto`` keeps the GQA latent (K's and V's width, 32, not X's 64) with no XQuant-CL groups; unquantized
    it decodes mlx_lm's tokens, also through quantized projections; at 4 bits its bytes are the latent's."""
    model = gqa_model(quantized)
    prompt = random_tokens(150, 1)
    expected = greedy(model, prompt)
    caches = xquant_caches(model, "chunk", bits=16)
    assert greedy(model, prompt, caches) == expected
    assert all(c.latent_on and not c.exact and c.group() == (c.layer,) for c in caches)
    caches = xquant_caches(model, bits=4, group=32)
    greedy(model, random_tokens(300, 3), caches, steps=3, chunk=100)
    width = 2 * model.args.hidden_size // model.args.num_attention_heads  # one KV head's keys and values
    for cache in caches:
        (fold,) = cache.folds
        assert set(fold.own) == {"l"} and fold.shared is None
        assert bytes_of(fold.own) / cache.offset == width * 4 / 8 + 2 * (width // 32) * 4, "4 bits, scale, bias"


@pytest.mark.parametrize("latent", [False, True])
def test_the_process_holds_less_than_unpatched_after_a_long_prompt(latent: bool) -> None:
    """X (a llama whose K and V are as wide as X), or the GQA latent (one KV head of four; groups of 32, its
    width)."""
    model = gqa_model() if latent else tiny("llama", layers=4)
    knobs = {"group": 32} if latent else {}
    prompt = random_tokens(2000, 5)
    mx.eval(prompt)
    held = []
    for patched in (False, True):
        mx.clear_cache()
        before = mx.get_active_memory()
        caches = xquant_caches(model, **knobs) if patched else make_prompt_cache(model)
        greedy(model, prompt, caches, steps=2, chunk=512)
        mx.eval([c.state for c in caches])
        mx.clear_cache()
        held.append((mx.get_active_memory() - before, sum(c.nbytes for c in caches)))
        veloxpatch.unpatch()
        del caches
    (vanilla, vanilla_bytes), (ours, our_bytes) = held
    assert our_bytes < 0.4 * vanilla_bytes and ours < 0.4 * vanilla, held


@pytest.mark.parametrize("cl, latent", [(1, "off"), (2, "off"), (2, "on")])
def test_a_saved_list_loads_back_and_finds_its_modules_at_the_next_step(tmp_path, cl: int, latent: str) -> None:
    model = tiny("qwen3", seed=2, layers=4)
    caches = xquant_caches(model, bits=4, cl=cl, latent=latent)
    greedy(model, random_tokens(200, 12), caches, steps=3, chunk=64)
    assert all(c.folds for c in caches)
    loaded = assert_round_trip(str(tmp_path / "prompt.safetensors"), model, caches)
    assert all(c.module() is layer.self_attn for c, layer in zip(loaded, model.layers))
    assert all(c.latent_on == (latent == "on") for c in loaded)
    if cl == 2 and latent == "off":
        assert loaded[0].folds[0].shared is loaded[1].folds[0].shared, "the anchor's X is linked again"
        assert sum(c.nbytes - c.store.nbytes for c in loaded) == sum(c.nbytes - c.store.nbytes for c in caches)


def test_a_loaded_list_run_without_the_layer_hooks_says_how_to_get_them(tmp_path) -> None:
    model = tiny("llama")
    caches = xquant_caches(model)
    greedy(model, random_tokens(100, 4), caches, steps=2)
    save_prompt_cache(str(tmp_path / "c.safetensors"), caches)
    veloxpatch.unpatch()
    veloxpatch.patch(kv="xquant", window=8)  # a new patch hooks a model's layers when it makes or starts a list
    loaded = load_prompt_cache(str(tmp_path / "c.safetensors"))
    with pytest.raises(RuntimeError, match="found when the model runs with veloxpatch's layer hooks"):
        model(mx.array([[1]]), cache=loaded)


def test_a_rejected_draft_and_a_trim_into_a_fold_leave_a_cache_of_the_prefix() -> None:
    model = tiny("llama", layers=4)
    caches = xquant_caches(model, "chunk", bits=16, cl_bits=16)  # lossless: a rewound and an untouched copy agree
    greedy(model, random_tokens(200, 14), caches, steps=2, chunk=50)
    assert_a_rejected_draft_leaves_no_trace(model, caches, steps=10)
    for cut in (150, 100):  # among the exact rows, then among the released ones
        before = [(c.keys, c.values) for c in caches]
        for cache in caches:
            cache.trim(cache.offset - cut)
        assert all(c.offset == cut == c.size() == x_rows(c) for c in caches), "the X of every token left"
        for cache, (keys, values) in zip(caches, before):
            assert mx.allclose(cache.keys, keys[..., :cut, :], atol=1e-5).item(), "the prefix's rows are unchanged"
            assert mx.allclose(cache.values, values[..., :cut, :], atol=1e-5).item()
    assert all(c.folded_rows() == 0 and c.store.rows == 100 for c in caches), "released rows of the prefix: exact"
    greedy(model, mx.array([3]), caches, steps=20, chunk=50)
    assert all(c.offset == c.size() == 121 and c.folded_rows() > 100 for c in caches), "released again, from X"


def test_speculative_decoding_keeps_the_offsets_of_mlx_lms_cache() -> None:
    steps, main, drafts = speculated("xquant")
    assert len(steps) == 40 and 0 < sum(from_draft for _, _, from_draft in steps) < 40
    for caches in (main, drafts):
        assert type(caches[0]) is KVCache
        assert all(c.offset == c.size() == caches[0].offset and c.folds for c in caches[1:])


def test_speculative_decoding_with_the_latent_decodes_mlx_lms_tokens() -> None:
    """A draft model and the main model both keeping the GQA latent (unquantized): mlx_lm's speculative tokens,
    draft steps trimmed from rebuilt rows."""
    model, draft = gqa_model(), gqa_model()
    prompt = random_tokens(150, 1)
    expected = [t for t, _, _ in speculative_generate_step(prompt, model, draft, num_draft_tokens=3, max_tokens=20)]
    caches = xquant_caches(model, "chunk", bits=16) + make_prompt_cache(draft)
    got = [t for t, _, _ in speculative_generate_step(prompt, model, draft, num_draft_tokens=3, max_tokens=20,
                                                      prompt_cache=caches)]
    assert got == expected
    assert all(c.latent_on and c.folded_rows() for c in caches)


@pytest.mark.parametrize("latent", [False, True])
def test_batched_generation_joins_the_rebuilt_rows_and_gives_mlx_lms_tokens(latent: bool) -> None:
    """mlx_lm's BatchGenerator handed XQuant caches that released rows (X, or the GQA latent; unquantized):
    each joins as the rows attention runs over, so the batch decodes what mlx_lm's own caches give."""
    model = gqa_model() if latent else tiny("llama", layers=4)
    prefixes = [random_tokens(120, 3).tolist(), random_tokens(90, 4).tolist()]
    prompts = [random_tokens(12, 5).tolist(), random_tokens(9, 6).tolist()]

    def batch(caches: list[list]) -> list[list[int]]:
        gen = BatchGenerator(model, max_tokens=5)
        return drain(gen, gen.insert(prompts, caches=caches))

    def prefilled(caches: list, tokens: list[int]) -> list:
        model(mx.array(tokens)[None], cache=caches)
        mx.eval([c.state for c in caches])
        return caches

    expected = batch([prefilled(make_prompt_cache(model), p) for p in prefixes])
    first = xquant_caches(model, "chunk", bits=16, cl_bits=16)
    ours = [prefilled(first, prefixes[0]), prefilled(make_prompt_cache(model), prefixes[1])]
    assert all(c.latent_on == latent and c.folded_rows() for caches in ours for c in caches)
    assert batch(ours) == expected


def test_cross_layer_groups_hold_the_first_layers_x_once_and_the_others_deltas() -> None:
    model = tiny("llama", layers=4)
    prompt = random_tokens(300, 6)
    expected = greedy(model, prompt, steps=8)
    caches = xquant_caches(model, bits=16, cl=2, cl_bits=16)
    assert greedy(model, prompt, caches, steps=8, chunk=100) == expected, "lossless deltas rebuild X exactly"
    veloxpatch.unpatch()
    for cl in (1, 2):
        caches = xquant_caches(model, bits=4, cl=cl, cl_bits=2)
        greedy(model, prompt, caches, steps=8, chunk=100)
        if cl == 2:
            anchor, partner = caches[0].folds[0], caches[1].folds[0]
            assert anchor.group == (0, 1) and anchor.own is None and partner.shared is anchor.shared
            assert set(partner.own) == {"d"} and caches[2].folds[0].shared is not anchor.shared
            shared = {id(f.shared): f.shared for c in caches for f in c.folds}
            owned = sum(c.store.nbytes + sum(bytes_of(f.own) for f in c.folds) for c in caches)
            assert sum(c.nbytes for c in caches) == owned + sum(bytes_of(s) for s in shared.values()), "once"
        folded = sum(c.nbytes - c.store.nbytes for c in caches)
        if cl == 1:
            alone = folded
        veloxpatch.unpatch()
    hidden = model.args.hidden_size
    four, two = (hidden * bits // 8 + 2 * hidden // 64 * 4 for bits in (4, 2))  # a float32 scale and bias per 64
    assert folded == pytest.approx(alone * (four + two) / (2 * four), rel=0.01), "4-bit X in half, 2-bit deltas"


@pytest.mark.parametrize("latent, cl", [(True, 4), (False, 1), (False, 2)])
def test_the_stats_line_says_every_token_is_kept_and_in_which_form(monkeypatch, latent: bool, cl: int) -> None:
    """xquant evicts nothing and ignores the budget: its VELOX_STATS line says every token is kept, how many as
    the 4-bit latent, X or deltas (K and V rebuilt) and how many exact, counts its folds rather than "0
    compression(s)", and gives its bytes against a dense cache's."""
    monkeypatch.setattr(stats, "totals", stats._Totals())
    model = gqa_model() if latent else tiny("llama", layers=4)
    caches = xquant_caches(model, bits=4, group=32, cl=cl, cl_bits=2)
    greedy(model, random_tokens(300, 3), caches, steps=3, chunk=100)
    rebuilt = sum(c.folded_rows() for c in caches)
    exact = sum(c.store.rows for c in caches)
    seen = sum(c.offset for c in caches)
    assert rebuilt + exact == seen and exact < seen / 4
    if latent:
        held = f"{rebuilt} as a 4-bit GQA latent (K and V rebuilt from it)"
    elif cl == 1:
        held = f"{rebuilt} as 4-bit X (K and V rebuilt from it)"
    else:  # layers 0 and 2 anchor a group (their X), 1 and 3 keep deltas from it; a tie keeps layer order
        held = (f"{rebuilt // 2} as 4-bit X (K and V rebuilt from it), "
                f"{rebuilt // 2} as 2-bit deltas from their group's 4-bit X (XQuant-CL; K and V rebuilt from it)")
    line = stats.summary("xquant", caches=caches)
    nbytes, dense = sum(c.nbytes for c in caches), sum(stats.dense_nbytes(c) for c in caches)
    assert line == (f"veloxpatch: xquant | 1 generation(s), 4 layer cache(s) built, 4 fold(s) | live: {seen}/{seen} "
                    f"rows kept (100.0%, VELOX_BUDGET does not apply): {held}, {exact} exact | KV "
                    f"{nbytes / 2**20:.2f} MiB vs {dense / 2**20:.2f} MiB dense ({100 * nbytes / dense:.1f}%)")
    assert nbytes < dense / 2


def test_attention_it_cannot_rebuild_keeps_exact_rows_with_one_log_line(monkeypatch, caplog) -> None:
    """phi3 projects q, k and v with one fused matrix: its layers keep exact rows and decode mlx_lm's tokens."""
    monkeypatch.setattr(veloxpatch.log, "_said", set())
    model = same_model("phi3")
    prompt = random_tokens(150, 1)
    expected = greedy(model, prompt)
    logger = logging.getLogger("veloxpatch")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="veloxpatch")
    try:
        caches = xquant_caches(model, log="INFO", bits=2)
        assert greedy(model, prompt, caches) == expected
    finally:
        logger.removeHandler(caplog.handler)
    assert all(c.exact and c.folded_rows() and all(set(f.own) == {"k", "v"} for f in c.folds) for c in caches)
    assert sum(c.nbytes for c in caches) >= sum(stats.dense_nbytes(c) for c in caches), "nothing saved, nothing hidden"
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("xquant: phi3 keeps exact K and V")]
    assert len(lines) == 1 and "no attribute 'k_proj'" in lines[0]


def test_rows_that_come_without_their_input_stay_exact() -> None:
    """A cache driven without the layer hooks (no model, or one where no attention module is found)."""
    cache = XQuantCache(CacheSpec(Budget(tokens=64), window=4))
    keys = mx.random.normal((1, 2, 40, 8), key=mx.random.key(1))
    for start, n in ((0, 30), (30, 1), (31, 9)):
        k, v = cache.update_and_fetch(keys[..., start : start + n, :], keys[..., start : start + n, :])
        cache.attend(mx.random.normal((1, 4, n, 8), key=mx.random.key(start)), k, v, 0.25)
    assert cache.exact and cache.folds and mx.array_equal(cache.keys, keys).item()


def test_the_probe_serves_every_full_attention_slot() -> None:
    model = tiny("gemma3_text")
    caches = xquant_caches(model)
    assert [type(c).__name__ for c in caches] == ["RotatingKVCache", "XQuantCache"] * 2
