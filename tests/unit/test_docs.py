"""The front door holds: README.md and docs/*.md link only to what exists (files, and headings
of the page a `#anchor` names), the tables in them are what benchmarks/render_docs.py renders
from the results files today, and the README stays short."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import render_docs  # noqa: E402

README_MAX_LINES = 250
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HTML_SRC = re.compile(r"<(?:img|a)\b[^>]*?\b(?:src|href)=\"([^\"]+)\"", re.I)
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _prose(text: str, blank_code: bool = True) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, inline code blanked out (or kept)."""
    out, fenced = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            continue
        if not fenced:
            out.append((n, re.sub(r"`[^`]*`", lambda m: " " * len(m.group(0)), line) if blank_code else line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text lowercased, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, line in _prose(text, blank_code=False):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    out |= set(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", text))
    return out


def broken_links(page: Path, text: str | None = None) -> list[str]:
    """Every relative link or image of the page whose file, or heading, is not there."""
    text = page.read_text() if text is None else text
    bad = []
    for n, line in _prose(text):
        for target in LINK.findall(line) + HTML_SRC.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / unquote(path)).resolve() if path else page
            where = f"{page.relative_to(ROOT) if page.is_relative_to(ROOT) else page}:{n}: {target}"
            if not dest.exists():
                bad.append(f"{where}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text() if dest != page else text):
                bad.append(f"{where}: no heading #{anchor} in {dest.name}")
    return bad


def test_every_relative_link_and_image_resolves():
    bad = [b for page in _pages() for b in broken_links(page)]
    assert not bad, "\n".join(bad)


def test_the_link_check_finds_a_broken_link_and_a_broken_anchor():
    page = ROOT / "README.md"
    text = "# cpr\n\n## The two commands\n\nSee [a](docs/NOT_THERE.md), ![b](docs/images/nothing.png),\n" \
           "[c](#the-two-commands), [d](#no-such-heading), [e](docs/CHAOS.md#no-such-heading), `[f](not-a-link.md)`\n"
    bad = broken_links(page, text)
    assert [b.split(": ", 1)[1] for b in bad] == [
        "docs/NOT_THERE.md: no such file", "docs/images/nothing.png: no such file",
        "#no-such-heading: no heading #no-such-heading in README.md",
        "docs/CHAOS.md#no-such-heading: no heading #no-such-heading in CHAOS.md",
    ]


def test_slugs_are_githubs():
    assert slug("Production-scale emulation (`cpr emulate`)") == "production-scale-emulation-cpr-emulate"
    assert slug("Trainer fault tolerance (ReCoVer-style)") == "trainer-fault-tolerance-recover-style"
    assert slug("Checking a finished run: `cpr verify RUN_DIR`") == "checking-a-finished-run-cpr-verify-run_dir"
    assert anchors("# A\n## B\n## B\n```\n# not a heading\n```\n") == {"a", "b", "b-1"}


def test_the_rendered_pages_are_up_to_date(capsys):
    code = render_docs.main(["--check"])
    assert code == 0, capsys.readouterr().err


def test_the_check_fails_on_a_stale_block(tmp_path):
    page = tmp_path / "PAGE.md"
    stale = "# Results\n\n<!-- render: recovery -->\nold numbers\n<!-- /render -->\n"
    page.write_text(stale)
    rendered = render_docs.render_page(page, stale)
    assert rendered != stale and "old numbers" not in rendered
    assert "benchmarks/results/recovery.json" in rendered.splitlines()[3]  # the block starts with the meta line
    assert render_docs.render_page(page, rendered) == rendered  # rendering is stable
    with pytest.raises(render_docs.RenderError, match="no renderer"):
        render_docs.render_page(page, "<!-- render: no_such_results -->\n<!-- /render -->\n")


def test_every_renderer_imports_and_has_its_results_file():
    for name in render_docs.RENDERERS:
        assert callable(render_docs.renderer(name)), name
        assert render_docs.results_file(name).exists(), name


def test_an_old_results_file_without_meta_says_not_recorded(tmp_path):
    line = render_docs.meta_line({"command": "python x.py", "machine": "x86_64, 2 CPUs"},
                                 render_docs.RESULTS / "x.json", tmp_path / "P.md")
    assert "`python x.py`" in line and "commit `not recorded`" in line and "date not recorded" in line


def test_the_config_reference_is_cpr_config_docs():
    from core.config_docs import config_reference

    text = (ROOT / "docs" / "CONFIG.md").read_text()
    assert f"<!-- config-reference:start -->\n{config_reference()}\n<!-- config-reference:end -->" in text


def test_the_readme_is_short():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (max {README_MAX_LINES}): move detail to docs/"


def test_every_results_file_parses():
    for path in sorted((ROOT / "benchmarks" / "results").glob("*.json")):
        json.loads(path.read_text())
