"""A method from another package: one file and an entry point, installed with pip into a folder of its own, found
by the registry in a child process and run by an unmodified mlx_lm script under the launcher."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import without_velox

LAUNCHER = str(Path(sys.executable).parent / "veloxpatch")
STRIDE = 3

ROOT = Path(__file__).resolve().parents[1]


def design_example() -> str:
    """The method file docs/DESIGN.md shows under "Adding a method" (so the page and this test cannot drift)."""
    text = (ROOT / "docs" / "DESIGN.md").read_text()
    section = text[text.index("## Adding a method"):]
    return re.search(r"^```python\n(.*?)^```$", section, re.M | re.S)[1]


PYPROJECT = textwrap.dedent('''
    [build-system]
    requires = ["setuptools>=61"]
    build-backend = "setuptools.build_meta"

    [project]
    name = "velox-strided"
    version = "0.1"

    [project.entry-points."veloxpatch.methods"]
    strided = "velox_strided"
''')

# an ordinary mlx_lm script: nothing in it knows veloxpatch or the plugin
APP = textwrap.dedent('''
    import json, sys
    from pathlib import Path
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(sys.argv[1]))
    caches = make_prompt_cache(model)
    prompt = mx.random.randint(0, 100, (200,), key=mx.random.key(0))
    for _ in zip(range(20), generate_step(prompt, model, prompt_cache=caches)):
        pass
    first = caches[0]
    print(json.dumps({"class": type(first).__name__, "offset": first.offset, "rows": first.size(),
                      "positions": first.store.row_positions()[0, 0].tolist()}))
''')


@pytest.fixture(scope="module")
def plugin(tmp_path_factory) -> Path:
    """The plugin's distribution, built and pip-installed into a folder of its own (offline: no build isolation,
    so setuptools and wheel come from the test environment)."""
    root = tmp_path_factory.mktemp("plugin")
    source = root / "source"
    (source / "velox_strided").mkdir(parents=True)
    (source / "velox_strided" / "__init__.py").write_text(design_example())
    (source / "pyproject.toml").write_text(PYPROJECT)
    target = root / "site"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-build-isolation",
           "--target", str(target), str(source)]
    result = subprocess.run(pip, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return target


def launch(plugin: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**without_velox(), "PYTHONPATH": str(plugin)}
    return subprocess.run([LAUNCHER, *args], env=env, capture_output=True, text=True, timeout=300)


def test_the_registry_finds_the_plugin_and_the_launcher_takes_its_knob(plugin: Path) -> None:
    listed = json.loads(launch(plugin, "methods", "--json").stdout)
    strided = next(m for m in listed if m["name"] == "strided")
    assert [k["option"] for k in strided["knobs"]] == ["--strided-stride"]
    bad = launch(plugin, "run", "--kv", "strided", "--strided-stride", "0", "-m", "json.tool")
    assert bad.returncode == 2 and "VELOX_STRIDED_STRIDE='0'" in bad.stderr
    methods_page = launch(plugin, "run", "-m", "veloxpatch.docs", "methods").stdout
    assert "\n## strided\n" in methods_page and "every stride-th token" in methods_page


def test_an_unmodified_script_runs_the_plugin_compressed(plugin: Path, model_dir: Path, tmp_path: Path) -> None:
    script = tmp_path / "app.py"
    script.write_text(APP)
    result = launch(plugin, "run", "--kv", "strided", "--strided-stride", str(STRIDE), "--budget", "48",
                    "--sink", "2", "--window", "8", "--strict", str(script), str(model_dir))
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout.splitlines()[-1])
    assert found["class"] == "StridedCache" and found["offset"] > 200 and found["rows"] < 200
    middle = [p for p in found["positions"] if 2 <= p < found["offset"] - 8 - 8]  # not sink, window or decode rows
    assert middle and all(p % STRIDE == 0 for p in middle), found["positions"]


HALFWAY = textwrap.dedent('''
    from veloxpatch.caches.evicting import EvictingCache
    from veloxpatch.methods.snapkv import SnapKVCache
    from veloxpatch.registry import method

    @method("halfway", "registers, then its module fails")
    class HalfwayCache(EvictingCache):
        policy_class = SnapKVCache.policy_class

    raise ImportError("something it needs is missing")
''')


def broken_plugins(folder: Path) -> None:
    """Two plugins that fail: one names a module that does not exist, one registers a method and then raises."""
    for name, module in (("broken", "velox_broken_missing"), ("halfway", "velox_halfway")):
        dist = folder / f"velox_{name}-0.1.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: velox-{name}\nVersion: 0.1\n")
        (dist / "entry_points.txt").write_text(f"[veloxpatch.methods]\n{name} = {module}\n")
    (folder / "velox_halfway.py").write_text(HALFWAY)


def test_a_plugin_that_fails_to_load_is_named_and_skipped_unless_strict(tmp_path: Path) -> None:
    broken_plugins(tmp_path)
    listed = launch(tmp_path, "methods")
    assert listed.returncode == 0 and "snapkv" in listed.stdout
    assert "method plugin 'broken' (velox_broken_missing) is not loaded: ModuleNotFoundError" in listed.stderr
    assert "method plugin 'halfway' (velox_halfway) is not loaded: ImportError" in listed.stderr
    assert "halfway" not in listed.stdout, "what a failing plugin registered is forgotten"
    env = {**without_velox(), "PYTHONPATH": str(tmp_path)}
    strict = subprocess.run([LAUNCHER, "methods"], capture_output=True, text=True, timeout=300,
                            env={**env, "VELOX_STRICT": "1"})
    assert strict.returncode != 0 and "StrictError" in strict.stderr
    assert "method plugin 'broken'" in strict.stderr and "method plugin 'halfway'" in strict.stderr, "every one named"
    code = "import veloxpatch; veloxpatch.patch(kv='snapkv', strict=True)"
    patched = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert patched.returncode != 0 and "StrictError" in patched.stderr and "method plugin 'halfway'" in patched.stderr
