"""Every relative link in the README and docs/ leads somewhere: the file exists and, for a ``#section``, the
page has a heading with that anchor (GitHub's rule: lower case, punctuation dropped, each space a hyphen,
repeats numbered -1, -2 ...)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text.
    e.g. 'Cost samples (online): `a --b`' -> 'cost-samples-online-a---b'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # a link in a heading counts by its text
    text = text.lower()
    text = re.sub(r"[^\w\- ]", "", text)  # \w keeps letters, digits and underscores (Unicode)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(page: Path):
    fenced = False
    for no, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        line = re.sub(r"`[^`]*`", "", line)  # code spans are not links
        for m in LINK.finditer(line):
            yield no, m.group(1)


def test_the_slug_rule_on_hand_built_headings():
    assert slug("Cost samples by the thread's CPU time (k = 4, 16 rows)") == \
        "cost-samples-by-the-threads-cpu-time-k--4-16-rows"
    assert slug("Adaptive policies: `speclab bench policies --control`") == \
        "adaptive-policies-speclab-bench-policies---control"
    assert slug("What is measured (vLLM's definitions)") == "what-is-measured-vllms-definitions"
    assert slug("see [the runs](x.md) here") == "see-the-runs-here"


def test_every_relative_link_and_anchor_exists():
    cache: dict[Path, set[str]] = {}
    bad = []
    for page in PAGES:
        for no, target in links(page):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT)}:{no}: {target}"
            if not dest.exists():
                bad.append(f"{where} (no such file)")
                continue
            if anchor and dest.suffix == ".md":
                if dest not in cache:
                    cache[dest] = anchors(dest)
                if anchor not in cache[dest]:
                    bad.append(f"{where} (no such section)")
    assert not bad, "broken links:\n" + "\n".join(bad)
