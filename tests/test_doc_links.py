"""What the docs point at exists. Every relative link of README.md and docs/*.md leads somewhere: the file
exists and, for a `#section` of a Markdown file, one of its headings has that anchor (GitHub's: lower case,
punctuation but `-` and `_` dropped, spaces to `-`, `-1`, `-2` ... for repeats); a renamed heading otherwise
leaves a link that silently lands at the top of the page. And docs/parity.md's table names every preset of
`python -m torchtrain.tools.parity`."""

from __future__ import annotations

import glob
import os
import re

from conftest import REPO

LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def anchors(path: str) -> set[str]:
    """The anchors GitHub gives the headings of the Markdown file `path` (fenced code is no heading)."""
    out, seen = set(), {}
    for line in FENCE.sub("", open(path, encoding="utf-8").read()).splitlines():
        m = HEADING.match(line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(2).strip().lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(doc: str) -> list[str]:
    """The relative links of `doc` (outside fenced code) whose file or heading is missing."""
    bad = []
    for target in LINK.findall(FENCE.sub("", open(doc, encoding="utf-8").read())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        full = os.path.normpath(os.path.join(os.path.dirname(doc), path)) if path else doc
        if not os.path.exists(full):
            bad.append(f"{target}: no such file")
        elif anchor and full.endswith(".md") and anchor not in anchors(full):
            bad.append(f"{target}: no heading of {os.path.relpath(full, REPO)} has this anchor")
    return bad


def test_every_relative_link_of_the_docs_resolves():
    docs = [os.path.join(REPO, "README.md"), *sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))]
    bad = [f"{os.path.relpath(d, REPO)}: {b}" for d in docs for b in broken_links(d)]
    assert not bad, "\n".join(bad)


def test_the_checker_finds_a_missing_heading_and_file(tmp_path):
    (tmp_path / "a.md").write_text("# Top\n\n## Two words, `code`\n\n```\n# not a heading\n```\n"
                                   "[ok](#two-words-code) [gone](#not-a-heading) [file](b.md) [web](https://x.org/#y)\n")
    assert broken_links(str(tmp_path / "a.md")) == [
        "#not-a-heading: no heading of " + os.path.relpath(str(tmp_path / "a.md"), REPO) + " has this anchor",
        "b.md: no such file"]


def test_the_parity_page_names_every_preset():
    from torchtrain.tools.parity import PRESETS

    with open(os.path.join(REPO, "docs", "parity.md"), encoding="utf-8") as f:
        named = set(re.findall(r"`(\w+)`", f.read()))
    assert sorted(set(PRESETS) - named) == []
