"""Eval and bench output: a terminal table, JSON and CSV for tools, PNG plots (matplotlib extra)."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any, Sequence


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """A fixed-width text table of ``columns`` (numbers formatted compactly)."""
    cells = [[_fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


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
    """``stem.json`` (rows + how they were made) and ``stem.csv``; returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, csv_path = out_dir / f"{stem}.json", out_dir / f"{stem}.csv"
    json_path.write_text(json.dumps({"meta": meta, "rows": list(rows)}, indent=2))
    with csv_path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
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
        for method, series in _groups([r for r in group if r["method"] != "full"], ("method",)).items():
            series = sorted(series, key=lambda r: r["share"])
            x_key = "share" if task != "perplexity" else "kv_bytes"
            ax.plot([r[x_key] for r in series], [r["value"] for r in series], marker="o", label=method[0])
        if full:
            ax.axhline(full[0]["value"], color="black", linestyle="--", label="full cache")
        ax.set_xlabel("KV budget (share of context)" if task != "perplexity" else "KV bytes")
        ax.set_ylabel("accuracy" if task != "perplexity" else "perplexity")
        ax.set_title(f"{task}, context {context}")
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
