"""The follow-up through the real ``mlx_lm server``: how often a chat's later questions are answered with the full
cache and compressed, each chat sent turn after turn as a client sends it (the server reusing its prompt cache).

    python bench/followup_server.py --model M [--context 1024] [--samples 10] [--budget 25%] [--kv snapkv]
                                    [--compress end|chunk] [--tier BITS] [--set VELOX_QUANT_KEEP=30% ...] [--facts 3]
                                    --out DIR

Three turns per chat (``ruler.followup`` and ``serving.ask_first_again``): a document's first question, a second about
another fact, then the first again; with ``--facts 3`` three facts, one asked a turn. Each chat runs on a server of
its own (``veloxpatch run -m mlx_lm server``), unpatched and with ``VELOX_KV``/``VELOX_BUDGET``: a shared server
would start the next chat from this one's cache trimmed back to the chat template. Every chat is appended to
``DIR/chats.jsonl`` as it ends with the knob values its server's caches got (defaults resolved), and a rerun
skips those there of the same label and knobs; the table (``DIR/table.md``) counts each turn right
when its answer has the number asked and none of the others, and gives the median KV bytes the server said it held
after the last turn (``usage.velox.kv_bytes``; mlx_lm's own bytes for the full cache, from the same field) and their
share of the full cache's (``dense_kv_bytes``), also as a 16-bit model would hold both (``kv_bytes_16bit``,
``dense_kv_bytes_16bit``: this CPU runs float32).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from mlx_lm.tokenizer_utils import load as load_tokenizer

import serving
from veloxpatch.eval import harness, ruler
from veloxpatch.eval.report import wilson
from veloxpatch.eval.variants import GENERAL, Variant, identity


def chat_example(tokenizer, context: int, seed: int, facts: int) -> ruler.Example:
    """The chat of three turns: two facts, the first asked again last (``serving.ask_first_again``), or three."""
    ex = ruler.followup(tokenizer, context, seed, facts=facts)
    return serving.ask_first_again(ex) if facts == 2 else ex


def turn_examples(ex: ruler.Example, facts: int) -> list[ruler.Example]:
    """``ex`` (three turns) scored per turn, each wanting its number and none of the others: with two facts turns 1
    and 3 want the first number, turn 2 the second; with three, turn i the i-th."""
    if facts == 2:
        return [ex, replace(ex, wanted=ex.unwanted, unwanted=ex.wanted), ex]
    numbers = (*ex.unwanted, *ex.wanted)
    return [replace(ex, wanted=(n,), unwanted=tuple(m for m in numbers if m != n)) for n in numbers]


TIMEOUT_S = 1800  # a request's first turn on this CPU: a 2k-token prompt read twice by Qwen2.5-0.5B passed 120 s


def run_chat(model: str, tokenizer, ex: ruler.Example, env: dict[str, str]) -> tuple[list[str], dict]:
    """One chat's answers from a fresh server with ``env``, and the last answer's ``usage.velox``."""
    serve = [sys.executable, "-m", "veloxpatch.cli", "run", "-m", "mlx_lm", "server", "--model", model,
             "--log-level", "INFO"]
    with tempfile.TemporaryDirectory() as folder, serving.running(serve, Path(folder) / "log", env) as url:
        usages: list[dict] = []
        answers = serving.chat(url, tokenizer, ex, harness.FIRST_TURN, usages, timeout=TIMEOUT_S)
        return answers, usages[-1].get("velox") or {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--budget", default="25%")
    parser.add_argument("--kv", default="snapkv")
    parser.add_argument("--compress", choices=["end", "chunk"], default="end")
    parser.add_argument("--tier", default="off", help="VELOX_TIER: off, or the bits of the tier dropped rows go to")
    parser.add_argument("--set", action="append", default=[], metavar="VELOX_NAME=VALUE",
                        help="another setting of the compressing server (a method knob), repeatable")
    parser.add_argument("--facts", type=int, choices=[2, 3], default=2,
                        help="2: a fact, another, the first again; 3: three facts, one a turn")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    extra = serving.env_settings(args.set)
    tokenizer = load_tokenizer(Path(args.model))
    ours = {"VELOX_KV": args.kv, "VELOX_BUDGET": args.budget, "VELOX_COMPRESS": args.compress,
            "VELOX_TIER": args.tier, **extra}
    label = args.kv + "".join(f"[{k}={v}]" for k, v, default in (("compress", args.compress, "end"),
                                                                    ("tier", args.tier, "off")) if v != default)
    knob = f"VELOX_{args.kv.upper()}_"  # a method's knob named as in its brackets elsewhere: [keep=30%]
    label += "".join(f"[{k.removeprefix(knob).removeprefix('VELOX_').lower()}={v}]" for k, v in extra.items())
    variants = {"full": ({}, {}), f"{label}@{args.budget}": (ours, server_knobs(args.kv, ours))}
    journal = args.out / "chats.jsonl"
    args.out.mkdir(parents=True, exist_ok=True)
    done = [json.loads(line) for line in journal.read_text().splitlines()] if journal.exists() else []
    done = [r for r in done if r.get("facts", 2) == args.facts]  # a journal of the other chat is left alone
    seen = {(chat_identity(r), r["seed"], r["context"]) for r in done}
    for seed in range(args.samples):
        ex = chat_example(tokenizer, args.context, seed, args.facts)
        for name, (env, knobs) in variants.items():
            if (identity(name, knobs), seed, args.context) in seen:
                continue
            answers, usage = run_chat(args.model, tokenizer, ex, env)
            row = {"variant": name, "knobs": knobs, "seed": seed, "context": args.context, "facts": args.facts,
                   "answers": answers, "usage": usage,
                   "right": [ruler.score(a, t) for a, t in zip(answers, turn_examples(ex, args.facts))]}
            done.append(row)
            with journal.open("a") as handle:
                handle.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)
    third = "the first again" if args.facts == 2 else "a third fact"
    lines = [f"**followup through `mlx_lm server`, {args.context} tokens, three turns, n={args.samples}**", "",
             f"| variant | turn 1 | turn 2 (follow-up) | turn 3 ({third}) | KV after (MiB) | share of full "
             "| share at 16 bits |", "|---|---|---|---|---|---|---|"]
    groups = dict.fromkeys(chat_identity(r) for r in done)  # every variant the journal holds, in the order run
    for group in groups:
        rows = [r for r in done if chat_identity(r) == group and r["context"] == args.context
                and r["seed"] < args.samples]
        if not rows:
            continue
        name = table_name(rows[0], done)
        cells = []
        for turn in range(3):
            k, n = sum(r["right"][turn] for r in rows), len(rows)
            low, high = wilson(k, n)
            cells.append(f"{k / n:.2f} [{low:.2f}, {high:.2f}]")
        lines.append(f"| {name} | " + " | ".join(cells + held(rows)) + " |")
    table = "\n".join(lines)
    print(table)
    (args.out / "table.md").write_text(table + "\n")


def server_knobs(kv: str, env: dict[str, str]) -> dict[str, Any]:
    """Every knob value the compressing server's caches get, its defaults resolved (quant's ``auto`` block size
    among them): what a journal's chat must match besides its label, so that a rerun after a default changed
    measures the chat again instead of counting the old one. A setting that is no knob of the method (``VELOX_SINK``)
    counts under its own name."""
    prefix = f"VELOX_{kv.upper()}_"
    names = set(Variant.of(kv).knob_values()) | set(GENERAL)
    short = {key: key.removeprefix(prefix).removeprefix("VELOX_").lower() for key in env if key != "VELOX_KV"}
    spec = ",".join(f"{short[k]}={v}" for k, v in env.items() if short.get(k) in names)
    others = {k: v for k, v in env.items() if k in short and short[k] not in names and k != "VELOX_BUDGET"}
    return {**Variant.of(f"{kv}[{spec}]" if spec else kv).knob_values(), **others}


def chat_identity(row: dict) -> str:
    """The variant a journal's chat measured: its label and knobs. A chat written before the knobs were kept
    matches no variant run now (its defaults may have changed since), the full cache's excepted (it has none)."""
    knobs = row.get("knobs", {} if row["variant"] == "full" else None)
    return identity(row["variant"], knobs)


def table_name(row: dict, done: list[dict]) -> str:
    """A variant's name in the table: its label, and where the journal has the label with other knobs too, the
    knob values that differ (or that this chat's were not kept)."""
    others = [r for r in done if r["variant"] == row["variant"] and chat_identity(r) != chat_identity(row)]
    if not others:
        return row["variant"]
    if "knobs" not in row:
        return f"{row['variant']} (knobs not kept)"
    seen = [r.get("knobs") or {} for r in others]
    differ = {k: v for k, v in row["knobs"].items() if any(s.get(k) != v for s in seen)}
    return f"{row['variant']} ({', '.join(f'{k}={v}' for k, v in differ.items())})"


def held(rows: list[dict]) -> list[str]:
    """The median KV bytes held after a chat's last turn (MiB) and their share of the full cache's, where the
    journal has them (chats measured before they were recorded have not)."""
    usages = [r["usage"] for r in rows if r.get("usage", {}).get("kv_bytes")]
    if not usages:
        return ["", "", ""]
    kv = statistics.median(u["kv_bytes"] for u in usages)
    share = statistics.median(u["kv_bytes"] / u["dense_kv_bytes"] for u in usages)
    at16 = [u["kv_bytes_16bit"] / u["dense_kv_bytes_16bit"] for u in usages if u.get("dense_kv_bytes_16bit")]
    return [f"{kv / 2**20:.1f}", f"{share:.3f}", f"{statistics.median(at16):.3f}" if at16 else ""]


if __name__ == "__main__":
    main()
