"""Does the installed mlx-lm get compressed caches, and exact ones where nothing is evicted?

    python bench/compat_check.py [--methods snapkv chunkkv xkv xquant] [--small 128] [--big 4096]

Runs a plain mlx_lm app (this file with ``--app``: the shipped model, a ~900-token passkey prompt,
16 greedy tokens through ``stream_generate`` on a ``make_prompt_cache`` list) in fresh interpreters:
once plain, then per method at a small budget and at one above the context, both through
``veloxpatch run`` and through ``import veloxpatch.auto``. A small budget must compress (our cache
class, fewer KV bytes than ``VELOX_KV=none`` run the same way: the launcher and the import may run the
weights as float32, VELOX_FLOAT32); a big one must give plain mlx_lm's tokens, for a method that has a
budget (xquant keeps every token, quantized: it is never exact, and only its compression is checked).
Prints one Markdown row per (method, path) and exits 1 if any fails: run it under each mlx-lm version
(noxfile.py does).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

from veloxpatch.registry import cache_class

APP_FLAG = "--app"
AUTO_FLAG = "--auto"


def app() -> None:
    """The app: knows nothing of veloxpatch unless ``--auto`` asks for the one-line import."""
    if AUTO_FLAG in sys.argv:
        import veloxpatch.auto  # noqa: F401  (the one-line switch, as a user's script would have it)
    import importlib.metadata

    from mlx_lm import load, stream_generate
    from mlx_lm.models.cache import make_prompt_cache

    from veloxpatch.assets import model_path

    model, tokenizer = load(str(model_path()))
    filler = " ".join(["The grass is green. The sky is blue. The sun is yellow."] * 16)
    prompt = f"{filler}\nThe pass key is 71432. Remember it.\n{filler}\nWhat is the pass key? The pass key is"
    caches = make_prompt_cache(model)
    tokens = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=16, prompt_cache=caches)]
    print(json.dumps({"mlx_lm": importlib.metadata.version("mlx-lm"), "cache": type(caches[0]).__name__,
                      "kv_bytes": sum(map(kv_bytes, caches)), "tokens": tokens,
                      "prompt_tokens": len(tokenizer.encode(prompt))}))


def kv_bytes(cache: Any) -> int:
    """What a cache holds: its ``nbytes`` (mlx-lm 0.28's ``KVCache`` has none: then its state's arrays)."""
    from mlx.utils import tree_flatten

    held = getattr(cache, "nbytes", None)
    return held if held is not None else sum(a.nbytes for _, a in tree_flatten(cache.state))


def run(path: str, env: dict[str, str]) -> dict[str, Any]:
    """The app's answer in a fresh interpreter: ``plain``, ``run`` (the launcher) or ``auto``."""
    me = os.path.abspath(__file__)
    command = {"plain": [sys.executable, me, APP_FLAG], "auto": [sys.executable, me, APP_FLAG, AUTO_FLAG],
               "run": [sys.executable, "-m", "veloxpatch", "run", me, APP_FLAG]}[path]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("VELOX_")}
    done = subprocess.run(command, env={**clean, **env}, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{path} {env} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=["snapkv", "chunkkv", "xkv", "xquant"])
    parser.add_argument("--small", type=int, default=128, help="a budget that must compress")
    parser.add_argument("--big", type=int, default=4096, help="a budget above the context: exact")
    args = parser.parse_args()
    plain = run("plain", {})
    print(f"mlx-lm {plain['mlx_lm']}, {plain['prompt_tokens']}-token prompt, plain KV {plain['kv_bytes']} bytes\n")
    print("| method | path | cache | KV bytes at the small budget / dense | compresses | exact at the big budget |")
    print("|---|---|---|---|---|---|")
    failed = False
    dense = {path: run(path, {"VELOX_KV": "none"})["kv_bytes"] for path in ("run", "auto")}
    for method in args.methods:
        for path in ("run", "auto"):
            small = run(path, {"VELOX_KV": method, "VELOX_BUDGET": str(args.small)})
            compresses = small["cache"] != "KVCache" and small["kv_bytes"] < dense[path]
            exact: bool | str = "n/a"
            if cache_class(method).uses_budget:
                exact = run(path, {"VELOX_KV": method, "VELOX_BUDGET": str(args.big)})["tokens"] == plain["tokens"]
            failed = failed or not compresses or exact is False
            print(f"| {method} | {path} | {small['cache']} | {small['kv_bytes']} / {dense[path]} | {compresses} "
                  f"| {exact} |", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    if APP_FLAG in sys.argv:
        app()
    else:
        sys.exit(main())
