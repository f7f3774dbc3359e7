"""The method registry: built-in methods found by discovery, what it refuses, and knobs through composition."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from veloxpatch.caches.crosslayer import CrossLayerCache
from veloxpatch.caches.evicting import EvictingCache
from veloxpatch.registry import METHODS, cache_class, knob_settings, method, name_of, policies
from veloxpatch.settings import Setting, int_range

BUILTIN = {"chunkkv", "expected_attention", "h2o", "minicache", "pyramidkv", "quant", "snapkv", "squeeze",
           "streamingllm", "tova", "xkv", "xquant"}


@pytest.fixture
def forget() -> Iterator[list[str]]:
    """Names of throwaway methods a test registers; removed after it."""
    names: list[str] = []
    yield names
    for name in names:
        METHODS.remove(name)


def test_every_module_of_the_methods_package_is_found_and_the_policies_are_those_offered() -> None:
    assert set(METHODS) == BUILTIN
    assert policies() == ("h2o", "snapkv", "streamingllm", "tova")
    assert cache_class("pyramidkv").policy_class is cache_class("snapkv").policy_class, "built on SnapKV, by id"


def test_a_cache_is_named_by_its_class_or_the_nearest_registered_base_without_the_class_being_changed(
        forget: list[str]) -> None:
    snapkv = cache_class("snapkv")
    assert "method" not in vars(snapkv), "the registry leaves the class it registers as it was written"
    assert name_of(object.__new__(snapkv)) == "snapkv"
    assert name_of(object.__new__(type("Narrower", (snapkv,), {}))) == "snapkv", "an unregistered subclass"
    forget.append("narrow")
    method("narrow", "test")(narrow := type("NarrowCache", (snapkv,), {}))
    assert name_of(object.__new__(narrow)) == "narrow", "registered itself: its own name, not its base's"
    assert name_of(object.__new__(type("Loose", (EvictingCache,), {}))) == "", "no registered class among its bases"


def test_a_class_offered_as_a_policy_must_have_one(forget: list[str]) -> None:
    with pytest.raises(ValueError, match="offered as a policy"):
        method("foldy", "test", policy=True)(type("FoldyCache", (CrossLayerCache,), {}))
    with pytest.raises(ValueError, match="already registered"):
        method("snapkv", "test")(type("AgainCache", (EvictingCache,), {}))
    with pytest.raises(ValueError, match="must be VELOX_NAMED_"):
        method("named", "test", (Setting("VELOX_OTHER_X", int, "1", "an integer", "x"),))(
            type("NamedCache", (EvictingCache,), {}))
    assert not {"foldy", "named"} & set(METHODS)


def test_knobs_reach_a_method_through_every_method_it_is_built_on(forget: list[str]) -> None:
    knob = Setting("VELOX_LAYERED_DEPTH", int_range(1, 9), "2", "an integer in [1, 9]", "test")  # marked layered's
    forget += ["layered", "outer"]
    method("layered", "test: built on pyramidkv", (knob,), composes=("pyramidkv",))(
        type("LayeredCache", (EvictingCache,), {"policy_class": cache_class("snapkv").policy_class}))
    method("outer", "test: built on layered", composes=lambda knobs: ("layered",))(
        type("OuterCache", (EvictingCache,), {"policy_class": cache_class("snapkv").policy_class}))
    assert set(knob_settings("outer", {})) == {"depth", "beta", "kernel", "pool"}
