"""Third-party apps built on mlx_lm, installed from PyPI and run unmodified: plain, then under ``veloxpatch run``.

The ``apps`` nox session installs each app (pinned, ``APPS`` in noxfile.py) in a venv of its own beside this
checkout and runs this file there; elsewhere each app's tests are skipped, as the app is not installed. Each app
reads the shipped model (a copy with a chat template, which the apps apply and the shipped tokenizer lacks) over
loopback or on its command line, greedy, with a ~900-token passkey prompt, and must:

- answer at a budget above the context exactly as it answers plain, on caches of ours ("snapkv on 4 of 4 cache
  slots" at ``VELOX_LOG=INFO``, no compression in the ``--stats`` line);
- hold compressed caches at a small budget: compressions counted, fewer rows kept than seen, fewer KV bytes than
  a dense cache (the ``--stats`` line, printed at exit, or at SIGTERM for a server).
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import serving
from conftest import without_velox
from veloxpatch.assets import model_path

BIN = Path(sys.executable).parent
LAUNCHER = str(BIN / "veloxpatch")
BIG, SMALL = 4096, 64
"""A budget above the context (nothing is evicted: the plain answer) and one that must compress."""
FILLER = " ".join(["The grass is green. The sky is blue. The sun is yellow."] * 16)
PROMPT = f"{FILLER}\nThe pass key is 71432. Remember it.\n{FILLER}\nWhat is the pass key? The pass key is"
TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
"""The chat template of the apps' model copy: the messages' text as it is, so a chat prompt is the passkey prompt."""
STATS = re.compile(r"veloxpatch: snapkv \| (\d+) generation\(s\), (\d+) layer cache\(s\) built, (\d+) compression\(s\) "
                   r"\| live: (\d+)/(\d+) rows kept .* \| KV ([\d.]+) MiB vs ([\d.]+) MiB dense")
SERVED = "llama: snapkv on 4 of 4 cache slots"


def installed(module: str) -> bool:
    """Whether ``module`` is importable here (the nox session installed its app)."""
    return importlib.util.find_spec(module) is not None


@dataclass(frozen=True)
class Stats:
    """The ``--stats`` line's numbers."""

    generations: int
    built: int
    compressions: int
    kept: int
    seen: int
    kv_mib: float
    dense_mib: float


def stats_of(output: str) -> Stats:
    """The one ``--stats`` line in ``output`` (the test fails without exactly one)."""
    found = STATS.findall(output)
    assert len(found) == 1, f"expected one stats line:\n{output[-3000:]}"
    g, b, c, kept, seen, kv, dense = found[0]
    return Stats(int(g), int(b), int(c), int(kept), int(seen), float(kv), float(dense))


def assert_exact(stats: Stats) -> None:
    """Our caches served, and evicted nothing (the budget is above the context)."""
    assert stats.built > 0 and stats.generations > 0, stats
    assert stats.compressions == 0 and stats.kept == stats.seen > 0, stats


def assert_compressed(stats: Stats) -> None:
    """Our caches served, and hold fewer rows and bytes than a dense cache."""
    assert stats.built > 0 and stats.compressions > 0, stats
    assert 0 < stats.kept < stats.seen and stats.kv_mib < stats.dense_mib, stats


def launcher(budget: int) -> list[str]:
    """``veloxpatch run`` with snapkv at ``budget``, the stats line at exit; the app's command follows."""
    return [LAUNCHER, "run", "--kv", "snapkv", "--budget", str(budget), "--stats", "--log", "INFO"]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shipped model's files, with :data:`TEMPLATE` as its chat template."""
    folder = tmp_path_factory.mktemp("apps") / "model"
    shutil.copytree(model_path(), folder)
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    return folder


# --------------------------------------------------------------------- llm + llm-mlx: a command-line tool
@pytest.fixture(scope="module")
def llm_home(chat_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An ``LLM_USER_PATH`` where llm-mlx knows the model copy as ``tiny`` (what ``llm mlx download-model`` writes,
    without the download)."""
    home = tmp_path_factory.mktemp("llm")
    (home / "llm-mlx.json").write_text(json.dumps({str(chat_model): {"aliases": ["tiny"]}}))
    return home


def ask_llm(home: Path, *launch: str) -> subprocess.CompletedProcess:
    """``llm -m tiny`` on the passkey prompt, greedy, 16 tokens; plain, or after ``launch`` (as ``-m llm``)."""
    program = [*launch, "-m", "llm"] if launch else [str(BIN / "llm")]
    done = subprocess.run([*program, "-m", "tiny", "-o", "temperature", "0", "-o", "max_tokens", "16", PROMPT],
                          env={**without_velox(), "LLM_USER_PATH": str(home)}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.skipif(not installed("llm_mlx"), reason="llm-mlx is not installed (nox -s apps installs it)")
def test_llm_mlx_answers_as_plain_above_the_context(llm_home: Path) -> None:
    plain = ask_llm(llm_home)
    assert "71432" in plain.stdout, "the shipped model finds the pass key plain"
    launched = ask_llm(llm_home, *launcher(BIG))
    assert launched.stdout == plain.stdout
    assert SERVED in launched.stderr, launched.stderr
    assert_exact(stats_of(launched.stderr))


@pytest.mark.skipif(not installed("llm_mlx"), reason="llm-mlx is not installed (nox -s apps installs it)")
def test_llm_mlx_compresses_at_a_small_budget(llm_home: Path) -> None:
    launched = ask_llm(llm_home, *launcher(SMALL))
    assert launched.stdout.strip(), "it answers"
    assert_compressed(stats_of(launched.stderr))


# --------------------------------------------------------------------- mlx-dev-server: an OpenAI-compatible server
def serve(log: Path, *launch: str) -> Iterator[str]:
    """mlx-dev-server on a loopback port, plain or after ``launch``; its URL. It loads the model a request names,
    generates on an executor thread with ``max_kv_size`` (its ``--max-kv-size``, 4096), and is stopped by SIGTERM."""
    program = [*launch, "mlx_dev_server"] if launch else [str(BIN / "mlx_dev_server")]
    return serving.running(program, log)


def complete(url: str, model: Path) -> str:
    """The server's greedy completion of the passkey prompt, 16 tokens."""
    status, body = serving.post(url, {"model": str(model), "prompt": PROMPT, "max_tokens": 16, "temperature": 0})
    assert status == 200, body
    return body["choices"][0]["text"]


def answers(log: Path, model: Path, *launch: str) -> list[str]:
    """Two requests' answers from one server run (the second on a model already loaded, caches built anew)."""
    with serve(log, *launch) as url:
        return [complete(url, model), complete(url, model)]


@pytest.mark.skipif(not installed("mlx_dev_server"), reason="mlx-dev-server is not installed (nox -s apps)")
def test_mlx_dev_server_answers_as_plain_above_the_context(chat_model: Path, tmp_path: Path) -> None:
    plain = answers(tmp_path / "plain.log", chat_model)
    assert "71432" in plain[0] and plain[1] == plain[0], plain
    launched = answers(tmp_path / "big.log", chat_model, *launcher(BIG))
    assert launched == plain
    log = (tmp_path / "big.log").read_text()
    assert SERVED in log, log[-3000:]
    stats = stats_of(log)  # printed at SIGTERM, how the test stops the server
    assert_exact(stats)
    assert stats.generations == 2, stats


@pytest.mark.skipif(not installed("mlx_dev_server"), reason="mlx-dev-server is not installed (nox -s apps)")
def test_mlx_dev_server_compresses_at_a_small_budget(chat_model: Path, tmp_path: Path) -> None:
    launched = answers(tmp_path / "small.log", chat_model, *launcher(SMALL))
    assert all(text for text in launched), launched
    assert_compressed(stats_of((tmp_path / "small.log").read_text()))
