"""The documentation site: it builds with no warning and no broken link, its reference page is the code's, and no page,
source file or help text cites an issue number (history belongs in git and CHANGELOG.md).

The pages' code blocks are run by tests/test_readme.py, with the README's.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from docs import reference

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
BUILD_TIMEOUT_S = 120
# "issue 29", "issues 22, 33", "(#41)": a citation of the tracker. A colour (#440154), an anchor (page.md#x) or a
# request id in code (`#1`) is not one.
ISSUE_CITATION = re.compile(r"\b[Ii]ssues?\s+\d+|(?:^|[\s(\[,;])#\d{1,5}\b")
SOURCE_FOLDERS = ("server", "convert", "clients", "protos", "bench")
# Written by hand: every page but the reference, which is made from the commands' help texts (checked with them).
HAND_WRITTEN = [ROOT / "README.md", ROOT / "CHANGELOG.md",
                *(page for page in sorted(DOCS.glob("*.md")) if page != reference.PAGE)]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "NO_MKDOCS_2_WARNING": "1"}


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=BUILD_TIMEOUT_S)


def citations(text: str) -> list[str]:
    return [f"line {text.count(chr(10), 0, found.start()) + 1}: {found.group().strip()}"
            for found in ISSUE_CITATION.finditer(text)]


def test_the_readme_is_a_front_page():
    """A user reads it in ten minutes; the rest is in docs/, which it links."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    linked = set(re.findall(r"\]\(docs/([\w-]+\.md)", readme))
    assert linked >= {page.name for page in HAND_WRITTEN if page.parent == DOCS} - {"index.md", "changelog.md"}


def test_the_site_builds_with_no_warning_and_no_broken_link(tmp_path):
    built = mkdocs_build(ROOT / "mkdocs.yml", tmp_path / "site")
    log = built.stdout + built.stderr
    assert built.returncode == 0 and "WARNING" not in log, f"`make docs` fails:\n{log[-4000:]}"
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    pages = [page for entry in config["nav"] for page in entry.values()]
    assert sorted(pages) == sorted(page.name for page in DOCS.glob("*.md")), "every page in mkdocs.yml's nav, once"
    for page in pages:
        assert (tmp_path / "site" / page.replace(".md", ".html")).is_file(), page
    assert (tmp_path / "site" / "images" / "score-map.png").is_file()


def test_a_broken_link_or_anchor_fails_the_build(tmp_path):
    """The strict build the suite runs does catch what it is there for, with the site's own validation settings."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    pages = tmp_path / "pages"
    pages.mkdir()
    (pages / "index.md").write_text("# Home\n\nSee [serving](serving.md) and [a part](other.md#no-such-part).\n")
    (pages / "other.md").write_text("# Other\n\n## A part\n")
    small = {key: config[key] for key in ("site_name", "theme", "markdown_extensions", "validation")}
    small.update(docs_dir=str(pages), nav=[{"Home": "index.md"}, {"Other": "other.md"}])
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(small))
    built = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    log = built.stdout + built.stderr
    assert built.returncode != 0
    assert "'serving.md'" in log and "no-such-part" in log, log[-3000:]


def test_the_reference_page_is_the_commands_own_definitions():
    assert reference.PAGE.read_text() == reference.render(), "docs/reference.md is stale: run `python -m docs.reference`"


def test_the_reference_has_every_flag_of_every_command():
    page = reference.PAGE.read_text()
    assert set(reference.commands()) >= {"scoremap-serve", "scoremap-convert", "scoremap-inspect", "scoremap-score",
                                         "scoremap-loadtest", "scoremap-export"}
    missing = []
    for command, entry in reference.commands().items():
        parser = reference.parser_of(entry)
        assert f"\n## {command}\n" in page
        for sub in [parser, *reference._subparsers(parser).values()]:
            missing += [f"{command}: {option}" for action in sub._actions for option in action.option_strings
                        if option not in ("-h", "--help") and f"`{option}`" not in page]
    assert not missing, "\n".join(missing)


def _same(shown: str, default: str) -> bool:
    try:
        return float(shown.replace(",", "")) == float(default)
    except ValueError:
        return shown == default


def test_a_default_quoted_in_a_page_is_the_reference_s():
    """A page may say "`--queue-depth` (128)" for the reader's sake; the value must be the one the code declares."""
    defaults: dict[str, set[str]] = {}
    for row in re.findall(r"^\| (`-.+?) \| (.*?) \|", reference.PAGE.read_text(), re.MULTILINE):
        for flag in re.findall(r"`(--[\w-]+)`", row[0]):
            defaults.setdefault(flag, set()).add(row[1])
    wrong = []
    for page in HAND_WRITTEN:
        for flag, shown in re.findall(r"`(--[\w-]+)` \((\d[\d.,]*(?: [KMG]iB)?)[):]", page.read_text()):
            if not any(_same(shown, default) for default in defaults.get(flag, ())):
                wrong.append(f"{page.relative_to(ROOT)}: {flag} ({shown}), the code's default: {defaults.get(flag)}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("page", HAND_WRITTEN, ids=lambda page: str(page.relative_to(ROOT)))
def test_no_page_cites_an_issue_number(page: Path):
    found = citations(page.read_text())
    assert not found, f"{page.relative_to(ROOT)} cites the tracker (history goes in CHANGELOG.md):\n" + "\n".join(found)


def test_the_citation_pattern_finds_what_it_should():
    assert citations("as measured (issue 29)\nissues 22, 33 and #41") == [
        "line 1: issue 29", "line 2: issues 22", "line 2: #41"]
    assert not citations("viridis #440154ff, [x](design.md#exact-tiles), `#1`, #ffcc00, request id '#12'")


def test_no_source_file_cites_an_issue_number():
    sources = [path for folder in SOURCE_FOLDERS for pattern in ("*.py", "*.proto")
               for path in sorted((ROOT / folder).rglob(pattern))]
    found = [f"{path.relative_to(ROOT)} {citation}" for path in sources for citation in citations(path.read_text())]
    assert not found, f"{len(found)} citations of the tracker in the sources:\n" + "\n".join(found)


def test_no_help_text_cites_an_issue_number():
    found = []
    for command, entry in reference.commands().items():
        parser = reference.parser_of(entry)
        for name, sub in {command: parser, **reference._subparsers(parser)}.items():
            found += [f"{command} {name}: {citation}" for citation in citations(sub.format_help())]
    found += [f"docs/reference.md {citation}" for citation in citations(reference.PAGE.read_text())]
    assert not found, "\n".join(found)
