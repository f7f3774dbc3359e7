"""One rank of tests/test_distributed.py, started by ``mlx.launch``: loads a model folder split by
tensor or pipeline parallelism and writes what each method does on this rank, as JSON, to ``OUT/rank<r>.json``.

``python ranks_worker.py tp|pp FOLDER methods OUT`` runs every method at a budget above the context and
at a small one (every evicting one also with a 4-bit tier); ``python ranks_worker.py tp FOLDER mismatch OUT`` builds
caches with a budget that differs by rank and writes the error; ``stats`` generates with ``VELOX_STATS`` on.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import sharded_load

import veloxpatch
from veloxpatch.caches import CompressedKVCache
from veloxpatch.caches.crosslayer import CrossLayerCache
from veloxpatch.config import ConfigError
from veloxpatch.coordinators import drain_streams
from veloxpatch.registry import METHODS

SMALL = dict(budget=8, sink=2, window=4)
# pair every rank's layers (4 layers, 2 per stage); quantize blocks of 32 tokens (the context is 44)
SMALL_KNOBS = {"minicache": {"minicache_start": 0.0}, "quant": {"quant_group": 32}}
PROMPT = mx.array([(7 * i + 3) % 90 for i in range(40)])


def greedy(model, caches) -> list[int]:
    """Four greedy tokens after the prompt, read in 16-token chunks (so compression runs between chunks)."""
    return [t for t, _ in generate_step(PROMPT, model, max_tokens=4, prefill_step_size=16, prompt_cache=caches)]


def agree(tokens: list[int]) -> bool:
    """Whether every rank generated these same tokens (after the step generate_step leaves in flight,
    whose collectives would otherwise pair with this one)."""
    drain_streams()
    rows = mx.distributed.all_gather(mx.array([tokens]), stream=mx.cpu).tolist()
    return all(row == tokens for row in rows)


def small_budget(model, method: str, tier: str = "off") -> dict:
    """Tokens, their agreement, and what the caches hold at a budget far below the prompt (with
    ``tier``, the rows the tier holds and their positions too)."""
    veloxpatch.patch(kv=method, compress="chunk", knobs=SMALL_KNOBS.get(method, {}), tier=tier, tier_size="all",
                     **SMALL)
    caches = make_prompt_cache(model)
    tokens = greedy(model, caches)
    ours = [c for c in caches if isinstance(c, CompressedKVCache)]
    kept = ours[0].store.row_positions()[0, 0].tolist() if ours and not isinstance(ours[0], CrossLayerCache) else []
    tiers = [c.tier for c in ours if getattr(c, "tier", None) is not None]
    return {"agree": agree(tokens), "ours": len(ours), "sizes": [c.size() for c in ours], "kept": kept,
            "offsets": [c.offset for c in ours], "evicted": any(c.evicted for c in ours),
            "folded": any(getattr(c, "folds", None) for c in ours),
            "cross_layer": isinstance(ours[0], CrossLayerCache) if ours else False,
            "tier_rows": [t.rows for t in tiers],
            "tier_kept": tiers[0].store.row_positions()[0, 0].tolist() if tiers and tiers[0].rows else []}


def methods(model, folder: str) -> dict:
    single = greedy(*_single(folder))
    plain = greedy(model, make_prompt_cache(model))
    out = {"single": single, "plain": plain, "plain_agree": agree(plain), "methods": {}, "tier": {}}
    for method in sorted(METHODS):
        veloxpatch.patch(kv=method, budget=4096)
        exact = greedy(model, make_prompt_cache(model))
        out["methods"][method] = {"exact": exact, **small_budget(model, method)}
        if not issubclass(METHODS[method].cls, CrossLayerCache):
            out["tier"][method] = small_budget(model, method, tier="4")
        veloxpatch.unpatch()
    return out


def _single(folder: str):
    """The same folder loaded whole, in this process alone (no collective runs in it)."""
    model, _ = load(folder)
    return model, make_prompt_cache(model)


def mismatch(model, rank: int) -> dict:
    veloxpatch.patch(kv="snapkv", budget=64 + 64 * rank)
    try:
        make_prompt_cache(model)
    except ConfigError as error:
        return {"error": str(error)}
    return {"error": None}


def stats(model) -> dict:
    """A generation with VELOX_STATS on: the lines come at exit."""
    veloxpatch.patch(kv="snapkv", budget=16, sink=2, window=4, stats=True)
    return {"tokens": greedy(model, make_prompt_cache(model))}


def main() -> None:
    mode, folder, job, out = sys.argv[1:5]
    group = mx.distributed.init()
    model, _ = sharded_load(folder, **{("tensor_group" if mode == "tp" else "pipeline_group"): group})
    jobs = {"methods": lambda: methods(model, folder), "mismatch": lambda: mismatch(model, group.rank()),
            "stats": lambda: stats(model)}
    result = jobs[job]()
    # a file per rank: two ranks' long lines on the launcher's one stdout could interleave (seen under load)
    Path(out, f"rank{group.rank()}.json").write_text(json.dumps({"rank": group.rank(), "size": group.size(),
                                                                  **result}))


if __name__ == "__main__":
    main()
