# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Every relative link in README.md and docs/*.md points at a file of the repository, and every
#anchor at a heading of its page (GitHub's anchors: lower case, punctuation but hyphens and
underscores dropped, spaces to hyphens, a repeated heading numbered -1, -2, ...)."""

import re
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
# [text](target) and ![alt](target), not inside code spans or fenced blocks
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def unfenced_lines(text):
    """The lines outside fenced code blocks."""
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
        elif not fenced:
            yield line


def prose(text):
    """The text outside fenced and indented code blocks, inline code spans blanked out."""
    lines = [line for line in unfenced_lines(text) if not line.startswith("    ") or line.lstrip()[:2] in ("* ", "| ")]
    return re.sub(r"`[^`\n]*`", "", "\n".join(lines))


def anchors(page: Path):
    """GitHub's heading anchors of `page`."""
    seen, found = Counter(), set()
    for line in unfenced_lines(page.read_text()):
        match = HEADING.match(line)
        if not match:
            continue
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", match.group(2))  # a link's text
        slug = re.sub(r"[^\w\- ]", "", title.replace("`", "").lower()).replace(" ", "-")
        found.add(slug if not seen[slug] else f"{slug}-{seen[slug]}")
        seen[slug] += 1
    return found


def links():
    for page in PAGES:
        for target in LINK.findall(prose(page.read_text())):
            if not re.match(r"[a-z]+:", target):
                yield pytest.param(page, target, id=f"{page.relative_to(ROOT)}:{target}")


def test_there_are_pages_and_links():
    assert len(PAGES) >= 7 and len(list(links())) > 40


@pytest.mark.parametrize("page,target", list(links()))
def test_relative_link_resolves(page, target):
    path, _, anchor = target.partition("#")
    resolved = (page.parent / path).resolve() if path else page
    assert resolved.exists(), f"{page.relative_to(ROOT)}: {target} -> {resolved} does not exist"
    assert ROOT in resolved.parents or resolved == ROOT, f"{target} leaves the repository"
    if anchor:
        assert resolved.suffix == ".md", f"{target}: an anchor into a file that is not a page"
        assert anchor in anchors(resolved), (f"{page.relative_to(ROOT)}: {target}: no heading with anchor "
                                             f"#{anchor} in {resolved.name} ({sorted(anchors(resolved))})")


def test_anchors_follow_githubs_rules(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## What `\"auto\"` costs, once\n\n```\n## not a heading\n```\n\n"
                    "## The self-check: who turns it on?\n\n## Title\n\n### [a link](x.md) and_more\n")
    assert anchors(page) == {
        "title", "what-auto-costs-once", "the-self-check-who-turns-it-on", "title-1", "a-link-and_more"
    }
