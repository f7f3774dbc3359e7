"""Every entry into mlx_lm's batched generation works under the patch and gives mlx_lm's own tokens.

mlx_lm's ``BatchGenerator`` merges per-sequence caches into its batch caches, which ours cannot
join. Caches it makes itself stay mlx_lm's own; compressed caches a caller hands in are turned into
mlx_lm's (exactly, or by re-reading their tokens) or refused before anything changes.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm import batch_generate, load
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache

import veloxpatch
from conftest import random_tokens

BUDGET = dict(kv="snapkv", budget=40, window=8)


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
