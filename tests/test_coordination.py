"""Coordinators reset when a new sequence starts on a list, restored lists get theirs back, and copies
of caches count in the statistics."""

from __future__ import annotations

import copy

import mlx.core as mx
from mlx_lm.generate import generate_step, speculative_generate_step
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache

import veloxpatch
from conftest import random_tokens, tiny
from veloxpatch import stats
from veloxpatch.caches import CompressedKVCache
from veloxpatch.coordinators import Coordinator, coordinators_of

BUDGET = dict(kv="snapkv", budget=40, window=8)


def drain(steps) -> list[int]:
    return [int(step[0]) for step in steps]


def test_a_generation_resets_every_coordinator_of_a_main_and_draft_list() -> None:
    """The server's lists hold the main model's caches and then the draft model's."""
    model, draft = tiny("llama", seed=1), tiny("llama", seed=2)
    veloxpatch.patch(**BUDGET)
    caches = make_prompt_cache(model) + make_prompt_cache(draft)
    main, second = coordinators_of(caches)
    assert main is not second and main.members == caches[:3] and second.members == caches[3:]
    drain(speculative_generate_step(random_tokens(20, 1), model, draft, max_tokens=4, prompt_cache=caches))
    assert (main.generations, second.generations) == (1, 1)
    drain(generate_step(mx.array([5]), model, max_tokens=2, prompt_cache=caches[:3]))
    assert (main.generations, second.generations) == (2, 1)


def test_a_restored_prompt_cache_gets_its_coordinator_back(tmp_path) -> None:
    model = tiny("llama")
    veloxpatch.patch(**BUDGET)
    caches = make_prompt_cache(model)
    model(random_tokens(60, 2)[None], cache=caches)
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, caches)
    restored, _ = load_prompt_cache(path, return_metadata=True)
    (coordinator,) = coordinators_of(restored)
    assert coordinator.members == restored and coordinator.method == "snapkv"


def test_caches_restored_one_by_one_get_a_coordinator_when_a_generation_starts() -> None:
    model = tiny("llama")
    veloxpatch.patch(**BUDGET)
    caches = make_prompt_cache(model)
    model(random_tokens(30, 3)[None], cache=caches)
    restored = [type(c).from_state(c.state) for c in caches]
    drain(generate_step(mx.array([7]), model, max_tokens=2, prompt_cache=restored))
    (coordinator,) = coordinators_of(restored)
    assert coordinator.members == restored and coordinator.generations == 1


def test_deep_copies_used_in_a_generation_count_in_the_statistics() -> None:
    """The server deep-copies prompt caches, which builds them without ``__init__``."""
    model = tiny("llama")
    veloxpatch.patch(**BUDGET)
    caches = make_prompt_cache(model)
    model(random_tokens(30, 4)[None], cache=caches)
    built = stats.totals.caches_built
    copies = copy.deepcopy(caches)
    drain(generate_step(mx.array([3]), model, max_tokens=2, prompt_cache=copies))
    live = list(stats._live)
    assert all(any(c is x for x in live) for c in copies), "the copies are live in the summary"
    assert stats.totals.caches_built == built, "a copy is not a cache built"


class Member:
    def __init__(self, offset: int = 0) -> None:
        self.offset = offset


def test_the_first_layer_at_offset_zero_starts_a_new_sequence_once() -> None:
    """The signal for loops that call the model directly (no generate_step)."""
    coordinator = Coordinator("snapkv")
    first, second = Member(), Member()
    coordinator.join(first)
    coordinator.join(second)
    coordinator.on_update(first)
    coordinator.on_update(second)  # a later layer of the same forward: no reset
    assert coordinator.generations == 1
    first.offset = second.offset = 30
    coordinator.on_update(first)
    assert coordinator.generations == 1, "a sequence that continues is not new"
    coordinator.reset()  # a generation starts on a list trimmed back to nothing
    first.offset = 0
    coordinator.on_update(first)
    assert coordinator.generations == 2, "the generation start already reset for this sequence"
    coordinator.on_update(first)
    assert coordinator.generations == 3


def test_a_direct_model_loop_resets_the_coordinator_for_each_new_sequence() -> None:
    """mlx_lm's evaluate and a user's own loop call the model, not generate_step."""
    model = tiny("llama")
    veloxpatch.patch(**BUDGET)
    caches = make_prompt_cache(model)
    (coordinator,) = coordinators_of(caches)
    for seed in range(2):
        model(random_tokens(20, seed)[None], cache=caches)
        model(random_tokens(1, seed)[None], cache=caches)
        for cache in caches:
            cache.trim(cache.offset)
    assert coordinator.generations == 2


def test_a_quantized_copy_takes_its_place_among_the_members() -> None:
    model = tiny("llama")
    veloxpatch.patch(**BUDGET)
    caches = make_prompt_cache(model)
    (coordinator,) = coordinators_of(caches)
    replacement = copy.copy(caches[1])
    coordinator.replace(caches[1], replacement)
    assert coordinator.members == [caches[0], replacement, caches[2]]
    assert replacement.coordinator is coordinator and isinstance(replacement, CompressedKVCache)


def _group_of(size: int) -> tuple[Coordinator, list[Member]]:
    coordinator = Coordinator("test")
    members = [Member() for _ in range(size)]
    for member in members:
        coordinator.join(member)
    return coordinator, members


def test_a_fan_in_completes_once_per_group_and_every_member_gets_the_same_result() -> None:
    coordinator, members = _group_of(4)
    calls: list[list[int]] = []

    def joint(parts: list[int]) -> dict[str, int]:
        calls.append(parts)
        return {"sum": sum(parts)}

    group = [1, 2, 3]
    assert coordinator.contribute("g", members[1], 10, group, joint) is None
    assert coordinator.contribute("g", members[2], 20, group, joint) is None
    assert coordinator.missing("g", group) == [3] and coordinator.joint("g") is None
    result = coordinator.contribute("g", members[3], 30, group, joint)
    assert result == {"sum": 60} and calls == [[10, 20, 30]], "computed once, parts in layer order"
    assert coordinator.joint("g") is result, "earlier members pick up the identical object"
    assert coordinator.contribute("g", members[1], 99, group, joint) is result and len(calls) == 1
    assert coordinator.missing("g", group) == []
    coordinator.reset()
    assert coordinator.joint("g") is None and coordinator.missing("g", group) == group, "a generation starts empty"
    for member, part in zip(members[1:], (1, 2, 3)):
        coordinator.contribute("g", member, part, group, joint)
    assert coordinator.joint("g") == {"sum": 6} and len(calls) == 2


def test_an_incomplete_group_never_blocks_and_two_lists_never_share() -> None:
    coordinator, members = _group_of(2)
    other, _ = _group_of(2)
    coordinator.contribute("g", members[0], 1, [0, 1], sum)
    assert coordinator.joint("g") is None and coordinator.missing("g", [0, 1]) == [1]
    assert other.joint("g") is None and other.missing("g", [0, 1]) == [0, 1]


def test_shared_storage_counts_once_in_the_first_live_holders_bytes() -> None:
    """A sum of nbytes over the list is what is held: a shared array counts at its first live holder."""
    model = tiny("llama")
    veloxpatch.patch(kv="snapkv", budget=64)
    caches = make_prompt_cache(model)
    model(random_tokens(40, 3)[None], cache=caches)
    before = [c.nbytes for c in caches]
    basis = {"u": mx.zeros((40, 16)), "s": mx.zeros((16,))}
    held: dict[int, list] = {1: [basis], 2: [basis, basis]}
    for cache in caches:
        cache.shared_parts = lambda layer=cache.layer: held.get(layer, [])
    extra = [c.nbytes - b for c, b in zip(caches, before)]
    assert extra[1] == 40 * 16 * 4 + 16 * 4 and sum(extra) == extra[1]
    held.pop(1)  # the first holder lets go: the next one counts it
    extra = [c.nbytes - b for c, b in zip(caches, before)]
    assert extra[2] == 40 * 16 * 4 + 16 * 4 and sum(extra) == extra[2]


def test_two_generations_in_two_threads_keep_their_own_coordinators() -> None:
    """No global state: each cache list has its coordinator, so two generations of a cross-layer method (squeeze's
    schedule, ChunkKV's shared positions) running at once in two threads give what each gives alone."""
    import threading

    from mlx_lm.generate import generate_step

    model = tiny("llama", layers=4)
    prompts = [random_tokens(160, 21), random_tokens(140, 22)]
    for method, knobs in (("squeeze", {"squeeze_strength": 1.0}), ("chunkkv", {"chunkkv_reuse": 2})):
        veloxpatch.patch(kv=method, budget=48, window=8, knobs=knobs)

        def run(prompt: mx.array, caches: list) -> list[int]:
            return [int(t) for t, _ in generate_step(prompt, model, max_tokens=12, prompt_cache=caches,
                                                     prefill_step_size=64)]

        alone = [run(p, make_prompt_cache(model)) for p in prompts]
        lists = [make_prompt_cache(model) for _ in prompts]
        got: list[list[int] | None] = [None, None]

        def worker(i: int) -> None:
            got[i] = run(prompts[i], lists[i])

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert got == alone, method
        assert lists[0][0].coordinator is not lists[1][0].coordinator
        veloxpatch.unpatch()
