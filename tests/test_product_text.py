"""Product text says what is true now, not how the project was made.

The README, the docs, the code and its comments, the tests, the notebooks, the scripts and the benchmark
harnesses are read by users. A numbered work period ("session 40"), an issue number ("issue 12", "#12"),
a date given as history ("2026-12-02") or where hardware came from ("lent") means nothing to them.
History belongs in CHANGELOG.md and the git log, so CHANGELOG.md is not scanned.

The scanner reads every text file under the scanned paths (binary files, and files git ignores, are
skipped) and reports each hit as ``path:line: match``. A few files may legitimately carry such text; they
are listed in ALLOWED with the reason.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ["README.md", "docs", "notebooks", "speclab", "tests", "scripts", "app.py", "benchmarks"]
MAX_BYTES = 2_000_000  # larger files are data (weights, tokenizers), not text anyone reads

# (name, pattern): each is searched case-insensitively, line by line.
RULES = [
    # a numbered work period, or one named by its place in the work ("the last session"). A process
    # session (setsid, start_new_session), an HTTP or browser session and requests.Session are left alone.
    ("work period", r"\bsessions?\s*#?\d+"),
    ("work period", r"\b(?:this|that|next|previous|prior|earlier|later|last|first|second|third|fourth|fifth|"
                    r"same|whole|each|every|one|another|today's|a\s+later|an\s+earlier|the\s+next)\s+sessions?\b"
                    r"(?!\s*(?:id|leader|cookie|object|token)\b)"),
    ("work period", r"\b(?:since|until|before|after|in|from|of)\s+sessions?\b(?!\s*(?:id|leader)\b)"),
    ("work period", r"\bround \d+ of work"),
    ("issue number", r"\bissues?\s*#?\d+"),
    ("issue number", r"(?<![\w&#/])#\d{2,}(?![\w-])"),
    ("where hardware came from", r"\blent\b"),
    ("a brief", r"\bthe brief\b"),
    ("a date as history", r"\b202[6-9]-[01]\d(?:-[0-3]\d)?\b"),
]
COMPILED = [(name, re.compile(pattern, re.IGNORECASE)) for name, pattern in RULES]

# path (relative, a file or a folder) -> why its hits are legitimate
ALLOWED: dict[str, str] = {
    "tests/test_product_text.py": "the scanner's own rules and the strings its self-check plants",
    "docs/gpu_results": "a generated result file stamps when its run started",
    "speclab/analysis/cpu_preset.json": "a measured hardware preset records when it was measured (data)",
}


def _tracked_or_new(paths: list[str]) -> list[Path]:
    """Files under `paths` that git does not ignore (tracked or untracked); every file when git is absent."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", *paths],
                             cwd=ROOT, capture_output=True, check=True, timeout=60).stdout
        files = [ROOT / p for p in out.decode().split("\0") if p]
    except (OSError, subprocess.SubprocessError):
        files = [f for p in paths for f in ([ROOT / p] if (ROOT / p).is_file() else (ROOT / p).rglob("*"))]
    return sorted(f for f in files if f.is_file())


def _text(path: Path) -> str | None:
    """The file's text, or None for a binary or oversized file."""
    if path.stat().st_size > MAX_BYTES:
        return None
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def scan_text(text: str) -> list[tuple[int, str, str]]:
    """(line number, rule name, matched text) for every hit in `text`."""
    hits = []
    for no, line in enumerate(text.splitlines(), 1):
        for name, rx in COMPILED:
            for m in rx.finditer(line):
                hits.append((no, name, m.group(0)))
    return hits


# notes contributors leave for the maintainer to fold into the pages and CHANGELOG.md (their "## CHANGELOG"
# lines carry dates); they are read once and removed, never published as they are
NOTES = "docs/incoming/"


def allowed(rel: str) -> bool:
    return rel.startswith(NOTES) or any(rel == a or rel.startswith(a.rstrip("/") + "/") for a in ALLOWED)


def scan(files: list[Path], root: Path = ROOT) -> dict[str, list[str]]:
    """{relative path: ["line: rule: match", ...]} for files that are not allowed and have hits."""
    found: dict[str, list[str]] = {}
    for f in files:
        rel = f.relative_to(root).as_posix()
        if allowed(rel):
            continue
        text = _text(f)
        if text is None:
            continue
        hits = scan_text(text)
        if hits:
            found[rel] = [f"{no}: {name}: {match!r}" for no, name, match in hits]
    return found


def test_the_scanner_flags_planted_history(tmp_path):
    """The scanner can fail: each kind of history text planted in a file is found, legitimate uses are not."""
    planted = {
        "a.md": "Measured in session 40 on the lent H200.",
        "b.py": "# fixed for issue 12 (see #123), 2026-12-02\n",
        "c.md": "What the brief asked for, since session 33; the last session tried it.",
        "d.txt": "round 3 of work",
    }
    clean = {
        "e.py": "proc = subprocess.Popen(cmd, start_new_session=True)  # its own session\n"
                "s = requests.Session(); client = aiohttp.ClientSession()\n",
        "f.md": "Each browser session keeps its last run; published 2025-03-10 (a source's date).\n"
                "colour #1f77b4, heading 2.1, 12 issues per page\n",
    }
    for name, text in {**planted, **clean}.items():
        (tmp_path / name).write_text(text)
    found = scan(sorted(tmp_path.iterdir()), tmp_path)
    assert set(found) == set(planted), found
    kinds = {path: {hit.split(": ")[1] for hit in hits} for path, hits in found.items()}
    assert kinds == {"a.md": {"work period", "where hardware came from"},
                     "b.py": {"issue number", "a date as history"},
                     "c.md": {"a brief", "work period"},
                     "d.txt": {"work period"}}, found
    assert len(found["b.py"]) == 3, found  # issue 12, #123 and the date


def test_allow_list_entries_exist():
    assert all((ROOT / a).exists() for a in ALLOWED), [a for a in ALLOWED if not (ROOT / a).exists()]


def test_product_text_tells_no_history():
    found = scan(_tracked_or_new(SCANNED))
    lines = [f"{path}:{hit}" for path, hits in sorted(found.items()) for hit in hits]
    assert not found, f"{len(lines)} hits in {len(found)} files:\n" + "\n".join(lines[:200])


def test_docs_are_clean():
    """The README and docs/ carry no history (the part of the tree the docs own)."""
    found = scan(_tracked_or_new(["README.md", "docs"]))
    assert not found, found
