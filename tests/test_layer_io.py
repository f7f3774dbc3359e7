"""Layer input/output hooks: found on every model of the zoo, called only for caches that ask, exact, undone."""

from __future__ import annotations

import importlib
import logging

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

import veloxpatch
from conftest import ARCHS, greedy, random_tokens, tiny
from veloxpatch import builder, eligibility
from veloxpatch.caches import CacheSpec, CompressedKVCache
from veloxpatch.config import Budget
from veloxpatch.eval.random_model import config_for
from veloxpatch.integration import layer_io
from veloxpatch.integration.state import STATE
from veloxpatch.methods.snapkv import SnapKVCache


class Recorder(SnapKVCache):
    """A SnapKV cache (at a budget nothing reaches) that records its stores and the hook calls it gets."""

    wants_layer_io = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.events: list[tuple] = []

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.events.append(("store", keys.shape[2]))
        return super().update_and_fetch(keys, values)

    def see_block_input(self, hidden: mx.array) -> None:
        self.events.append(("block", hidden.shape, hidden))

    def see_attention(self, normed: mx.array, output: mx.array) -> None:
        self.events.append(("attention", normed.shape, output.shape, normed, output))


class Deaf(Recorder):
    """Records the same, but does not ask for layer inputs and outputs."""

    wants_layer_io = False


def recorded(model, cls: type[Recorder]) -> list:
    """mlx_lm's cache list for ``model`` with ``cls`` caches in the slots snapkv gets (patched)."""
    veloxpatch.patch(kv="snapkv", budget=4096)
    slots = [i for i, c in enumerate(make_prompt_cache(model)) if isinstance(c, CompressedKVCache)]
    return eligibility.assemble(builder.mlx_caches(model), slots, lambda: cls(CacheSpec(Budget(tokens=4096))), "snapkv")


def hooked() -> list[str]:
    return [key for key in STATE.swaps if key.startswith("layer io")]


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_every_slot_of_ours_sees_its_block_input_and_attention_and_tokens_stay_mlx_lms(arch: str) -> None:
    """Per forward and slot: the block input, then the store, then the attention's input and output, each
    (batch, the step's tokens, hidden); prefill chunks and decode steps alike; the tokens are unchanged."""
    model = tiny(arch)
    prompt = random_tokens(100, 3)
    expected = greedy(model, prompt, steps=8)
    caches = recorded(model, Recorder)
    assert layer_io.install(model)
    assert greedy(model, prompt, caches, steps=8, chunk=32) == expected
    hidden = config_for(arch)["hidden_size"]
    ours = [c for c in caches if isinstance(c, Recorder)]
    assert ours
    for cache in ours:
        steps = [cache.events[i : i + 3] for i in range(0, len(cache.events), 3)]
        sizes = [store[1] for _, store, _ in steps]
        assert sum(sizes) == cache.offset and max(sizes) == 32 and sizes[-1] == 1, "prefill chunks, then decode"
        for (block, store, attention), n in zip(steps, sizes):
            assert (block[:2], store[0], attention[:3]) == (("block", (1, n, hidden)), "store",
                                                           ("attention", (1, n, hidden), (1, n, hidden)))


def test_a_cache_that_does_not_ask_is_never_called() -> None:
    model = tiny("llama")
    caches = recorded(model, Deaf)
    assert layer_io.install(model) and hooked()
    greedy(model, random_tokens(50, 4), caches, steps=3)
    assert {event[0] for cache in caches for event in cache.events} == {"store"}


def test_unpatch_restores_every_wrapped_call_and_the_model_then_calls_nothing_of_ours() -> None:
    model = tiny("lfm2")  # attention, decoder layer and short convolution: three classes
    classes = list(layer_io.hooked_classes(model))
    originals = {cls: vars(cls)["__call__"] for cls in classes}
    caches = recorded(model, Recorder)
    assert layer_io.install(model) and layer_io.install(model)
    assert len(classes) == 3 and len(hooked()) == 3, "each class wrapped once"
    assert all(vars(cls)["__call__"] is not originals[cls] for cls in classes)
    veloxpatch.unpatch()
    assert all(vars(cls)["__call__"] is originals[cls] for cls in classes) and not STATE.swaps
    model(random_tokens(20, 5)[None], cache=caches)
    assert {event[0] for cache in caches if isinstance(cache, Recorder) for event in cache.events} == {"store"}


def test_an_inherited_call_is_wrapped_on_the_class_that_defines_it() -> None:
    model = tiny("llama")
    base = type(model.layers[0].self_attn)
    original = vars(base)["__call__"]
    derived = type("DerivedAttention", (base,), {})
    for layer in model.layers:
        layer.self_attn.__class__ = derived
    caches = recorded(model, Recorder)
    assert layer_io.install(model) and "__call__" not in vars(derived)
    model(random_tokens(10, 6)[None], cache=caches)
    assert all(sum(event[0] == "attention" for event in cache.events) == 1 for cache in caches)
    veloxpatch.unpatch()
    assert vars(base)["__call__"] is original and "__call__" not in vars(derived)


class ToyAttention(nn.Module):
    """Takes its cache by keyword only and returns (output, weights), as some attention modules do."""

    def __call__(self, x: mx.array, *, cache=None) -> tuple[mx.array, str]:
        return 2 * x, "weights"


class ToyBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mixer = ToyAttention()

    def __call__(self, x: mx.array, mask, cache) -> mx.array:
        return x + self.mixer(x, cache=cache)[0]


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = [ToyBlock(), ToyBlock()]

    def __call__(self, x: mx.array, cache) -> mx.array:
        for layer, c in zip(self.layers, cache):
            x = layer(x, None, c)
        return x


def test_found_by_signature_whatever_the_names_with_the_first_element_of_a_tuple_output() -> None:
    model = Toy()
    caches = [Recorder(CacheSpec(Budget(tokens=64))), None]
    assert set(layer_io.hooked_classes(model)) == {ToyAttention, ToyBlock}
    assert layer_io.install(model)
    x = mx.array(np.random.default_rng(7).standard_normal((1, 3, 4)).astype(np.float32))
    model(x, caches)
    (_, _, block_input), (_, _, _, normed, output) = caches[0].events
    assert np.array_equal(np.array(block_input), np.array(x)) and np.array_equal(np.array(normed), np.array(x))
    assert np.array_equal(np.array(output), 2 * np.array(x))


class Flat(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def __call__(self, x: mx.array) -> mx.array:
        return self.proj(x)


def test_a_model_without_attention_modules_gets_nothing_and_one_info_line(caplog, monkeypatch) -> None:
    logger = logging.getLogger("veloxpatch")
    monkeypatch.setattr(logger, "propagate", False)  # records reach caplog once, through its handler
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="veloxpatch")
    try:
        assert not layer_io.install(Flat()) and not layer_io.install(Flat())
    finally:
        logger.removeHandler(caplog.handler)
    assert not hooked()
    lines = [r.getMessage() for r in caplog.records if "layer inputs and outputs" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("test_layer_io: no attention module")


def test_the_builder_hooks_a_model_only_for_a_method_that_asks() -> None:
    model = tiny("qwen3")
    veloxpatch.patch(kv="snapkv", budget=64)
    make_prompt_cache(model)
    assert not hooked()
    veloxpatch.patch(kv="squeeze", budget=64)
    make_prompt_cache(model)
    assert {type(model.layers[0]), type(model.layers[0].self_attn)} == {swap.owner for swap in STATE.swaps.values()
                                                                        if swap.name == "__call__"}


def test_a_generation_on_a_list_loaded_from_a_file_hooks_the_model(tmp_path) -> None:
    """A list from ``load_prompt_cache`` never went through ``make_prompt_cache``: the generation's start
    installs the hooks for caches that ask."""
    generation = importlib.import_module("mlx_lm.generate")  # generate_step looked up when called, as an app does
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    model = tiny("llama")
    veloxpatch.patch(kv="squeeze", budget=4096)
    save_prompt_cache(str(tmp_path / "c.safetensors"), make_prompt_cache(model))
    veloxpatch.unpatch()
    veloxpatch.patch(kv="squeeze", budget=4096)
    assert not hooked(), "nothing built yet in this patch"
    caches = load_prompt_cache(str(tmp_path / "c.safetensors"))
    list(generation.generate_step(random_tokens(20, 5), model, max_tokens=2, prompt_cache=caches))
    assert hooked(), "the generation installed them"
