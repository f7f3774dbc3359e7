"""Where H2O's cost per request goes: one generation on a passkey document, timed, with the time spent in
``received_mass`` (the attention mass every query pays each row, H2O's score) measured apart.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
    python bench/h2o_cost.py --model "$(veloxpatch fetch-model smollm2 | tail -1)" --context 1024 --repeats 3

Prints, per repeat and method (none, snapkv, h2o; 25% of the context, 32 new tokens, float32), the whole time, the
time to the first token (the prompt), the decode time and the seconds inside ``received_mass`` (evaluated there).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import mlx.core as mx

import veloxpatch
import veloxpatch.methods.h2o as h2o
from veloxpatch.eval import tasks

SPENT = [0.0]
_RECEIVED_MASS = h2o.received_mass


def timed_mass(*args: Any, **kwargs: Any) -> mx.array:
    """``received_mass``, evaluated, its time added to :data:`SPENT`."""
    start = time.perf_counter()
    out = _RECEIVED_MASS(*args, **kwargs)
    mx.eval(out)
    SPENT[0] += time.perf_counter() - start
    return out


def run(model: Any, prompt: mx.array, kv: str) -> tuple[float, float, float]:
    """(whole, prompt, seconds in received_mass) of one generation under ``kv``."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    veloxpatch.unpatch() if kv == "none" else veloxpatch.patch(kv=kv, budget="25%")
    caches, SPENT[0] = make_prompt_cache(model), 0.0
    start, first = time.perf_counter(), 0.0
    for i, _ in enumerate(generate_step(prompt, model, prompt_cache=caches, max_tokens=32)):
        if i == 0:
            first = time.perf_counter() - start
    return time.perf_counter() - start, first, SPENT[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from mlx_lm import load

    model, tokenizer = load(args.model)
    model.set_dtype(mx.float32)
    text, _ = tasks.passkey_example(tokenizer, args.context, 5, depth=0.5)
    prompt = mx.array(tokenizer.encode(text))
    h2o.received_mass = timed_mass
    run(model, prompt, "snapkv"), run(model, prompt, "h2o")  # warm-up: the probes
    print("| repeat | method | whole (s) | prompt (s) | decode (s) | in received_mass (s) |\n|---|---|---|---|---|---|")
    for r in range(args.repeats):
        for kv in ("none", "snapkv", "h2o"):
            whole, first, mass = run(model, prompt, kv)
            print(f"| {r} | {kv} | {whole:.2f} | {first:.2f} | {whole - first:.2f} | {mass:.2f} |", flush=True)


if __name__ == "__main__":
    main()
