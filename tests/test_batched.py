"""Every entry into mlx_lm's batched generation works under the patch and gives the right tokens.

mlx_lm's ``BatchGenerator`` merges per-sequence caches into its batch caches, which ours cannot
join. Caches it makes itself stay mlx_lm's own; compressed caches a caller hands in are turned into
mlx_lm's exactly, by re-reading their tokens, or, handed to ``insert`` without their tokens, with
the rows they kept at their true positions: such a sequence gives the tokens the compressed cache
gives on its own (eviction frozen) and comes back out as a compressed cache. ``batch_generate``
serves such caches one sequence at a time through ``generate_step``.
"""

from __future__ import annotations

import copy
import sys

import mlx.core as mx
import pytest
from mlx_lm import batch_generate, load
from mlx_lm.generate import BatchGenerator, BatchResponse, BatchStats, generate_step
from mlx_lm.models.cache import KVCache, make_prompt_cache

import veloxpatch
from conftest import drain, random_tokens
from veloxpatch.caches import CompressedKVCache
from veloxpatch.config import Budget
from veloxpatch.integration import batched

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


def stepped(model, tokenizer, prompt: list[int], caches: list, limit: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probabilities from ``generate_step`` itself, ending at an eos token."""
    tokens, logprobs = [], []
    for token, vector in generate_step(mx.array(prompt), model, prompt_cache=caches, max_tokens=limit):
        if token in tokenizer.eos_token_ids:
            break
        tokens.append(token)
        logprobs.append(vector[token].item())
    return tokens, logprobs


def frozen(caches: list) -> list:
    """A copy of ``caches`` whose compressed caches evict nothing more (a batch keeps every new row)."""
    caches = copy.deepcopy(caches)
    for cache in caches:
        if isinstance(cache, CompressedKVCache):
            cache.budget = Budget(tokens=1 << 20)
    return caches


def alone(model, prompt: list[int], caches: list, limit: int) -> list[int]:
    """``limit`` greedy tokens from ``generate_step`` on ``caches`` itself (no stop token)."""
    return [token for token, _ in generate_step(mx.array(prompt), model, prompt_cache=caches, max_tokens=limit)]


def segments_tokens(model, segments: list[list[list[int]]], **insert) -> list[list[int]]:
    gen = BatchGenerator(model, max_tokens=6)
    return drain(gen, gen.insert_segments(segments, **insert))


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


def test_batch_generate_with_folded_cross_layer_caches_attends_over_their_rebuilt_rows(loaded) -> None:
    """A cross-layer cache evicts nothing: it joins as a copy of the rows attention runs over, the folds'
    rebuilt rows first. At full rank those are the rows, so the tokens are mlx_lm's own."""
    model, tokenizer = loaded
    prefixes = [random_tokens(300, 3).tolist(), random_tokens(280, 4).tolist()]  # longer than the rank (256)
    prompts = [random_tokens(12, 5).tolist(), random_tokens(9, 6).tolist()]
    own = [prefilled(model, p) for p in prefixes]
    expected = batch_generate(model, tokenizer, prompts, prompt_caches=own, max_tokens=5,
                              return_token_ids=True).token_ids
    veloxpatch.patch(kv="xkv", window=8, compress="chunk", knobs={"xkv_rank": "100%"})
    ours = [prefilled(model, p) for p in prefixes]
    # earlier layers of a group fold on their next call: pending until then
    assert all((c.folds or c.pending) and c.size() == c.offset for caches in ours for c in caches)
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


def test_compressed_history_without_its_tokens_joins_at_its_true_positions(loaded) -> None:
    """No tokens to re-read: the batch attends over the rows the cache kept, at their positions."""
    model, _ = loaded
    veloxpatch.patch(**BUDGET)
    evicted = prefilled(model, random_tokens(90, 13).tolist())
    assert evicted[0].evicted and evicted[0].size() < evicted[0].offset
    prompt = random_tokens(5, 14).tolist()
    reference = frozen(evicted)
    expected = alone(model, prompt, reference, 6)
    assert all(r.size() - e.size() == r.offset - e.offset for r, e in zip(reference, evicted)), "nothing evicted"
    state = [(c.offset, c.size()) for c in evicted]
    gen = BatchGenerator(model, max_tokens=6)
    assert drain(gen, gen.insert([prompt], caches=[evicted])) == [expected]
    assert [(c.offset, c.size()) for c in evicted] == state, "the caller's caches are not updated"


def test_joined_sequence_batches_with_plain_ones_first_in_the_call(loaded) -> None:
    """A plain history first in the call (mlx_lm merges with the first sequence's cache), a fresh
    prompt, and an evicted cache: left padding and right-padded prefill, each as it would alone."""
    model, _ = loaded
    history = prefilled(model, random_tokens(60, 20).tolist())  # unpatched: mlx_lm's KVCache
    prompts = [random_tokens(7, 21).tolist(), random_tokens(30, 22).tolist(), random_tokens(4, 23).tolist()]
    expected = [alone(model, prompts[0], copy.deepcopy(history), 5),
                alone(model, prompts[1], make_prompt_cache(model), 5)]
    veloxpatch.patch(**BUDGET)
    evicted = prefilled(model, random_tokens(90, 24).tolist())
    assert evicted[0].evicted
    expected.append(alone(model, prompts[2], frozen(evicted), 5))
    gen = BatchGenerator(model, max_tokens=5)
    assert drain(gen, gen.insert(prompts, caches=[history, None, evicted])) == expected
    assert type(history[0]) is KVCache and history[0].offset == 60, "the caller's caches stay as they were"


@pytest.mark.parametrize("tier", ["off", "4"])
@pytest.mark.parametrize("started", [False, True], ids=["plain-waiting", "plain-running"])
def test_joined_sequence_comes_back_as_a_compressed_cache(loaded, started: bool, tier: str) -> None:
    """Inserted after a plain sequence (still waiting, or already in a running batch), the evicted
    cache's sequence comes back out as a compressed cache holding its rows at their positions (with a tier,
    its tier setting and an empty tier: a batch keeps the exact rows only)."""
    model, _ = loaded
    plain = random_tokens(20, 30).tolist()
    plain_expected = alone(model, plain, make_prompt_cache(model), 4)
    veloxpatch.patch(**BUDGET, tier=tier)
    evicted = prefilled(model, random_tokens(90, 31).tolist())
    prompt = random_tokens(6, 32).tolist()
    expected = alone(model, prompt, frozen(evicted), 4)
    gen = BatchGenerator(model, max_tokens=4, prefill_step_size=8)
    (first,) = gen.insert([plain])
    if started:
        gen.next()  # the plain sequence's prefill has begun: a batch cache of mlx_lm's runs
    (joined,) = gen.insert([prompt], caches=[evicted])
    tokens: dict[int, list[int]] = {first: [], joined: []}
    finished = {}
    while responses := gen.next_generated():
        for r in responses:
            tokens[r.uid].append(r.token)
            if r.finish_reason is not None:
                finished[r.uid] = r
    gen.close()
    assert tokens == {first: plain_expected, joined: expected}

    back, seen = finished[joined].prompt_cache, finished[joined].all_tokens
    assert seen == prompt + expected
    reference = frozen(evicted)
    model(mx.array(seen)[None], cache=reference)
    for got, want in zip(back, reference):
        assert type(got) is type(want) and got.offset == want.offset == 90 + len(seen)
        assert (got.tier is None) == (tier == "off") and (got.tier is None or got.tier.rows == 0)
        assert mx.array_equal(got.store.row_positions(), want.store.row_positions())
        assert mx.allclose(got.keys, want.keys, atol=1e-4) and mx.allclose(got.values, want.values, atol=1e-4)
    more = random_tokens(3, 33).tolist()
    assert alone(model, more, frozen(back), 4) == alone(model, more, reference, 4), "it continues right"
    plain_back = finished[first].prompt_cache
    assert type(plain_back[0]) is KVCache and plain_back[0].offset == len(finished[first].all_tokens)


def test_joined_sequence_given_back_before_its_prefill_can_be_inserted_again(loaded) -> None:
    model, _ = loaded
    veloxpatch.patch(**BUDGET)
    evicted = prefilled(model, random_tokens(90, 40).tolist())
    prompts = [random_tokens(9, 41).tolist(), random_tokens(5, 42).tolist()]
    expected = [alone(model, prompts[0], make_prompt_cache(model), 4), alone(model, prompts[1], frozen(evicted), 4)]
    gen = BatchGenerator(model, max_tokens=4)
    (uid,) = gen.insert([prompts[1]], caches=[evicted])
    waiting, _ = gen.remove([uid], return_prompt_caches=True)[uid]
    with pytest.raises(ValueError, match="insert them into a BatchGenerator again"):
        alone(model, prompts[1], copy.deepcopy(waiting), 1)
    again = BatchGenerator(model, max_tokens=4)
    assert drain(again, again.insert(prompts, caches=[None, waiting])) == expected


@pytest.mark.parametrize("uneven", ["holes", "layers"])
def test_uneven_rows_join_compressed_to_the_fewest(loaded, uneven: str) -> None:
    """A batch masks every head and layer of a sequence alike: heads left uneven by a trim (holes),
    or layers with different budgets, join as copies compressed to the fewest rows any holds, and
    the batch gives the tokens those copies give on their own."""
    model, _ = loaded
    veloxpatch.patch(**BUDGET)
    evicted = prefilled(model, random_tokens(90, 13).tolist())
    if uneven == "holes":
        for cache in evicted:
            cache.trim(9)
        assert any(bool((c.store.row_positions() < 0).any().item()) for c in evicted), "the trim left holes"
    else:
        evicted[1].compress(evicted[1].size() - 6, 0.25)
    state = [(c.offset, c.size()) for c in evicted]
    equal = batched._equal_rows(evicted)
    fewest = min(c.size() for c in equal)
    assert all(c.size() == fewest and not bool((c.store.row_positions() < 0).any().item()) for c in equal)
    prompt = random_tokens(5, 14).tolist()
    expected = alone(model, prompt, frozen(equal), 3)
    gen = BatchGenerator(model, max_tokens=3)
    assert drain(gen, gen.insert([prompt], caches=[evicted])) == [expected]
    assert [(c.offset, c.size()) for c in evicted] == state, "the caller's caches are not changed"


def test_compressed_and_plain_layers_with_different_rows_without_tokens_are_refused(loaded) -> None:
    """One mask serves every layer of a batch; mlx_lm's own cache cannot be compressed to match."""
    model, _ = loaded
    tokens = random_tokens(90, 13).tolist()
    plain = prefilled(model, tokens)
    veloxpatch.patch(**BUDGET)
    mixed = prefilled(model, tokens)
    mixed[1] = plain[1]
    gen = BatchGenerator(model, max_tokens=3)
    with pytest.raises(ValueError, match="different numbers of rows"):
        gen.insert([[1, 2, 3]], caches=[mixed])
    assert len(drain(gen, gen.insert([[1, 2, 3]]))[0]) == 3


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
