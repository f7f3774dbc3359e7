"""mlx-lm's own tests as a compatibility check: does every test that passes plain still pass under the launcher?

    pip download --no-deps --no-binary :all: mlx-lm==0.32.2 -d /tmp/mlxlm-sdist    # the installed version
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \
        python bench/mlx_lm_tests.py --sdist /tmp/mlxlm-sdist/mlx_lm-0.32.2.tar.gz

mlx-lm's sdist ships its tests; they exercise generate, batching, prompt caches and every model file, written by
people who know what mlx_lm promises. This unpacks `tests/` into a temp dir and runs each chosen file with pytest,
once plain and once per method through `veloxpatch run -m pytest` at a budget above every prompt (so a method that
evicts must give mlx_lm's answers), then compares the pass sets per test id from pytest's junit xml.

The model swap: test_generate.py and test_prompt_cache.py load a hub repo id (`HF_MODEL_PATH = "mlx-community/..."`)
and there is no hub here. `swap_model` rewrites that one string literal in the *copied* file to the shipped model's
folder (SmolLM2-135M-Instruct, `veloxpatch fetch-model smollm2`, or `--model`) and stops unless it finds exactly
the assignments it expects, so nothing else changes and no test is skipped or edited. Tests that assert that model's
exact outputs fail plain as well; the check is "every plain pass is kept".

Like with like: plain and launched runs get the same environment, LD_PRELOAD included: the launched ones run with
VELOX_BLAS=none, so the launcher adds no OpenBLAS of its own (preloading it changes the numerics of some tests, e.g.
test_gemma3n_kv_shared_layers_ignore_chunking); the JSON records the LD_PRELOAD and a resumed run must have the same.
xquant stores every row at 4 bits whatever the budget, so a test comparing exact outputs may legitimately lose its
pass under it; such losses are listed, not hidden. VELOX_STATS=1 in launched runs: the table says how many layer
caches of ours the tests built (0 would mean they never met our caches). Each run is one pytest process, capped by
a timeout and a memory watchdog over its process group (mlx-lm's test_models.py builds huge default configs, never
evaluated; a probe that evaluated them ran the 24 GB machine out of memory). Resumable: a (file, method) already in
the JSON is skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

FILES = ["test_generate.py", "test_prompt_cache.py", "test_models.py"]
METHODS = ["snapkv", "chunkkv", "squeeze", "xkv", "xquant"]
HF_ASSIGN = re.compile(r'(HF_MODEL_PATH\s*=\s*)"mlx-community/[^"]+"')
SWAPS = {"test_generate.py": 1, "test_prompt_cache.py": 1}  # the assignments each file is known to hold
PAGE = os.sysconf("SC_PAGE_SIZE")
ROOT = Path(__file__).resolve().parents[1]


def unpack(sdist: Path, into: Path) -> Path:
    """The sdist's `tests/` folder, extracted under ``into``."""
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.split("/")[1:2] == ["tests"]]
        tar.extractall(into, members=members, filter="data")
    return into / members[0].name.split("/")[0] / "tests"


def swap_model(test: Path, model: Path) -> None:
    """Point the copied file's hub repo id at the local model; exactly the known assignments, or stop."""
    text, n = HF_ASSIGN.subn(lambda m: f"{m[1]}{str(model)!r}", test.read_text())
    if n != SWAPS.get(test.name, 0) or "mlx-community/Qwen" in text:
        raise SystemExit(f"{test.name}: found {n} HF_MODEL_PATH assignments, expected {SWAPS.get(test.name, 0)}")
    test.write_text(text)


def group_rss(pgid: int) -> int:
    """Bytes resident in every process of the group (the watchdog's reading)."""
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getpgid(int(pid)) == pgid:
                total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
        except (OSError, ValueError):
            pass
    return total


def run_pytest(test: Path, method: str, budget: str, timeout: float, max_rss: int) -> dict[str, Any]:
    """One pytest process over ``test``: plain, or under the launcher with ``method``; its results by test id."""
    junit = test.with_suffix(f".{method}.xml")
    args = ["-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA", "-n", "0", f"--junitxml={junit}", test.name]
    env = {k: v for k, v in os.environ.items() if not k.startswith("VELOX_")}
    if method != "plain":
        args = ["-m", "veloxpatch", "run", *args]
        env |= {"VELOX_KV": method, "VELOX_BUDGET": budget, "VELOX_STATS": "1", "VELOX_BLAS": "none"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))  # this checkout's veloxpatch
    log = test.with_suffix(f".{method}.log")
    start, killed = time.monotonic(), None
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, *args], cwd=test.parent, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    while True:  # os.wait4, not Popen.wait: it gives the child's own rusage (its peak RSS)
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if killed is None and time.monotonic() - start > timeout:
            killed = f"timeout after {timeout:.0f} s"
        elif killed is None and group_rss(proc.pid) > max_rss:
            killed = f"over {max_rss / 2**30:.0f} GiB resident"
        if killed:
            os.killpg(proc.pid, signal.SIGKILL)
        time.sleep(0.5)
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
    passed, failed = read_junit(junit)
    text = log.read_text()
    stats = [line for line in text.splitlines() if line.startswith("veloxpatch: ")]
    return {"returncode": proc.returncode, "killed": killed, "passed": passed, "failed": failed,
            "stats": stats[-1] if stats else "", "time_s": round(time.monotonic() - start, 1),
            "peak_rss_mib": usage.ru_maxrss // 1024, "log_tail": text[-3000:] if killed or not passed else ""}


def read_junit(path: Path) -> tuple[list[str], dict[str, str]]:
    """Passed test ids, and the others' first line of failure/error/skip message (pytest's junit xml)."""
    if not path.exists():
        return [], {}
    passed, failed = [], {}
    for case in ET.parse(path).iter("testcase"):
        tid = f"{case.get('classname')}::{case.get('name')}"
        bad = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
        if bad is None:
            passed.append(tid)
        else:
            failed[tid] = f"{bad.tag}: {(bad.get('message') or bad.text or '').strip()[:300]}"
    return sorted(passed), failed


def built(stats: str) -> str:
    """Layer caches of ours the run built, from its VELOX_STATS line (0: the tests never met our caches)."""
    found = re.search(r"(\d+) layer cache\(s\) built", stats)
    return found[1] if found else "?"


def table(runs: dict[str, dict[str, Any]]) -> str:
    """The Markdown table: a row per (file, method), each lost pass named with its message below it."""
    lines = ["| file | method | plain passed | passed under the launcher | lost passes | layer caches of ours built "
             "| time | peak RSS |", "|---|---|---|---|---|---|---|---|"]
    notes = []
    for name, by_method in runs.items():
        plain = set(by_method["plain"]["passed"]) if "plain" in by_method else set()
        for method, r in by_method.items():
            ran = f"{len(plain)} of {len(r['passed']) + len(r['failed'])}"
            if method == "plain":
                cells = [ran, "-", "-", "-"]
            else:
                lost = sorted(plain - set(r["passed"]))
                notes += [f"- {name}, {method}: `{t}`: {r['failed'].get(t, 'not run')}" for t in lost]
                cells = [ran, f"{len(r['passed'])}" + (f" ({r['killed']})" if r["killed"] else ""), str(len(lost)),
                         built(r["stats"])]
            lines.append(f"| {name} | {method} | {' | '.join(cells)} | {r['time_s']:.0f} s | {r['peak_rss_mib']} MiB |")
    return "\n".join(lines + ([""] + notes if notes else []))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sdist", type=Path, required=True, help="mlx-lm's sdist (.tar.gz) of the installed version")
    parser.add_argument("--files", nargs="+", default=FILES)
    parser.add_argument("--methods", nargs="+", default=METHODS)
    parser.add_argument("--budget", default="100000", help="VELOX_BUDGET: above every prompt of the tests")
    parser.add_argument("--json", type=Path, default=ROOT / "docs/results/mlx-lm-tests.json")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per pytest run")
    parser.add_argument("--max-rss-gib", type=float, default=16, help="kill a run whose processes hold more")
    parser.add_argument("--model", type=Path, help="the model folder the tests load (default: fetch-model smollm2)")
    args = parser.parse_args()
    if args.model is None:
        from veloxpatch.models.catalog import SMOLLM2
        from veloxpatch.models.fetch import fetch_model  # reuses the cached folder (already fetched: no download)

        args.model = fetch_model(SMOLLM2)

    preload = os.environ.get("LD_PRELOAD", "")
    kept = json.loads(args.json.read_text()) if args.json.exists() else {"ld_preload": preload, "runs": {}}
    if kept["ld_preload"] != preload:
        raise SystemExit(f"{args.json} was run with LD_PRELOAD={kept['ld_preload']!r}, not {preload!r}: like with like")
    runs: dict[str, dict[str, Any]] = kept["runs"]
    with tempfile.TemporaryDirectory() as tmp:
        tests = unpack(args.sdist, Path(tmp))
        for name in args.files:
            swap_model(tests / name, args.model)
            for method in ["plain", *args.methods]:
                if method in runs.get(name, {}):
                    continue
                print(f"{name} {method} ...", file=sys.stderr, flush=True)
                runs.setdefault(name, {})[method] = run_pytest(tests / name, method, args.budget, args.timeout,
                                                               int(args.max_rss_gib * 2**30))
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps({"sdist": args.sdist.name, "budget": args.budget,
                                                 "ld_preload": preload, "runs": runs}, indent=1))
    print(table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
