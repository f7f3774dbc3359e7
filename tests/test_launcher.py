"""``veloxpatch run`` in real subprocesses: the app must not be able to tell it is launched."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import run_group, without_velox
from serving import free_port
from veloxpatch.cli import app_arguments_apart, main
from veloxpatch.launching import SHIM_DIR

LAUNCHER = str(Path(sys.executable).parent / "veloxpatch")

APP = textwrap.dedent("""
    import os, sys
    print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "name": __name__,
                      "shim_on_path": any("_shim" in p for p in sys.path)}))
    code = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 0
    if "--check-patch" in sys.argv:
        import veloxpatch, mlx_lm, mlx.core
        from mlx_lm.models.cache import make_prompt_cache
        from mlx_lm.models.llama import Model, ModelArgs
        args = ModelArgs(model_type="llama", hidden_size=32, num_hidden_layers=1, intermediate_size=64,
                         num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-5, vocab_size=50)
        model = Model(args)
        mlx.core.eval(model.parameters())  # the probe never evaluates a model the app has not
        print("patched", veloxpatch.is_patched(), type(make_prompt_cache(model)[0]).__name__)
    if "--spawn" in sys.argv:
        child = "import mlx_lm, veloxpatch; print('child', veloxpatch.is_patched())"
        print(subprocess.run([sys.executable, "-c", child], capture_output=True, text=True).stdout.strip())
    if "--own-handler" in sys.argv:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(5))
    if "--signal" in sys.argv:
        os.kill(os.getpid(), signal.SIGTERM)
    sys.exit(code)
""")


def launch(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([LAUNCHER, *args], env={**without_velox(), **(env or {})}, cwd=cwd, capture_output=True,
                          text=True, timeout=180)


@pytest.fixture
def app(tmp_path: Path) -> Path:
    path = tmp_path / "app.py"
    path.write_text("import json, signal, subprocess\n" + APP)
    return path


def first_json(out: str) -> dict:
    return json.loads(out.splitlines()[0])


def test_argv_path_and_name_are_the_apps_own(app: Path) -> None:
    result = launch("run", "--kv", "snapkv", str(app), "x", "--kv", "y", "-m", "z")
    assert result.returncode == 0, result.stderr
    seen = first_json(result.stdout)
    assert seen == {"argv": [str(app), "x", "--kv", "y", "-m", "z"], "path0": str(app.parent),
                    "name": "__main__", "shim_on_path": False}


def test_exit_code_and_signal_pass_through(app: Path) -> None:
    assert launch("run", "--kv", "snapkv", str(app), "4").returncode == 4
    assert launch("run", "--kv", "snapkv", str(app), "--signal").returncode == -signal.SIGTERM


def test_a_sigterm_prints_the_stats_line_and_keeps_the_exit_status(app: Path) -> None:
    # how systemd, docker and supervisors stop a server: by default SIGTERM ends a process without atexit
    for handler, status in ([], -signal.SIGTERM), (["--own-handler"], 5):
        result = launch("run", "--kv", "snapkv", "--budget", "64", "--stats", str(app), "--check-patch",
                        *handler, "--signal")
        assert result.returncode == status, result.stderr
        assert "veloxpatch: snapkv | 0 generation(s), 1 layer cache(s) built" in result.stderr, result.stderr


def test_info_says_what_was_built_for_each_model(app: Path) -> None:
    result = launch("run", "--kv", "snapkv", "--budget", "64", str(app), "--check-patch", env={"VELOX_LOG": "INFO"})
    assert result.returncode == 0, result.stderr
    assert ("veloxpatch: INFO: llama: snapkv on 1 of 1 cache slots (VELOX_BUDGET=64, VELOX_SINK=4, VELOX_TIER=8, "
            "VELOX_TIER_SIZE=3x, VELOX_COMPRESS=chunk, VELOX_WINDOW=32, VELOX_SNAPKV_KERNEL=") in result.stderr
    result = launch("run", "--kv", "quant", str(app), "--check-patch", env={"VELOX_LOG": "INFO"})
    assert ("llama: quant on 1 of 1 cache slots (VELOX_WINDOW=32, VELOX_QUANT_BITS=4, VELOX_QUANT_GROUP=auto, "
            "VELOX_QUANT_KEEP=100%, VELOX_QUANT_POOL=1, VELOX_QUANT_BUDGETS=model, VELOX_QUANT_FLOOR=0.25, "
            "VELOX_QUANT_SCORE=repeat)"
            ) in result.stderr, result.stderr


def test_module_mode(app: Path) -> None:
    result = launch("run", "--kv", "snapkv", "-m", "app", "7", cwd=app.parent)
    assert result.returncode == 7, result.stderr
    assert first_json(result.stdout)["argv"][1:] == ["7"]


def test_the_child_and_its_subprocesses_are_patched(app: Path) -> None:
    result = launch("run", "--kv", "snapkv", "--budget", "64", str(app), "--check-patch", "--spawn")
    assert result.returncode == 0, result.stderr
    assert "patched True SnapKVCache" in result.stdout
    assert "child True" in result.stdout


def test_bad_values_stop_before_the_app_runs(app: Path) -> None:
    result = launch("run", "--kv", "snapkv", str(app), env={"VELOX_BUDGET": "lots"})
    assert result.returncode == 2 and result.stdout == ""
    assert "VELOX_BUDGET='lots' is not allowed" in result.stderr
    result = launch("run", "--kv", "tova2", str(app))
    assert result.returncode == 2 and "VELOX_KV='tova2'" in result.stderr and "snapkv" in result.stderr
    result = launch("run", "--kv", "snapkv", str(app), env={"VELOX_BUGDET": "5"})
    assert result.returncode == 0 and "did you mean VELOX_BUDGET?" in result.stderr


def test_the_users_own_sitecustomize_still_runs(app: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys; print('user sitecustomize ran', file=sys.stderr)\n")
    result = launch("run", "--kv", "snapkv", str(app), "--check-patch", env={"PYTHONPATH": str(site)})
    assert result.returncode == 0, result.stderr
    assert "user sitecustomize ran" in result.stderr
    assert "patched True SnapKVCache" in result.stdout


@pytest.mark.parametrize("method", ["snapkv", "xquant"])
def test_mlx_lm_generate_module_runs_patched(model_dir: Path, method: str) -> None:
    result = launch("run", "--kv", method, "--budget", "40", "--window", "8", "--stats",
                    "-m", "mlx_lm", "generate", "--model", str(model_dir),
                    "--prompt", "hello world " * 12, "--max-tokens", "20", "--ignore-chat-template")
    assert result.returncode == 0, result.stderr
    assert "Generation: " in result.stdout
    summary = [line for line in result.stderr.splitlines() if line.startswith(f"veloxpatch: {method}")]
    assert summary, result.stderr
    if method == "snapkv":
        assert "compression(s)" in summary[0] and "fold(s)" not in summary[0], summary
    else:  # every token kept, most as X or its latent at 4 bits: no "0 compression(s) ... 100.0%" alone
        assert "compression(s)" not in summary[0] and "fold(s)" in summary[0], summary
        assert "(100.0%, VELOX_BUDGET does not apply): " in summary[0] and "4-bit" in summary[0], summary


def test_methods_and_info(app: Path) -> None:
    listed = json.loads(launch("methods", "--json").stdout)
    assert {m["name"] for m in listed} >= {"snapkv", "streamingllm"}
    budgets = {m["name"]: (m["uses_budget"], m["budget"]) for m in listed}
    assert budgets["snapkv"] == (True, "VELOX_BUDGET is the rows it keeps per layer.")
    assert budgets["xquant"][0] is False and budgets["xquant"][1].startswith("VELOX_BUDGET does not apply: it keeps "
                                                                           "every token")
    assert "does not apply" in launch("methods").stdout.split("\nxquant")[1].split("\n")[0]
    info = launch("info", env={"VELOX_KV": "snapkv"})
    assert info.returncode == 0 and "VELOX_KV               snapkv     (environment (VELOX_KV))" in info.stdout
    bad = launch("info", env={"VELOX_WINDOW": "0", "VELOX_LOG": "loud"})
    assert bad.returncode == 2 and "VELOX_WINDOW='0'" in bad.stdout and "VELOX_LOG='loud'" in bad.stdout
    assert launch("--version").stdout.startswith("veloxpatch, version")


def test_the_readme_quickstart_runs() -> None:
    example = Path(__file__).resolve().parents[1] / "examples" / "quickstart.py"
    result = launch("run", "--kv", "snapkv", "--budget", "256", "--stats", str(example), "--words", "300")
    assert result.returncode == 0, result.stderr
    assert "answer: " in result.stdout and "decode" in result.stdout
    assert "veloxpatch: snapkv | 1 generation(s)" in result.stderr


def test_a_child_interpreter_without_veloxpatch_still_runs_the_users_sitecustomize(tmp_path: Path) -> None:
    """PYTHONPATH reaches children that run another interpreter: no error there, the user's file runs."""
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True, timeout=60)
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys; print('user sitecustomize ran', file=sys.stderr)\n")
    app = tmp_path / "spawn.py"
    app.write_text(textwrap.dedent(f"""
        import subprocess, sys
        child = subprocess.run([{str(bare / "bin" / "python")!r}, "-c", "import sys; print(sys.prefix)"],
                               capture_output=True, text=True)
        print(child.stdout.strip())
        print(child.stderr.strip() or "<no stderr>")
    """))
    result = launch("run", "--kv", "snapkv", str(app), env={"PYTHONPATH": str(site)})
    assert result.returncode == 0, result.stderr
    prefix, *child_stderr = result.stdout.splitlines()
    assert Path(prefix) == bare, "the child ran the bare interpreter"
    assert child_stderr == ["user sitecustomize ran"]


MLX_LAUNCH = str(Path(sys.executable).parent / "mlx.launch")
RANK = textwrap.dedent("""
    import json, os
    import mlx.core as mx
    group = mx.distributed.init()
    import mlx_lm, veloxpatch
    config = veloxpatch.active_config()
    print(json.dumps({"rank": group.rank(), "size": group.size(), "kv": os.environ.get("VELOX_KV"),
                      "patched": veloxpatch.is_patched(), "method": config and config.kv,
                      "budget": os.environ.get("VELOX_BUDGET")}), flush=True)
""")


@pytest.fixture
def execs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[str], dict[str, str]]]:
    """``veloxpatch run``'s exec, captured instead of done; VELOX_* cleared from the caller's environment."""
    for name in [n for n in os.environ if n.startswith("VELOX_")]:
        monkeypatch.delenv(name)
    calls: list[tuple[list[str], dict[str, str]]] = []
    monkeypatch.setattr(os, "execve", lambda path, argv, env: calls.append((list(argv), dict(env))))
    return calls


def run_captured(execs: list, *args: str) -> tuple[list[str], dict[str, str]]:
    result = CliRunner().invoke(main, ["run", "--kv", "snapkv", "--budget", "64", "--blas", "none", *args])
    assert result.exit_code == 0, result.output
    (argv, env), = execs
    return argv, env


def forwarded(env: dict[str, str], *names: str) -> list[str]:
    return [part for name in names for part in ("--env", f"{name}={env[name]}")]


@pytest.mark.parametrize("program", [["mlx.launch"], ["-m", "mlx.launch"], [MLX_LAUNCH]],
                         ids=["bare-name", "module", "path"])
def test_mlx_launch_gets_the_settings_as_env_flags(execs: list, program: list[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VELOX_WINDOW", "8")
    argv, env = run_captured(execs, *program, "-n", "2", "app.py", "--x")
    assert argv[:2] == [sys.executable, MLX_LAUNCH]
    flags = forwarded(env, "VELOX_BLAS", "VELOX_BUDGET", "VELOX_KV", "VELOX_WINDOW", "PYTHONPATH")
    assert argv[2:] == [*flags, "-n", "2", "app.py", "--x"]
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(SHIM_DIR)


def test_the_users_own_env_flags_win(execs: list) -> None:
    argv, env = run_captured(execs, "mlx.launch", "--env", "VELOX_BUDGET=128", "-n", "2", "app.py",
                             "--env=VELOX_KV=h2o", "--", "--env", "VELOX_WINDOW=3")
    assert argv[2:] == [*forwarded(env, "VELOX_BLAS", "PYTHONPATH"), "--env", "VELOX_BUDGET=128", "-n", "2",
                        "app.py", "--env=VELOX_KV=h2o", "--", "--env", "VELOX_WINDOW=3"]


def test_the_users_pythonpath_flag_keeps_the_shim_first(execs: list) -> None:
    argv, _ = run_captured(execs, "mlx.launch", "--env=PYTHONPATH=/mine", "app.py")
    assert "--env=PYTHONPATH=" + os.pathsep.join([str(SHIM_DIR), "/mine"]) in argv
    assert not any(arg.startswith("PYTHONPATH=") for arg in argv)


def test_the_local_blas_preload_stays_local(execs: list) -> None:
    result = CliRunner().invoke(main, ["run", "--kv", "snapkv", "--blas", sys.executable, "mlx.launch", "app.py"])
    assert result.exit_code == 0, result.output
    (argv, env), = execs
    assert sys.executable in env["LD_PRELOAD"]
    assert not any(arg.startswith("LD_PRELOAD") for arg in argv)


def test_other_programs_get_no_env_flags(execs: list) -> None:
    argv, _ = run_captured(execs, "-m", "mlx_lm.generate", "--prompt", "hi")
    assert argv == [sys.executable, "-m", "mlx_lm.generate", "--prompt", "hi"]
    execs.clear()
    argv, _ = run_captured(execs, "mlx_lm.generate", "--prompt", "hi")
    assert argv == [sys.executable, str(Path(sys.executable).parent / "mlx_lm.generate"), "--prompt", "hi"]


@pytest.mark.parametrize("args", [["-m", "mlx_lm.generate"], ["-mmlx_lm.generate"]], ids=["apart", "attached"])
def test_an_apps_own_dash_m_is_the_apps(execs: list, args: list[str]) -> None:
    """``llm -m MODEL`` under ``-m``: as with ``python -m``, what follows the module is the app's (it was read as a
    second ``-m MODULE`` of ours, and the launcher tried to run the model's name)."""
    argv, env = run_captured(execs, *args, "-m", "tiny", "--kv", "none", "--", "-x")
    assert argv == [sys.executable, "-m", "mlx_lm.generate", "-m", "tiny", "--kv", "none", "--", "-x"]
    assert env["VELOX_KV"] == "snapkv", "the app's --kv is not the launcher's"


def test_an_option_value_is_not_taken_for_dash_m() -> None:
    assert app_arguments_apart(["--kv", "-m", "x.py", "-m", "y"], {"--kv"}) == ["--kv", "-m", "x.py", "-m", "y"]
    assert app_arguments_apart(["--stats", "-m", "app", "-m"], set()) == ["--stats", "-m", "app", "--", "-m"]
    assert app_arguments_apart(["-m"], set()) == ["-m"], "click says the module is missing"


@pytest.mark.parametrize("args, named", [
    (["no-such-program"], "SCRIPT 'no-such-program' is neither a file nor a Python console script"),
    (["-m", "no_such.module"], "-m MODULE 'no_such.module' is neither an importable module nor a Python console"),
    (["ls"], "is not a Python script"),
])
def test_an_unknown_program_is_named(execs: list, args: list[str], named: str) -> None:
    result = CliRunner().invoke(main, ["run", "--kv", "snapkv", *args])
    assert result.exit_code == 2 and named in result.output
    assert execs == []


def test_mlx_launch_ranks_run_patched(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    command = [LAUNCHER, "run", "--kv", "snapkv", "--budget", "64", "mlx.launch", "-n", "2", "--backend", "ring",
               "--starting-port", str(free_port(2)), "--python", sys.executable, str(script)]
    code, out = run_group(command, timeout=60, cwd=tmp_path)
    assert code == 0, out
    ranks = sorted((json.loads(line) for line in out.splitlines() if line.startswith("{")), key=lambda r: r["rank"])
    assert ranks == [{"rank": rank, "size": 2, "kv": "snapkv", "patched": True, "method": "snapkv", "budget": "64"}
                     for rank in (0, 1)], out
