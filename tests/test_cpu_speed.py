"""VELOX_BLAS (the launcher preloads OpenBLAS) and VELOX_FLOAT32 (mlx_lm's models run as float32)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm import generate, load
from mlx_lm.utils import load_model

import veloxpatch
from conftest import tiny
from test_launcher import LAUNCHER, launch
from veloxpatch import cpu
from veloxpatch.config import ConfigError
from veloxpatch.integration.float32 import upcast

ENV_APP = textwrap.dedent("""
    import os, subprocess, sys
    print(os.environ.get("LD_PRELOAD", "<unset>"))
    if len(sys.argv) > 1:  # veloxpatch run inside veloxpatch run
        print(subprocess.run([sys.argv[1], "run", *sys.argv[2:], __file__], capture_output=True,
                             text=True).stdout.strip())
""")


@pytest.fixture
def fake_blas(tmp_path: Path) -> Path:
    """Only its path matters here (ld.so says it cannot preload it, and goes on)."""
    path = tmp_path / "libblas.so.3"
    path.write_bytes(b"")
    return path


@pytest.fixture
def env_app(tmp_path: Path) -> Path:
    path = tmp_path / "env_app.py"
    path.write_text(ENV_APP)
    return path


@pytest.fixture(scope="module")
def float16_dir(tmp_path_factory) -> Path:
    from veloxpatch.eval.random_model import write_model_dir

    path = write_model_dir(tmp_path_factory.mktemp("f16") / "model", hidden_size=128, intermediate_size=192)
    weights = mx.load(str(path / "model.safetensors"))
    mx.save_safetensors(str(path / "model.safetensors"), {k: v.astype(mx.float16) for k, v in weights.items()})
    return path


def dtypes(model: nn.Module) -> set[mx.Dtype]:
    return {v.dtype for _, v in tree_flatten(model.parameters())}


def test_the_launcher_preloads_the_library_after_the_users_own_and_once(env_app: Path, fake_blas: Path,
                                                                         tmp_path: Path) -> None:
    result = launch("run", "--blas", str(fake_blas), str(env_app), LAUNCHER,
                    "--blas", str(fake_blas), env={"LD_PRELOAD": "/usr/lib/mine.so"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"/usr/lib/mine.so:{fake_blas}"] * 2


def test_none_preloads_nothing(env_app: Path) -> None:
    result = launch("run", "--blas", "none", str(env_app))
    assert result.returncode == 0 and result.stdout.strip() == "<unset>", result.stderr


def test_a_missing_explicit_library_stops_the_launcher(env_app: Path, tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "libopenblas.so.0"
    result = launch("run", str(env_app), env={"VELOX_BLAS": str(missing)})
    assert result.returncode == 2 and result.stdout == ""
    assert f"VELOX_BLAS='{missing}': no such file" in result.stderr
    relative = launch("run", "--blas", "libblas.so", str(env_app))
    assert relative.returncode == 2 and "VELOX_BLAS='libblas.so' is not allowed" in relative.stderr


def test_openblas_is_searched_for_on_linux_only(monkeypatch, fake_blas: Path, tmp_path: Path) -> None:
    monkeypatch.setattr(cpu, "SEARCH", (str(tmp_path / "{arch}" / "absent.so"), str(fake_blas)))
    assert cpu.choose_blas("auto", "Linux", "x86_64", on_cpu=lambda: True).path == str(fake_blas)
    assert cpu.choose_blas("openblas", "Linux", "aarch64", on_cpu=lambda: False).path == str(fake_blas)
    assert cpu.choose_blas("auto", "Linux", "x86_64", on_cpu=lambda: False).path is None
    assert cpu.choose_blas("auto", "Darwin", "arm64", on_cpu=lambda: True).path is None
    assert cpu.choose_blas("none", "Linux", "x86_64", on_cpu=lambda: True).path is None
    monkeypatch.setattr(cpu, "SEARCH", (str(tmp_path / "{arch}" / "absent.so"),))
    assert "no system OpenBLAS" in cpu.choose_blas("auto", "Linux", "x86_64", on_cpu=lambda: True).reason
    with pytest.raises(ConfigError, match=f"VELOX_BLAS='openblas'.*looked in {tmp_path}/x86_64/absent.so"):
        cpu.choose_blas("openblas", "Linux", "x86_64")


@pytest.mark.parametrize("argv0, preload, expected", [
    ("/venv/bin/veloxpatch", "", True), ("/src/veloxpatch/__main__.py", "", True),
    ("/venv/bin/pytest", "", False), ("/venv/bin/veloxpatch", "LIB", False)],
    ids=["the command", "python -m veloxpatch", "a test's CliRunner", "already preloaded"])
def test_eval_and_bench_run_again_with_the_blas_preloaded(monkeypatch, fake_blas: Path, argv0: str, preload: str,
                                                         expected: bool) -> None:
    """Their timings and long runs are mlx's matmuls: started as the command, they exec themselves again once with
    the library VELOX_BLAS chooses preloaded (and say so in a result's record)."""
    from veloxpatch.eval import commands

    calls = []
    monkeypatch.setattr(commands.os, "execve", lambda exe, argv, env: calls.append((argv, env["LD_PRELOAD"])))
    monkeypatch.setattr(commands.sys, "argv", [argv0, "bench", "--contexts", "256"])
    monkeypatch.setenv("VELOX_BLAS", str(fake_blas))
    monkeypatch.setenv("LD_PRELOAD", str(fake_blas) if preload else "")
    commands.with_fast_blas()
    assert calls == ([([commands.sys.executable, "-m", "veloxpatch", "bench", "--contexts", "256"], str(fake_blas))]
                     if expected else [])
    assert cpu.blas_in_use({"LD_PRELOAD": str(fake_blas)}) == f"preloaded {fake_blas}"
    assert cpu.blas_in_use({}) == "mlx's bundled BLAS"


def test_float16_weights_load_as_float32_and_generate_the_hand_cast_tokens(float16_dir: Path) -> None:
    plain, tokenizer = load(str(float16_dir))
    assert dtypes(plain) == {mx.float16}
    plain.set_dtype(mx.float32)
    expected = generate(plain, tokenizer, "hello world", max_tokens=12)
    veloxpatch.patch(float32="on")
    model, tokenizer = load(str(float16_dir))
    assert dtypes(model) == {mx.float32}
    assert generate(model, tokenizer, "hello world", max_tokens=12) == expected


def test_off_and_unpatch_keep_the_files_dtype(float16_dir: Path) -> None:
    veloxpatch.patch(float32="off")
    assert dtypes(load_model(float16_dir)[0]) == {mx.float16}
    veloxpatch.patch(float32="on")
    veloxpatch.unpatch()
    assert dtypes(load_model(float16_dir, lazy=True)[0]) == {mx.float16}


def test_quantized_layers_stay_quantized() -> None:
    model = tiny("llama")
    nn.quantize(model, group_size=32, bits=4)
    model.set_dtype(mx.bfloat16)
    assert upcast(model)["bfloat16"] > 0
    layer = model.layers[0].self_attn.q_proj
    assert isinstance(layer, nn.QuantizedLinear) and layer.weight.dtype == mx.uint32
    assert layer.scales.dtype == layer.biases.dtype == mx.float32
    assert dtypes(model) == {mx.uint32, mx.float32}


def test_the_launcher_applies_float32_without_a_kv_method(float16_dir: Path, tmp_path: Path) -> None:
    app = tmp_path / "dtype_app.py"
    app.write_text("import sys\nfrom mlx_lm import load\n"
                   "print(load(sys.argv[1])[0].model.embed_tokens.weight.dtype)\n")
    assert launch("run", str(app), str(float16_dir)).stdout.strip() == "mlx.core.float32"
    assert launch("run", "--float32", "off", str(app), str(float16_dir)).stdout.strip() == "mlx.core.float16"


def test_info_names_both(fake_blas: Path) -> None:
    shown = launch("info", env={"VELOX_BLAS": str(fake_blas), "VELOX_FLOAT32": "on"}).stdout
    assert f"blas: `veloxpatch run` preloads {fake_blas}" in shown
    assert "float32: on" in shown and "run as float32" in shown
    off = launch("info", env={"VELOX_BLAS": "none", "VELOX_FLOAT32": "off"}).stdout
    assert "blas: `veloxpatch run` preloads nothing: VELOX_BLAS=none" in off
    assert "float32: off" in off and "weights keep their dtype" in off
