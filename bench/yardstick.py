"""The yardstick's tables: RULER at 4k, question after, every variant at equal bytes (Markdown on stdout).

    python bench/yardstick.py docs/results/qwen2.5-0.5b-ruler-4k-after [more folders] [--per-task]

Reads the samples journal ``veloxpatch eval --question after --equal-bytes`` writes as it goes, so a run still going
(or stopped and resumed later) is tabled from what it has measured. Only examples every variant finished count (a run
measures all variants of one example together), so every row is on the same prompts. A row's accuracy is over all
its examples pooled (equal to the average over tasks where each task has the same n), with its 95% Wilson interval;
its share is its KV bytes once the context was read, counted as a 16-bit model holds them, over the full cache's,
averaged over the examples that measured it ("n/a" where none did: an eval with the question inside wrote none
before 2026-12-05). ``--per-task`` adds one column per task; ``--variant NAME`` (repeatable) tables only
the variants named as the table names them, and then counts every example those finished (a run that changed its
variants part way has more of them). Several folders (runs of the same model and protocol, one variant measured in
one, others in another) are tabled as one journal; an example two of them measured for the same variant counts once,
the first folder's, and where their answers differ it says so.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from veloxpatch.eval.report import accuracy_text, markdown
from veloxpatch.registry import METHODS, cache_class

Key = tuple[str, int]  # (task, seed)


def load(*folders: Path) -> dict[str, dict[Key, dict]]:
    """Per variant label, its samples by (task, seed), from each folder's ``eval.samples.jsonl`` (the last line of a
    repeat within a folder, the first folder's across them)."""
    out: dict[str, dict[Key, dict]] = defaultdict(dict)
    for folder in folders:
        found: dict[str, dict[Key, dict]] = defaultdict(dict)
        for line in (folder / "eval.samples.jsonl").read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                found[_name(row["label"])][row["task"], row["seed"]] = row
        for name, by_key in found.items():
            for key, row in by_key.items():
                kept = out[name].setdefault(key, row)
                if kept["value"] != row["value"]:
                    print(f"note: {name} on {key} answered {kept['value']} in one folder and {row['value']} in "
                          f"{folder}; the first is tabled", file=sys.stderr)
    return out


def _name(label: str) -> str:
    """A variant's name in the table: mlx_lm's quantized cache at a width it names, or a method that keeps every
    token (``quant``), once, without the share column it was listed under (it holds what it holds, whatever the
    share)."""
    method = label.split("[", 1)[0].split("@", 1)[0]
    ignores = label.startswith("quantized[bits=") or (method in METHODS and not cache_class(method).uses_budget)
    return label.rsplit("@", 1)[0] if ignores else label


def complete(samples: dict[str, dict[Key, dict]]) -> set[Key]:
    """The examples every variant has."""
    sets = [set(by_key) for by_key in samples.values()]
    return set.intersection(*sets) if sets else set()


def rows(samples: dict[str, dict[Key, dict]], per_task: bool) -> list[dict]:
    """A row per variant: share reached, pooled accuracy, and (``per_task``) each task's."""
    keys = sorted(complete(samples))
    full = samples["full"]
    tasks = sorted({task for task, _ in keys})
    out = []
    for label, by_key in sorted(samples.items(), key=lambda item: _order(item[0])):
        values = [by_key[k]["value"] for k in keys]
        shares = [by_key[k]["kv16_bytes"] / full[k]["kv16_bytes"] for k in keys
                  if by_key[k].get("kv16_bytes") is not None and full[k].get("kv16_bytes")]
        row = {"variant": label, "bytes (16-bit share)": f"{sum(shares) / len(shares):.3f}" if shares else "n/a",
               "accuracy": accuracy_text(sum(values) / len(values), len(values))}
        if per_task:
            for task in tasks:
                got = [by_key[k]["value"] for k in keys if k[0] == task]
                row[task] = f"{sum(got) / len(got):.2f}"
        out.append(row)
    return out


def _order(label: str) -> tuple[float, str]:
    """The full cache first, then by the share the label names (mlx_lm's quantized caches by their width)."""
    if label == "full":
        return (-2.0, "")
    if "@" not in label:  # mlx_lm's quantized caches, beside the full one
        return (-1.0, label)
    return (-float(label.rsplit("@", 1)[1]), label)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", type=Path, nargs="+")
    parser.add_argument("--per-task", action="store_true")
    parser.add_argument("--variant", action="append", help="a variant to table, as the table names it (repeatable)")
    args = parser.parse_args()
    samples = load(*args.folders)
    if args.variant:
        samples = {name: by_key for name, by_key in samples.items() if name in {"full", *args.variant}}
    keys = complete(samples)
    if not keys:
        counts = ", ".join(f"{name} {len(by_key)}" for name, by_key in sorted(samples.items()))
        sys.exit(f"no example every variant finished (examples per variant: {counts}); name fewer with --variant")
    table = rows(samples, args.per_task)
    per_task: dict[str, int] = defaultdict(int)
    for task, _ in keys:
        per_task[task] += 1
    print(f"{len(keys)} examples every variant finished: " + ", ".join(f"{t} {n}" for t, n in sorted(per_task.items())))
    print()
    print(markdown(table, list(table[0])))


if __name__ == "__main__":
    main()
