"""VELOX_KV_MEMORY on a real model: a long prompt whose vanilla KV is larger than the target, read and answered
under it, measured by what the process holds (``mx.get_active_memory``) over the loaded model.

    python bench/kv_memory.py --model M [--context 8192] [--target 64MiB] [--budget 100%] [--prefill-step 512]
                              [--variants "vanilla,snapkv chunk, tier 4"] [--out DIR]

``--target off`` measures the read peaks of the modes at ``--budget`` alone.

For vanilla mlx_lm, for SnapKV under the target (``end`` and ``chunk`` mode, with and without a 4-bit tier) and for
Expected Attention and H2O (``chunk`` mode), ``quant`` (every row at 4 bits, or an eighth of the bytes:
``quant[keep=0.125x]``, whose second reading of the prompt
runs with the prompt's last token, so its peak counts here), one niah_single prompt of ``--context`` tokens
through mlx_lm's ``generate_step`` (32 new tokens): the memory held after the answer and the peak while the prompt
was read, both over the loaded model, the caches' ``nbytes``, and whether the answer was right. Prints a Markdown
table (and writes it with its JSON to ``--out``).
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

import veloxpatch
from veloxpatch.eval import ruler
from veloxpatch.settings import Memory

VARIANTS = {
    "vanilla": {},
    "snapkv end": {"kv": "snapkv", "compress": "end"},
    "snapkv chunk": {"kv": "snapkv", "compress": "chunk"},
    "snapkv end, tier 4": {"kv": "snapkv", "compress": "end", "tier": "4"},
    "snapkv chunk, tier 4": {"kv": "snapkv", "compress": "chunk", "tier": "4"},
    "snapkv chunk, tier 8": {"kv": "snapkv", "compress": "chunk", "tier": "8"},
    "expected_attention chunk": {"kv": "expected_attention", "compress": "chunk"},
    "h2o chunk": {"kv": "h2o", "compress": "chunk"},
    "quant": {"kv": "quant"},
    "quant, keep 0.125x": {"kv": "quant", "knobs": {"quant_keep": "0.125x"}},
}


def measure(model, tokenizer, prompt: mx.array, step: int, settings: dict, target: str, budget: str) -> dict:
    """One run: held after, read peak, nbytes, the answer."""
    veloxpatch.patch(**settings, budget=budget, kv_memory=target) if settings else veloxpatch.unpatch()
    gc.collect()
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    caches = make_prompt_cache(model)
    tokens, read_peak = [], None
    for token, logprobs in generate_step(prompt, model, max_tokens=32, prefill_step_size=step, prompt_cache=caches):
        if read_peak is None:  # the first token: the prompt has been read
            read_peak = mx.get_peak_memory() - base
        tokens.append(token)
    del logprobs  # the last step's (vocabulary-sized): not the cache's
    gc.collect()
    return {"held_MiB": (mx.get_active_memory() - base) / 2**20, "read_peak_MiB": read_peak / 2**20,
            "nbytes_MiB": sum(c.nbytes for c in caches) / 2**20, "answer": tokenizer.decode(tokens)}


def chosen_variants(text: str) -> dict[str, dict[str, str]]:
    """The variants ``--variants`` names, in its order (a name may hold a comma: they are matched whole)."""
    chosen, rest = {}, text.strip()
    while rest:
        name = next((n for n in sorted(VARIANTS, key=len, reverse=True) if rest.startswith(n)), None)
        if name is None:
            raise SystemExit(f"--variants {text!r}: {rest!r} is not one of: {'; '.join(VARIANTS)}")
        chosen[name] = VARIANTS[name]
        rest = rest[len(name):].lstrip(", ")
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--target", default="64MiB")
    parser.add_argument("--budget", default="100%")
    parser.add_argument("--prefill-step", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"which to run, comma-separated names of: {'; '.join(VARIANTS)}")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    chosen = chosen_variants(args.variants)
    veloxpatch.patch(float32="auto")  # the float32 upcast a patched app gets on the CPU, for every variant alike
    model, tokenizer = load(args.model)
    veloxpatch.unpatch()
    example = ruler.example("niah_single", tokenizer, args.context, args.seed)
    prompt = mx.array(tokenizer.encode(example.prompt))
    rows = []
    for name, settings in chosen.items():
        row = {"variant": name,
               **measure(model, tokenizer, prompt, args.prefill_step, settings, args.target, args.budget)}
        row["right"] = ruler.score(row["answer"], example)
        rows.append(row)
        print(json.dumps(row), flush=True)
    target = Memory.parse(args.target)
    limit = f"VELOX_KV_MEMORY={args.target} ({target.bytes / 2**20:.1f} MiB)" if target.bytes else "no memory target"
    lines = [f"**{args.context}-token niah_single prompt, {args.prefill_step}-token prefill steps, "
             f"VELOX_BUDGET={args.budget}, {limit}**", "",
             "| variant | held after, MiB | read peak, MiB | nbytes, MiB | right |", "|---|---|---|---|---|"]
    lines += [f"| {r['variant']} | {r['held_MiB']:.1f} | {r['read_peak_MiB']:.1f} | {r['nbytes_MiB']:.1f} | "
              f"{'yes' if r['right'] else 'no'} |" for r in rows]
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "table.md").write_text(table + "\n")
        (args.out / "rows.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                        "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
