"""A request repeated on a cache its first answer was decoded on answers the same: a trim back into the last prompt
starts from the cache as that prompt left it (``caches/evicting.py``, ``Snapshot``), not from what decoding
compressed since. In process for every evicting method and mode, and through the real ``mlx_lm server``."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

import veloxpatch
from conftest import EVICTING, greedy, random_tokens, tiny
from serving import post, processed, running
from veloxpatch.assets import model_path
from veloxpatch.eval import tasks
from veloxpatch.eval.random_model import build, config_for

PROMPT = 600


def wide() -> object:
    """A random llama whose head_dim (32) mlx can quantize in groups of 32 (a 4-bit tier's)."""
    return build(config_for("llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=256), 1)


def served_again(caches: list, prompt: mx.array) -> list:
    """What the server does with a repeated prompt: a deep copy of the cache it kept, trimmed to the prompt but
    its last token, which it reads again."""
    again = copy.deepcopy(caches)
    trim_prompt_cache(again, caches[0].offset - (prompt.size - 1))
    return again


@pytest.mark.parametrize("method", EVICTING)
@pytest.mark.parametrize("mode", ["end", "chunk"])
@pytest.mark.parametrize("tier", ["off", "4"])
def test_a_repeated_prompt_gets_the_same_answer(method: str, mode: str, tier: str) -> None:
    model = wide() if tier != "off" else tiny("llama", seed=1)
    prompt = random_tokens(PROMPT, 3)
    veloxpatch.patch(kv=method, budget=64, window=8, compress=mode, tier=tier)
    caches = make_prompt_cache(model)
    first = greedy(model, prompt, caches, steps=80, chunk=128)
    assert sum(c.evicted for c in caches) and all(c.snapshot is not None for c in caches)
    again = served_again(caches, prompt)
    if tier != "off":  # the snapshot keeps no tier: the one rebuilt is the one the prompt left
        assert all(c.snapshot.nbytes(c) > 0 for c in caches), "decoding compacted (and tiered rows) after the prompt"
        just_read = make_prompt_cache(model)
        greedy(model, prompt, just_read, steps=1, chunk=128)
        for got, want in zip(again, just_read):
            assert mx.array_equal(got.tier.store.row_positions(), want.tier.store.row_positions()).item()
            assert mx.allclose(got.tier.store.fetch()[0], want.tier.store.fetch()[0], atol=1e-5).item()
    assert greedy(model, prompt[-1:], again, steps=80, chunk=128) == first
    assert all(c.snapshot is not None for c in caches), "the cache the server keeps keeps its snapshot"


@pytest.mark.parametrize("method", EVICTING)
@pytest.mark.parametrize("mode", ["end", "chunk"])
def test_a_repeated_follow_up_gets_the_same_answer(method: str, mode: str) -> None:
    """A request that continues a cached prompt with a few tokens (a chat's next turn, fewer than a prompt chunk):
    the server trims its kept cache back to the prompt, reads the new tokens and answers; the same request again
    answers the same, though its few tokens were read as a decode-sized step."""
    model = tiny("llama", seed=1)
    prompt, more = random_tokens(PROMPT, 3), random_tokens(9, 6)
    veloxpatch.patch(kv=method, budget=64, window=8, compress=mode)
    caches = make_prompt_cache(model)
    greedy(model, prompt, caches, steps=40, chunk=128)
    follow = copy.deepcopy(caches)
    trim_prompt_cache(follow, follow[0].offset - prompt.size)
    first = greedy(model, more, follow, steps=80, chunk=128)
    assert sum(c.evicted for c in follow)
    again = served_again(follow, mx.concatenate([prompt, more]))
    assert greedy(model, more[-1:], again, steps=80, chunk=128) == first


def test_a_trim_deeper_than_the_prompt_trims_what_the_prompt_left() -> None:
    model = tiny("llama", seed=1)
    prompt = random_tokens(PROMPT, 4)
    veloxpatch.patch(kv="snapkv", budget=64, window=8)
    caches = make_prompt_cache(model)
    greedy(model, prompt, caches, steps=1, chunk=128)
    left = copy.deepcopy(caches)
    greedy(model, mx.array([7]), caches, steps=60, chunk=128)
    assert all(c.snapshot.nbytes(c) > 0 for c in caches), "decoding compacted: the snapshot holds rows of its own"
    assert all(c.nbytes > c.store.nbytes + c.memory.nbytes for c in caches)
    for cache in (caches, left):
        trim_prompt_cache(cache, cache[0].offset - 300)
    for got, want in zip(caches, left):
        assert got.offset == 300 and got.snapshot is None
        assert mx.array_equal(got.store.row_positions(), want.store.row_positions()).item()
        assert mx.array_equal(got.store.fetch()[0], want.store.fetch()[0]).item()


def test_under_a_memory_target_no_snapshot_is_kept() -> None:
    model = tiny("llama", seed=1)
    veloxpatch.patch(kv="snapkv", budget=64, window=8, kv_memory="1GB")
    caches = make_prompt_cache(model)
    greedy(model, random_tokens(PROMPT, 5), caches, steps=3, chunk=128)
    assert all(c.snapshot is None for c in caches)


@pytest.mark.parametrize("mode", ["end", "chunk"])
def test_an_announced_prompt_leaves_one_snapshot_where_it_ends(mode: str) -> None:
    """mlx_lm's generate_step announces its prompt (``expect_prompt``): the snapshot is the cache after the step that
    reads the prompt's last token, not one taken again at the next step (the first answer token read)."""
    model = tiny("llama", seed=1)
    prompt = random_tokens(PROMPT, 6)
    veloxpatch.patch(kv="snapkv", budget=64, window=8, compress=mode)
    from mlx_lm.generate import generate_step  # the patched one, which announces its prompt

    caches = make_prompt_cache(model)
    for _, (_, _) in zip(range(4), generate_step(prompt, model, prompt_cache=caches, prefill_step_size=128)):
        pass
    assert all(c.offset > PROMPT + 1 for c in caches), "decoded past the prompt's end and one answer token"
    assert all(c.snapshot is not None and c.snapshot.offset == PROMPT for c in caches)


@pytest.mark.parametrize("method", ["snapkv", "h2o", "streamingllm"])
def test_the_server_answers_a_repeated_request_as_the_first_time(method: str, tmp_path: Path) -> None:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    prompt, _ = tasks.passkey_example(load_tokenizer(model_path()), 1024, 2006, depth=0.5)
    log = tmp_path / "log"
    serve = [sys.executable, "-m", "veloxpatch.cli", "run", "-m", "mlx_lm", "server", "--model", str(model_path()),
             "--log-level", "INFO"]
    with running(serve, log, {"VELOX_KV": method, "VELOX_BUDGET": "96"}) as url:
        texts, read = [], []
        for _ in range(2):
            status, body = post(url, {"prompt": prompt, "max_tokens": 40, "temperature": 0})
            assert status == 200, body
            texts.append(body["choices"][0]["text"])
            read.append(processed(body))
    assert read[1] < 5, f"the second request reused the first one's cache ({read})"
    assert texts[0] == texts[1]


@pytest.mark.parametrize("mode", ["end", "chunk"])
def test_a_short_next_turn_chooses_among_every_row(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A chat's next question shorter than the decode headroom (30 tokens under a 512-row budget's 64) is still a
    prompt: it takes the tier back, so its own queries choose among every row the first prompt left, and in ``end``
    mode nothing is compressed before its last token. (It used to be read as decode steps: compressed after its
    first chunk, the tier never taken back.)"""
    from veloxpatch.caches.evicting import EvictingCache

    model = wide()
    veloxpatch.patch(kv="snapkv", budget=512, window=8, compress=mode, tier="8")
    caches = make_prompt_cache(model)
    greedy(model, random_tokens(1200, 7), caches, steps=1, chunk=256)
    assert all(c.tier is not None and c.tier.rows for c in caches)
    took: list[int] = []
    held: list[int] = []
    take_back = EvictingCache._take_back
    compress = EvictingCache.compress

    def spy_take(self: EvictingCache, keys: mx.array, values: mx.array) -> None:
        took.append(self.tier.rows if self.tier is not None else 0)
        take_back(self, keys, values)

    def spy_compress(self: EvictingCache, keep: int, scale: float) -> None:
        held.append(self.store.rows)
        compress(self, keep, scale)

    monkeypatch.setattr(EvictingCache, "_take_back", spy_take)
    monkeypatch.setattr(EvictingCache, "compress", spy_compress)
    greedy(model, random_tokens(30, 8), caches, steps=1, chunk=256)
    assert len(took) == len(caches) and all(took), "every layer took its tier back for the question"
    if mode == "end":
        assert not held, "nothing compressed mid-question: the selection waits for its last token"
    assert all(c.store.rows <= 512 + c.schedule.headroom(512) for c in caches)
