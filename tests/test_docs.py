"""The documentation a user reads: the generated reference pages match the registry, the README stays a short
landing page that opens with the commands CI runs, and no relative link is broken."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from veloxpatch import docs
from veloxpatch.config import all_settings
from veloxpatch.docs import COMMANDS, _method_doc, methods_markdown, settings_markdown
from veloxpatch.registry import METHODS

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]


def rows(text: str) -> dict[str, list[str]]:
    """Table rows that start with a `VELOX_*` name, by that name: the cells after it, unescaped."""
    found = {}
    for line in text.splitlines():
        match = re.match(r"^\| `(VELOX_\w+)` \| (.*) \|$", line)
        if match:
            found[match[1]] = [c.replace("\\|", "|") for c in re.split(r" (?<!\\)\| ", match[2])]
    return found


@pytest.mark.parametrize("page, generate", [("settings", settings_markdown), ("methods", methods_markdown)])
def test_the_generated_pages_are_up_to_date(page: str, generate) -> None:
    path = ROOT / "docs" / f"{page}.md"
    assert path.exists() and path.read_text() == generate(), f"{path} is stale: regenerate it with `{COMMANDS[page]}`"


def test_the_settings_page_has_every_setting_with_its_default_allowed_values_and_doc() -> None:
    documented = rows((ROOT / "docs" / "settings.md").read_text())
    registry = {s.name: [f"`{s.default}`", s.allowed_text, s.doc] for s in all_settings()}
    assert documented == registry


def test_the_methods_page_has_every_method_with_its_knobs_and_notes() -> None:
    text = (ROOT / "docs" / "methods.md").read_text()
    documented = rows(text)
    for name, info in METHODS.items():
        assert f"\n## {name}\n\n{info.description}\n" in text
        for knob in info.knobs:
            assert documented[knob.name] == [f"`{knob.option}`", f"`{knob.default}`", knob.allowed_text, knob.doc]
        doc = _method_doc(name)
        assert doc and doc in text, f"{name}: its module docstring is missing"


def test_a_method_registered_later_appears_on_both_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    """A method from another package is in METHODS (and its knobs in all_settings) once registered; the pages are
    written from those, so it appears without anyone editing them. Faked here in what the generator reads."""
    knob = SimpleNamespace(name="VELOX_MYMETHOD_DEPTH", option="--mymethod-depth", default="3",
                           allowed_text="an integer", doc="MyMethod: how deep.", method="mymethod")
    info = SimpleNamespace(name="mymethod", description="One line about it.", knobs=(knob,),
                           cls=type("MyCache", (), {"bounds_memory": True, "budget_use": ""}))
    real_doc = docs._method_doc
    monkeypatch.setattr(docs, "METHODS", {**docs.METHODS, "mymethod": info})
    monkeypatch.setattr(docs, "all_settings", lambda: (*all_settings(), knob))
    monkeypatch.setattr(docs, "_method_doc", lambda name: "Its paper, its deviations." if name == "mymethod"
                        else real_doc(name))
    text = docs.methods_markdown()
    assert "\n## mymethod\n\nOne line about it.\n\nIt evicts rows: `VELOX_KV_MEMORY`" in text
    assert "Its paper, its deviations." in text
    assert rows(text)["VELOX_MYMETHOD_DEPTH"] == ["`--mymethod-depth`", "`3`", "an integer", "MyMethod: how deep."]
    assert rows(docs.settings_markdown())["VELOX_MYMETHOD_DEPTH"] == ["`3`", "an integer", "MyMethod: how deep."]


def test_the_readme_is_short_and_opens_with_the_commands_ci_runs() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'pip install -q -e ".[test]"' in ci and "python -m pytest -q" in ci
    blocks = re.findall(r"^```bash\n(.*?)^```$", text, re.M | re.S)
    assert 'pip install -e ".[test]"' in blocks[0] and blocks[1].strip() == "python -m pytest -q"
    before = text[:text.index("```bash")]
    assert before.strip() == "# veloxpatch", "the two commands come first, right under the title"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower()
    return "".join(c for c in text if c.isalnum() or c in " -_").replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```$", "", path.read_text(), flags=re.M | re.S)
    seen: dict[str, int] = {}
    found = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        base = slug(heading)
        found.add(base if base not in seen else f"{base}-{seen[base]}")
        seen[base] = seen.get(base, 0) + 1
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_to_a_file_that_exists(page: Path) -> None:
    text = re.sub(r"^```.*?^```$", "", page.read_text(), flags=re.M | re.S)
    text = re.sub(r"`[^`\n]*`", "", text)  # code is not a link (link text in backticks becomes empty)
    broken = []
    for target in re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: broken links {broken}"


def test_the_docs_module_regenerates_a_page_from_the_command_line(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "veloxpatch.docs", "settings"], capture_output=True, text=True,
                            timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout == settings_markdown()
    bad = subprocess.run([sys.executable, "-m", "veloxpatch.docs", "nope"], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert bad.returncode == 2 and "usage" in bad.stderr
