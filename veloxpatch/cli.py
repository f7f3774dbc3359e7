"""The ``veloxpatch`` command: ``run`` an unmodified app with the shim, list ``methods``, show ``info``.

``run`` validates the settings (a bad value exits with status 2), then replaces itself with the interpreter running
the app, the bootstrap first on PYTHONPATH: argv, exit codes and signals are the app's own, and subprocesses inherit
the shim through the environment.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

import click

from . import cpu, launching, models
from ._version import __version__
from .config import ConfigError, VeloxConfig, all_settings, from_env
from .eval.commands import COMMANDS
from .integration import compat, features, version
from .log import model_type
from .registry import METHODS
from .settings import to_text


class AppCommand(click.Command):
    """``run``: as with ``python -m MODULE``, every argument after ``-m MODULE`` is the app's (click would read an
    app's own ``-m``, as in ``llm -m MODEL``, as ours), so the arguments are cut there before click parses them."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        """Click's parsing, with ``--`` put after ``-m MODULE`` (a value given to an option of ours is ours)."""
        valued = {name for param in self.params if isinstance(param, click.Option) and not param.is_flag
                  for name in param.opts if name != "-m"}
        return super().parse_args(ctx, app_arguments_apart(args, valued))


def app_arguments_apart(args: list[str], valued: set[str]) -> list[str]:
    """``args`` with ``--`` after the first ``-m MODULE`` (or ``-mMODULE``) among the launcher's own options."""
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--" or not arg.startswith("-"):
            return args
        if arg.startswith("-m") and not arg.startswith("--"):  # -m MODULE, or -mMODULE
            cut = i + 2 if arg == "-m" else i + 1
            return args if cut > len(args) else [*args[:cut], "--", *args[cut:]]
        i += 2 if arg in valued else 1
    return args


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="veloxpatch")
def main() -> None:
    """Compressed KV caches for unmodified mlx_lm applications."""


def _setting_options(command: Any) -> Any:
    """One ``--option`` per registry setting; given ones become ``VELOX_*`` for the child."""
    for s in reversed(all_settings()):
        doc = f"{s.doc} [{s.name}; default {s.default}]"
        names = f"{s.option}/--no-{s.option[2:]}" if s.is_flag else s.option
        command = click.option(names, s.key, default=None, metavar=None if s.is_flag else "VALUE", help=doc)(command)
    return command


@main.command(cls=AppCommand, context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("-m", "module", metavar="MODULE", help="Run a library module as a script (like python -m).")
@click.argument("argv", nargs=-1, type=click.UNPROCESSED, metavar="SCRIPT [ARGS]...")
@_setting_options
def run(module: str | None, argv: tuple[str, ...], **options: str | None) -> None:
    """Run SCRIPT [ARGS]... or -m MODULE [ARGS]... with compressed KV caches.

    Options before the script or module set VELOX_* for it; everything after belongs to the app.
    SCRIPT or MODULE may name a Python console script, e.g. mlx.launch, whose ranks, local or
    remote, then all run with the same settings.
    """
    if module is None and not argv:
        raise click.UsageError("give a SCRIPT to run, or -m MODULE")
    env = {**os.environ, **{s.name: to_text(options[s.key]) for s in all_settings() if options.get(s.key) is not None}}
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([str(launching.SHIM_DIR), *paths])  # the bootstrap first
    try:
        loaded = from_env(env)
        for warning in loaded.warnings:
            click.echo(f"veloxpatch: WARNING: {warning}", err=True)
        blas = cpu.choose_blas(loaded.config.blas)
    except ConfigError as error:
        raise click.UsageError(str(error)) from None
    if blas.path is not None:  # only at exec can a library be preloaded
        if loaded.config.log in ("DEBUG", "INFO"):
            click.echo(f"veloxpatch: INFO: preloading {blas.path} ({blas.reason})", err=True)
        env = cpu.with_preload(env, blas.path)
    target = launching.module_target(module) if module is not None else launching.script_target(argv[0])
    rest = list(argv if module is not None else argv[1:])
    if Path(target[0]).name == "mlx.launch":  # mlx's distributed launcher, by path, bare name or -m
        rest = launching.forward_environment(rest, env)
    os.execve(sys.executable, [sys.executable, *target, *rest], env)


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def methods(as_json: bool) -> None:
    """List the compression methods, their knobs and what each does."""
    rows: list[dict[str, Any]] = [
        {"name": m.name, "description": m.description, "uses_budget": m.cls.uses_budget, "budget": m.cls.budget_use,
         "knobs": [{"name": k.name, "option": k.option, "default": k.default,
                    "allowed": k.allowed_text, "doc": k.doc} for k in m.knobs]}
        for m in sorted(METHODS.values(), key=lambda m: m.name)
    ]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        click.echo(f"{r['name']:<{width}}  {' '.join(filter(None, (r['description'], r['budget'])))}")
        for k in r["knobs"]:
            click.echo(f"{'':<{width}}    {k['name']} ({k['option']}, default {k['default']}): {k['doc']}")


@main.command()
@click.option("--model", "model_path", type=click.Path(exists=True, file_okay=False), metavar="PATH",
              help="Also say, per method, whether this model's caches are compressed, and if not why.")
def info(model_path: str | None) -> None:
    """Show the effective configuration, where each value came from, versions and backend."""
    import mlx.core as mx

    click.echo(f"veloxpatch {__version__}  python {platform.python_version()}  {platform.platform()}")
    found = version.mlx_lm_version()
    mlx_version = mx.__version__  # type: ignore[attr-defined]  # there at run time; mlx.core's stubs omit it
    click.echo(f"mlx {mlx_version}  mlx-lm {found} ({version.describe(found)})  backend {mx.default_device()}")
    _features(found)
    try:
        loaded = from_env()
    except ConfigError as error:  # every bad value, one a line
        click.echo("\n  ".join(["invalid configuration:", *str(error).splitlines()]))
        raise SystemExit(2) from None
    config = loaded.config
    click.echo("settings:")
    for s in all_settings():
        value = config.knobs[s.key] if s.method else getattr(config, s.key)
        click.echo(f"  {s.name:<22} {str(value):<10} ({loaded.sources[s.name]})")
    for warning in loaded.warnings:
        click.echo(f"warning: {warning}")
    _cpu_speed(config)
    if "MLX_RANK" in os.environ:  # under mlx.launch: which rank of how many this is (each must show the same settings)
        group = mx.distributed.init()
        click.echo(f"distributed: rank {group.rank()} of {group.size()} (started by mlx.launch); caches agree "
                   "across ranks when first built, and settings that differ are an error then")
    if model_path is not None:
        _model_support(Path(model_path), config)


def _features(found: str | None) -> None:
    """Each feature veloxpatch patches in mlx_lm: on, or off and why (mlx_lm is imported to look)."""
    if version.too_old(found):
        return
    click.echo("features:")
    found_features = features.survey()
    for name, problem in found_features.items():
        click.echo(f"  {name:<25} {'on' if problem is None else 'off: ' + problem}")
    layouts = compat.layout_problem() if found_features["batched generation"] is None else None
    if layouts is not None:
        click.echo(f"  (batches run on mlx_lm's own caches only, from their first call: {layouts})")


def _cpu_speed(config: VeloxConfig) -> None:
    """Say what ``VELOX_BLAS`` and ``VELOX_FLOAT32`` do here (a missing explicit library exits 2)."""
    try:
        choice = cpu.choose_blas(config.blas)
    except ConfigError as error:
        click.echo(f"invalid configuration:\n  {error}")
        raise SystemExit(2) from None
    if choice.path is None:
        click.echo(f"blas: `veloxpatch run` preloads nothing: {choice.reason}")
    else:
        now = "preloaded in this process" if cpu.is_preloaded(dict(os.environ), choice.path) else "not preloaded here"
        click.echo(f"blas: `veloxpatch run` preloads {choice.path} ({choice.reason}; {now})")
    effect = ("float16/bfloat16 weights loaded by mlx_lm run as float32" if cpu.float32_wanted(config.float32)
              else "weights keep their dtype")
    click.echo(f"float32: {config.float32} (default device {'cpu' if cpu.cpu_backend() else 'not cpu'}): {effect}")


def _model_support(path: Path, config: VeloxConfig) -> None:
    """Probe the model at ``path`` with each method under the effective settings."""
    from .eval.zoo import explain_patched, load_as_patched  # here: it imports mlx_lm, which the launcher never needs

    model = load_as_patched(path, config)
    click.echo(f"model {path} ({model_type(model)}):")
    width = max(map(len, METHODS))
    failed = None
    for name in sorted(METHODS):
        bounded = METHODS[name].cls.bounds_memory
        try:
            line = explain_patched(model, config.replace(kv=name, kv_memory=config.kv_memory if bounded else "off"))
        except ConfigError as error:  # VELOX_KV_MEMORY too small for this model
            line, failed = f"invalid configuration: {error}", failed or (name == config.kv and error)
        click.echo(f"  {name:<{width}}  {line}")
    if failed:
        raise SystemExit(2)


@main.command("fetch-model")
@click.argument("name", type=click.Choice(sorted(models.MODELS)), metavar="NAME")
@click.option("--quantized", is_flag=True,
              help="Keep the GGUF's 4-bit matrices (smaller; fast on Metal) instead of dense float32 (fast on CPU).")
def fetch_model(name: str, quantized: bool) -> None:
    """Download model NAME once into the user cache and convert it to an mlx_lm folder.

    The cache is $XDG_CACHE_HOME/veloxpatch (default ~/.cache/veloxpatch). The folder's path is
    the last line of standard output, for --model or mlx_lm.load.
    """
    try:
        folder = models.fetch_model(models.MODELS[name], quantized=quantized)
    except (models.DownloadError, models.GGUFError) as error:
        raise click.ClickException(str(error)) from None
    click.echo(str(folder))


for _command in COMMANDS:
    main.add_command(_command)

if __name__ == "__main__":
    main()
