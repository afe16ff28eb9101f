"""The README stays a short read, every relative link in it and in docs/ leads somewhere, the
generated pages match the code, and the documentation site builds."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_the_readme_is_a_five_minute_read_and_keeps_the_ci_blocks():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200
    assert "<!-- ci:setup -->" in text and "<!-- ci:test -->" in text


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_relative_links_lead_to_files_that_exist(page):
    text = page.read_text(encoding="utf-8")
    targets = [t for t in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text) if "://" not in t]
    missing = [t for t in targets if not (page.parent / t).exists()]
    assert missing == []


CONFIG_BLOCKS = [
    (page, block)
    for page in PAGES
    for block in re.findall(r"```json\n(.*?)```", page.read_text(encoding="utf-8"), re.S)
]


@pytest.mark.parametrize(
    "page,block", CONFIG_BLOCKS, ids=[f"{p.name}:{i}" for i, (p, _) in enumerate(CONFIG_BLOCKS)]
)
def test_every_config_the_pages_show_is_accepted(page, block, trainmon_log):
    """A config copied from the README or a page works as it is: no error, no warning."""
    import json

    from monitor.config.schema import validate_config

    validate_config(json.loads(block))
    assert [r.getMessage() for r in trainmon_log.records if r.levelname == "WARNING"] == []


def test_every_config_key_has_a_meaning_and_every_meaning_a_key():
    from monitor.reference_docs import MEANINGS, MSPROBE_DIFFERENCES, config_keys

    assert set(MEANINGS) == set(config_keys())
    assert set(MSPROBE_DIFFERENCES) == set(config_keys())  # the migration page says each key's fate


def test_the_generated_pages_say_what_the_code_says():
    """docs/configuration.md's key table, the migration page's and docs/cli.md come from the code
    (regenerate them with ``python -m monitor.reference_docs``)."""
    from monitor.cli import build_parser
    from monitor.reference_docs import cli_page, with_config_table, with_side_by_side_table

    configuration = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert with_config_table(configuration) == configuration
    migrating = (ROOT / "docs" / "migrating-from-msprobe.md").read_text(encoding="utf-8")
    assert with_side_by_side_table(migrating) == migrating
    assert cli_page(build_parser()) == (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")


def test_the_documentation_site_builds_strictly(tmp_path):
    """mkdocs (the dev extra) builds the site from docs/ with every warning an error."""
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "site" / "configuration" / "index.html").exists()
