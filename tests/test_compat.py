"""mlx_lm's private layouts that batched generation touches, pinned against the installed mlx_lm, and
what the shim does where one has changed: batching alone runs on mlx_lm's own caches (one warning,
an error under strict) while everything else stays patched."""

from __future__ import annotations

import importlib
import inspect
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm import batch_generate, load
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

import veloxpatch
from conftest import drain, random_tokens, unless_offered
from veloxpatch import log
from veloxpatch.integration import compat
from veloxpatch.integration.version import mlx_lm_version

BUDGET = dict(kv="snapkv", budget=40, window=8, compress="chunk")  # prefills evict
GENERATE = importlib.import_module("mlx_lm.generate")  # mlx_lm.generate is also a function's name
FALLBACK = "batched generation runs on mlx_lm's own caches only"
BATCHING = unless_offered("batched generation")  # the layouts below are those of mlx-lm 0.31+'s batches
RETURNS_TOKEN_IDS = "return_token_ids" in inspect.signature(batch_generate).parameters  # mlx-lm 0.32's


def batch_answers(model, tokenizer, prompts: list[list[int]], **options) -> list:
    """``batch_generate``'s answers: its token ids, or where it cannot return them (``return_token_ids`` is mlx-lm
    0.32's) its texts, one character per token with this model's byte-level tokenizer."""
    if RETURNS_TOKEN_IDS:
        return batch_generate(model, tokenizer, prompts, return_token_ids=True, **options).token_ids
    return batch_generate(model, tokenizer, prompts, **options).texts


@pytest.fixture(autouse=True)
def fresh_check(monkeypatch):
    """Each test checks the layouts anew and may say the fall-back warning again."""
    compat.layout_problem.cache_clear()
    monkeypatch.setattr(log, "_said", set())
    yield
    compat.layout_problem.cache_clear()


@pytest.fixture
def warnings(caplog, monkeypatch) -> Callable[[], list[str]]:
    """The veloxpatch warnings said during the test (its logger does not propagate once patched)."""
    logger = logging.getLogger("veloxpatch")
    monkeypatch.setattr(logger, "propagate", False)
    logger.addHandler(caplog.handler)
    yield lambda: [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    logger.removeHandler(caplog.handler)


@pytest.fixture(scope="module")
def loaded(model_dir):
    return load(str(model_dir))


@BATCHING
@pytest.mark.parametrize("name", list(compat.LAYOUTS))
def test_the_installed_mlx_lm_has_each_layout_compat_relies_on(name: str) -> None:
    found = compat.check(name)
    assert found is None, f"mlx-lm {mlx_lm_version()} changed {name}: {found}"


# --------------------------------------------------------------------- each check sees its layout change
def reordered_waiting(monkeypatch) -> None:
    """Waiting sequences hold their caches second."""
    original = BatchGenerator.insert_segments

    def insert_segments(self, segments, max_tokens=None, caches=None, all_tokens=None, samplers=None,
                        logits_processors=None, stop_sequences=None):
        uids = original(self, segments, max_tokens, caches, all_tokens, samplers, logits_processors, stop_sequences)
        self._unprocessed_sequences = deque((s[0], s[3], s[1], s[2], *s[4:]) for s in self._unprocessed_sequences)
        return uids

    monkeypatch.setattr(BatchGenerator, "insert_segments", insert_segments)


def renamed_batch(monkeypatch) -> None:
    """The generation batch lives under another name."""
    original = BatchGenerator.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self._decode_batch = vars(self).pop("_generation_batch")

    monkeypatch.setattr(BatchGenerator, "__init__", __init__)


def extract_with_an_option(monkeypatch) -> None:
    """``extract`` grows a parameter (mlx_lm still works: the option is ignored)."""
    original = BatchKVCache.extract

    def extract(self, idx, copy=True):
        return original(self, idx)

    monkeypatch.setattr(BatchKVCache, "extract", extract)


def one_offset_per_batch(monkeypatch) -> None:
    original = BatchKVCache.merge

    def merge(cls, caches):
        batch = original(caches)
        batch.offset = int(batch.offset.max().item())
        return batch

    monkeypatch.setattr(BatchKVCache, "merge", classmethod(merge))


def merged_without_the_first_cache(monkeypatch) -> None:
    """A prefill group gets batch caches of mlx_lm's own, not its first sequence's caches' ``merge``."""

    def merge_caches(caches: list) -> list:
        return [BatchKVCache([0] * len(caches)) for _ in caches[0]] if caches else []

    monkeypatch.setattr(GENERATE, "_merge_caches", merge_caches)


CHANGES: dict[str, tuple[Callable[[Any], None], str]] = {
    "BatchGenerator._unprocessed_sequences": (reordered_waiting, "holds its cache list at [1], not at [3]"),
    "BatchGenerator's state": (renamed_batch, "_generation_batch.prompt_cache is NoneType"),
    "the KVCache/BatchKVCache protocol": (extract_with_an_option,
                                          "BatchKVCache.extract is (self, idx, copy), not (self, idx)"),
    "BatchKVCache.offset": (one_offset_per_batch, "gives offset 2, not one position per sequence"),
}


def test_every_layout_has_a_change_it_is_shown_to_catch() -> None:
    assert set(CHANGES) == set(compat.LAYOUTS)


@BATCHING
@pytest.mark.parametrize("name", list(CHANGES))
def test_a_changed_layout_is_named_with_what_was_found(monkeypatch, name: str) -> None:
    change, found = CHANGES[name]
    change(monkeypatch)
    what = compat.check(name)
    assert what is not None and found in what
    assert compat.layout_problem() == f"{name} is not the layout veloxpatch {veloxpatch.__version__} knows ({what})"


@BATCHING
def test_a_prefill_group_merged_another_way_is_caught(monkeypatch) -> None:
    """A prefill group merged some other way than by its first sequence's caches' merge."""
    merged_without_the_first_cache(monkeypatch)
    assert "not merged by its first sequence's cache's merge" in compat.check("BatchGenerator._unprocessed_sequences")


# --------------------------------------------------------------------- the server (settings per request)
def test_the_installed_server_queues_a_request_as_compat_knows() -> None:
    assert set(compat.SERVER_LAYOUTS) == {"the server's queued request"}
    found = compat.check("the server's queued request")
    assert found is None, f"mlx-lm {mlx_lm_version()} changed how its server queues a request: {found}"


def test_a_server_queueing_its_request_another_way_is_caught(monkeypatch) -> None:
    server = importlib.import_module("mlx_lm.server")

    class Queue(deque):
        put = deque.append

    # the arguments before the request
    monkeypatch.setattr(server.ResponseGenerator, "generate",
                        lambda self, request, generation_args, progress_callback=None:
                        self.requests.put((Queue(), generation_args, request)))
    assert compat.check("the server's queued request") == "generate queues the arguments at [1], not at [2]"


def test_generation_arguments_that_keep_no_attribute_are_caught(monkeypatch) -> None:
    import dataclasses

    server = importlib.import_module("mlx_lm.server")

    @dataclasses.dataclass(slots=True)
    class GenerationArguments:
        max_tokens: int

    monkeypatch.setattr(server, "GenerationArguments", GenerationArguments)
    assert compat.check("the server's queued request").startswith("AttributeError: ")


# --------------------------------------------------------------------- batching alone falls back
@BATCHING
def test_a_changed_layout_leaves_batching_to_mlx_lm_and_the_rest_patched(loaded, monkeypatch, warnings) -> None:
    model, tokenizer = loaded
    extract_with_an_option(monkeypatch)  # mlx_lm still runs: only the layout veloxpatch knows has changed
    prompts = [random_tokens(60, 1).tolist(), random_tokens(75, 2).tolist()]
    segments = [[random_tokens(50, 7).tolist(), random_tokens(10, 8).tolist()], [random_tokens(64, 9).tolist()]]
    expected = batch_answers(model, tokenizer, prompts, max_tokens=5)
    gen = BatchGenerator(model, max_tokens=6)
    expected_segments = drain(gen, gen.insert_segments(segments))
    veloxpatch.patch(**BUDGET)

    assert batch_answers(model, tokenizer, prompts, max_tokens=5) == expected
    gen = BatchGenerator(model, max_tokens=6)
    assert drain(gen, gen.insert_segments(segments)) == expected_segments
    evicted = make_prompt_cache(model)
    assert type(evicted[0]).__name__ == "SnapKVCache", "make_prompt_cache stays patched"
    model(random_tokens(90, 13)[None], cache=evicted)  # through the attention route: it evicts
    assert evicted[0].evicted and evicted[0].size() < evicted[0].offset
    with pytest.raises((ValueError, ZeroDivisionError)) as raised:  # mlx_lm's own answer
        batch_generate(model, tokenizer, [prompts[0]], prompt_caches=[evicted], max_tokens=3)
    # mlx-lm 0.31's batch_generate hides it behind its stats dividing by a prompt time of 0 on the way out
    said = raised.value if isinstance(raised.value, ValueError) else raised.value.__context__
    assert isinstance(said, ValueError) and "does not yet support batching with history" in str(said)
    assert hasattr(GENERATE.generate_step, "__wrapped__"), "generate_step stays patched"

    said = [w for w in warnings() if FALLBACK in w]
    assert said == [f"{FALLBACK}: the KVCache/BatchKVCache protocol is not the layout veloxpatch "
                    f"{veloxpatch.__version__} knows (BatchKVCache.extract is (self, idx, copy), not (self, idx))"]


@BATCHING
def test_a_changed_layout_is_an_error_under_strict(loaded, monkeypatch) -> None:
    model, tokenizer = loaded
    reordered_waiting(monkeypatch)
    veloxpatch.patch(**BUDGET, strict=True)
    with pytest.raises(RuntimeError, match=f"{FALLBACK}: BatchGenerator._unprocessed_sequences is not the layout"):
        batch_generate(model, tokenizer, [[1, 2, 3]], max_tokens=2)
    with pytest.raises(RuntimeError, match=FALLBACK):
        BatchGenerator(model, max_tokens=2).insert([[1, 2, 3]])
    caches = make_prompt_cache(model)
    assert type(caches[0]).__name__ == "SnapKVCache", "the rest stays patched under strict too"
    mx.eval(model(mx.array([[1, 2, 3]]), cache=caches))


@BATCHING
def test_without_a_kv_method_batching_is_mlx_lms_own_whatever_the_layout(loaded, monkeypatch, warnings) -> None:
    """With only VELOX_FLOAT32 at work nothing of veloxpatch joins a batch: a changed layout says nothing, and
    strict has nothing to refuse."""
    model, tokenizer = loaded
    extract_with_an_option(monkeypatch)  # mlx_lm still runs: only the layout veloxpatch knows has changed
    prompts = [random_tokens(40, 3).tolist()]
    expected = batch_answers(model, tokenizer, prompts, max_tokens=3)
    veloxpatch.patch(kv="none", float32="on", strict=True)
    assert batch_answers(model, tokenizer, prompts, max_tokens=3) == expected
    assert not [w for w in warnings() if FALLBACK in w]


@BATCHING
def test_under_strict_batched_generation_runs_compressed(loaded) -> None:
    """Batches hold compressed caches: nothing falls back, so strict has nothing to refuse."""
    model, tokenizer = loaded
    veloxpatch.patch(**BUDGET, strict=True)
    done = batch_generate(model, tokenizer, [random_tokens(90, 4).tolist()], max_tokens=2, return_prompt_caches=True)
    cache = done.caches[0][0]
    assert type(cache).__name__ == "SnapKVCache" and cache.evicted and cache.size() < cache.offset
