"""The docs site: it builds with ``mkdocs build --strict`` (broken links and anchors fail), and
every ``elflow ...`` command in its pages' code blocks parses as written, as the README's do."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.doc_commands import DOCS, ROOT, doc_pages, fenced_elflow_commands, parse_error

pytestmark = pytest.mark.docs

PAGES = doc_pages()
COMMANDS = [
    pytest.param(command, id=f"{page.relative_to(DOCS)}:{i}")
    for page in PAGES
    for i, command in enumerate(fenced_elflow_commands(page.read_text(encoding="utf-8")))
]


def test_docs_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install -e '.[dev]')")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "s")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "s" / "index.html").is_file()
    assert (tmp_path / "s" / "sampling" / "index.html").is_file()


def test_every_page_is_in_the_nav():
    """A page left out of mkdocs.yml's nav is only an info line under --strict: catch it here."""
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    missing = [str(p.relative_to(DOCS)) for p in PAGES if str(p.relative_to(DOCS)) not in nav]
    assert not missing, f"pages not in mkdocs.yml's nav: {missing}"


def test_docs_have_elflow_commands():
    assert len(COMMANDS) >= 60  # the extraction itself still works


@pytest.mark.parametrize("command", COMMANDS)
def test_docs_command_parses(command):
    """Each documented command is accepted as written: flags, and for train/distill the
    preset, --steps and every --set key."""
    error = parse_error(command)
    assert error is None, f"elflow {command}: {error}"
