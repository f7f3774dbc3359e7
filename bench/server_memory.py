"""Many sequential requests to the real ``mlx_lm server`` under the launcher: does its memory stay flat?

One compressing server on loopback; ``--requests`` completions one after another, each a distinct prompt of about
``--context`` tokens (its own first line: no prompt-cache reuse between them, so the server's prompt cache fills to
its own limit and stays there). The server's resident memory (``VmRSS`` of its process) is read every ``--every``
requests: after warm-up it should not grow.

    python bench/server_memory.py --model "$(veloxpatch fetch-model smollm2 | tail -1)" --requests 1000 \\
        --kv snapkv --budget 128 --out docs/results/smollm2-server-memory-1000-requests

Writes ``result.json`` (the series) and prints it as a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import serving
from veloxpatch.eval import tasks


def server_pid(port: str) -> int:
    """The process serving on ``port`` (the launcher execs the interpreter, so it is the one started)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                command = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"--port" in command and port.encode() in command and b"server" in command:
                return int(entry.name)
    raise RuntimeError(f"no server process found on port {port}")


def rss_mib(pid: int) -> float:
    """Resident memory of ``pid`` (``VmRSS``), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--kv", default="snapkv")
    parser.add_argument("--budget", default="128")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tokenizer = load_tokenizer(Path(args.model))
    args.out.mkdir(parents=True, exist_ok=True)
    env = {"VELOX_KV": args.kv, "VELOX_BUDGET": args.budget}
    command = [sys.executable, "-m", "veloxpatch.cli", "run", "-m", "mlx_lm", "server", "--model", args.model]
    series: list[tuple[int, float, float]] = []
    start = time.perf_counter()
    with serving.running(command, Path(tempfile.mkdtemp()) / "server.log", env, unset=("LD_PRELOAD",)) as url:
        pid = server_pid(url.rpartition(":")[2])
        for i in range(1, args.requests + 1):
            text, _ = tasks.passkey_example(tokenizer, args.context, 9000 + i, depth=0.5)
            status, body = serving.post(url, {"prompt": f"Request {i}.\n{text}", "max_tokens": 8, "temperature": 0})
            if status != 200:
                raise RuntimeError(f"request {i}: {status} {body}")
            if i % args.every == 0 or i == 1:
                series.append((i, round(rss_mib(pid), 1), round(time.perf_counter() - start, 1)))
                print(f"{i:5d} requests: {series[-1][1]:8.1f} MiB  ({series[-1][2]:.0f} s)", flush=True)
    settings = {k: v for k, v in vars(args).items() if k != "out"} | {"model": Path(args.model).name}
    (args.out / "result.json").write_text(json.dumps({"settings": settings, "series": series}, indent=1))
    print("| requests | RSS (MiB) | seconds |\n|---|---|---|")
    print("\n".join(f"| {i} | {rss} | {t} |" for i, rss, t in series))


if __name__ == "__main__":
    main()
