"""mlx_lm's batched generation runs on compressed caches, each sequence on its own, exactly as one at a time.

A batch of ours keeps every sequence's caches side by side (``veloxpatch.caches.batch.SequenceBatch``): the
model's projections and MLP run batched, each sequence's cache stores its own slice of a (right-padded) step and
attends with its own queries. So every sequence gives the tokens ``generate_step`` gives on the same caches alone,
keeps compressing to its own budget, and leaves the batch as compressed caches of its method.
"""

from __future__ import annotations

import copy
import gc
import weakref

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models.cache import KVCache, make_prompt_cache

import veloxpatch
from conftest import drain, drain_with_caches, random_tokens, unless_offered
from veloxpatch.caches import CompressedKVCache
from veloxpatch.caches.batch import SequenceBatch
from veloxpatch.registry import METHODS, name_of

pytestmark = unless_offered("batched generation")  # mlx-lm 0.28-0.30 batch on their own caches only
SETTINGS = dict(budget=40, window=8)  # every prompt here is longer: prefills evict
LENGTHS = (60, 75, 49)  # unequal: mlx_lm right-pads the batch's prompt steps


@pytest.fixture(scope="module")
def loaded(model_dir):
    return load(str(model_dir))


def prompts() -> list[list[int]]:
    return [random_tokens(n, seed).tolist() for seed, n in enumerate(LENGTHS, start=1)]


def alone(model, prompt: list[int], caches: list, limit: int, **options) -> list[int]:
    """``limit`` greedy tokens from ``generate_step`` on ``caches`` alone (no stop token)."""
    steps = generate_step(mx.array(prompt), model, prompt_cache=caches, max_tokens=limit, **options)
    return [token for token, _ in steps]


def batched(model, prompt_list: list[list[int]], limit: int, caches: list | None = None, **options) -> list[list[int]]:
    """Each sequence's ``limit`` greedy tokens from mlx_lm's ``BatchGenerator`` (no stop token)."""
    gen = BatchGenerator(model, max_tokens=limit, **options)
    return drain(gen, gen.insert(prompt_list, caches=caches))


def finished(model, prompt_list: list[list[int]], limit: int, **options) -> tuple[list[list[int]], list[list]]:
    """As :func:`batched`, with the cache list each sequence leaves the batch with."""
    gen = BatchGenerator(model, max_tokens=limit, **options)
    return drain_with_caches(gen, gen.insert(prompt_list))


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_batches_as_it_runs_alone(loaded, method: str) -> None:
    """Prompt steps of 32 tokens: several right-padded steps, each sequence compressing as it goes."""
    model, _ = loaded
    veloxpatch.patch(kv=method, **SETTINGS)
    expected = [alone(model, p, make_prompt_cache(model), 6, prefill_step_size=32) for p in prompts()]
    tokens, caches = finished(model, prompts(), 6, prefill_step_size=32)
    assert tokens == expected
    for cache_list, n in zip(caches, LENGTHS):
        found = [c for c in cache_list if isinstance(c, CompressedKVCache)]
        assert found and all(name_of(c) == method for c in found)
        assert {c.offset for c in found} == {n + 6}  # the batch has read every token it returned


def test_a_budget_above_the_context_batches_as_mlx_lm_unpatched(loaded) -> None:
    model, _ = loaded
    expected = batched(model, prompts(), 6)
    veloxpatch.patch(kv="snapkv", budget=4096)
    assert batched(model, prompts(), 6) == expected


def test_each_sequence_keeps_its_own_budget_rows_and_positions(loaded) -> None:
    """A share budget is each sequence's own; a sequence's KV is what it would hold alone."""
    model, _ = loaded
    veloxpatch.patch(kv="snapkv", budget="25%", window=8, compress="end", tier="off")
    _, caches_out = finished(model, prompts(), 4, prefill_step_size=32)
    for caches, prompt in zip(caches_out, prompts()):
        own = make_prompt_cache(model)
        alone(model, prompt, own, 4, prefill_step_size=32)
        assert [c.size() for c in caches] == [c.size() for c in own]
        assert all(mx.array_equal(a.store.row_positions(), b.store.row_positions()).item() for a, b in zip(caches, own))


def test_each_sequence_keeps_the_tier_it_would_keep_alone(loaded) -> None:
    """With the defaults (chunk, 8-bit tier) every prompt step of a sequence drops rows to its tier; the caches a
    sequence leaves the batch with hold the same rows in store and tier as its caches alone."""
    model, _ = loaded
    veloxpatch.patch(kv="snapkv", **SETTINGS)
    _, caches_out = finished(model, prompts(), 4, prefill_step_size=32)
    for caches, prompt in zip(caches_out, prompts()):
        own = make_prompt_cache(model)
        alone(model, prompt, own, 4, prefill_step_size=32)
        assert all(c.tier is not None and c.tier.rows for c in own)
        for a, b in zip(caches, own):
            for part in ("store", "tier"):
                ours, theirs = (getattr(c, part) if part == "store" else c.tier.store for c in (a, b))
                assert mx.array_equal(ours.row_positions(), theirs.row_positions()).item(), part


def test_history_handed_in_continues_as_alone_and_stays_the_callers(loaded) -> None:
    """Compressed caches that evicted rows go on compressing in the batch; the caller's lists are not touched."""
    model, _ = loaded
    veloxpatch.patch(kv="chunkkv", **SETTINGS)
    histories = []
    for seed, n in ((5, 70), (6, 90)):
        caches = make_prompt_cache(model)
        model(random_tokens(n, seed)[None], cache=caches)
        mx.eval([c.state for c in caches])
        assert caches[0].evicted
        histories.append(caches)
    before = [[(c.offset, c.size()) for c in h] for h in histories]
    follow = [random_tokens(9, 7).tolist(), random_tokens(17, 8).tolist()]
    expected = [alone(model, f, copy.deepcopy(h), 5) for f, h in zip(follow, histories)]
    assert batched(model, follow, 5, caches=histories) == expected
    assert [[(c.offset, c.size()) for c in h] for h in histories] == before


def test_plain_kv_caches_batch_with_compressed_ones(loaded) -> None:
    """mlx_lm's own caches (a caller's list, a sequence that joined an earlier plain batch) share the batch."""
    model, _ = loaded
    plain_prompt, ours_prompt = random_tokens(40, 11).tolist(), random_tokens(70, 12).tolist()
    plain_history = [KVCache() for _ in model.layers]
    model(random_tokens(20, 13)[None], cache=plain_history)
    expected_plain = alone(model, plain_prompt, copy.deepcopy(plain_history), 5)
    veloxpatch.patch(kv="snapkv", **SETTINGS)
    expected_ours = alone(model, ours_prompt, make_prompt_cache(model), 5)
    assert batched(model, [plain_prompt, ours_prompt], 5, caches=[plain_history, None]) == \
        [expected_plain, expected_ours]

    veloxpatch.unpatch()
    gen = BatchGenerator(model, max_tokens=5)
    [first] = gen.insert([plain_prompt], caches=[copy.deepcopy(plain_history)])
    gen.next_generated()  # mlx_lm's own batch is running
    veloxpatch.patch(kv="snapkv", **SETTINGS)
    [second] = gen.insert([ours_prompt])
    out = {first: [], second: []}
    while responses := gen.next_generated():
        for r in responses:
            out[r.uid].append(r.token)
    gen.close()
    assert out[second] == expected_ours and len(out[first]) == 4 and out[first] == expected_plain[1:]


def test_a_sequence_extracted_midway_is_a_consistent_copy(loaded) -> None:
    """mlx_lm extracts a sequence layer by layer; a cross-layer method's layers come from one copy of the list."""
    model, _ = loaded
    veloxpatch.patch(kv="xkv", budget=40, window=8)
    gen = BatchGenerator(model, max_tokens=6)
    uids = gen.insert(prompts()[:2])
    for _ in range(3):
        gen.next_generated()
    copies = gen.extract_cache(uids[:1])[uids[0]][0]
    originals = gen._generation_batch.prompt_cache
    assert isinstance(originals[0], SequenceBatch)
    assert copies[0] is not originals[0].members[0]
    assert copies[0].coordinator is copies[-1].coordinator is not originals[0].members[0].coordinator
    assert [c.offset for c in copies] == [c.members[0].offset for c in originals]
    drain(gen, uids)


def test_without_a_patch_nothing_of_ours_merges(loaded) -> None:
    model, _ = loaded
    veloxpatch.patch(kv="snapkv", **SETTINGS)
    cache = make_prompt_cache(model)[0]
    assert hasattr(cache, "merge")
    veloxpatch.unpatch()
    assert not hasattr(cache, "merge")


def test_finished_sequences_leave_nothing_behind(loaded) -> None:
    """A sequence's caches go once it has left the batch and its copies are dropped (the server runs for days)."""
    model, _ = loaded
    veloxpatch.patch(kv="chunkkv", **SETTINGS)
    gen = BatchGenerator(model, max_tokens=4)
    gen.insert(prompts()[:2])
    gen.next_generated()
    members = gen._generation_batch.prompt_cache[0].members
    gone = [weakref.ref(m.coordinator) for m in members] + [weakref.ref(m) for m in members]
    del members
    while gen.next_generated():
        pass
    gen.close()
    del gen
    gc.collect()
    assert [ref() for ref in gone] == [None] * len(gone)
