"""The real ``mlx_lm server`` with the patch applied after its model loaded, so it batches.

A server that loads its model before the patch decides it can batch (mlx_lm's caches merge);
then its batched path meets our caches: fresh ones, and compressed ones with evicted rows that
its prompt cache kept from a request served one at a time (a request with a seed). Every request
must succeed, and a batched answer must be mlx_lm's own.
"""

from __future__ import annotations

import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from serving import post, running

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
# byte-level tokenizer: one token per character, so this prompt is far over the 64-row budget
PREFIX = "the quick brown fox jumps over the lazy dog; " * 4
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def served(model_dir: Path, tmp_path_factory):
    """(url, server log) of one server for this module, stopped at the end."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    with running([sys.executable, "-c", SERVER, "--model", str(model_dir)], log) as url:
        yield url, log


def expected_text(model_dir: Path, prompt: str) -> str:
    """mlx_lm's own greedy answer, unpatched, in this process."""
    from mlx_lm import generate, load

    model, tokenizer = load(str(model_dir))
    return generate(model, tokenizer, prompt, max_tokens=MAX_TOKENS)


def test_concurrent_requests_take_the_batched_path_and_succeed(served, model_dir: Path) -> None:
    url, log = served
    # a seed makes the server serve it alone, compressed; its cache stays in the server's prompt cache
    status, single = post(url, {"prompt": PREFIX, "max_tokens": MAX_TOKENS, "temperature": 0, "seed": 1})
    assert status == 200, (single, log.read_text())
    prompts = [PREFIX + "and again", PREFIX + "and again", "a short one", "another prompt, not cached"]
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda p: post(url, {"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0}),
                                prompts))
    for status, body in answers:
        assert status == 200, (body, log.read_text())
        assert body["choices"][0]["finish_reason"] in ("length", "stop"), body
    texts = [body["choices"][0]["text"] for _, body in answers]
    assert texts[0] == texts[1] == expected_text(model_dir, prompts[0]), "the evicted history was read again"
    output = log.read_text()
    assert "batched generation merges caches" in output, output
    assert "re-reading the tokens it saw" in output, output
    assert "Traceback" not in output, output
