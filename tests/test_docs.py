"""The README stays a short read and every relative link in it and in docs/ leads somewhere."""

from __future__ import annotations

import re
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
