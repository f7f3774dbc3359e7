"""SnapKV's two compression schedules on the shipped model: retrieval accuracy and peak memory.

    python bench/compress_modes.py [--samples 20] [--context 1024] [--prefill-step 256]

``VELOX_COMPRESS=chunk`` compresses after every prefill chunk (each chunk scored by its own last
queries, memory bounded during the prompt); ``end`` keeps every prompt row and compresses once
decoding starts, scored by the prompt's last window (the paper's one-shot mode). Each runs without a
tier, and ``chunk`` once more with the default tier (4 bits, three budgets: ``VELOX_TIER``,
``VELOX_TIER_SIZE``), whose rows the chunks attend over and the prompt's end takes back. Each cell runs
mlx_lm's ``generate_step`` on held-out passkey and multi-key prompts (seeds 3000..) through the
real shim, and records the process's peak memory (``mx.get_peak_memory``) and the caches' largest ``nbytes``
after any prefill chunk, per run (medians in the table). Prints a
Markdown table and writes it as JSON next to the table with ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

import veloxpatch
from veloxpatch.assets import model_path
from veloxpatch.eval import tasks

EXAMPLES = {"passkey": tasks.passkey_example, "multikey": tasks.multikey_example}
# the schedules compared, by the name the table gives them: their settings
MODES = {"chunk": {"compress": "chunk", "tier": "off"}, "end": {"compress": "end", "tier": "off"},
         "chunk + 4-bit tier": {"compress": "chunk", "tier": "4", "tier_size": "3x"}}


def run_one(model, tokenizer, prompt: str, answer: str, prefill_step: int) -> tuple[bool, float, float]:
    """(right, peak MiB of the process, peak MiB of the KV caches) of one greedy answer with the
    cache list the patched mlx_lm builds; the caches are weighed after every prefill chunk."""
    mx.clear_cache()
    mx.reset_peak_memory()
    tokens = mx.array(tokenizer.encode(prompt))
    caches = make_prompt_cache(model)
    kv = [0]

    def weigh(done: int, total: int) -> None:
        kv[0] = max(kv[0], sum(c.nbytes for c in caches))

    steps = len(tokenizer.encode(answer)) + 2
    out = [t for t, _ in generate_step(tokens, model, max_tokens=steps, prompt_cache=caches,
                                       prefill_step_size=prefill_step, prompt_progress_callback=weigh)]
    right = tasks.is_correct(tokenizer.decode(out), answer)
    return right, mx.get_peak_memory() / 2**20, kv[0] / 2**20


def cell(model, tokenizer, task: str, mode: str | None, share: float, args: argparse.Namespace) -> dict:
    """Accuracy and median peak memory of one (task, mode, budget) over the samples."""
    veloxpatch.unpatch()
    if mode is not None:
        veloxpatch.patch(kv="snapkv", budget=max(round(share * args.context), 36), **MODES[mode])
    results = [run_one(model, tokenizer, *EXAMPLES[task](tokenizer, args.context, 3000 + i), args.prefill_step)
               for i in range(args.samples)]
    return {"task": task, "mode": mode or "full cache", "budget": share, "n": args.samples,
            "accuracy": sum(r[0] for r in results) / args.samples,
            "peak_MiB": round(statistics.median(r[1] for r in results), 2),
            "kv_peak_MiB": round(statistics.median(r[2] for r in results), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--prefill-step", type=int, default=256)
    parser.add_argument("--budgets", default="0.25,0.125")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    model, tokenizer = load(str(model_path()))
    rows = []
    for task in EXAMPLES:
        rows.append(cell(model, tokenizer, task, None, 1.0, args))
        for share in (float(s) for s in args.budgets.split(",")):
            rows += [cell(model, tokenizer, task, mode, share, args) for mode in MODES]
    print("| task | mode | budget | n | accuracy | process peak MiB | KV peak MiB |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['task']} | {r['mode']} | {r['budget']:g} | {r['n']} | {r['accuracy']:.2f} | {r['peak_MiB']} "
              f"| {r['kv_peak_MiB']} |")
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
