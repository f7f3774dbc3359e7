"""What the eligibility probe costs: the first ``make_prompt_cache`` for a model, plain mlx_lm against patched.

    python bench/probe_cost.py [--model smollm2,random4b,random4b-lazy] [--method snapkv] [--whole] [--out FILE]

Each (model, mode) runs in a process of its own, so every build is the first for its model and the peak is its own:

* ``smollm2``: SmolLM2-135M-Instruct (``veloxpatch fetch-model smollm2``), loaded, cast to float32 as a patched app
  on the CPU runs it (``VELOX_FLOAT32=auto``);
* ``random4b``: mlx_lm's llama class with Qwen3-4B's sizes (36 layers, 4.0B parameters), random weights in float16
  (8 GB; float32 would be 16), evaluated before the build as an app's loaded model is;
* ``random4b-lazy``: the same config never evaluated, as mlx-lm's own tests build models: the patched build must
  not be what evaluates it.

Modes: ``plain`` (unpatched mlx_lm), ``patched`` (``--method`` at a budget above the probe), and with ``--whole``
``whole``, patched with the probe forced over every layer (what it cost before it ran a prefix of them; not for the
lazy model). Reported per row: the build's wall time, the peak of mlx's memory during it over what was held before,
what it still holds after, and how many of the model's parameters are still unevaluated after it. Prints a Markdown
table (and writes it, with the JSON rows, to ``--out``). Time only with nothing else running on the machine.
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

SMOLLM2 = Path.home() / ".cache/veloxpatch/models/smollm2-135m-instruct"
# Qwen3-4B's sizes on mlx_lm's llama class: 36 x 101M + 389M (tied embedding) = 4.02B parameters
RANDOM_4B: dict[str, Any] = dict(
    model_type="llama", hidden_size=2560, num_hidden_layers=36, intermediate_size=9728, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1e6,
    tie_word_embeddings=True, max_position_embeddings=40960,
)
MODELS = ("smollm2", "random4b", "random4b-lazy")


def pending(model: Any) -> int:
    """How many parameters of ``model`` are still unevaluated (``veloxpatch.structure``'s test, inlined so that this
    script also runs on a checkout without it)."""

    def lazy(array: mx.array) -> bool:
        out = io.StringIO()
        mx.export_to_dot(out, array)
        return "->" in out.getvalue()

    return sum(lazy(a) for _, a in tree_flatten(model.parameters()))


def build_model(name: str) -> Any:
    """The model of ``name``, evaluated unless it is the lazy one."""
    if name == "smollm2":
        from mlx_lm import load

        model, _ = load(str(SMOLLM2))
        model.set_dtype(mx.float32)
    else:
        from mlx_lm.utils import _get_classes

        model_cls, args_cls = _get_classes(RANDOM_4B)
        model = model_cls(args_cls.from_dict(RANDOM_4B))
        model.set_dtype(mx.float16)
    if not name.endswith("-lazy"):
        for _, array in tree_flatten(model.parameters()):  # one at a time: each float32 draw freed as it is cast
            mx.eval(array)
    return model


def one(name: str, mode: str, method: str) -> dict[str, Any]:
    """The first build for ``name`` in ``mode``, measured in this process."""
    import mlx_lm.models.cache as cache_module  # its make_prompt_cache read at the call: the one patching binds

    import veloxpatch
    from veloxpatch.caches import CompressedKVCache

    model = build_model(name)
    params = sum(a.size for _, a in tree_flatten(model.parameters()))
    if mode != "plain":
        veloxpatch.patch(kv=method, budget=1 << 20)
    if mode == "whole":
        from veloxpatch import structure

        structure.prefix = lambda *args, **kwargs: None  # no prefix: every layer is probed
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    start = time.perf_counter()
    caches = cache_module.make_prompt_cache(model)
    seconds = time.perf_counter() - start
    peak = max(mx.get_peak_memory(), before) - before  # the peak restarts at 0
    gc.collect()
    held = mx.get_active_memory() - before
    ours = sum(isinstance(c, CompressedKVCache) for c in caches)
    return {"model": name, "mode": mode, "layers": len(model.layers), "params": params, "seconds": seconds,
            "peak_MiB": peak / 2**20, "held_after_MiB": held / 2**20, "model_MiB": before / 2**20,
            "compressed_slots": ours, "unevaluated_after": pending(model)}


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | mode | first make_prompt_cache | peak over the model | held after | compressed slots | "
             "unevaluated parameters after |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        size = f"{r['params'] / 1e9:.2f}B" if r["params"] > 1e9 else f"{r['params'] / 1e6:.0f}M"
        lines.append(f"| {r['model']} ({size}, {r['layers']} layers) | {r['mode']} | {r['seconds']:.3f} s | "
                     f"{r['peak_MiB']:.1f} MiB | {r['held_after_MiB']:.1f} MiB | {r['compressed_slots']} | "
                     f"{r['unevaluated_after']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=",".join(MODELS))
    parser.add_argument("--method", default="snapkv")
    parser.add_argument("--whole", action="store_true", help="also probe every layer (the cost before the prefix)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(*args.one, args.method)))
        return
    rows = []
    for name in args.model.split(","):
        modes = ["plain", "patched"] + (["whole"] if args.whole and not name.endswith("-lazy") else [])
        for mode in modes:
            run = subprocess.run([sys.executable, __file__, "--one", name, mode, "--method", args.method],
                                 capture_output=True, text=True, check=True)
            rows.append(json.loads(run.stdout.splitlines()[-1]))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    text = table(rows)
    print(text)
    if args.out:
        args.out.write_text(text + "\n\n" + json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
