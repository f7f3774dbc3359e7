"""The VELOX_* registry: parsing, clear errors, unknown names (its generated pages: tests/test_docs.py)."""

from __future__ import annotations

import pytest

from veloxpatch.config import Budget, ConfigError, VeloxConfig, from_env
from veloxpatch.registry import METHODS


def test_defaults_pass_through() -> None:
    config = from_env({}).config
    assert config.kv == "none" and not config.enabled
    assert config.budget == Budget(tokens=1024) and (config.sink, config.window) == (4, 32)


@pytest.mark.parametrize("name,value,allowed", [
    ("VELOX_KV", "snapk", "one of none, " + ", ".join(sorted(METHODS))),
    ("VELOX_BUDGET", "0", "an integer >= 1 or a percentage"),
    ("VELOX_BUDGET", "150%", "an integer >= 1 or a percentage"),
    ("VELOX_BUDGET", "1k", "an integer >= 1 or a percentage"),
    ("VELOX_SINK", "-2", "an integer >= 0"),
    ("VELOX_WINDOW", "wide", "an integer >= 1"),
    ("VELOX_LOG", "loud", "one of DEBUG, INFO, WARNING, ERROR"),
    ("VELOX_STRICT", "maybe", "a boolean"),
    ("VELOX_SNAPKV_KERNEL", "4", "an odd integer in [1, 63]"),
    ("VELOX_SNAPKV_POOL", "median", "one of avg, max"),
    ("VELOX_QUANT_POOL", "8", "an odd integer in [1, 63]"),
])
def test_bad_values_name_the_setting_the_value_and_what_is_allowed(name: str, value: str, allowed: str) -> None:
    with pytest.raises(ConfigError) as error:
        from_env({"VELOX_KV": "snapkv", name: value})
    assert f"{name}={value!r} is not allowed" in str(error.value)
    assert allowed in str(error.value)


def test_budget_forms() -> None:
    assert Budget.parse("25%").resolve(1000) == 250
    assert Budget.parse("100%").resolve(77) == 77
    assert Budget.parse("12.5%").resolve(9) == 2
    assert Budget.parse(" 512 ").resolve(10_000) == 512
    with pytest.raises(ConfigError, match="at least VELOX_SINK \\+ VELOX_WINDOW = 4 \\+ 32 = 36"):
        VeloxConfig(kv="snapkv", budget=20)
    assert VeloxConfig(kv="none", budget=20).budget.tokens == 20


def test_unknown_names_get_the_closest_valid_name() -> None:
    warnings = from_env({"VELOX_WINDWO": "8", "VELOX_ZZZ": "1"}).warnings
    assert warnings[0] == "unknown setting VELOX_WINDWO; did you mean VELOX_WINDOW? (see `veloxpatch info`)"
    assert warnings[1].startswith("unknown setting VELOX_ZZZ") and "did you mean" not in warnings[1]


@pytest.mark.parametrize("method", ["xkv", "minicache", "xquant"])
def test_a_tier_given_to_a_method_that_drops_no_row_is_said_to_do_nothing(method: str) -> None:
    warnings = from_env({"VELOX_KV": method, "VELOX_TIER": "4"}).warnings
    assert warnings == [f"VELOX_TIER=4 does nothing with VELOX_KV={method}: it keeps the rows a method drops, and "
                        f"{method} drops none (it keeps every token in a form of its own); it is for chunkkv, "
                        "expected_attention, h2o, pyramidkv, snapkv, squeeze, streamingllm, tova"]
    assert from_env({"VELOX_KV": method}).warnings == [], "the default says nothing"
    assert from_env({"VELOX_KV": "snapkv", "VELOX_TIER": "4"}).warnings == []


def test_patch_takes_a_methods_knobs_by_key_and_names_an_unknown_setting() -> None:
    import veloxpatch

    given = VeloxConfig().replace(kv="quant", quant_keep="0.125x", budget="25%")
    assert given == from_env({"VELOX_KV": "quant", "VELOX_QUANT_KEEP": "0.125x", "VELOX_BUDGET": "25%"}).config
    assert given.replace(quant_bits=3).knobs["quant_keep"] == given.knobs["quant_keep"], "other knobs kept"
    with pytest.raises(ConfigError, match="unknown setting 'quant_kep': did you mean quant_keep"):
        veloxpatch.patch(kv="quant", quant_kep="0.125x")
    with pytest.raises(ConfigError, match="VELOX_QUANT_KEEP='all' is not allowed"):
        veloxpatch.patch(kv="quant", quant_keep="all")


def test_python_form_matches_the_environment_form() -> None:
    env = {"VELOX_KV": "snapkv", "VELOX_BUDGET": "25%", "VELOX_SNAPKV_POOL": "max", "VELOX_STATS": "yes"}
    loaded = from_env(env)
    python = VeloxConfig(kv="snapkv", budget="25%", stats=True, knobs={"snapkv_pool": "max"})
    assert loaded.config == python
    assert from_env(python.to_env()).config == python
    assert loaded.sources["VELOX_BUDGET"] == "environment (VELOX_BUDGET)" and loaded.sources["VELOX_SINK"] == "default"
    with pytest.raises(ConfigError, match="unknown method knob"):
        VeloxConfig(knobs={"snapkv_kernal": 3})

