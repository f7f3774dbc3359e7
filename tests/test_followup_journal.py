"""bench/followup_server.py's journal: a chat counts again only for the variant it measured, its label and every
knob value its server's caches got (defaults resolved), so a changed default is measured again, not reused."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from conftest import bench_script

QUANT = {"VELOX_KV": "quant", "VELOX_BUDGET": "25%", "VELOX_COMPRESS": "end", "VELOX_TIER": "off"}


@pytest.fixture(scope="module")
def script() -> types.ModuleType:
    return bench_script("followup_server")


def test_the_knobs_resolve_defaults_and_keep_settings_that_are_no_knobs(script: types.ModuleType) -> None:
    share = script.server_knobs("quant", {**QUANT, "VELOX_QUANT_KEEP": "0.125x"})
    assert share["group"] == 32 and share["keep"] == "0.125x" and share["bits"] == 4
    assert script.server_knobs("quant", QUANT)["group"] == 64
    other = script.server_knobs("snapkv", {"VELOX_KV": "snapkv", "VELOX_BUDGET": "25%", "VELOX_SINK": "8"})
    assert other["kernel"] == 31 and other["VELOX_SINK"] == "8" and "VELOX_BUDGET" not in other


def test_an_old_chat_counts_for_the_full_cache_only(script: types.ModuleType) -> None:
    knobs = script.server_knobs("quant", {**QUANT, "VELOX_QUANT_KEEP": "0.125x"})
    new = {"variant": "quant[keep=0.125x]@25%", "knobs": knobs}
    old = {"variant": "quant[keep=0.125x]@25%"}
    assert script.chat_identity(old) != script.chat_identity(new)
    assert script.chat_identity({"variant": "full"}) == script.chat_identity({"variant": "full", "knobs": {}})
    assert script.table_name(new, [old, new]) == "quant[keep=0.125x]@25% (bits=4, budgets=model, floor=0.25, " \
        "group=32, keep=0.125x, pool=1, score=repeat, compress=end, tier=0)"
    assert script.table_name(old, [old, new]) == "quant[keep=0.125x]@25% (knobs not kept)"
    assert script.table_name(new, [new]) == "quant[keep=0.125x]@25%"


def test_a_rerun_measures_what_the_journal_lacks_and_tables_both(script: types.ModuleType, model_dir: Path,
                                                                 tmp_path: Path, monkeypatch) -> None:
    """A journal with a full-cache chat and a compressed one written before knobs were kept: the rerun measures the
    compressed chat again (its default may have changed), not the full cache's, and the table has both."""
    journal = tmp_path / "chats.jsonl"
    row = {"seed": 0, "context": 160, "facts": 3, "answers": ["", "", ""], "usage": {}, "right": [True, False, True]}
    journal.write_text("".join(json.dumps({**row, "variant": v}) + "\n" for v in ("full", "quant[keep=0.125x]@25%")))
    calls: list[dict[str, str]] = []

    def chat(model: str, tokenizer, ex, env: dict[str, str]) -> tuple[list[str], dict]:
        calls.append(env)
        return ["", "", ""], {}

    monkeypatch.setattr(script, "run_chat", chat)
    monkeypatch.setattr(sys, "argv", ["followup_server.py", "--model", str(model_dir), "--context", "160",
                                      "--samples", "1", "--kv", "quant", "--set", "VELOX_QUANT_KEEP=0.125x",
                                      "--facts", "3", "--out", str(tmp_path)])
    script.main()
    assert [env.get("VELOX_QUANT_KEEP") for env in calls] == ["0.125x"]
    table = (tmp_path / "table.md").read_text()
    assert "(knobs not kept)" in table and "group=32" in table and table.count("| full |") == 1
    script.main()  # everything is in the journal now
    assert len(calls) == 1

