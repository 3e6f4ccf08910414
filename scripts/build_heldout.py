"""Build the held-out workloads: datasets/heldout_{json,code,prose}.jsonl.

Text the family never trained on, taken from what a speclab installation ships beside the standard library
(the family's corpus is the standard library's code and docstrings, pydoc topics and seeded synthetic records;
see speclab/family/corpus.py):

* ``heldout_json``: JSON files shipped in installed packages (JSON schemas, settings schemas, package.json)
  and installed packages' metadata written as JSON objects;
* ``heldout_code``: small top-level functions and classes from installed pure-Python packages (none of them is
  in the corpus);
* ``heldout_prose``: paragraphs of the installed distributions' READMEs (their long descriptions in METADATA).

Each record names its source (``package==version:path``). Candidates are taken in a fixed order and sampled
with a fixed seed, and a prompt is dropped when any stretch of OVERLAP_CHARS of it occurs in the corpus
(train or held-out documents), so the same installed packages give the same files.

    python scripts/build_heldout.py            # writes datasets/heldout_*.jsonl
    python scripts/build_heldout.py --check    # exits 1 when the files differ from a fresh build
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib.metadata as md
import json
import random
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PER_WORKLOAD = 24
SEED = 0
WINDOW, STRIDE = 40, 8  # a shared stretch of WINDOW + STRIDE - 1 characters always covers one window
OVERLAP_CHARS = WINDOW + STRIDE - 1

# pure-Python packages that a speclab installation pulls in; the corpus holds none of their files
CODE_PACKAGES = ("click", "packaging", "idna", "h11", "attr", "pluggy", "jinja2", "dateutil", "tomlkit",
                 "arrow", "pygments", "requests", "httpx", "anyio", "starlette", "traitlets", "jsonschema",
                 "markdown_it", "bleach", "mistune", "narwhals", "referencing", "fsspec", "filelock")
JSON_PACKAGES = ("jupyterlab", "jsonschema_specifications", "nbformat", "jupyter_lsp", "jupyter_server",
                 "ipykernel", "jupyter_events")



def _site_root(package: str) -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


@functools.lru_cache(maxsize=1)
def _distributions() -> dict[str, list[str]]:
    return md.packages_distributions()


def _version_of(package: str) -> str:
    """The installed version of the distribution that provides an import name."""
    for dist in _distributions().get(package, []):
        return md.version(dist)
    return "?"


def _cut_lines(text: str, lo: int, hi: int) -> str:
    """Whole lines from the start, at least ``lo`` characters and at most ``hi`` where a line break allows."""
    out = ""
    for line in text.splitlines(keepends=True):
        if len(out) >= lo or len(out) + len(line) > hi and out:
            break
        out += line
    return out


# ----------------------------------------------------------------------------------------------
# candidates per workload: (source, prompt)


def _package_files(packages, pattern: str, skip: set[str]):
    """(source prefix ``pkg==version:path``, path) of every installed file of ``packages`` matching ``pattern``,
    in a stable order, outside folders named in ``skip``."""
    for pkg in packages:
        root = _site_root(pkg)
        if root is None:
            continue
        version = _version_of(pkg)
        for p in sorted(root.rglob(pattern)):
            rel = p.relative_to(root)
            if not skip & set(rel.parts):
                yield f"{pkg}=={version}:{rel}", p


def json_file_candidates() -> list[tuple[str, str]]:
    out = []
    for source, p in _package_files(JSON_PACKAGES, "*.json", {"tests", "node_modules", "test"}):
        if not 400 <= p.stat().st_size <= 40_000:
            continue
        text = p.read_text(encoding="utf-8", errors="replace")
        if not text.isascii() or "\t" in text:
            continue
        out.append((source, _cut_lines(text, 260, 520)))
    return out


def json_metadata_candidates() -> list[tuple[str, str]]:
    out = []
    for dist in sorted({d.metadata["Name"] for d in md.distributions() if d.metadata["Name"]}, key=str.lower):
        meta = md.metadata(dist)
        record = {"name": meta["Name"], "version": meta["Version"], "summary": meta.get("Summary") or "",
                  "requires_python": meta.get("Requires-Python") or "",
                  "license": meta.get("License-Expression") or meta.get("License") or "",
                  "requires_dist": meta.get_all("Requires-Dist") or [],
                  "classifiers": meta.get_all("Classifier") or []}
        if len(record["requires_dist"]) + len(record["classifiers"]) < 4 or "\n" in record["license"]:
            continue
        text = json.dumps(record, indent=2)
        if text.isascii():
            out.append((f"{meta['Name']}=={meta['Version']}:METADATA (as JSON)", _cut_lines(text, 260, 520)))
    return out


def _small_definitions(path: Path) -> list[tuple[int, str]]:
    """(line, source) of top-level functions and classes of 250-1500 characters that have a docstring."""
    try:
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return []
    lines = text.splitlines(keepends=True)
    out = []
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) or node.name.startswith("_"):
            continue
        if ast.get_docstring(node) is None or node.decorator_list:
            continue
        src = "".join(lines[node.lineno - 1:node.end_lineno])
        if 250 <= len(src) <= 1500 and src.isascii() and "\t" not in src:
            out.append((node.lineno, src))
    return out


def _code_prompt(src: str) -> str:
    """The definition up to the end of its docstring and one line of body: the rest is the model's to write."""
    node = ast.parse(src).body[0]
    doc_end = node.body[0].end_lineno  # the docstring expression's last line
    lines = src.splitlines(keepends=True)
    return "".join(lines[:doc_end + 1])


def code_candidates() -> list[tuple[str, str]]:
    out = []
    for source, p in _package_files(CODE_PACKAGES, "*.py", {"tests", "test", "_vendor", "vendor"}):
        for lineno, src in _small_definitions(p):
            prompt = _code_prompt(src)
            if 120 <= len(prompt) <= 700:
                out.append((f"{source}:{lineno}", prompt))
    return out


_PLAIN = re.compile(r"^[A-Za-z][A-Za-z0-9 ,.;:'()\-/`\"!?]+$")


def _paragraphs(readme: str) -> list[str]:
    """Plain prose paragraphs: no headings, lists, tables, code, links or HTML."""
    out = []
    for block in re.split(r"\n\s*\n", readme):
        lines = [ln.strip() for ln in block.strip().splitlines()]
        if not lines or any(not _PLAIN.match(ln) for ln in lines):
            continue
        para = " ".join(lines)
        if 200 <= len(para) <= 1500 and para.count(". ") >= 1 and "http" not in para:
            out.append(para)
    return out


def _prose_prompt(para: str) -> str:
    """The paragraph's first sentences, at least 120 characters, cut after a sentence's full stop."""
    ends = [m.end() for m in re.finditer(r"\. ", para)]
    cut = next((e for e in ends if e >= 120), None)
    return para[:cut].rstrip() if cut else para[: len(para) // 2].rsplit(" ", 1)[0]


def prose_candidates() -> list[tuple[str, str]]:
    out = []
    for dist in sorted({d.metadata["Name"] for d in md.distributions() if d.metadata["Name"]}, key=str.lower):
        meta = md.metadata(dist)
        body = meta.get_payload() or meta.get("Description") or ""
        for i, para in enumerate(_paragraphs(body)):
            out.append((f"{meta['Name']}=={meta['Version']}:METADATA#paragraph{i}", _prose_prompt(para)))
    return out


# ----------------------------------------------------------------------------------------------
# the corpus check and the sampling


def corpus_text() -> str:
    """Every document of the family's corpus (train and held-out split), as the family was trained on it."""
    sys.path.insert(0, str(ROOT))
    from speclab.family.corpus import build_corpus

    c = build_corpus(SEED)
    return "\x00".join(d.text for d in c.train + c.heldout)


def overlaps(prompt: str, corpus: str) -> bool:
    """True when a stretch of OVERLAP_CHARS characters of the prompt occurs in the corpus."""
    starts = range(0, max(1, len(prompt) - WINDOW + 1), STRIDE)
    return any(prompt[i:i + WINDOW] in corpus for i in starts)


def pick(candidates: list[tuple[str, str]], corpus: str, n: int, seed: int) -> list[tuple[str, str]]:
    """``n`` prompts, spread over the candidates' packages (round-robin in a seeded order), none in the corpus."""
    rng = random.Random(seed)
    by_pkg: dict[str, list[tuple[str, str]]] = {}
    for src, prompt in candidates:
        by_pkg.setdefault(src.split("==")[0], []).append((src, prompt))
    for group in by_pkg.values():
        rng.shuffle(group)
    order = sorted(by_pkg)
    rng.shuffle(order)
    out, seen = [], set()
    while len(out) < n and any(by_pkg.values()):
        for pkg in order:
            while by_pkg[pkg]:
                src, prompt = by_pkg[pkg].pop()
                if prompt in seen or overlaps(prompt, corpus):
                    continue
                seen.add(prompt)
                out.append((src, prompt))
                break
            if len(out) == n:
                break
    return out


def build(corpus: str) -> dict[str, list[dict]]:
    half = PER_WORKLOAD // 2
    sets = {"heldout_json": [(json_file_candidates(), half), (json_metadata_candidates(), PER_WORKLOAD - half)],
            "heldout_code": [(code_candidates(), PER_WORKLOAD)],
            "heldout_prose": [(prose_candidates(), PER_WORKLOAD)]}
    out = {}
    for k, (name, groups) in enumerate(sets.items()):
        chosen = [c for cands, n in groups for c in pick(cands, corpus, n, SEED + k)]
        category = name.removeprefix("heldout_")
        out[name] = [{"id": f"{name}-{i:03d}", "category": category, "source": src, "prompt": prompt}
                     for i, (src, prompt) in enumerate(chosen)]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "datasets", help="folder for heldout_*.jsonl")
    ap.add_argument("--check", action="store_true", help="compare with the files in --out; write nothing")
    args = ap.parse_args(argv)
    sets = build(corpus_text())
    differ = []
    for name, rows in sets.items():
        text = "".join(json.dumps(r) + "\n" for r in rows)
        path = args.out / f"{name}.jsonl"
        if args.check:
            if not path.exists() or path.read_text() != text:
                differ.append(path)
            continue
        path.write_text(text)
        print(f"{path}: {len(rows)} prompts")
    for p in differ:
        print(f"{p}: differs from a fresh build", file=sys.stderr)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
