"""The ``eval``, ``bench``, ``demo`` and ``model-path`` subcommands of ``veloxpatch``."""

from __future__ import annotations

import os
import platform
import sys
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import click

import veloxpatch

from .. import cpu
from ..assets import model_path
from ..config import COMPRESS_MODES, from_env
from ..registry import METHODS, cache_class
from ..settings import ConfigError
from . import report, tasks
from .bench import LARGE_RANDOM, PEAK_NOTE, BenchSpec, run_bench
from .harness import ALL_TASKS, TASKS, EvalSpec, Journal, run_eval
from .random_model import build, config_for
from .variants import Variant, known_methods, parse_spec, split_specs

EVAL_COLUMNS = ("task", "context", "label", "result", "kv_bytes", "peak_bytes", "read_peak_bytes")
BENCH_COLUMNS = ("context", "variant", "budget", "prefill_s", "decode_tok_s", "decode_vs_vanilla",
                 "kv_bytes", "kv_vs_vanilla", "peak_bytes", "read_peak_bytes", "read_vs_vanilla", "prefill")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _shares(text: str) -> list[float]:
    """``"100%,25%"`` or ``"1,0.25"`` -> [1.0, 0.25]; anything outside (0, 1] is refused."""
    shares = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        share = float(item[:-1]) / 100 if item.endswith("%") else float(item)
        if not 0 < share <= 1:
            raise click.BadParameter(f"{item!r} not allowed: budgets are shares in (0, 100%]", param_hint="--budgets")
        shares.append(share)
    return shares


def _methods(text: str) -> list[str]:
    """``all``, or methods, each with knob overrides if wanted: ``snapkv,snapkv[kernel=15],streamingllm``."""
    allowed = known_methods()
    chosen = allowed if text == "all" else split_specs(text)
    try:
        parsed = [parse_spec(m)[0] for m in chosen]
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--methods") from None
    unknown = [m for m, method in zip(chosen, parsed) if method not in allowed]
    if unknown:
        raise click.BadParameter(f"{unknown} not allowed: choose from all, {', '.join(allowed)}",
                                 param_hint="--methods")
    return chosen


def _progress(label: str, items: Iterator[Any], length: int) -> Iterator[Any]:
    with click.progressbar(items, length=length, label=label, file=sys.stderr) as bar:
        yield from bar


def prefill_step(option: int | None, model: str | None) -> int:
    """``--prefill-step`` if given; else mlx_lm's own default for a model folder (what an app gets), and 512
    for the shipped model (two chunks of its 1024-token contexts, as in the README's results)."""
    if option is not None:
        return option
    if model is None:
        return 512
    import inspect

    from mlx_lm.generate import generate_step

    return inspect.signature(generate_step).parameters["prefill_step_size"].default


def load_model(model: str | None) -> tuple[Any, Any, str]:
    """The given mlx_lm folder, else the shipped model; errors say how to get one."""
    from mlx_lm import load

    path = Path(model) if model else model_path()
    if not (path / "config.json").exists():
        hint = "" if model else " (the shipped model is missing: run train/train.py --export)"
        raise click.BadParameter(f"{path} is not an mlx_lm model folder{hint}", param_hint="--model")
    loaded, tokenizer = load(str(path))[:2]  # without return_config, mlx_lm.load gives these two
    return loaded, tokenizer, str(path)


def machine() -> str:
    import mlx.core as mx

    version = mx.__version__  # type: ignore[attr-defined]  # mlx's stubs leave it out
    return (f"{platform.machine()} {platform.system()}, mlx {version} on {mx.default_device()}, "
            f"{cpu.blas_in_use(dict(os.environ))}")


def with_fast_blas() -> None:
    """Run this ``veloxpatch eval|bench`` again with the BLAS ``VELOX_BLAS`` chooses preloaded, as ``veloxpatch
    run`` does for an app: on the CPU the wheel's reference BLAS makes every matmul (and so every timing and
    every long eval) about 30x slower. Only a process started as the command re-executes (a library call, or a
    test's CliRunner, is left as it is), and only once: the library is then preloaded."""
    argv0 = Path(sys.argv[0])
    if argv0.name != "veloxpatch" and argv0.parts[-2:] != ("veloxpatch", "__main__.py"):
        return
    try:
        choice = cpu.choose_blas(os.environ.get("VELOX_BLAS", "auto"))
    except ConfigError as error:
        raise click.UsageError(str(error)) from None
    if choice.path is None or cpu.is_preloaded(dict(os.environ), choice.path):
        return
    click.echo(f"veloxpatch: preloading {choice.path} for this run ({choice.reason}; VELOX_BLAS=none keeps mlx's "
               "own)", err=True)
    env = cpu.with_preload(dict(os.environ), choice.path)
    os.execve(sys.executable, [sys.executable, "-m", "veloxpatch", *sys.argv[1:]], env)


def finish(rows: list[dict[str, Any]], columns: tuple[str, ...], out: Path, stem: str, path: str, spec: Any,
           started: float, shown: list[dict[str, Any]] | None = None) -> None:
    """``shown`` (else ``rows``) as a table on stdout, ``rows`` to OUT/stem.json and OUT/stem.csv with how they
    were made: the model at ``path``, the spec, this machine, and the seconds since ``started``."""
    meta = {"model": path, "spec": vars(spec), "machine": machine(), "seconds": round(time.time() - started, 1)}
    click.echo(report.table(rows if shown is None else shown, columns))
    for written in report.write_files(rows, out, stem, meta):
        click.echo(f"wrote {written}", err=True)


@click.command("eval")
@click.option("--model", default=None, help="mlx_lm model folder [default: the shipped model]")
@click.option("--tasks", "task_list", default=",".join(TASKS), show_default=True,
              help=f"Comma-separated, of: {', '.join(ALL_TASKS)} (the niah_*, vt and trip ones are for a real model).")
@click.option("--contexts", default="1024", show_default=True, help="Comma-separated context lengths (tokens).")
@click.option("--budgets", default="100%,50%,25%,12.5%", show_default=True, help="KV budgets as shares of the context.")
@click.option("--methods", default="all", show_default=True,
              help=f"Comma-separated: {', '.join(known_methods())}; a method's knobs as METHOD[KNOB=VALUE,...], "
                   f"e.g. snapkv[kernel=15].")
@click.option("--samples", default=20, show_default=True, help="Held-out examples per cell.")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(min=0),
              help="First held-out example: a cell uses seeds SEED .. SEED+SAMPLES-1.")
@click.option("--prefill-step", "prefill_step_option", default=None, type=int,
              help="mlx_lm prefill_step_size [default: mlx_lm's own with --model, else 512].")
@click.option("--out", default="velox-eval", show_default=True, type=click.Path(path_type=Path), help="Output folder.")
@click.option("--plots/--no-plots", default=True, show_default=True, help="Write PNG plots (needs matplotlib).")
@click.option("--share-prefill/--no-share-prefill", default=True, show_default=True,
              help="Retrieval: one prompt prefill for the full cache and our methods at every budget, where exact.")
@click.option("--question", "protocol", default="inside", show_default=True, type=click.Choice(["inside", "after"]),
              help="RULER tasks: the question inside the prompt, or after it (the context compressed alone, the "
                   "question the next turn on that cache: kvpress's protocol).")
@click.option("--equal-bytes", is_flag=True,
              help="--budgets are shares of the full cache's bytes held once the context is read, as a 16-bit model "
                   "holds them (each method's row budget measured to land there), not of its rows.")
def eval_command(model, task_list, contexts, budgets, methods, samples, seed, prefill_step_option, out, plots,
                 share_prefill, protocol, equal_bytes) -> None:
    """Quality per method and budget: passkey, multi-key retrieval and perplexity, or RULER-style tasks.

    Accuracies show their 95% Wilson interval and sample count. Finished cells go to OUT/eval.cells.jsonl and
    finished examples to OUT/eval.samples.jsonl as they finish; a rerun with the same arguments skips them, and
    OUT/eval.csv and OUT/eval.json table every cell the journal holds under those arguments (earlier runs' variants
    too)."""
    with_fast_blas()
    chosen = [t.strip() for t in task_list.split(",") if t.strip()]
    if any(t not in ALL_TASKS for t in chosen):
        raise click.BadParameter(f"{chosen} not allowed: choose from {', '.join(ALL_TASKS)}", param_hint="--tasks")
    step = prefill_step(prefill_step_option, model)
    spec = EvalSpec(chosen, _ints(contexts), _shares(budgets), _methods(methods), samples, step, seed, share_prefill,
                    protocol, equal_bytes)
    loaded, tokenizer, path = load_model(model)
    key = {"model": path, "samples": samples, "seed": seed, "prefill_step": step}
    if protocol != "inside" or equal_bytes:  # journals written before either existed keep their key
        key.update(protocol=protocol, equal_bytes=equal_bytes)
    journal = Journal(out / "eval.cells.jsonl", key)
    started = time.time()
    cells = run_eval(loaded, tokenizer, spec, partial(_progress, "eval"), journal)
    # and the journal's cells under the same arguments that this run did not ask for (another run's variants or
    # tasks into the same folder), so the folder's eval.csv and eval.json keep them
    asked = {(c.task, c.context, c.variant.identity()) for c in cells}
    rows = [c.row() for c in [*cells, *(cell for done, cell in journal.done().items() if done not in asked)]]
    rows = report.with_byte_shares(rows) if equal_bytes else rows
    columns = EVAL_COLUMNS + (("kv16_share",) if equal_bytes else ())
    finish(rows, columns, out, "eval", path, spec, started, [{**r, "result": report.result_text(r)} for r in rows])
    if plots:
        pngs = report.plot_eval(rows, out)
        for png in pngs:
            click.echo(f"wrote {png}", err=True)
        if not pngs:
            click.echo("no plots: matplotlib is not installed (pip install 'veloxpatch[plot]')", err=True)


@click.command("bench")
@click.option("--model", default=None, help="mlx_lm model folder [default: the shipped model]")
@click.option("--random-model", is_flag=True, help="A larger random-weight llama (8 x 1024) for speed.")
@click.option("--contexts", default="1024,4096", show_default=True, help="Comma-separated context lengths.")
@click.option("--budget", default=256, show_default=True, help="KV rows each method keeps per layer.")
@click.option("--methods", default="all", show_default=True, help=f"Comma-separated: {', '.join(known_methods())}.")
@click.option("--new-tokens", default=64, show_default=True, help="Tokens generated per run.")
@click.option("--repeats", default=3, show_default=True,
              help="Timed runs per case (median), after a warm-up; with shared prefills, timed decodes (each on a "
                   "fresh copy of a prefill timed once).")
@click.option("--prefill-step", "prefill_step_option", default=None, type=int,
              help="mlx_lm prefill_step_size [default: mlx_lm's own with --model, else 512].")
@click.option("--compress", default="end", show_default=True, type=click.Choice(COMPRESS_MODES),
              help="VELOX_COMPRESS for our methods.")
@click.option("--share-prefill/--no-share-prefill", default=True, show_default=True,
              help="With --compress end: time one prompt prefill per group of cases whose prefill is the same "
                   "(vanilla; our methods without prefill state; each other method), then decode each case on "
                   "its own copy, where exact.")
@click.option("--out", default="velox-bench", show_default=True, type=click.Path(path_type=Path), help="Output folder.")
def bench_command(model, random_model, contexts, budget, methods, new_tokens, repeats, prefill_step_option, compress,
                  share_prefill, out) -> None:
    """Speed and memory per method, side by side with unpatched mlx_lm.

    prefill_s is the time to the first token; peak_bytes the most memory mlx held during a case (weights
    included): with a shared or own prefill (the prefill column), the larger of the prefill group's peak and
    the case's own decode peak (less the prefill kept aside for other cases)."""
    with_fast_blas()
    chosen = _methods(methods)
    step = prefill_step(prefill_step_option, model)
    spec = BenchSpec(_ints(contexts), budget, chosen, new_tokens, repeats, step, compress, share_prefill)
    if random_model:
        loaded = build(config_for("llama", **LARGE_RANDOM, max_position_embeddings=1 << 16))
        path = "random llama 8x1024"
    else:
        loaded, _, path = load_model(model)
    started = time.time()
    rows = run_bench(loaded, spec, partial(_progress, "bench"))
    finish(rows, BENCH_COLUMNS, out, "bench", path, spec, started)
    click.echo(PEAK_NOTE)


def demo_variant(kv: str) -> Variant:
    """The method (and knobs) ``--kv`` names; a ValueError naming what is wrong otherwise."""
    variant = Variant.of(kv)
    if variant.method not in METHODS:
        raise ValueError(f"{kv!r} is not a method of veloxpatch ({', '.join(sorted(METHODS))})")
    return variant


def demo_rows(model: Any, tokenizer: Any, kv: str, budget: str, context: int, seed: int) -> tuple[list[dict], str]:
    """One held-out passkey question under mlx_lm's stream_generate, vanilla then compressed."""
    import mlx.core as mx
    import mlx_lm.models.cache as mlx_cache
    from mlx_lm import stream_generate

    prompt, answer = tasks.passkey_example(tokenizer, context, seed, "heldout")
    rows = []
    variant, environment = demo_variant(kv), from_env().config
    label = f"{kv}@{budget}" if cache_class(variant.method).uses_budget else kv  # quant keeps every token
    for name, settings in (("vanilla", {"kv": "none"}), (label, variant.settings(budget, unset={}))):
        veloxpatch.patch(environment.replace(**settings))
        cache = mlx_cache.make_prompt_cache(model)  # what generate would make; kept here to read its bytes
        mx.clear_cache()
        mx.reset_peak_memory()
        text, last = "", None
        for last in stream_generate(model, tokenizer, prompt, max_tokens=8, prompt_cache=cache, prefill_step_size=512):
            text += last.text
        assert last is not None, "stream_generate yielded nothing"
        first_line = (text.strip().splitlines() or [""])[0]
        rows.append({"run": name, "answer": repr(first_line), "right": tasks.is_correct(text, answer),
                     "kv_MiB": sum(c.nbytes for c in cache) / 2**20, "prompt_tok_s": last.prompt_tps,
                     "decode_tok_s": last.generation_tps, "peak_MiB": last.peak_memory * 1e9 / 2**20,
                     "prompt_tokens": last.prompt_tokens})
    veloxpatch.unpatch()
    return rows, answer.strip()


@click.command("demo")
@click.option("--model", default=None, help="mlx_lm model folder [default: the shipped model]")
@click.option("--kv", default="quant", show_default=True,
              help="Method for the compressed run, with knobs as --methods names them (`quant[keep=0.125x]`); "
                   "VELOX_* settings in the environment apply to both runs.")
@click.option("--budget", default="25%", show_default=True,
              help="VELOX_BUDGET for the compressed run (a method keeping every token, as quant, has none).")
@click.option("--context", default=1024, show_default=True, help="Prompt length in tokens.")
@click.option("--seed", default=0, show_default=True, help="Held-out passkey example.")
def demo_command(model, kv, budget, context, seed) -> None:
    """A long-context question under plain mlx_lm, vanilla then compressed, side by side."""
    try:
        demo_variant(kv)
    except ValueError as error:  # before the model loads
        raise click.BadParameter(str(error), param_hint="--kv") from None
    try:
        from_env()
    except ConfigError as error:
        raise click.ClickException(str(error)) from None
    loaded, tokenizer, _ = load_model(model)
    rows, answer = demo_rows(loaded, tokenizer, kv, budget, context, seed)
    click.echo(f"question: {rows[0]['prompt_tokens']}-token passkey prompt; expected answer {answer!r}")
    click.echo(report.table(rows, ("run", "answer", "right", "kv_MiB", "prompt_tok_s", "decode_tok_s", "peak_MiB")))


@click.command("model-path")
def model_path_command() -> None:
    """Print the folder of the shipped model (for --model or mlx_lm.load)."""
    click.echo(str(model_path()))


COMMANDS = (eval_command, bench_command, demo_command, model_path_command)
