"""Every entry into mlx_lm's batched generation works under the patch and gives mlx_lm's own tokens.

mlx_lm's ``BatchGenerator`` merges per-sequence caches into its batch caches, which ours cannot
join. Caches it makes itself stay mlx_lm's own; compressed caches a caller hands in are turned into
mlx_lm's (exactly, or by re-reading their tokens) or, handed straight to ``insert`` without their
tokens, refused before anything changes. ``batch_generate`` never meets that refusal: it serves
such caches one sequence at a time through ``generate_step``.
"""

from __future__ import annotations

import copy
import sys

import mlx.core as mx
import pytest
from mlx_lm import batch_generate, load
from mlx_lm.generate import BatchGenerator, BatchResponse, BatchStats, generate_step
from mlx_lm.models.cache import make_prompt_cache

import veloxpatch
from conftest import random_tokens

BUDGET = dict(kv="snapkv", budget=40, window=8, compress="chunk")  # prefills evict


@pytest.fixture(scope="module")
def loaded(model_dir):
    return load(str(model_dir))


def prefilled(model, tokens: list[int]) -> list:
    """A cache list (ours while patched) that has seen ``tokens``."""
    caches = make_prompt_cache(model)
    model(mx.array(tokens)[None], cache=caches)
    mx.eval([c.state for c in caches])
    return caches


def run(gen: BatchGenerator, uids: list[int]) -> list[list[int]]:
    """Drive the generator to the end; the tokens of each uid in order."""
    out: dict[int, list[int]] = {uid: [] for uid in uids}
    while responses := gen.next_generated():
        for r in responses:
            out[r.uid].append(r.token)
    gen.close()
    return [out[uid] for uid in uids]


def stepped(model, tokenizer, prompt: list[int], caches: list, limit: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probabilities from ``generate_step`` itself, ending at an eos token."""
    tokens, logprobs = [], []
    for token, vector in generate_step(mx.array(prompt), model, prompt_cache=caches, max_tokens=limit):
        if token in tokenizer.eos_token_ids:
            break
        tokens.append(token)
        logprobs.append(vector[token].item())
    return tokens, logprobs


def segments_tokens(model, segments: list[list[list[int]]], **insert) -> list[list[int]]:
    gen = BatchGenerator(model, max_tokens=6)
    return run(gen, gen.insert_segments(segments, **insert))


def test_batch_generate_with_fresh_compressed_caches(loaded) -> None:
    model, tokenizer = loaded
    prompts = [random_tokens(60, 1).tolist(), random_tokens(75, 2).tolist()]
    expected = batch_generate(model, tokenizer, prompts, max_tokens=5, return_token_ids=True).token_ids
    veloxpatch.patch(**BUDGET)
    caches = [make_prompt_cache(model) for _ in prompts]
    assert type(caches[0][0]).__name__ == "SnapKVCache"
    got = batch_generate(model, tokenizer, prompts, prompt_caches=caches, max_tokens=5, return_token_ids=True)
    assert got.token_ids == expected


def test_batch_generate_with_compressed_caches_that_hold_history(loaded) -> None:
    """History that lost nothing (fewer tokens than the budget) continues exactly as mlx_lm's own."""
    model, tokenizer = loaded
    prefixes = [random_tokens(30, 3).tolist(), random_tokens(20, 4).tolist()]
    prompts = [random_tokens(12, 5).tolist(), random_tokens(9, 6).tolist()]
    own = [prefilled(model, p) for p in prefixes]
    expected = batch_generate(model, tokenizer, prompts, prompt_caches=own, max_tokens=5,
                              return_token_ids=True).token_ids
    veloxpatch.patch(**BUDGET)
    ours = [prefilled(model, p) for p in prefixes]
    assert type(ours[0][0]).__name__ == "SnapKVCache" and ours[0][0].offset == 30
    got = batch_generate(model, tokenizer, prompts, prompt_caches=ours, max_tokens=5, return_token_ids=True)
    assert got.token_ids == expected


def test_insert_segments_called_directly_makes_mlx_lms_caches(loaded) -> None:
    """The server calls insert_segments, not insert."""
    model, _ = loaded
    segments = [[random_tokens(50, 7).tolist(), random_tokens(10, 8).tolist()], [random_tokens(64, 9).tolist()]]
    expected = segments_tokens(model, segments)
    veloxpatch.patch(**BUDGET)
    assert segments_tokens(model, segments) == expected
    assert type(make_prompt_cache(model)[0]).__name__ == "SnapKVCache", "single-sequence caches stay ours"


def test_compressed_history_with_its_tokens_is_read_again(loaded) -> None:
    """Evicted rows cannot be recovered from the cache, but the tokens it saw can be re-read."""
    model, _ = loaded
    prefix, rest = random_tokens(90, 10).tolist(), random_tokens(12, 11).tolist()
    other = random_tokens(40, 12).tolist()
    expected = segments_tokens(model, [[prefix + rest], [other]])
    veloxpatch.patch(**BUDGET)
    evicted = prefilled(model, prefix)
    assert evicted[0].evicted and evicted[0].size() < evicted[0].offset
    got = segments_tokens(model, [[rest], [other]], caches=[evicted, None], all_tokens=[prefix, []])
    assert got == expected


def test_compressed_history_without_its_tokens_is_refused_before_any_change(loaded) -> None:
    model, _ = loaded
    veloxpatch.patch(**BUDGET)
    evicted = prefilled(model, random_tokens(90, 13).tolist())
    gen = BatchGenerator(model, max_tokens=3)
    with pytest.raises(ValueError, match="evicted"):
        gen.insert([random_tokens(5, 14).tolist(), [1, 2, 3]], caches=[None, evicted])
    uids = gen.insert([[1, 2, 3]])
    assert uids == [0] and len(run(gen, uids)[0]) == 3, "the generator is untouched and still works"


def test_batch_generate_serves_evicted_caches_one_at_a_time(loaded) -> None:
    """No tokens to re-read: each sequence runs through generate_step on a copy of its caches."""
    model, tokenizer = loaded
    veloxpatch.patch(**BUDGET)
    evicted = prefilled(model, random_tokens(90, 13).tolist())
    assert evicted[0].evicted and evicted[0].size() < evicted[0].offset
    prompts = [random_tokens(5, 14).tolist(), random_tokens(30, 15).tolist()]
    limits = [6, 4]
    expected = [stepped(model, tokenizer, prompts[0], copy.deepcopy(evicted), limits[0]),
                stepped(model, tokenizer, prompts[1], make_prompt_cache(model), limits[1])]
    offsets = [c.offset for c in evicted]
    got = batch_generate(model, tokenizer, prompts, prompt_caches=[evicted, None], max_tokens=limits,
                         return_token_ids=True, return_logprobs=True, return_prompt_caches=True)
    assert isinstance(got, BatchResponse) and isinstance(got.stats, BatchStats)
    assert got.texts == [tokenizer.decode(tokens) for tokens, _ in expected]
    assert got.token_ids == [tokens for tokens, _ in expected]
    for logprobs, (_, want) in zip(got.logprobs, expected):
        assert logprobs == pytest.approx(want)
    assert [c.offset for c in evicted] == offsets, "the caller's caches are not updated in place"
    assert got.caches[0][0] is not evicted[0] and got.caches[0][0].offset > offsets[0]
    assert got.stats.prompt_tokens == 35 and got.stats.generation_tokens >= sum(map(len, got.token_ids))
    assert 0 < got.stats.prompt_time + got.stats.decode_time <= got.stats.wall_time


def test_batch_generate_is_bound_while_patched_only() -> None:
    import mlx_lm

    generate = sys.modules["mlx_lm.generate"]  # mlx_lm.generate is also a function's name
    veloxpatch.patch(**BUDGET)
    assert hasattr(generate.batch_generate, "__wrapped__") and mlx_lm.batch_generate is generate.batch_generate
    veloxpatch.unpatch()
    assert not hasattr(generate.batch_generate, "__wrapped__") and mlx_lm.batch_generate is generate.batch_generate


def test_sequential_batch_honours_logits_processors_and_eos(loaded) -> None:
    """An eos token ends a sequence unreported, as in mlx_lm's batch; processors see prompt and output."""
    model, tokenizer = loaded
    veloxpatch.patch(**BUDGET)
    eos = next(iter(tokenizer.eos_token_ids))
    prompt = random_tokens(5, 16).tolist()

    def eos_third(tokens: mx.array, logits: mx.array) -> mx.array:
        force = mx.where(mx.arange(logits.shape[-1]) == eos, 0.0, -mx.inf)
        return force[None] if tokens.size == len(prompt) + 2 else logits

    evicted = prefilled(model, random_tokens(90, 17).tolist())
    got = batch_generate(model, tokenizer, [prompt], prompt_caches=[evicted], max_tokens=8,
                         logits_processors=[eos_third], return_token_ids=True)
    assert len(got.token_ids[0]) == 2 and eos not in got.token_ids[0]
    assert got.stats.generation_tokens == 3
