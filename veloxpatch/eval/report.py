"""Eval and bench output: a terminal table, JSON and CSV for tools, PNG plots (matplotlib extra)."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile


def wilson(successes: float, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval for ``successes`` out of ``n`` Bernoulli trials: unlike the normal approximation
    it stays inside [0, 1] and is not empty at 0/n or n/n, where small-sample accuracies often sit."""
    if n <= 0:
        return 0.0, 1.0
    k = round(successes)  # a mean of 0/1 outcomes times n: undo the float rounding
    p = k / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    return (0.0 if k == 0 else centre - half), (1.0 if k == n else centre + half)  # exact at the ends


def accuracy_text(value: float, n: int) -> str:
    """``0.80 [0.49, 0.94] n=10``: an accuracy, its 95% Wilson interval and its sample count."""
    low, high = wilson(value * n, n)
    return f"{value:.2f} [{low:.2f}, {high:.2f}] n={n}"


def result_text(row: dict[str, Any]) -> str:
    """An eval row's value as a reader should see it: accuracies with their interval, all with n."""
    if row.get("metric", "accuracy") == "accuracy" and row["task"] != "perplexity":
        return accuracy_text(row["value"], row["samples"])
    return f"{row['value']:.4g} n={row['samples']}"


def with_byte_shares(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows with ``kv16_share``: their 16-bit KV bytes over the full cache's in the same (task, context), where both
    were measured (``veloxpatch eval --equal-bytes``)."""
    full = {(r["task"], r["context"]): r.get("kv16_bytes") for r in rows if r["label"] == "full"}
    out = []
    for r in rows:
        whole = full.get((r["task"], r["context"]))
        share = r["kv16_bytes"] / whole if whole and r.get("kv16_bytes") is not None else None
        out.append({**r, "kv16_share": share})
    return out


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """A fixed-width text table of ``columns`` (numbers formatted compactly)."""
    cells = [[_fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    lines = [list(columns), ["-" * w for w in widths], *cells]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(line, widths)) for line in lines)


def markdown(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """The same table as Markdown (for the README's results section)."""
    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    out += ["| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(out)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def write_files(rows: Sequence[dict[str, Any]], out_dir: Path, stem: str, meta: dict[str, Any]) -> list[Path]:
    """``stem.json`` (rows + how they were made) and ``stem.csv`` (the scalar columns: a variant's knob
    values are in the JSON); returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, csv_path = out_dir / f"{stem}.json", out_dir / f"{stem}.csv"
    json_path.write_text(json.dumps({"meta": meta, "rows": list(rows)}, indent=2))
    with csv_path.open("w", newline="") as handle:
        columns = [k for k, v in rows[0].items() if not isinstance(v, (dict, list))]
        writer = csv.DictWriter(handle, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return [json_path, csv_path]


def plot_eval(rows: Sequence[dict[str, Any]], out_dir: Path) -> list[Path]:
    """Accuracy vs budget share per retrieval task, perplexity vs KV bytes; [] without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    paths = []
    for (task, context), group in _groups(rows, ("task", "context")).items():
        fig, ax = plt.subplots(figsize=(6, 4))
        full = [r for r in group if r["method"] == "full"]
        ppl = task == "perplexity"
        for method, series in _groups([r for r in group if r["method"] != "full"], ("method",)).items():
            series = sorted(series, key=lambda r: r["share"])
            x, y = [r["kv_bytes" if ppl else "share"] for r in series], [r["value"] for r in series]
            if ppl:
                ax.plot(x, y, marker="o", label=method[0])
            else:  # 95% Wilson intervals: is a gap between methods more than noise?
                bounds = [wilson(r["value"] * r["samples"], r["samples"]) for r in series]
                errors = [[max(0.0, v - lo) for v, (lo, _) in zip(y, bounds)],
                          [max(0.0, hi - v) for v, (_, hi) in zip(y, bounds)]]
                ax.errorbar(x, y, yerr=errors, marker="o", capsize=3, label=method[0])
        if full:
            ax.axhline(full[0]["value"], color="black", linestyle="--", label="full cache")
        ax.set(xlabel="KV bytes" if ppl else "KV budget (share of context)", ylabel="perplexity" if ppl else "accuracy",
               title=f"{task}, context {context}")
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"{task}_{context}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def _groups(rows: Sequence[dict[str, Any]], keys: tuple[str, ...]) -> dict[tuple, list[dict[str, Any]]]:
    out: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        out.setdefault(tuple(r[k] for k in keys), []).append(r)
    return out
