"""Concurrent requests to the real ``mlx_lm server`` (the ``openai`` client): batched and compressed against plain.

Two servers on loopback under the launcher, both float32 with OpenBLAS (the launcher's defaults on the CPU): one with
no method (mlx_lm's own batching, the reference), one compressing. Each round sends ``--concurrency`` distinct
prompts of ``--context`` tokens at once to one server, then the same to the other (the order alternates between
rounds, so both meet the same machine), and times the round's wall clock. Every prompt opens with its own line,
"Document R-I.", so two prompts share at most a few tokens; mlx_lm's prompt cache still starts a request from an
earlier one's cache trimmed back to them (``--prompt-cache-size 0`` turns it off for both timed servers). After the
rounds, each of the compressing server's prompts is sent again alone (a seed makes mlx_lm serve a request one at a
time) to a fresh compressing server without a prompt cache (each read fresh), and its answer compared with the
batched one (both kept in ``result.json``); the batched answers' ``usage.velox`` say what each sequence's KV held.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
    python bench/server_batch.py --model "$(veloxpatch fetch-model smollm2 | tail -1)" --context 2048 \\
        --concurrency 8 --rounds 3 --kv snapkv --budget 512 --out docs/results/smollm2-server-batch-2k

``--set VELOX_NAME=VALUE`` adds a setting to the compressing servers (``VELOX_QUANT_KEEP=0.125x``, say).

Writes ``result.json`` and prints a markdown table (requests per second, their ratio, the KV held per sequence).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import serving
from veloxpatch.eval import tasks

MAX_TOKENS = 32


def prompts(tokenizer: Any, context: int, count: int, round_: int) -> list[str]:
    """``count`` passkey documents of about ``context`` tokens, each opened by its own line (no shared prefix)."""
    out = []
    for i in range(count):
        text, _ = tasks.passkey_example(tokenizer, context - 16, 7000 + 100 * round_ + i, depth=0.5)
        out.append(f"Document {round_}-{i}.\n{text}")
    return out


def send(url: str, batch: list[str], alone: bool = False) -> tuple[float, list[dict]]:
    """(seconds, answers) of ``batch`` sent at once with the ``openai`` client (``alone``: one after another, each
    served one at a time); each answer as the server's JSON (``choices``, ``usage`` with ``velox``)."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=900)

    def one(prompt: str) -> dict:
        answer = client.completions.create(model="default_model", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                           extra_body={"seed": 0} if alone else None)
        return answer.model_dump()

    start = time.perf_counter()
    if alone:
        answers = [one(p) for p in batch]
    else:
        with ThreadPoolExecutor(len(batch)) as pool:
            answers = list(pool.map(one, batch))
    return time.perf_counter() - start, answers


def server(model: str, env: dict[str, str], log: Path, *extra: str) -> Any:
    """A server under the launcher with ``env`` over this process's environment (VELOX_* removed)."""
    command = [sys.executable, "-m", "veloxpatch.cli", "run", "-m", "mlx_lm", "server", "--model", model,
               "--log-level", "INFO", *extra]
    return serving.running(command, log, env, unset=("LD_PRELOAD",))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kv", default="snapkv")
    parser.add_argument("--budget", default="512")
    parser.add_argument("--prompt-cache-size", help="the timed servers' (default: mlx_lm's)")
    parser.add_argument("--set", action="append", default=[], metavar="VELOX_NAME=VALUE",
                        help="a setting more for the compressing servers (repeatable), e.g. VELOX_QUANT_KEEP=0.125x")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tokenizer = load_tokenizer(Path(args.model))
    args.out.mkdir(parents=True, exist_ok=True)
    plain_env = {"VELOX_KV": "none", "VELOX_FLOAT32": "on"}
    ours_env = {"VELOX_KV": args.kv, "VELOX_BUDGET": args.budget, "VELOX_FLOAT32": "on",
                **serving.env_settings(args.set)}
    logs = Path(tempfile.mkdtemp(prefix="server-batch-"))
    times: dict[str, list[float]] = {"plain": [], "ours": []}
    batched: list[tuple[str, dict]] = []
    extra = ("--prompt-cache-size", args.prompt_cache_size) if args.prompt_cache_size else ()
    with (server(args.model, plain_env, logs / "plain.log", *extra) as plain,
          server(args.model, ours_env, logs / "ours.log", *extra) as ours):
        send(plain, prompts(tokenizer, 256, 2, -1))  # warm-up: the first request loads and probes
        send(ours, prompts(tokenizer, 256, 2, -2))
        for r in range(args.rounds):
            order = [("plain", plain), ("ours", ours)] if r % 2 == 0 else [("ours", ours), ("plain", plain)]
            for name, url in order:
                batch = prompts(tokenizer, args.context, args.concurrency, 2 * r + (name == "ours"))
                seconds, answers = send(url, batch)
                times[name].append(seconds)
                if name == "ours":
                    batched += list(zip(batch, answers))
                print(f"round {r}: {name} {seconds:.1f} s", flush=True)
    # no prompt cache: every prompt starts "Document", so each would otherwise start from the last one's cache
    # trimmed back to that word (a lossy cache's rows then come back as held, not as read fresh)
    with server(args.model, ours_env, logs / "alone.log", "--prompt-cache-size", "0") as alone:
        _, singles = send(alone, [p for p, _ in batched], alone=True)
    result = summary(args, times, batched, singles)
    (args.out / "result.json").write_text(json.dumps(result, indent=1))
    print(table(result))


def summary(args: argparse.Namespace, times: dict[str, list[float]], batched: list[tuple[str, dict]],
            singles: list[dict]) -> dict[str, Any]:
    """Requests per second of each server (median round), their ratio, answers equal alone, KV per sequence (and its
    share of mlx_lm's as a 16-bit model holds both: this CPU runs float32)."""
    rate = {name: args.concurrency / statistics.median(t) for name, t in times.items()}
    held = [a["usage"]["velox"] for _, a in batched]
    same = [a["choices"][0]["text"] == s["choices"][0]["text"] for (_, a), s in zip(batched, singles)]
    return {
        "settings": {k: v for k, v in vars(args).items() if k != "out"} | {"model": Path(args.model).name},
        "seconds": times, "requests_per_s": rate, "ratio": rate["ours"] / rate["plain"],
        "equal_alone": sum(same), "requests": len(same),
        "rows_kept_per_layer": [h["rows_kept"] / layers(args.model) for h in held],
        "share_kept": [h["share_kept"] for h in held], "kv_bytes": [h["kv_bytes"] for h in held],
        "dense_kv_bytes": [h["dense_kv_bytes"] for h in held],
        "share_16bit": [h["kv_bytes_16bit"] / h["dense_kv_bytes_16bit"] for h in held if h.get("dense_kv_bytes_16bit")],
        "answers": [{"batched": a["choices"][0]["text"], "alone": s["choices"][0]["text"]}
                    for (_, a), s in zip(batched, singles)],
    }


def layers(model: str) -> int:
    """The model's decoder layers (its config)."""
    return json.loads((Path(model) / "config.json").read_text())["num_hidden_layers"]


def table(result: dict[str, Any]) -> str:
    rate, s = result["requests_per_s"], result["settings"]
    kv = statistics.median(result["kv_bytes"]) / 2**20
    dense = statistics.median(result["dense_kv_bytes"]) / 2**20
    return "\n".join([
        "| server | requests/s (median of rounds) | vs plain | answers equal alone | KV per sequence (MiB) "
        "| rows per layer |",
        "|---|---|---|---|---|---|",
        f"| plain (no method) | {rate['plain']:.3f} | 1.00 | | {dense:.1f} | all |",
        f"| {s['kv']} at {s['budget']} | {rate['ours']:.3f} | {result['ratio']:.2f} | "
        f"{result['equal_alone']}/{result['requests']} | {kv:.1f} | "
        f"{min(result['rows_kept_per_layer']):.0f}-{max(result['rows_kept_per_layer']):.0f} |",
    ])


if __name__ == "__main__":
    main()
