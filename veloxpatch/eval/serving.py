"""A real ``mlx_lm server`` on a loopback port, for the tests and benches that talk to it as a client would: start
it, wait until it answers ``/health``, post completions, stop it."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from . import ruler


def free_port() -> int:
    """A loopback port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict, timeout: float = 120, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    """POST a completion request (with ``headers`` besides its content type); (status, JSON body or {"error": text})."""
    request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, {"error": error.read().decode(errors="replace")}


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
def running(command: list[str], log: Path, env: dict[str, str]) -> Iterator[str]:
    """Start ``command`` plus ``--host 127.0.0.1 --port P`` with environment ``env``, its output to ``log``; yield
    its URL; stop it afterwards."""
    port = free_port()
    with log.open("w") as sink:
        server = subprocess.Popen([*command, "--host", "127.0.0.1", "--port", str(port)], env=env,
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
