"""What ``veloxpatch run`` starts, and how the shim reaches the ranks that ``mlx.launch`` starts.

A SCRIPT or ``-m`` MODULE that Python cannot run by itself may name a console script (``mlx.launch``,
``mlx_lm.generate``): a small Python file, which the launcher runs with its own interpreter like any script.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import shutil
import sys
from pathlib import Path

import click

SHIM_DIR = Path(__file__).resolve().parent / "_shim"


def script_target(script: str) -> list[str]:
    """The interpreter arguments that run SCRIPT: itself when Python can open it (Python's own options ``-c``,
    ``-``, and existing paths pass unchanged), else its console script."""
    if script.startswith("-") or os.path.exists(script):
        return [script]
    found = _console_script(script)
    if found is None:
        raise click.UsageError(_missing("SCRIPT", script, "a file"))
    return [found]


def module_target(module: str) -> list[str]:
    """The interpreter arguments that run ``-m MODULE``: the module when importable, else its console script
    (``mlx.launch``); the import machinery (slow: it runs parents' ``__init__``) is asked only before refusing."""
    if _found_without_importing(module):
        return ["-m", module]
    found = _console_script(module)
    if found is not None:
        return [found]
    if _found_by_importing(module):
        return ["-m", module]
    raise click.UsageError(_missing("-m MODULE", module, "an importable module"))


def forward_environment(args: list[str], env: dict[str, str]) -> list[str]:
    """``mlx.launch``'s ``args`` with ``--env NAME=VALUE`` first for each ``VELOX_*`` and PYTHONPATH in ``env``:
    remote ranks start over ssh with a fresh environment, and mlx.launch exports its ``--env`` values, in order, on
    every rank (veloxpatch at the same path on every host, as ``--python`` assumes). Not LD_PRELOAD: another host may
    lack that BLAS. A name the user gives with ``--env`` is theirs (their PYTHONPATH gets the shim first), and any
    later flag of theirs wins, even in a spelling not recognised here; ours win over a hostfile's ``envs``."""
    given = _given_env(args)
    names = [name for name in sorted(env) if name.startswith("VELOX_")] + ["PYTHONPATH"]
    flags = [part for name in names if name in env and name not in given for part in ("--env", f"{name}={env[name]}")]
    return flags + _shim_first(args, given.get("PYTHONPATH"))


def _search_path() -> str:
    """Where console scripts are looked for: the interpreter's folder (its scripts, even off PATH), then PATH."""
    return os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])


def _console_script(name: str) -> str | None:
    """The path of ``name`` if it is a Python console script (``#!.../python``, or pip's ``#!/bin/sh`` execing it)."""
    found = shutil.which(name, path=_search_path())
    if found is None:
        return None
    try:
        with open(found, "rb") as file:
            head = file.readline(512) + file.readline(512)
    except OSError:
        return None
    return found if head.startswith(b"#!") and b"python" in head else None


def _missing(what: str, name: str, kind: str) -> str:
    """Why ``name`` cannot be run, naming where console scripts were looked for."""
    where = f"{Path(sys.executable).parent} or on PATH"
    message = f"{what} {name!r} is neither {kind} nor a Python console script in {where}"
    other = shutil.which(name, path=_search_path())
    return message + (f" ({other} is not a Python script)" if other else "")


def _found_without_importing(module: str) -> bool:
    """Whether ``module``'s file can be found by walking its packages' folders without importing them (from the
    working folder first, as ``python -m`` does; this process has its own folder on ``sys.path``)."""
    top, *parts = module.split(".")
    try:
        spec = importlib.machinery.PathFinder.find_spec(top, [os.getcwd()]) or importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return False
    for depth in range(1, len(parts) + 1):
        if spec is None or spec.submodule_search_locations is None:
            return False
        name = ".".join([top, *parts[:depth]])
        spec = importlib.machinery.PathFinder.find_spec(name, list(spec.submodule_search_locations))
    return spec is not None


def _found_by_importing(module: str) -> bool:
    """Whether the import machinery finds ``module`` (packages that extend ``__path__`` when imported)."""
    try:
        return importlib.util.find_spec(module) is not None
    except Exception:  # a parent package that fails to import cannot run the module either
        return False


def _given_env(args: list[str]) -> dict[str, int]:
    """Each name the user sets with ``--env`` before any ``--`` (as mlx.launch reads it), to its NAME=VALUE's index."""
    given: dict[str, int] = {}
    for index, arg in enumerate(args):
        if arg == "--":
            break
        if arg == "--env" and index + 1 < len(args):
            given[args[index + 1].split("=", 1)[0]] = index + 1
        elif arg.startswith("--env="):
            given[arg[len("--env="):].split("=", 1)[0]] = index
    return given


def _shim_first(args: list[str], index: int | None) -> list[str]:
    """``args`` with the shim's folder first in the user's own ``--env PYTHONPATH=...`` (at ``index``),
    which every rank exports over the inherited one: without it no rank would bootstrap the shim."""
    if index is None:
        return list(args)
    prefix, _, value = args[index].partition("PYTHONPATH=")
    paths = [path for path in value.split(os.pathsep) if path]
    if str(SHIM_DIR) in paths:
        return list(args)
    joined = os.pathsep.join([str(SHIM_DIR), *paths])
    return [*args[:index], f"{prefix}PYTHONPATH={joined}", *args[index + 1:]]
