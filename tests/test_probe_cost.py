"""The eligibility probe costs little and changes nothing (issue 22, item 5).

It never evaluates a model the app has not evaluated (mlx-lm's own tests build default-size configs, 35B parameters,
and only look at output shapes), and it runs as many layers on a deep model as on a shallow one: a prefix of the
layers holding every kind of layer, whose verdict each later layer of a kind shares."""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten, tree_map
from mlx_lm.generate import generate_step
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import _get_classes

import veloxpatch
from conftest import random_tokens, tiny
from veloxpatch import builder, eligibility, structure
from veloxpatch.caches import CompressedKVCache
from veloxpatch.config import VeloxConfig
from veloxpatch.eval.random_model import config_for
from veloxpatch.fallback import StrictError


def lazy(arch: str = "llama", **overrides: Any) -> nn.Module:
    """mlx_lm's model for a small config, as mlx-lm's tests build one: its parameters never evaluated."""
    config = config_for(arch, **overrides)
    model_cls, args_cls = _get_classes(config)
    return model_cls(args_cls.from_dict(config))


def pending(model: nn.Module) -> int:
    """How many of ``model``'s parameters are not evaluated."""
    return sum(structure._pending(a) for _, a in tree_flatten(model.parameters()))


def compressed(caches: list) -> int:
    return sum(isinstance(c, CompressedKVCache) for c in caches)


def test_unevaluated_tells_a_lazy_model_from_an_evaluated_one_without_evaluating_it() -> None:
    model = lazy()
    total = len(tree_flatten(model.parameters()))
    assert structure.unevaluated(model) and pending(model) == total
    mx.eval(model.layers[0].parameters())
    assert structure.unevaluated(model) and 0 < pending(model) < total  # one evaluated layer is not the model
    mx.eval(model.parameters())
    assert not structure.unevaluated(model) and not structure.unevaluated(tiny("llama"))


def test_a_model_not_evaluated_yet_stays_so_and_runs_on_mlx_lms_caches_until_the_app_evaluates_it(records) -> None:
    model = lazy()
    total = pending(model)
    veloxpatch.patch(kv="snapkv", budget=64, log="INFO")
    caches = make_prompt_cache(model)
    assert compressed(caches) == 0 and pending(model) == total, "the probe evaluated the model"
    said = [r.getMessage() for r in records if r.levelno == logging.INFO]
    assert said == [f"llama with snapkv: {builder.LAZY}"]
    mx.eval(model.parameters())  # the app's first forward does this
    assert compressed(make_prompt_cache(model)) == len(model.layers)


def test_under_strict_a_model_not_evaluated_is_an_error_that_evaluates_nothing() -> None:
    model = lazy()
    total = pending(model)
    veloxpatch.patch(kv="snapkv", budget=64, strict=True)
    with pytest.raises(StrictError, match="not evaluated yet"):
        make_prompt_cache(model)
    assert pending(model) == total


def test_a_generation_on_a_lazy_model_is_compressed_from_its_first_list(monkeypatch) -> None:
    """``generate_step`` without a prompt cache evaluates the model with its first forward anyway: the model is
    evaluated just before mlx_lm makes the list, and the probe serves this generation."""
    evaluated = tiny("llama")
    expected = [t for t, _ in generate_step(random_tokens(12, 0), evaluated, max_tokens=3)]
    model = lazy()
    model.update(tree_map(lambda a: a + 0, evaluated.parameters()))  # the same weights, not evaluated
    assert structure.unevaluated(model)
    built: list[list] = []
    build = builder.build
    monkeypatch.setattr(builder, "build", lambda *args: built.append(build(*args)) or built[-1])
    veloxpatch.patch(kv="snapkv", budget=4096)
    assert [t for t, _ in generate_step(random_tokens(12, 0), model, max_tokens=3)] == expected
    assert len(built) == 1 and compressed(built[0]) == len(model.layers)


def calls_of(monkeypatch, block: type) -> list[int]:
    """A list whose one number counts every call of ``block`` (a module class) from now on."""
    calls = [0]
    original = block.__call__

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(block, "__call__", counted)
    return calls


@pytest.mark.parametrize(("arch", "shallow", "deep"), [("llama", 2, 24), ("gemma3_text", 4, 16)])
def test_the_probe_runs_as_many_layers_on_a_deep_model_as_on_a_shallow_one(monkeypatch, arch: str, shallow: int,
                                                                           deep: int) -> None:
    """llama: every layer of one kind; gemma3: sliding-window and full-attention layers alternating."""
    models = {n: tiny(arch, layers=n) for n in (shallow, deep)}
    block = type(models[shallow].layers[0])
    calls = calls_of(monkeypatch, block)
    veloxpatch.patch(kv="snapkv", budget=64)
    counted = {}
    for n, model in models.items():
        calls[0] = 0
        caches = make_prompt_cache(model)
        counted[n] = calls[0]
        assert compressed(caches) == sum(type(c).__name__ == "KVCache" for c in builder.mlx_caches(model)) > 0
    assert counted[deep] == counted[shallow] > 0, counted


class Unrouted(llama.Attention):
    """An attention that stores in its cache but attends with mlx's kernel, not through mlx_lm's routed function."""

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        b, n, _ = x.shape
        q, k, v = (p(x).reshape(b, n, h, -1).transpose(0, 2, 1, 3) for p, h in
                   ((self.q_proj, self.n_heads), (self.k_proj, self.n_kv_heads), (self.v_proj, self.n_kv_heads)))
        q, k = self.rope(q, offset=cache.offset), self.rope(k, offset=cache.offset)
        k, v = cache.update_and_fetch(k, v)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask="causal" if n > 1 else None)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, n, -1))


def unrouted_every_other_layer(layers: int) -> nn.Module:
    """A llama whose odd layers attend outside the routed function (their slots cannot be ours)."""
    model = tiny("llama", layers=layers)
    args = llama.ModelArgs.from_dict(config_for("llama", num_hidden_layers=layers))
    for layer in model.layers[1::2]:
        attention = Unrouted(args)
        attention.update(layer.self_attn.parameters())
        layer.self_attn = attention
    return model


def test_a_slot_past_the_prefix_gets_the_verdict_of_its_kind(monkeypatch) -> None:
    model = unrouted_every_other_layer(8)
    caches = builder.mlx_caches(model)
    part = structure.prefix(model, caches)
    assert part == structure.Prefix(4, (0, 1, 0, 1, 0, 1, 0, 1))
    config = VeloxConfig(kv="snapkv")
    veloxpatch.patch(config)
    slots = builder.candidate_slots(caches)
    blocks, forwards = (calls_of(monkeypatch, cls) for cls in (llama.TransformerBlock, llama.Model))
    found = eligibility.verdict(model, caches, slots, config, whole=False)
    assert forwards[0] > 0 and blocks[0] == 4 * forwards[0], "the probe ran more than the prefix"
    whole = eligibility._probe(model, caches, slots, config, whole=True)
    assert found.slots == whole.slots == (0, 2, 4, 6)
    assert found.left == whole.left and sorted(found.left) == [1, 3, 5, 7]
    assert all("routed function" in why for why in found.left.values())
    assert found.layouts == whole.layouts and len(found.layouts) == 8
    assert [type(c).__name__ for c in make_prompt_cache(model)] == ["SnapKVCache", "KVCache"] * 4


def walking_every_layer(monkeypatch, layers: int | None = None) -> None:
    """llama's inner forward, as some models of the zoo write theirs: every layer by index into the cache list
    (nemotron_h), or a count of its own instead of its list (kimi_k3), when ``layers`` is given."""
    def forward(self, inputs, cache=None, input_embeddings=None):
        h = self.embed_tokens(inputs)
        mask = llama.create_attention_mask(h, cache[0])
        for i in range(layers or len(self.layers)):
            h = self.layers[i](h, mask, cache=cache[i])
        return self.norm(h)

    monkeypatch.setattr(llama.LlamaModel, "__call__", forward)


def test_a_forward_that_walks_every_layer_runs_the_prefix_on_a_view_and_leaves_the_model_alone(monkeypatch,
                                                                                               records) -> None:
    model = tiny("llama", layers=6)
    inner, stack = model.model, model.layers
    walking_every_layer(monkeypatch)
    blocks, forwards = (calls_of(monkeypatch, cls) for cls in (llama.TransformerBlock, llama.Model))
    veloxpatch.patch(kv="snapkv", budget=64, log="DEBUG")
    assert compressed(make_prompt_cache(model)) == 6
    assert blocks[0] == 2 * forwards[0] > 0 and not [r for r in records if "every layer" in r.getMessage()]
    assert model.model is inner and model.layers is stack and len(stack) == 6


def test_a_forward_that_cannot_run_a_prefix_is_probed_whole(monkeypatch, records) -> None:
    model = tiny("llama", layers=6)
    walking_every_layer(monkeypatch, layers=6)
    blocks, forwards = (calls_of(monkeypatch, cls) for cls in (llama.TransformerBlock, llama.Model))
    veloxpatch.patch(kv="snapkv", budget=64, log="DEBUG")
    assert compressed(make_prompt_cache(model)) == 6
    said = [r.getMessage() for r in records if "every layer" in r.getMessage()]
    assert said == ["probing every layer of Model: a forward over 2 layers raised IndexError('list index out of "
                    "range')"]
    assert blocks[0] > 2 * forwards[0]


def test_layers_told_apart_by_class_attribute_shape_or_cache_and_not_by_their_index() -> None:
    model = tiny("llama", layers=6)
    caches = builder.mlx_caches(model)
    for i, layer in enumerate(model.layers):
        layer.layer_idx, layer.self_attn.number = i, i + 1  # counting the layers: a place, not a kind
    assert structure.prefix(model, caches) == structure.Prefix(2, (0,) * 6)
    model.layers[3].self_attn.use_rope = False
    model.layers[4].mlp.gate_proj = nn.Linear(64, 8, bias=False)
    assert structure.prefix(model, caches).kinds == (0, 0, 0, 3, 4, 0)
    from mlx_lm.models.cache import RotatingKVCache

    caches[1] = RotatingKVCache(max_size=16)
    assert structure.prefix(model, caches).kinds == (0, 1, 0, 3, 4, 0)
    assert structure.prefix(model, caches[:5]) is None  # slots that are not one per layer
