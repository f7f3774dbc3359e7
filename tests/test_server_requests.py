"""Settings per request on the real ``mlx_lm server`` (issue 23, item 2): a request's own method and budget, in its
JSON body's ``velox`` field or in ``X-Velox-*`` headers, validated like the environment (a bad value is a 400 naming
the field, the value and what is allowed, and the server keeps serving); its answer's ``usage.velox`` says what its
KV cache holds; and a prompt cached under one setting is never reused under another.

The must-show: four clients at once, each a conversation of four turns over one shared document, each with its own
settings (the process's default, a body field with a method knob, no compression, headers), answer exactly as
the same conversation does on a server whose process-wide settings are that client's, one request at a time: the
same text, the same usage (tokens read from the prompt cache, KV bytes and rows kept). Every client's first turn is
the same prompt, so a prompt cache shared across settings would show as cached tokens there. Plain ``urllib``:
the ``openai`` package is not installed here, and the server's JSON is what is checked.
"""

from __future__ import annotations

import http.client
import json
import pickle
import re
import sys
import threading
from urllib.parse import urlparse

import pytest

import veloxpatch
from serving import post, running
from veloxpatch.assets import model_path
from veloxpatch.config import VeloxConfig
from veloxpatch.eval import tasks
from veloxpatch.integration import compat, features
from veloxpatch.integration.server import RequestError, Ticket, settings_of

PROCESS = {"VELOX_KV": "snapkv", "VELOX_BUDGET": "128", "VELOX_SNAPKV_KERNEL": "7"}
CLIENTS = (  # (JSON field, headers) of each client's requests
    (None, {}),
    ({"kv": "snapkv", "budget": "25%", "snapkv_kernel": 3}, {}),
    ({"kv": "none"}, {}),
    (None, {"X-Velox-Kv": "streamingllm", "X-Velox-Budget": "96"}),
)
TURNS = 4
MAX_TOKENS = 6
SERVE = [sys.executable, "-m", "veloxpatch.cli", "run", "-m", "mlx_lm", "server", "--model", str(model_path()),
         "--prompt-cache-size", "32"]


# --------------------------------------------------------------------- in process
BASE = VeloxConfig(kv="snapkv", budget=128, knobs={"snapkv_kernel": 7})


def test_a_request_that_says_nothing_gets_the_process_settings() -> None:
    assert settings_of({"prompt": "x"}, {}, BASE) is BASE
    assert settings_of({"velox": {}}, {}, BASE) is BASE


def test_body_and_headers_set_the_settings_a_request_may_carry() -> None:
    got = settings_of({"velox": {"kv": "h2o", "budget": "25%", "snapkv_kernel": 3}},
                      {"X-Velox-Window": "16", "x-velox-tier-size": "all", "Content-Type": "x"}, BASE)
    assert (got.kv, str(got.budget), got.window, str(got.tier_size), got.knobs["snapkv_kernel"]) == \
        ("h2o", "25%", 16, "all", 3)
    assert (got.sink, got.compress, got.stats) == (BASE.sink, BASE.compress, BASE.stats)  # the rest: the process's
    # the same value said in both places (in any spelling the setting parses alike) is no conflict
    assert settings_of({"velox": {"budget": "25%"}}, {"X-Velox-Budget": "25.0%"}, BASE).budget == got.budget


@pytest.mark.parametrize(("body", "headers", "said"), [
    ({"velox": {"budget": "abc"}}, {},
     "velox.budget: VELOX_BUDGET='abc' is not allowed: expected an integer >= 1 or a percentage in (0, 100]"),
    ({}, {"X-Velox-Kv": "snapkvv"}, "header X-Velox-Kv: VELOX_KV='snapkvv' is not allowed: expected one of none, "),
    ({"velox": {"budgett": 5}}, {}, "velox.budgett: 'budgett' is not a setting (did you mean 'budget'?); a request "
                                    "may carry kv, budget, sink, window, tier, tier_size, compress, draft_kv and"),
    ({"velox": {"float32": "on"}}, {}, "velox.float32: VELOX_FLOAT32 is the server process's setting, not a "
                                       "request's (the model's weights are cast once, when the model loads)"),
    ({"velox": {"kv_memory": "1GB"}}, {}, "velox.kv_memory: VELOX_KV_MEMORY is the server process's setting"),
    ({"velox": {"budget": None}}, {}, "velox.budget=None is not allowed: expected an integer >= 1 or a percentage"),
    ({"velox": "snapkv"}, {}, '"velox" must be a JSON object of settings'),
    ({"velox": {"budget": 64}}, {"X-Velox-Budget": "65"}, "velox.budget=64 and header X-Velox-Budget='65' disagree"),
    ({"velox": {"budget": 8}}, {}, "velox: VELOX_BUDGET=8 is not allowed: it must be at least VELOX_SINK + "
                                   "VELOX_WINDOW = 4 + 32 = 36"),
])
def test_a_bad_setting_names_the_field_the_value_and_what_is_allowed(body, headers, said) -> None:
    with pytest.raises(RequestError) as raised:
        settings_of(body, headers, BASE)
    assert str(raised.value).startswith(said), str(raised.value)
    assert isinstance(raised.value, ValueError)  # mlx_lm answers a ValueError of its parameter checks with 400


def test_the_cache_key_is_what_a_list_is_built_from() -> None:
    said_as_default = settings_of({"velox": {"kv": "snapkv", "budget": 128}}, {}, BASE)
    assert said_as_default.cache_settings() == BASE.cache_settings()
    assert settings_of({"velox": {"budget": 129}}, {}, BASE).cache_settings() != BASE.cache_settings()
    assert settings_of({"velox": {"snapkv_kernel": 3}}, {}, BASE).cache_settings() != BASE.cache_settings()
    # a knob of another method builds the same lists; with no method every setting does
    assert settings_of({"velox": {"chunkkv_chunk": 3}}, {}, BASE).cache_settings() == BASE.cache_settings()
    assert VeloxConfig(budget=64).cache_settings() == VeloxConfig(budget=512, window=8).cache_settings()


def test_a_ticket_travels_to_other_ranks_as_its_settings() -> None:
    ticket = Ticket(BASE)
    ticket.started, ticket.held = True, {"kv_bytes": 1}
    copy = pickle.loads(pickle.dumps(ticket))
    assert (copy.config, copy.started, copy.held) == (BASE, False, None)


def test_the_installed_mlx_lm_offers_settings_per_request() -> None:
    assert features.survey()["settings per request"] is None
    assert compat.check("the server's queued request") is None


def test_the_prompt_cache_keeps_each_setting_apart() -> None:
    import mlx_lm.server  # noqa: F401  (the feature is bound when the server module is seen)
    from mlx_lm.models.cache import KVCache, LRUPromptCache

    from veloxpatch.integration.state import serving

    veloxpatch.patch(BASE)
    prompts = LRUPromptCache()
    prompts.insert_cache("m", [1, 2, 3], [KVCache()])  # under the process's settings
    other = settings_of({"velox": {"budget": "25%"}}, {}, BASE)
    with serving(other):
        assert prompts.fetch_nearest_cache("m", [1, 2, 3, 4]) == (None, [1, 2, 3, 4])
        prompts.insert_cache("m", [1, 2, 3], [KVCache()])
    with serving(settings_of({"velox": {"kv": "snapkv", "budget": "128"}}, {}, BASE)):  # the process's, said
        assert prompts.fetch_nearest_cache("m", [1, 2, 3, 4])[1] == [4]
    assert len(prompts) == 2
    veloxpatch.unpatch()
    assert prompts.fetch_nearest_cache("m", [1, 2, 3, 4]) == (None, [1, 2, 3, 4])  # mlx_lm's own keys again


# --------------------------------------------------------------------- the real server
def document() -> tuple[str, list[str]]:
    """A shared document with four secret codes, and a question for each, in turn order."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    text, _ = tasks.multikey_example(load_tokenizer(model_path()), 500, seed=3, n_keys=TURNS)
    text = text[: text.rindex("What is")]
    names = re.findall(r"The secret code for (\w+) is", text)
    assert len(names) == TURNS, names
    return text, [tasks.MULTIKEY_QUESTION.format(name=n) for n in names]


def conversation(url: str, field: dict | None, headers: dict[str, str]) -> list[tuple[str, dict]]:
    """One client's turns, each the conversation so far: (answer, usage) per turn."""
    doc, questions = document()
    out: list[tuple[str, dict]] = []
    for question in questions:
        prompt = doc + "".join(f"{q}{a}\n" for q, (a, _) in zip(questions, out)) + question
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **({"velox": field} if field else {})}
        status, answer = post(url, body, headers=headers)
        assert status == 200, answer
        out.append((answer["choices"][0]["text"], answer["usage"]))
    return out


def process_env(field: dict | None, headers: dict[str, str]) -> dict[str, str]:
    """The process-wide settings equal to a client's: the server's, with what the client says as VELOX_*."""
    said = {k: str(v) for k, v in (field or {}).items()}
    said |= {name[len("X-Velox-"):].replace("-", "_").lower(): v for name, v in headers.items()}
    return {**PROCESS, **{f"VELOX_{k.upper()}": v for k, v in said.items()}}


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One server, the four clients at once; it stays up for the tests that follow."""
    log = tmp_path_factory.mktemp("shared") / "server.log"
    with running(SERVE, log, {**PROCESS, "VELOX_LOG": "INFO"}) as url:
        results: dict[int, list] = {}

        def client(i: int) -> None:
            try:
                results[i] = conversation(url, *CLIENTS[i])
            except BaseException as error:  # said in the main thread
                results[i] = error

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(CLIENTS))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for result in results.values():
            if isinstance(result, BaseException):
                raise result
        yield url, [results[i] for i in range(len(CLIENTS))], log


@pytest.fixture(scope="module")
def alone(tmp_path_factory) -> list[list[tuple[str, dict]]]:
    """Each client's conversation on a server of its own whose process-wide settings are the client's."""
    out = []
    for i, (field, headers) in enumerate(CLIENTS):
        log = tmp_path_factory.mktemp(f"alone{i}") / "server.log"
        with running(SERVE, log, process_env(field, headers)) as url:
            out.append(conversation(url, None, {}))
    return out


def test_concurrent_clients_with_their_own_settings_answer_as_one_at_a_time(shared, alone) -> None:
    _, concurrent, _ = shared
    for i, (together, by_itself) in enumerate(zip(concurrent, alone)):
        assert [a for a, _ in together] == [a for a, _ in by_itself], f"client {i}: {CLIENTS[i]}"
        for turn, ((_, usage), (_, reference)) in enumerate(zip(together, by_itself)):
            if CLIENTS[i][0] == {"kv": "none"}:  # alone, mlx_lm batches it on its own caches (usage not measured)
                usage = {**usage, "velox": {**usage["velox"], **reference["velox"]}}
            assert usage == reference, f"client {i}, turn {turn + 1}"


def test_requests_with_settings_of_their_own_are_batched(shared) -> None:
    _, _, log = shared
    assert "a server request with settings of its own joins a batch" in log.read_text()


def test_no_prompt_cache_is_shared_across_settings(shared) -> None:
    _, concurrent, _ = shared
    first_turns = [turns[0][1]["prompt_tokens_details"]["cached_tokens"] for turns in concurrent]
    assert first_turns == [0] * len(CLIENTS), "every client's first prompt is the same; each setting reads it anew"
    for turns in concurrent:
        later = [usage["prompt_tokens_details"]["cached_tokens"] for _, usage in turns[1:]]
        assert all(c > 0 for c in later), f"each turn reuses its own conversation's cache: {later}"


def test_usage_says_what_each_requests_kv_holds(shared) -> None:
    _, concurrent, _ = shared
    held = [turns[-1][1]["velox"] for turns in concurrent]
    assert [(h["kv"], h["budget"]) for h in held] == [("snapkv", "128"), ("snapkv", "25%"), ("none", None),
                                                      ("streamingllm", "96")]
    for h, turns in zip(held, concurrent):
        assert h["rows_seen"] == 4 * turns[-1][1]["total_tokens"]  # 4 layers, each token (mlx_lm reads one ahead)
        assert h["share_kept"] == round(h["rows_kept"] / h["rows_seen"], 4)
    assert held[2]["share_kept"] == 1.0 and held[2]["kv_bytes"] == held[2]["dense_kv_bytes"]
    assert held[3]["share_kept"] < held[0]["share_kept"] < held[1]["share_kept"] < 1
    assert all(h["kv_bytes"] < h["dense_kv_bytes"] for h in (held[0], held[1], held[3]))


def posted(url: str, path: str, body: dict, headers: dict[str, str] | None = None) -> tuple[int, str]:
    """POST ``body`` to ``path``: (status, the answer's text)."""
    where = urlparse(url)
    connection = http.client.HTTPConnection(where.hostname, where.port, timeout=120)
    connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json", **(headers or {})})
    answer = connection.getresponse()
    return answer.status, answer.read().decode()


def streamed_usage(url: str, body: dict) -> dict:
    """The usage chunk of a streamed completion (``stream_options.include_usage``)."""
    status, text = posted(url, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200, text
    chunks = [json.loads(e[len("data: "):]) for e in text.split("\n\n") if e.startswith("data: {")]
    return next(c["usage"] for c in chunks if c.get("usage"))


@pytest.mark.parametrize(("body", "headers", "said"), [
    ({"velox": {"budget": "abc"}}, {},
     "velox.budget: VELOX_BUDGET='abc' is not allowed: expected an integer >= 1 or a percentage in (0, 100]"),
    ({}, {"X-Velox-Tier": "5"}, "header X-Velox-Tier: VELOX_TIER='5' is not allowed: expected off, or one of"),
    ({"velox": {"strict": True}}, {}, "velox.strict: VELOX_STRICT is the server process's setting"),
])
def test_a_bad_setting_is_a_400_and_the_server_keeps_serving(shared, body, headers, said) -> None:
    url, _, _ = shared
    status, answer = post(url, {"prompt": "The pass key is", "max_tokens": 2, **body}, headers=headers)
    assert status == 400
    assert json.loads(answer["error"])["error"].startswith(said), answer
    status, answer = post(url, {"prompt": "The pass key is", "max_tokens": 2, "temperature": 0})
    assert status == 200 and answer["usage"]["velox"]["kv"] == "snapkv"


def test_a_streamed_answer_says_its_kv_in_its_usage_chunk(shared) -> None:
    url, _, _ = shared
    usage = streamed_usage(url, {"prompt": "The pass key is 1234. The pass key is", "max_tokens": 3,
                                 "temperature": 0, "velox": {"kv": "streamingllm", "budget": 40}})
    assert usage["velox"]["kv"] == "streamingllm" and usage["velox"]["rows_seen"] > 0, usage


def test_a_chat_completion_takes_its_settings_from_headers(shared) -> None:
    url, _, _ = shared
    status, text = posted(url, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "The pass key is 4242. What is the pass key?"}], "max_tokens": 3,
        "temperature": 0}, {"X-Velox-Kv": "tova", "X-Velox-Budget": "40"})
    assert status == 200, text
    assert json.loads(text)["usage"]["velox"]["kv"] == "tova"
