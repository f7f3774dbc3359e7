"""The mlx-lm compatibility matrix in one command: ``pipx run nox`` (or ``pip install nox; nox``).

One session per supported mlx-lm minor: a fresh virtualenv with this checkout and that minor (pip picks
an mlx it accepts), then ``bench/compat_check.py`` (the shipped model compressed at a small budget and
exact above the context, through ``veloxpatch run`` and ``import veloxpatch.auto``) and the tests that
matter for compatibility. CI runs the newest only; run the matrix before a release and whenever mlx-lm
is bumped (``nox -s "compat(mlx_lm='0.30')"`` for one minor; test files after ``--`` replace the list), and
update docs/compatibility.md.

Not in the default run: ``nox -s apps`` installs third-party apps built on mlx_lm from PyPI (``APPS``), each in a venv
of its own beside this checkout, and runs ``tests/apps/test_third_party.py`` there: each app unmodified, plain and
under ``veloxpatch run`` on the shipped model over loopback, the same answers at a budget above the context and
compressed caches at a small one (``nox -s "apps(app='llm-mlx')"`` for one).
"""

from __future__ import annotations

import re

import nox

MINORS = ["0.28", "0.29", "0.30", "0.31", "0.32"]

PINS = {minor: ["mlx<0.32"] for minor in ("0.28", "0.29", "0.30")}
"""What a minor needs besides: mlx-lm 0.28-0.30 make their generation stream once, at import, in the importing
thread (``mx.new_stream``), and mlx 0.32's streams are per thread, so with mlx 0.32 their server's generation
thread (any generation off the main thread) fails "There is no Stream(cpu, 0) in current thread", veloxpatch or
not; 0.31 makes it with ``mx.new_thread_local_stream``. On Linux they require no mlx at all, so pip would pick
the newest (docs/compatibility.md)."""

TESTS = [
    "tests/test_features.py",  # what is patched, by feature, on this mlx-lm
    "tests/test_patching.py",  # import orders, exact unpatch, batch_generate compressed while patched only
    "tests/test_launcher.py",  # veloxpatch run
    "tests/test_exactness.py",  # generate / stream_generate token for token at a budget above the context
    "tests/test_speculative.py",
    "tests/test_server.py",  # the server batching on loopback (where batched generation is patched)
    "tests/test_server_reuse.py",  # the server one request at a time under the launcher, its prompt cache reused
    "tests/test_server_exit.py",  # the server stopped by SIGINT exits with status 0 (about 70 s)
    "tests/test_batched.py",  # batches of compressed caches, every method as it runs alone
    "tests/test_contracts.py",  # save/load and the cache protocol
    "tests/test_compat.py",  # mlx_lm's private layouts batching and the server's settings per request rely on
]

APPS = {
    "llm-mlx": ["llm-mlx==0.4", "llm==0.36", "mlx-lm==0.32.*"],
    "mlx-dev-server": ["mlx-dev-server==0.1.2", "mlx-lm==0.28.4", "mlx<0.32", "huggingface-hub==0.36.2"],
}
"""Each app's pins. llm-mlx: a plugin of the ``llm`` command-line tool, on the newest mlx-lm. mlx-dev-server: an
OpenAI-compatible server (aiohttp, generation on executor threads, ``max_kv_size``); it asks for
``huggingface-hub~=0.36``, which mlx-lm 0.31+ (transformers 5) do not take, and for mlx-lm 0.28 on macOS only, so
here mlx-lm 0.28.4 with mlx older than 0.32 (``PINS``' reason: generation off the main thread). Apps tried and left
out are in docs/compatibility.md."""

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["compat"]  # not ``apps``: it installs third-party apps from PyPI


@nox.session
@nox.parametrize("mlx_lm", MINORS)
def compat(session: nox.Session, mlx_lm: str) -> None:
    """This checkout against mlx-lm ``mlx_lm``.* (its newest patch release)."""
    session.install("-e", ".[test]", f"mlx-lm=={mlx_lm}.*", *PINS.get(mlx_lm, []))
    session.run("python", "-c", "import importlib.metadata as m; print('mlx-lm', m.version('mlx-lm'), "
                "'mlx', m.version('mlx'))")
    session.run("veloxpatch", "info", env={"VELOX_KV": "snapkv"})
    session.run("python", "bench/compat_check.py")
    session.run("python", "-m", "pytest", "-q", "-n", "0", "-rfEs", *(session.posargs or TESTS))  # with why skipped


@nox.session
@nox.parametrize("app", list(APPS))
def apps(session: nox.Session, app: str) -> None:
    """Third-party app ``app`` (``APPS``) unmodified, plain and under the launcher (tests/apps/test_third_party.py)."""
    session.install("-e", ".", "pytest>=8", "pytest-xdist>=3.5", *APPS[app])
    names = list(dict.fromkeys([*(re.split(r"[=<>~]", pin)[0] for pin in APPS[app]), "mlx-lm", "mlx"]))
    session.run("python", "-c", f"import importlib.metadata as m; print({{n: m.version(n) for n in {names!r}}})")
    session.run("python", "-m", "pytest", "-q", "-n", "0", "-rfEs", "-p", "no:cacheprovider",
                "tests/apps/test_third_party.py", *session.posargs)
