"""A real ``mlx_lm server`` on a loopback port for tests: start, wait until healthy, ask, stop."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest
from conftest import without_velox


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict, timeout: float = 120) -> tuple[int, dict]:
    """POST a completion request; (status, JSON body or {"error": text})."""
    request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, {"error": error.read().decode(errors="replace")}


def wait_healthy(url: str, server: subprocess.Popen, log: Path, limit: float = 90) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        assert server.poll() is None, log.read_text()
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    pytest.fail("server did not come up:\n" + log.read_text())


@contextlib.contextmanager
def running(command: list[str], log: Path, env: dict[str, str] | None = None) -> Iterator[str]:
    """Start ``command`` plus ``--host 127.0.0.1 --port P``; yield its URL; stop it afterwards."""
    port = free_port()
    full_env = {**without_velox(), **(env or {})}
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
