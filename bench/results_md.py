"""Turn ``veloxpatch eval`` / ``bench`` JSON files into docs/results.md's tables (Markdown on stdout).

    python bench/results_md.py velox-eval/eval.json [more eval.json ...] --bench velox-bench/bench.json ...
    # + one PNG per (task, context):
    python bench/results_md.py a/eval.json b/eval.json --plot docs/results/smollm2-niah-plots

Eval rows become one table per (task, context): a row per variant, a column per KV budget share, each cell the
measured value and its sample count; an accuracy also shows its 95% Wilson interval (``0.80 [0.49, 0.94] n=10``), so
a claim that one method beats another can be checked against the noise of n examples. Several eval files are merged
(e.g. a slower variant run with fewer samples); where two files hold the same cell (task, context, method, share,
sample count), the later file wins. A method measured with different sample counts (each run measures the full cache
as its own baseline) gets one row per count, so every row still has a baseline measured on the same prompts: the
largest count keeps the method's name, a smaller one is named after the run it belongs to, the other methods measured
with that count (``full (quantized run)``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from veloxpatch.assets import model_path
from veloxpatch.eval.report import accuracy_text, markdown, wilson


def eval_tables(rows: list[dict]) -> str:
    out = []
    for task, context in sorted({(r["task"], r["context"]) for r in rows}):
        cells = [r for r in rows if r["task"] == task and r["context"] == context]
        shares = sorted({r["share"] for r in cells}, reverse=True)
        methods = sorted({(r["method"], r["samples"]) for r in cells}, key=lambda m: (m[0] != "full", m[0], -m[1]))
        labels = row_labels(methods)
        table = []
        for method, samples in methods:
            line = {"method": labels[method, samples]}
            for share in shares:
                hit = [r for r in cells if (r["method"], r["samples"], r["share"]) == (method, samples, share)]
                line[f"{share:.3g}"] = cell_text(task, hit[0]) if hit else ""
            table.append(line)
        metric = "perplexity (lower is better)" if task == "perplexity" else "accuracy"
        out.append(f"**{task}, context {context} tokens** ({metric}; columns: KV budget as a share of the context)\n")
        out.append(markdown(table, ["method"] + [f"{s:.3g}" for s in shares]) + "\n")
    return "\n".join(out)


def cell_text(task: str, row: dict) -> str:
    """An accuracy with its 95% Wilson interval and n; a perplexity with n."""
    if task == "perplexity":
        return f"{row['value']:.3g} (n={row['samples']})"
    return accuracy_text(row["value"], row["samples"])


def row_labels(methods: list[tuple[str, int]]) -> dict[tuple[str, int], str]:
    """A distinct row name per (method, sample count): the method's name for its largest count; for a smaller
    count, the method plus the run it came from, i.e. the other methods measured with that count."""
    labels = {}
    for method, samples in methods:
        if samples == max(n for m, n in methods if m == method):
            labels[method, samples] = method
            continue
        peers = sorted({m for m, n in methods if n == samples and m != method})
        labels[method, samples] = f"{method} ({'/'.join(peers)} run)" if peers else f"{method} (n={samples} run)"
    return labels


def bench_table(rows: list[dict]) -> str:
    """A bench run's table; the peak while reading (over the loaded model) where the run measured it."""
    shown = [{**r, "kv_MiB": r["kv_bytes"] / 2**20, "peak_MiB": r["peak_bytes"] / 2**20} for r in rows]
    columns = ["context", "variant", "budget", "prefill_s", "decode_tok_s", "decode_vs_vanilla", "kv_MiB",
               "kv_vs_vanilla", "peak_MiB"]
    if all("read_peak_bytes" in r for r in rows):
        shown = [{**r, "read_MiB": r["read_peak_bytes"] / 2**20} for r in shown]
        columns += ["read_MiB", "read_vs_vanilla"]
    return markdown(shown, columns) + "\n"


def panel_cells(rows: list[dict], task: str, context: int) -> tuple[int, list[dict]]:
    """The cells a (task, context) figure draws: methods at their defaults, from the run with the most examples
    (every panel on the same prompts), and that n."""
    cells = [r for r in rows if (r["task"], r["context"]) == (task, context) and "[" not in r["method"]]
    n = max(r["samples"] for r in cells)
    return n, [r for r in cells if r["samples"] == n]


def panels(rows: list[dict], out_dir: Path) -> list[Path]:
    """Accuracy against budget, one small panel per method at its default knobs (a variant with knobs in
    brackets is left to the tables), the full cache as a dashed line with its interval as a band: a dozen
    methods with error bars in one axes hide each other. One PNG per (task, context); perplexity is skipped."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for task, context in sorted({(r["task"], r["context"]) for r in rows if r["task"] != "perplexity"}):
        n, cells = panel_cells(rows, task, context)
        full = [r for r in cells if r["method"] == "full"]
        methods = sorted({r["method"] for r in cells} - {"full"})
        cols = 4
        lines = -(-len(methods) // cols)
        fig, axes = plt.subplots(lines, cols, figsize=(2.6 * cols, 2.1 * lines), sharex=True, sharey=True,
                                 squeeze=False)
        for ax, method in zip(axes.flat, methods):
            series = sorted((r for r in cells if r["method"] == method), key=lambda r: r["share"])
            x, y = [r["share"] for r in series], [r["value"] for r in series]
            bounds = [wilson(v * n, n) for v in y]
            ax.fill_between(x, [lo for lo, _ in bounds], [hi for _, hi in bounds], alpha=0.25)
            ax.plot(x, y, marker="o")
            if full:
                ax.axhline(full[0]["value"], color="black", linestyle="--", linewidth=1)
            ax.set_title(method, fontsize=9)
            ax.set_xscale("log", base=2)
            ax.set_xticks([0.125, 0.25, 0.5], ["1/8", "1/4", "1/2"])
            ax.set_ylim(-0.05, 1.05)
        for ax in list(axes.flat)[len(methods):]:
            ax.axis("off")
        fig.suptitle(f"{task}, {context} tokens, n={n} (band: 95% Wilson; dashed: full cache)", fontsize=10)
        fig.supxlabel("KV budget (share of the context)", fontsize=9)
        fig.supylabel("accuracy", fontsize=9)
        fig.tight_layout()
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"{task}_{context}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("eval", nargs="*", type=Path, help="eval.json files")
    parser.add_argument("--bench", nargs="*", type=Path, default=[], help="bench.json files")
    parser.add_argument("--plot", type=Path, help="also write accuracy-against-budget panels here (needs matplotlib)")
    args = parser.parse_args()
    cells = {}
    for path in args.eval:
        for r in json.loads(path.read_text())["rows"]:
            cells[r["task"], r["context"], r["method"], r["share"], r["samples"]] = r
    rows = list(cells.values())
    if rows:
        print(eval_tables(rows))
    if args.plot:
        for path in panels(rows, args.plot):
            print(f"wrote {path}")
    for path in args.bench:
        data = json.loads(path.read_text())
        model = data["meta"]["model"]
        name = "the shipped model" if Path(model) == model_path() else model
        mode = data["meta"]["spec"].get("compress")  # absent in runs made before the setting existed
        setting = f", VELOX_COMPRESS={mode}" if mode else ""
        print(f"**bench: {name}{setting}** ({data['meta']['machine']})\n")
        print(bench_table(data["rows"]))


if __name__ == "__main__":
    main()
