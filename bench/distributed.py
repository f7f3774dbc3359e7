"""Compressed against vanilla KV caches under mlx.distributed: ranks in tensor parallel, one long prompt.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 python bench/distributed.py \\
        --context 4096 --budget 1024 --kv snapkv --decode 64 --out docs/results/random-distributed-4k-tp2.md

The command is the driver: unless ``--model`` names a folder that holds a model, it writes a random-weight
llama whose KV heads split evenly over the ranks (SmolLM2's 3 do not split over 2), finds two free ports (the
ring backend listens on the starting port + rank) and starts ``mlx.launch -n 2 --backend ring`` on this
script's worker role, under ``--timeout``. The ranks inherit the environment, so a preloaded OpenBLAS reaches
them; the output says whether it did.

Each rank loads the folder with ``mlx_lm.utils.sharded_load(tensor_group=...)`` (its share of the heads and
of the MLP) and runs mlx_lm's ``generate_step`` on one prompt of exactly ``--context`` random tokens, with
mlx_lm's own caches and with veloxpatch's (``veloxpatch.patch`` in the same process), in the order vanilla,
compressed, vanilla at a context of ``--budget``, compressed, vanilla, after a short warm-up of each: a
drift linear in time gives each variant's mean the same share. Vanilla at the budget's context is the decode
speed a cache holding that many rows should approach, under the same sharding. Random weights say nothing
about the text, but the speed and memory are real.

Per rank and variant: prefill s (time to the first token, where ``end`` mode compresses the prompt), decode
tok/s of the other new tokens, KV MiB of the cache list after the run, active MiB after the prefill and peak
MiB of the run (both with the rank's weights), and whether the ranks generated the same tokens (all_gather).
Rank 0 prints a Markdown table and writes it to ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.utils import sharded_load

import veloxpatch
from serving import free_port
from veloxpatch.cpu import preloaded
from veloxpatch.eval import sharing
from veloxpatch.eval.commands import machine
from veloxpatch.eval.random_model import write_model_dir
from veloxpatch.eval.report import markdown
from veloxpatch.eval.variants import Variant

RANKS = 2
MIB = 2**20
FIGURES = ("prefill_s", "decode_tok_s", "kv_mib", "active_mib", "peak_mib")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=4096, help="prompt tokens")
    parser.add_argument("--budget", type=int, default=1024, help="rows the compressed cache keeps")
    parser.add_argument("--kv", default="snapkv", help="a veloxpatch method, knobs allowed: snapkv[kernel=15]")
    parser.add_argument("--compress", choices=("end", "chunk"), default="end")
    parser.add_argument("--decode", type=int, default=64, help="new tokens per run")
    parser.add_argument("--prefill-step", type=int, default=512, help="prefill_step_size for every run")
    parser.add_argument("--model", type=Path, default=None,
                        help="a model folder; written (random llama) if it holds none; default: a temporary one")
    parser.add_argument("--hidden", type=int, default=512, help="random llama: hidden size (64 per query head)")
    parser.add_argument("--layers", type=int, default=8, help="random llama: layers")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds before the ranks are stopped")
    parser.add_argument("--out", type=Path, default=None, help="the Markdown file rank 0 writes")
    parser.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--command", default="", help=argparse.SUPPRESS)  # the driver's, for the report
    parser.add_argument("--model-note", default="", help=argparse.SUPPRESS)
    return parser.parse_args()


# --- driver ------------------------------------------------------------------------------------------------

def random_llama(path: Path, args: argparse.Namespace) -> str:
    """Write a random-weight float32 llama into ``path``: head_dim 64, half as many KV heads as query heads
    (an even count for the ranks to split), rope long enough for the prompt; returns how the report names it."""
    heads = args.hidden // 64
    write_model_dir(path, "llama", hidden_size=args.hidden, num_hidden_layers=args.layers,
                    num_attention_heads=heads, num_key_value_heads=heads // 2, head_dim=64,
                    intermediate_size=2 * args.hidden,
                    max_position_embeddings=max(4096, args.context + args.decode))
    return "a random-weight llama (veloxpatch.eval.random_model, seed 0) written by this script"


def driver_command() -> str:
    """This run's command line as typed, with the preload that changes its speed."""
    preload = os.environ.get("LD_PRELOAD")
    prefix = f"LD_PRELOAD={shlex.quote(preload)} " if preload else ""
    return prefix + shlex.join(["python", *sys.argv])


def launch(args: argparse.Namespace, folder: Path, note: str) -> int:
    """Run the worker role on RANKS local ranks; stop their process group at the timeout."""
    port = free_port(RANKS)
    worker = [str(Path(__file__).resolve()), "--rank-worker", "--model", str(folder),
              "--context", str(args.context), "--budget", str(args.budget), "--kv", args.kv,
              "--compress", args.compress, "--decode", str(args.decode), "--prefill-step", str(args.prefill_step),
              "--command", driver_command(), "--model-note", note]
    if args.out:
        worker += ["--out", str(args.out.resolve())]
    command = [str(Path(sys.executable).with_name("mlx.launch")), "-n", str(RANKS), "--backend", "ring",
               "--starting-port", str(port), "--python", sys.executable, "--", *worker]
    process = subprocess.Popen(command, start_new_session=True)
    try:
        return process.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait()
        print(f"stopped after {args.timeout:g} s (--timeout)", file=sys.stderr)
        return 124


def drive(args: argparse.Namespace) -> int:
    if args.model is not None and (args.model / "config.json").exists():
        return launch(args, args.model, f"`{args.model}`")
    if args.model is not None:
        return launch(args, args.model, random_llama(args.model, args))
    with tempfile.TemporaryDirectory(prefix="velox-tp-") as folder:
        return launch(args, Path(folder), random_llama(Path(folder), args))


# --- worker (one per rank) ---------------------------------------------------------------------------------

@dataclass
class Case:
    label: str
    variant: Variant
    context: int


@dataclass
class Run:
    label: str
    figures: list[float]  # FIGURES, on this rank
    agree: bool  # every rank generated the same tokens


def timed_run(model: Any, prompt: mx.array, caches: list[Any], new_tokens: int,
              prefill_step: int) -> tuple[list[float], list[int]]:
    """One greedy ``generate_step`` run: FIGURES and the tokens. The peak is reset first, so it is the run's
    own (with the weights); active memory is read when the first token comes, i.e. after the prefill.

    ``generate_step`` leaves one more step running on its stream when it stops (it computes token n + 1
    before it yields token n); its all_sums would interleave with the next collective on another stream (the
    ranks then receive each other's data), so the run waits for it after the clock stops."""
    # looked up after the caches (un)patched mlx_lm, as an app's call would be
    from mlx_lm.generate import generate_step, generation_stream

    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    tokens: list[int] = []
    start = time.perf_counter()
    first, active = start, 0
    for n, (token, _) in enumerate(generate_step(prompt, model, max_tokens=new_tokens, prompt_cache=caches,
                                                 prefill_step_size=prefill_step)):
        if n == 0:
            first, active = time.perf_counter(), mx.get_active_memory()
        tokens.append(token)
    end = time.perf_counter()
    mx.synchronize(generation_stream)
    kv = sum(c.nbytes for c in caches)
    return [first - start, (new_tokens - 1) / (end - first), kv / MIB, active / MIB, mx.get_peak_memory() / MIB], tokens


def same_on_all_ranks(tokens: list[int], group: Any) -> bool:
    """Whether every rank generated ``tokens`` (a collective: every rank must call it, in the same order)."""
    rows = mx.distributed.all_gather(mx.array(tokens, dtype=mx.int32), group=group).reshape(group.size(), -1)
    return bool(mx.all(rows == rows[0]).item())


def run_case(model: Any, group: Any, case: Case, args: argparse.Namespace, context: int, new_tokens: int) -> Run:
    """``case`` on a fresh cache list and a prompt of ``context`` tokens (every rank draws the same)."""
    caches = case.variant.caches(model, case.context, args.compress, budget=args.budget)
    figures, tokens = timed_run(model, sharing.random_prompt(model, context), caches, new_tokens, args.prefill_step)
    return Run(case.label, figures, same_on_all_ranks(tokens, group))


def gather_figures(runs: list[Run], group: Any) -> list[list[list[float]]]:
    """[rank][run] -> FIGURES, the same on every rank."""
    mine = mx.array([r.figures for r in runs], dtype=mx.float32)
    every = mx.distributed.all_gather(mine, group=group).reshape(group.size(), len(runs), len(FIGURES))
    return every.tolist()


def table(cases: list[Case], runs: list[Run], figures: list[list[list[float]]]) -> str:
    """Per rank and case, the mean of its runs (decode tok/s: each run too) and the ratios to vanilla (the
    first case) on the same rank."""
    rows = []
    for rank, per_run in enumerate(figures):
        mine = []
        for case in cases:
            own = [f for r, f in zip(runs, per_run) if r.label == case.label]
            mine.append({"rank": rank, "variant": case.label, "context": case.context,
                         **{k: sum(column) / len(column) for k, column in zip(FIGURES, zip(*own))},
                         "decode tok/s (runs)": "/".join(f"{f[1]:.3g}" for f in own),
                         "ranks agree": all(r.agree for r in runs if r.label == case.label)})
        for row in mine:
            row["decode vs vanilla"] = row["decode_tok_s"] / mine[0]["decode_tok_s"]
            row["KV vs vanilla"] = row["kv_mib"] / mine[0]["kv_mib"]
        rows += mine
    return markdown(rows, ["rank", "variant", "context", "prefill_s", "decode_tok_s", "decode tok/s (runs)",
                           "decode vs vanilla", "kv_mib", "KV vs vanilla", "active_mib", "peak_mib",
                           "ranks agree"])


def machine_notes(model: Any, group: Any) -> list[str]:
    """The facts a reader needs to compare these figures: machine, backend, BLAS, model and its sharding."""
    blas = [p for p in preloaded(dict(os.environ)) if "blas" in os.path.basename(os.path.realpath(p))]
    a = model.args
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters())) / MIB
    dtype = str(tree_flatten(model.parameters())[0][1].dtype).removeprefix("mlx.core.")
    where = (f"{machine()}, mlx-lm {importlib.metadata.version('mlx-lm')}, {os.cpu_count()} CPU cores; "
             f"{group.size()} ranks on this machine (mlx.launch, ring backend over loopback)")
    threads = os.environ.get("OPENBLAS_NUM_THREADS", "unset")
    blas_note = (f"OpenBLAS preloaded: {'yes (' + ', '.join(blas) + ')' if blas else 'no'}; "
                 f"OPENBLAS_NUM_THREADS={threads}")
    shape = (f"{a.model_type}: hidden {a.hidden_size}, {a.num_hidden_layers} layers, {a.num_attention_heads} query / "
             f"{a.num_key_value_heads} KV heads (KV heads per rank: {a.num_key_value_heads // group.size()}), "
             f"{dtype}; {weights:.1f} MiB of weights per rank")
    return [where, blas_note, shape]


def report(args: argparse.Namespace, notes: list[str], cases: list[Case], runs: list[Run],
           figures: list[list[list[float]]]) -> str:
    order = ", ".join(r.label for r in runs)
    return "\n".join([
        f"# {args.kv} against vanilla mlx_lm, {len(figures)} ranks in tensor parallel",
        "",
        f"`{args.command}`",
        "",
        f"{datetime.now():%Y-%m-%d %H:%M}; " + "; ".join(notes) + f"; model: {args.model_note}.",
        "",
        (f"A prompt of {args.context} random tokens, {args.decode} greedy new tokens per run through mlx_lm's "
         f"`generate_step` (prefill_step_size {args.prefill_step}); {args.kv} keeps {args.budget} rows, "
         f"compress={args.compress}. Runs in this order after a short warm-up of each: {order}. Each figure is "
         "the mean of the variant's runs on that rank. prefill_s: time to the first token; decode_tok_s: the "
         "other new tokens; kv_mib: the cache list's nbytes after the run; active_mib: mlx's active memory after "
         "the prefill; peak_mib: mlx's peak during the run (both with the rank's weights); ranks agree: every "
         "rank generated the same tokens in every run."),
        "",
        table(cases, runs, figures),
        "",
    ])


def work(args: argparse.Namespace) -> None:
    group = mx.distributed.init()
    model, _ = sharded_load(str(args.model), tensor_group=group)
    if model.args.num_key_value_heads % group.size():
        raise SystemExit(f"{model.args.num_key_value_heads} KV heads do not split over {group.size()} ranks")
    vanilla = Case("vanilla", Variant("full"), args.context)
    compressed = Case(args.kv, Variant.of(args.kv), args.context)
    reference = Case(f"vanilla@ctx={args.budget}", Variant("full"), args.budget)
    cases = [vanilla, compressed, reference]
    for case in cases:  # warm-up: past the budget, so the compressed one compresses
        run_case(model, group, case, args, min(case.context, args.budget + 64), 4)
    schedule = [vanilla, compressed, reference, compressed, vanilla]
    runs = []
    for case in schedule:
        runs.append(run_case(model, group, case, args, case.context, args.decode))
        if group.rank() == 0:
            shown = ", ".join(f"{k} {v:.4g}" for k, v in zip(FIGURES, runs[-1].figures))
            print(f"rank 0, run {len(runs)}/{len(schedule)} {case.label}: {shown}", file=sys.stderr, flush=True)
    veloxpatch.unpatch()
    figures = gather_figures(runs, group)
    if group.rank() == 0:
        text = report(args, machine_notes(model, group), cases, runs, figures)
        print(text, flush=True)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(text)


def main() -> None:
    args = parse_args()
    if args.rank_worker:
        work(args)
        return
    sys.exit(drive(args))


if __name__ == "__main__":
    main()
