"""The real ``mlx_lm server`` batches concurrent requests on compressed caches, whenever the patch came.

Patched before it loads its model (the launcher), the server finds our caches mergeable and batches; patched after
(this module's server), it decided so with mlx_lm's caches, and its batched path meets ours: fresh ones, and
compressed ones with evicted rows that its prompt cache kept from a request served one at a time (a request with a
seed). Every request must succeed, and a batched answer must be the one the same request gets alone.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import unless_offered
from serving import post, processed, running

pytestmark = unless_offered("batched generation")  # on mlx-lm 0.28-0.30 the server batches none of our caches

SERVER = textwrap.dedent("""
    import sys
    import mlx_lm.server as server
    import veloxpatch

    load = server.ModelProvider._load

    def load_then_patch(self, *args, **kwargs):
        load(self, *args, **kwargs)
        veloxpatch.patch(kv="snapkv", budget=64, window=8, log="INFO")

    server.ModelProvider._load = load_then_patch
    sys.argv = ["mlx_lm.server", *sys.argv[1:]]
    server.main()
""")
# mlx-lm 0.31's batched path never finalizes its detokenizer: an answer ending in an incomplete UTF-8 sequence (this
# tokenizer's tokens are bytes) lacks the replacement characters the single path ends it with (plain mlx_lm 0.31.3
# answers so too, without veloxpatch; 0.32 finalizes)
FINALIZES = "finalize()" in inspect.getsource(importlib.import_module("mlx_lm.server").ResponseGenerator._generate)


def as_alone(batched: str, alone: str) -> bool:
    """Whether a batched answer is the one its request got alone, as the installed mlx_lm's batched path gives it."""
    if FINALIZES:
        return batched == alone
    return alone.startswith(batched) and set(alone[len(batched):]) <= {"\ufffd"}


# byte-level tokenizer: one token per character, so this prompt is far over the 64-row budget
PREFIX = "the quick brown fox jumps over the lazy dog; " * 4
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def served(model_dir: Path, tmp_path_factory):
    """(url, server log) of one server for this module, stopped at the end."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    with running([sys.executable, "-c", SERVER, "--model", str(model_dir)], log) as url:
        yield url, log


def one_at_a_time(model_dir: Path, tmp_path: Path, prompts: list[str]) -> list[str]:
    """The answers of a fresh server of this module's kind to ``prompts``, each served alone (a seed), in order."""
    with running([sys.executable, "-c", SERVER, "--model", str(model_dir)], tmp_path / "alone.log") as url:
        answers = [post(url, {"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0, "seed": 1}) for p in prompts]
    return [body["choices"][0]["text"] for _, body in answers]


def test_concurrent_requests_take_the_batched_path_and_succeed(served, model_dir: Path, tmp_path: Path) -> None:
    url, log = served
    # a seed makes the server serve a request alone, compressed; its cache stays in the server's prompt cache
    status, single = post(url, {"prompt": PREFIX, "max_tokens": MAX_TOKENS, "temperature": 0, "seed": 1})
    assert status == 200, (single, log.read_text())
    # one batched request continues the cached prefix; the others share nothing with any (an answer that depended on
    # which of two racing requests stored its cache first would not be one to compare)
    prompts = [PREFIX + "and again", "a short one", "another prompt, not cached", "and one more"]
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda p: post(url, {"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0}),
                                prompts))
    for status, body in answers:
        assert status == 200, (body, log.read_text())
        assert body["choices"][0]["finish_reason"] in ("length", "stop"), body
    texts = [body["choices"][0]["text"] for _, body in answers]
    alone = one_at_a_time(model_dir, tmp_path, [PREFIX, *prompts])[1:]
    assert all(as_alone(b, a) for b, a in zip(texts, alone, strict=True)), (texts, alone)
    assert processed(answers[0][1]) < len(PREFIX), "a batched request reused the compressed prompt the first one left"
    held = answers[0][1]["usage"]["velox"]
    assert held["kv"] == "snapkv" and held["rows_kept"] < held["rows_seen"], held
    output = log.read_text()
    assert "Traceback" not in output, output


def test_the_openai_client_gets_batched_compressed_answers(served) -> None:
    """The real ``openai`` client, four completions at once (two streamed with their usage), each one's
    ``usage.velox`` what its own sequence held."""
    import openai

    url, log = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    prompts = [PREFIX + f"number {i}" for i in range(4)]

    def ask(i: int) -> tuple[str, dict]:
        options = dict(model="default_model", prompt=prompts[i], max_tokens=MAX_TOKENS, temperature=0)
        if i % 2:
            chunks = list(client.completions.create(**options, stream=True, stream_options={"include_usage": True}))
            usage = next(c.usage for c in chunks if c.usage is not None)
            return "".join(c.choices[0].text for c in chunks if c.choices), usage.model_dump()
        answer = client.completions.create(**options)
        return answer.choices[0].text, answer.usage.model_dump()

    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(ask, range(len(prompts))))
    for text, usage in answers:
        held = usage["velox"]
        assert text and held["kv"] == "snapkv" and 0 < held["rows_kept"] < held["rows_seen"], (usage, log.read_text())
    assert "Traceback" not in log.read_text()


def test_a_client_that_leaves_does_not_hold_up_the_next(served) -> None:
    """A non-streaming request whose client gave up goes on generating (the server cannot tell until it writes the
    answer), but in the batch: the next request is answered beside it. Last in this module: it never ends."""
    url, log = served
    with pytest.raises(OSError):  # the client's timeout
        post(url, {"prompt": PREFIX, "max_tokens": 10**6, "temperature": 0}, timeout=2)
    start = time.monotonic()
    status, body = post(url, {"prompt": "a quick one", "max_tokens": MAX_TOKENS, "temperature": 0}, timeout=60)
    assert status == 200, (body, log.read_text())
    assert time.monotonic() - start < 20, "the next request waited for the one whose client left"
