"""The documentation holds together: every relative link in the README, the pages under
docs/ and cluster/README.md leads to a file (and heading) that exists, every page under
docs/ is reachable from the docs index, and the README stays a five-minute read."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README_MAX_BYTES = 10 * 1024  # issue 37: "at most about 10 KB"
# Pages that other branches of the same session add (generated from the one definition of
# engine args, server settings and environment variables; the GPU runs). Linked already;
# until they land a missing one is not an error. Empty this set once they are all merged.
# Pages linked before they exist (none now: every linked page has landed).
PAGES_FROM_OTHER_BRANCHES: set[str] = set()
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_CODE_BLOCK = re.compile(r"^```.*?^```", re.S | re.M)


def documentation_pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "cluster" / "README.md", *sorted(DOCS.rglob("*.md"))]


def github_anchor(heading: str) -> str:
    """The fragment GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = _CODE_BLOCK.sub("", page.read_text())
    return {github_anchor(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}


def relative_links(page: Path) -> list[str]:
    text = _CODE_BLOCK.sub("", page.read_text())
    return [link for link in _LINK.findall(text) if not re.match(r"[a-z]+:", link)]


def test_github_anchor_follows_githubs_rules():
    assert github_anchor(" One machine: the floors, and vLLM's CPU build on the same workload") == \
        "one-machine-the-floors-and-vllms-cpu-build-on-the-same-workload"
    assert github_anchor(" 4. Benchmark") == "4-benchmark"


@pytest.mark.parametrize("page", documentation_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_leads_to_a_file_and_heading_that_exist(page):
    broken = []
    for link in relative_links(page):
        path, _, fragment = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        name = str(target.relative_to(ROOT)) if target.is_relative_to(ROOT) else str(target)
        if not target.exists():
            if name not in PAGES_FROM_OTHER_BRANCHES:
                broken.append(f"{link} (no {name})")
        elif fragment and fragment not in anchors(target):
            broken.append(f"{link} (no heading #{fragment} in {name})")
    assert not broken, f"{page.relative_to(ROOT)} links to what does not exist: {broken}"


def test_every_page_under_docs_is_linked_from_the_docs_index():
    index = DOCS / "README.md"
    linked = {(index.parent / link.partition("#")[0]).resolve() for link in relative_links(index)}
    unlinked = [str(page.relative_to(ROOT)) for page in DOCS.rglob("*.md") if page != index and page not in linked]
    assert not unlinked, f"docs/README.md does not link {unlinked}"


def test_the_readme_stays_a_five_minute_read():
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes; move detail under docs/ (at most {README_MAX_BYTES})"
