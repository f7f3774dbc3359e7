"""Every fallback to mlx_lm's own behaviour: said once per (place, error type) with its traceback at DEBUG, or,
under ``VELOX_STRICT``, an error naming the method, the model type and the original error."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

import veloxpatch
from conftest import random_tokens, tiny
from veloxpatch.caches.evicting import EvictingCache, Policy
from veloxpatch.eval import zoo
from veloxpatch.eval.random_model import build
from veloxpatch.fallback import StrictError, fall_back
from veloxpatch.registry import METHODS, method


class Boom(ValueError):
    """What the broken method's score raises."""


@pytest.fixture
def broken() -> Iterator[str]:
    """A method whose score() raises: the probe meets it as soon as rows are evicted."""

    class Raising(Policy):
        def score(self, cache, keys: mx.array, positions: mx.array, scale: float) -> mx.array:
            raise Boom("the score is broken")

    @method("broken", "test: its score raises")
    class BrokenCache(EvictingCache):
        policy_class = Raising

    yield "broken"
    METHODS.remove("broken")


def generate(model, caches) -> list[int]:
    return [t for t, _ in generate_step(random_tokens(40, 1), model, max_tokens=4, prompt_cache=caches)]


def test_a_method_whose_score_raises_runs_on_mlx_lms_caches_with_one_warning(broken: str, records) -> None:
    model = tiny("llama")
    expected = generate(model, make_prompt_cache(model))
    veloxpatch.patch(kv=broken, budget=64, log="DEBUG")
    for _ in range(3):
        caches = make_prompt_cache(model)
        assert {type(c).__name__ for c in caches} == {"KVCache"}
        assert generate(model, caches) == expected
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert (warnings[0].startswith("llama with broken: ") and "Boom" in warnings[0]
            and "the score is broken" in warnings[0])
    traces = [r.getMessage() for r in records if r.levelno == logging.DEBUG and "Traceback" in r.getMessage()]
    assert len(traces) == 1 and "in score" in traces[0] and 'raise Boom("the score is broken")' in traces[0]


def test_under_strict_the_app_fails_with_that_error(broken: str) -> None:
    model = tiny("llama")
    veloxpatch.patch(kv=broken, budget=64, strict=True)
    with pytest.raises(StrictError) as raised:
        generate(model, make_prompt_cache(model))
    message = str(raised.value)
    assert "llama with broken" in message and "VELOX_STRICT" in message and "the score is broken" in message
    assert isinstance(raised.value.__cause__, Boom), "chained to the method's own error"
    assert 'raise Boom("the score is broken")' in message, "with where it was raised"


def test_under_strict_a_model_the_probe_turns_away_is_an_error() -> None:
    veloxpatch.patch(kv="snapkv", budget=64, strict=True)
    with pytest.raises(StrictError, match="gemma2 with snapkv: its attention does not go through mlx_lm's routed"):
        make_prompt_cache(build(zoo.small_config("gemma2")))
    with pytest.raises(StrictError, match="qwen2: no plain full-attention KVCache slot"):
        make_prompt_cache(tiny("qwen2"), max_kv_size=64)  # the user's RotatingKVCache: nothing to compress
    assert type(make_prompt_cache(tiny("llama"))[0]).__name__ == "SnapKVCache", "a model it can serve is served"


def test_each_place_and_error_type_is_said_once(records) -> None:
    veloxpatch.patch(kv="snapkv", log="DEBUG")
    config = veloxpatch.active_config()
    for error in (KeyError("a"), KeyError("b"), TypeError("c")):
        try:
            raise error
        except Exception as caught:
            fall_back("a place", caught, config, instead="nothing happens")
    fall_back("another place", KeyError("d"), config)
    said = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert said == ["a place failed for snapkv (KeyError: 'a'); nothing happens",
                    "a place failed for snapkv (TypeError: c); nothing happens",
                    "another place failed for snapkv (KeyError: 'd'); running unpatched mlx_lm"]
    traces = [r.getMessage() for r in records if r.levelno == logging.DEBUG]
    assert len(traces) == 2 and all("Traceback" in t for t in traces), "a raised error's traceback, at DEBUG"
