"""The mlx-lm compatibility matrix in one command: ``pipx run nox`` (or ``pip install nox; nox``).

One session per supported mlx-lm minor: a fresh virtualenv with this checkout and that minor (pip picks
an mlx it accepts), then ``bench/compat_check.py`` (the shipped model compressed at a small budget and
exact above the context, through ``veloxpatch run`` and ``import veloxpatch.auto``) and the tests that
matter for compatibility. CI runs the newest only; run the matrix before a release and whenever mlx-lm
is bumped (``nox -s "compat(mlx_lm='0.30')"`` for one minor; test files after ``--`` replace the list), and
update docs/compatibility.md.
"""

from __future__ import annotations

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

nox.options.default_venv_backend = "venv"


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
