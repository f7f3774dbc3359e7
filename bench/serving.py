"""What the tests and the bench scripts share, not shipped with the package: a real ``mlx_lm server`` on a loopback
port, for those that talk to it as a client would (start it without this process's VELOX_* settings, wait until it
answers ``/health``, post completions, stop it), free loopback ports, and the follow-up chat they send.

Not a script: a script here imports it as ``serving`` (``python bench/NAME.py`` puts bench/ first on the path), and
pytest's ``pythonpath`` (pyproject.toml) puts bench/ on the tests' path."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from veloxpatch.eval import ruler


def free_port(count: int = 1) -> int:
    """A port P with P .. P + count - 1 free on loopback: a server's, or ``mlx.launch --backend ring --starting-port
    P`` on one machine (the ring backend listens on the starting port + rank). Free when looked at, not reserved."""
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + count <= 65536 and all(_free(port) for port in range(base, base + count)):
            return base
    raise RuntimeError(f"no {count} consecutive free ports on 127.0.0.1")


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def without_velox() -> dict[str, str]:
    """This process's environment without its VELOX_* settings (a child starts from its own)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("VELOX_")}


def post(url: str, body: dict, timeout: float = 120, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    """POST a completion request (with ``headers`` besides its content type); (status, JSON body or {"error": text})."""
    request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, {"error": error.read().decode(errors="replace")}


def processed(body: dict) -> int:
    """The prompt tokens a completion had to read: the rest came from the server's prompt cache (mlx_lm's usage
    says how many, in the single and in the batched path alike)."""
    usage = body["usage"]
    return usage["prompt_tokens"] - usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)


def wait_healthy(url: str, server: subprocess.Popen, log: Path, limit: float = 90) -> None:
    """Return once the server answers ``/health``, whatever its status (a third-party server may have no such route:
    an HTTP answer at all means it is up); RuntimeError with its log if it exits or takes over ``limit`` s."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with status {server.returncode}:\n{log.read_text()}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return
        except urllib.error.HTTPError:  # it answered
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"the server did not come up in {limit:.0f} s:\n{log.read_text()}")


def env_settings(given: list[str]) -> dict[str, str]:
    """A bench's ``--set VELOX_NAME=VALUE`` options (settings of the compressing server) as environment variables;
    one of another form is refused by name."""
    pairs = [text.partition("=") for text in given]
    bad = [text for text, (name, sign, _) in zip(given, pairs) if not (name.startswith("VELOX_") and sign)]
    if bad:
        raise SystemExit(f"--set {bad[0]!r}: expected VELOX_NAME=VALUE, e.g. VELOX_QUANT_KEEP=0.125x")
    return {name: value for name, _, value in pairs}


@contextlib.contextmanager
def running(command: list[str], log: Path, env: dict[str, str] | None = None,
            unset: tuple[str, ...] = ()) -> Iterator[str]:
    """Start ``command`` plus ``--host 127.0.0.1 --port P`` with ``env`` over this environment less its VELOX_*
    settings and the variables named in ``unset``, its output to ``log``; yield its URL; stop it afterwards."""
    port = free_port()
    full_env = {**{k: v for k, v in without_velox().items() if k not in unset}, **(env or {})}
    with log.open("w") as sink:
        server = subprocess.Popen([*command, "--host", "127.0.0.1", "--port", str(port)], env=full_env,
                                  stdout=sink, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, server, log)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def ask_first_again(ex: ruler.Example) -> ruler.Example:
    """A follow-up example (:func:`ruler.followup`) with a third turn: its first question (the last line of the
    first message) asked again, after the second answer; the answer wanted is then the first number."""
    (message, prefix), _ = ex.turns
    return replace(ex, wanted=ex.unwanted, unwanted=ex.wanted, answer=ex.unwanted[0],
                   turns=(*ex.turns, (message.rsplit("\n", 1)[1], prefix)))


def chat(url: str, tokenizer: Any, ex: ruler.Example, max_tokens: int,
         usages: list[dict[str, Any]] | None = None, timeout: float = 120) -> list[str]:
    """A chat client's turns of ``ex`` (:func:`ruler.conversation`: each request the whole conversation so far, as
    the server's prompt-cache reuse expects), greedy; each turn's answer as the server returned it (and its
    ``usage`` appended to ``usages``, if given); each request given ``timeout`` seconds."""
    answers: list[str] = []
    for _ in ex.turns:
        text = ruler.conversation(tokenizer, ex.turns, answers)
        status, body = post(url, {"prompt": text, "max_tokens": max_tokens, "temperature": 0}, timeout)
        if status != 200:
            raise RuntimeError(f"the server answered {status}: {body}")
        answers.append(body["choices"][0]["text"])
        if usages is not None:
            usages.append(body.get("usage") or {})
    return answers


def read_per_request(log: Path) -> list[int]:
    """How many prompt tokens each request read (the rest came from the prompt cache), from the server's
    ``--log-level INFO`` log: the total of a request's last progress line, between its response line and the next."""
    segments = re.split(r'"POST /v1/completions[^\n]*\n', log.read_text())[1:]
    return [int(([0] + re.findall(r"Prompt processing progress: \d+/(\d+)", s))[-1]) for s in segments]
