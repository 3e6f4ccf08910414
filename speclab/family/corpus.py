"""Deterministic training corpus built from what every Python installation ships.

Three sources, mixed into one list of documents:

* ``code``: CPython standard library ``*.py`` files (tests, idlelib and site-packages excluded), then
  optionally those of installed packages named by ``packages`` (the larger corpus of the GPU-trained
  family: torch, transformers, numpy, which every speclab installation has);
* ``prose``: English technical prose: ``pydoc_data.topics`` and module / class / function docstrings
  extracted with :mod:`ast` (from the same files);
* ``records``: structured text generated with a seeded RNG: JSON objects and arrays, INI and
  YAML-like configuration files, CSV and markdown tables.

The held-out split is by document (a seeded fraction of each source).
"""

from __future__ import annotations

import ast
import csv
import functools
import hashlib
import io
import json
import random
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

MAX_FILE_BYTES = 200_000  # larger source files (generated tables, vendored blobs) are left out
EXCLUDED_PARTS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__", "turtledemo"}


@dataclass
class Document:
    source: str  # "code" | "prose" | "records"
    name: str
    text: str


@dataclass
class Corpus:
    train: list[Document] = field(default_factory=list)
    heldout: list[Document] = field(default_factory=list)

    def stats(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for split, docs in (("train", self.train), ("heldout", self.heldout)):
            for d in docs:
                s = out.setdefault(f"{split}/{d.source}", {"documents": 0, "chars": 0})
                s["documents"] += 1
                s["chars"] += len(d.text)
        return out

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for d in self.train + self.heldout:
            h.update(d.source.encode())
            h.update(d.name.encode())
            h.update(hashlib.sha256(d.text.encode("utf-8", "replace")).digest())
        return h.hexdigest()[:16]


# ----------------------------------------------------------------------------------------------
# code and prose from the standard library


def _py_files(root: Path, max_file_bytes: int) -> list[Path]:
    files = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if EXCLUDED_PARTS.intersection(rel.parts):
            continue
        try:
            if p.stat().st_size > max_file_bytes or p.stat().st_size < 200:
                continue
        except OSError:
            continue
        files.append(p)
    return sorted(files, key=lambda p: str(p.relative_to(root)))


def stdlib_files(max_file_bytes: int = MAX_FILE_BYTES) -> list[Path]:
    return _py_files(Path(sysconfig.get_paths()["stdlib"]), max_file_bytes)


def package_root(name: str) -> Path:
    """The directory of an installed package, found without importing it."""
    import importlib.util

    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"corpus package {name!r} is not installed (or is not a package)")
    return Path(list(spec.submodule_search_locations)[0])


def source_files(packages: tuple[str, ...] = ()) -> list[tuple[str, Path]]:
    """(document name, path) of every source file: the standard library's (named by their path under it,
    as the shipped family's corpus has them), then each package's (``package/path``)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = [(str(p.relative_to(root)), p) for p in stdlib_files()]
    for name in packages:
        proot = package_root(name)
        out += [(f"{name}/{p.relative_to(proot)}", p) for p in _py_files(proot, MAX_FILE_BYTES)]
    return out


# copies of other projects inside a package (pip's and setuptools' vendored packaging, requests, idna, ...)
VENDORED_PARTS = {"_vendor", "vendor", "vendored", "_vendored", "extern", "_extern", "third_party"}


def package_code_documents(packages: tuple[str, ...], chars_per_package: int,
                           exclude: tuple[str, ...] = ()) -> list[Document]:
    """Source files of installed packages as code documents: at most ``chars_per_package`` characters of
    each (files in path order, vendored copies left out), and no file that contains any of the strings
    in ``exclude`` (windows of evaluation prompts: the training text stays disjoint from them). A package
    that is not installed (an extra this environment lacks) adds nothing."""
    docs = []
    for name in packages:
        try:
            root, total = package_root(name), 0
        except ValueError:
            continue
        for p in _py_files(root, MAX_FILE_BYTES):
            if VENDORED_PARTS.intersection(p.relative_to(root).parts):
                continue
            text = _read(p)
            if not text or not text.isascii() or contains_any(text, exclude):
                continue
            docs.append(Document("code", f"{name}/{p.relative_to(root)}", text))
            total += len(text)
            if total >= chars_per_package:
                break
    return docs


def _window_hashes(data, n: int):
    """A polynomial hash (mod 2**64) of every ``n``-byte window of ``data``, vectorised over positions."""
    import numpy as np

    b = np.frombuffer(data, dtype=np.uint8).astype(np.uint64)
    if len(b) < n:
        return np.zeros(0, dtype=np.uint64)
    h = np.zeros(len(b) - n + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(n):
            h = h * np.uint64(1_000_003) + b[j:len(b) - n + 1 + j]
    return h


@functools.lru_cache(maxsize=4)
def _needle_hashes(needles: tuple[str, ...]):
    import numpy as np

    n = len(needles[0])
    assert all(len(w) == n for w in needles), "needles of one length"
    want = {int(_window_hashes(w.encode("ascii", "replace"), n)[0]): w for w in needles}
    return want, np.fromiter(want, dtype=np.uint64)


def contains_any(text: str, needles: tuple[str, ...]) -> bool:
    """True when ``text`` contains one of ``needles`` (ASCII strings of one length): one hashed pass over the
    text instead of a search per needle; a hash match is confirmed on the strings."""
    import numpy as np

    if not needles:
        return False
    n = len(needles[0])
    want, keys = _needle_hashes(needles)
    hashes = _window_hashes(text.encode("ascii", "replace"), n)
    for i in np.flatnonzero(np.isin(hashes, keys)):
        if text[i:i + n] == want[int(hashes[i])]:
            return True
    return False


def _read(p: Path) -> str | None:
    try:
        text = p.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None
    return text.replace("\r\n", "\n").replace("\t", "    ")


def code_documents(max_chars: int, packages: tuple[str, ...] = ()) -> list[Document]:
    docs, total = [], 0
    for name, p in source_files(packages):
        text = _read(p)
        if not text or not text.isascii():
            continue
        docs.append(Document("code", name, text))
        total += len(text)
        if total >= max_chars:
            break
    return docs


def _clean_docstring(s: str) -> str:
    import inspect

    return inspect.cleandoc(s).strip()


def docstring_documents(max_chars: int, packages: tuple[str, ...] = ()) -> list[Document]:
    """One document per module: its docstring plus the docstrings of its classes and functions,
    each introduced by a short heading line (``name(args)``)."""
    docs, total = [], 0
    for name, p in source_files(packages):
        text = _read(p)
        if not text:
            continue
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        parts = []
        mod_doc = ast.get_docstring(tree)
        modname = name[:-3].replace("/", ".").removesuffix(".__init__")
        if mod_doc and len(mod_doc) > 40:
            parts.append(f"{modname}\n\n{_clean_docstring(mod_doc)}")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                d = ast.get_docstring(node)
                if not d or len(d) < 60 or node.name.startswith("_"):
                    continue
                if isinstance(node, ast.ClassDef):
                    head = f"class {modname}.{node.name}"
                else:
                    args = ", ".join(a.arg for a in node.args.args)
                    head = f"{modname}.{node.name}({args})"
                parts.append(f"{head}\n\n{_clean_docstring(d)}")
        if not parts:
            continue
        body = "\n\n".join(parts)
        if not body.isascii():
            continue
        docs.append(Document("prose", "doc:" + modname, body))
        total += len(body)
        if total >= max_chars:
            break
    return docs


def topic_documents() -> list[Document]:
    try:
        from pydoc_data.topics import topics
    except ImportError:  # pragma: no cover - some distributions strip pydoc_data
        return []
    docs = []
    for key in sorted(topics):
        text = topics[key].replace("\r\n", "\n").strip()
        text = text.encode("ascii", "ignore").decode()
        if len(text) > 100:
            docs.append(Document("prose", "topic:" + key, text))
    return docs


# ----------------------------------------------------------------------------------------------
# generated structured records

FIRST = ["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "judy", "mallory",
         "nina", "oscar", "peggy", "quinn", "rupert", "sybil", "trent", "ursula", "victor", "wendy", "yuki",
         "zoe", "omar", "priya", "li", "mateo", "sofia", "noah", "emma"]
LAST = ["smith", "jones", "garcia", "miller", "davis", "lopez", "wilson", "anderson", "thomas", "moore",
        "martin", "lee", "clark", "lewis", "walker", "young", "king", "wright", "scott", "green", "baker",
        "adams", "nelson", "hill", "campbell", "chen", "kim", "patel", "nguyen", "silva"]
CITIES = ["London", "Paris", "Berlin", "Madrid", "Rome", "Lisbon", "Vienna", "Prague", "Warsaw", "Dublin",
          "Oslo", "Helsinki", "Tokyo", "Osaka", "Seoul", "Toronto", "Chicago", "Boston", "Denver", "Austin",
          "Sydney", "Lima", "Nairobi", "Cairo", "Mumbai"]
COUNTRIES = {"London": "GB", "Paris": "FR", "Berlin": "DE", "Madrid": "ES", "Rome": "IT", "Lisbon": "PT",
             "Vienna": "AT", "Prague": "CZ", "Warsaw": "PL", "Dublin": "IE", "Oslo": "NO", "Helsinki": "FI",
             "Tokyo": "JP", "Osaka": "JP", "Seoul": "KR", "Toronto": "CA", "Chicago": "US", "Boston": "US",
             "Denver": "US", "Austin": "US", "Sydney": "AU", "Lima": "PE", "Nairobi": "KE", "Cairo": "EG",
             "Mumbai": "IN"}
PRODUCTS = ["keyboard", "monitor", "mouse", "laptop", "headphones", "webcam", "desk lamp", "usb cable",
            "charger", "notebook", "backpack", "water bottle", "coffee mug", "phone case", "speaker",
            "router", "hard drive", "memory card", "tablet", "printer"]
CATEGORIES = ["electronics", "office", "accessories", "audio", "storage", "networking", "home"]
TAGS = ["new", "sale", "popular", "limited", "refurbished", "eco", "premium", "bundle", "gift", "clearance"]
STATUSES = ["pending", "paid", "shipped", "delivered", "cancelled", "refunded"]
LEVELS = ["DEBUG", "INFO", "WARNING", "ERROR"]
SERVICES = ["auth", "billing", "search", "gateway", "scheduler", "storage", "notifier", "metrics"]
EVENTS = ["login", "logout", "page_view", "click", "purchase", "signup", "error", "upload", "download"]
MESSAGES = ["request completed", "connection reset by peer", "cache miss", "retrying request",
            "user not found", "token expired", "rate limit exceeded", "job finished", "timeout waiting for lock",
            "payload too large", "database connection opened", "configuration reloaded"]
WORDS = ["data", "cache", "server", "client", "queue", "worker", "batch", "stream", "index", "table",
         "report", "backup", "session", "token", "model", "cluster", "node", "job", "task", "event"]


class RecordGen:
    def __init__(self, rng: random.Random):
        self.r = rng

    def date(self) -> str:
        r = self.r
        return f"20{r.randint(18, 26):02d}-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}"

    def timestamp(self) -> str:
        r = self.r
        return f"{self.date()}T{r.randint(0, 23):02d}:{r.randint(0, 59):02d}:{r.randint(0, 59):02d}Z"

    def person(self, i: int) -> dict:
        r = self.r
        first, last = r.choice(FIRST), r.choice(LAST)
        city = r.choice(CITIES)
        d = {
            "id": i,
            "name": f"{first.title()} {last.title()}",
            "email": f"{first}.{last}@example.{r.choice(['com', 'org', 'net'])}",
            "age": r.randint(18, 80),
            "active": r.random() < 0.7,
            "address": {"city": city, "country": COUNTRIES[city], "zip": f"{r.randint(10000, 99999)}"},
            "tags": r.sample(TAGS, r.randint(0, 3)),
        }
        if r.random() < 0.4:
            d["created_at"] = self.timestamp()
        return d

    def product(self, i: int) -> dict:
        r = self.r
        name = r.choice(PRODUCTS)
        return {
            "sku": f"{name[:3].upper()}-{r.randint(1000, 9999)}",
            "id": i,
            "name": name,
            "category": r.choice(CATEGORIES),
            "price": round(r.uniform(2, 900), 2),
            "currency": r.choice(["USD", "EUR", "GBP"]),
            "in_stock": r.random() < 0.8,
            "quantity": r.randint(0, 500),
            "tags": r.sample(TAGS, r.randint(0, 2)),
        }

    def order(self, i: int) -> dict:
        r = self.r
        items = []
        for _ in range(r.randint(1, 4)):
            items.append({"product": r.choice(PRODUCTS), "quantity": r.randint(1, 5),
                          "unit_price": round(r.uniform(2, 300), 2)})
        total = round(sum(it["quantity"] * it["unit_price"] for it in items), 2)
        return {"order_id": 10000 + i, "customer_id": r.randint(1, 5000), "status": r.choice(STATUSES),
                "items": items, "total": total, "created_at": self.timestamp()}

    def log_event(self, i: int) -> dict:
        r = self.r
        return {"timestamp": self.timestamp(), "level": r.choice(LEVELS), "service": r.choice(SERVICES),
                "event": r.choice(EVENTS), "user_id": r.randint(1, 9999), "latency_ms": r.randint(1, 2500),
                "message": r.choice(MESSAGES)}

    def api_response(self) -> dict:
        r = self.r
        n = r.randint(1, 3)
        kind = r.choice(["users", "products", "orders"])
        make = {"users": self.person, "products": self.product, "orders": self.order}[kind]
        start = r.randint(1, 900)
        return {"status": "ok", "page": r.randint(1, 20), "per_page": n, "total": r.randint(n, 5000),
                kind: [make(start + j) for j in range(n)]}

    def json_doc(self) -> str:
        r = self.r
        c = r.random()
        indent = r.choice([2, 2, 2, 4, None])
        if c < 0.25:
            obj = self.api_response()
        elif c < 0.5:
            kind = r.choice([self.person, self.product, self.order])
            start = r.randint(1, 900)
            obj = [kind(start + j) for j in range(r.randint(2, 5))]
        elif c < 0.7:
            obj = self.order(r.randint(1, 9999))
        elif c < 0.85:
            # JSON lines log
            return "\n".join(json.dumps(self.log_event(j)) for j in range(r.randint(3, 10)))
        else:
            obj = self.person(r.randint(1, 9999))
        return json.dumps(obj, indent=indent)

    def ini_doc(self) -> str:
        r = self.r
        lines = []
        for sec in r.sample(["server", "database", "logging", "cache", "auth", "paths", "worker", "metrics"],
                            r.randint(2, 4)):
            lines.append(f"[{sec}]")
            for key in r.sample(["host", "port", "timeout", "enabled", "level", "path", "user", "retries",
                                 "max_connections", "pool_size", "debug", "name"], r.randint(2, 6)):
                lines.append(f"{key} = {self.value(key)}")
            lines.append("")
        return "\n".join(lines).strip() + "\n"

    def value(self, key: str):
        r = self.r
        return {
            "host": r.choice(["localhost", "127.0.0.1", "db.internal", "0.0.0.0", "cache.local"]),
            "port": r.choice([80, 443, 5432, 6379, 8000, 8080, 9000]),
            "timeout": r.choice([5, 10, 30, 60, 120]),
            "enabled": r.choice(["true", "false"]),
            "debug": r.choice(["true", "false"]),
            "level": r.choice(LEVELS).lower(),
            "path": "/" + "/".join(r.sample(["var", "opt", "srv", "data", "log", "lib", "app"], 2)),
            "user": r.choice(FIRST),
            "retries": r.randint(0, 5),
            "max_connections": r.choice([10, 50, 100, 200]),
            "pool_size": r.choice([1, 2, 4, 8, 16]),
            "name": r.choice(WORDS) + "-" + r.choice(WORDS),
        }[key]

    def yaml_doc(self) -> str:
        r = self.r
        name = r.choice(WORDS) + "-" + r.choice(SERVICES)
        lines = [f"name: {name}", f"version: {r.randint(1, 3)}.{r.randint(0, 9)}.{r.randint(0, 20)}", "services:"]
        for svc in r.sample(SERVICES, r.randint(1, 3)):
            lines += [f"  {svc}:", f"    image: {svc}:{r.randint(1, 9)}.{r.randint(0, 9)}",
                      f"    replicas: {r.randint(1, 6)}", "    ports:",
                      f"      - \"{r.choice([80, 8080, 9000, 5000])}:{r.choice([80, 8080, 9000, 5000])}\"",
                      "    environment:", f"      LOG_LEVEL: {r.choice(LEVELS).lower()}",
                      f"      TIMEOUT: \"{r.choice([5, 10, 30])}\""]
        return "\n".join(lines) + "\n"

    def csv_doc(self) -> str:
        r = self.r
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        if r.random() < 0.5:
            w.writerow(["id", "name", "email", "city", "age"])
            for i in range(r.randint(4, 15)):
                p = self.person(i + 1)
                w.writerow([p["id"], p["name"], p["email"], p["address"]["city"], p["age"]])
        else:
            w.writerow(["sku", "name", "category", "price", "quantity"])
            for i in range(r.randint(4, 15)):
                p = self.product(i + 1)
                w.writerow([p["sku"], p["name"], p["category"], p["price"], p["quantity"]])
        return buf.getvalue()

    def markdown_doc(self) -> str:
        r = self.r
        cols = ["service", "requests", "errors", "p50 ms", "p99 ms"]
        lines = [f"## {r.choice(['Weekly', 'Daily', 'Monthly'])} report for {self.date()}", "",
                 "| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
        for svc in r.sample(SERVICES, r.randint(3, 7)):
            p50 = r.randint(2, 200)
            lines.append(f"| {svc} | {r.randint(100, 99999)} | {r.randint(0, 500)} | {p50} | {p50 * r.randint(2, 9)} |")
        return "\n".join(lines) + "\n"

    def document(self) -> str:
        c = self.r.random()
        if c < 0.6:
            return self.json_doc()
        if c < 0.7:
            return self.ini_doc()
        if c < 0.8:
            return self.yaml_doc()
        if c < 0.9:
            return self.csv_doc()
        return self.markdown_doc()


def record_documents(seed: int, max_chars: int) -> list[Document]:
    gen = RecordGen(random.Random(seed))
    docs, total, i = [], 0, 0
    while total < max_chars:
        # several records per document so the models see long structured stretches
        parts = [gen.document() for _ in range(gen.r.randint(1, 3))]
        text = "\n".join(parts)
        docs.append(Document("records", f"rec:{i}", text))
        total += len(text)
        i += 1
    return docs


# ----------------------------------------------------------------------------------------------


def build_corpus(seed: int = 0, *, code_chars: int = 9_000_000, prose_chars: int = 4_000_000,
                 record_chars: int = 7_000_000, heldout_fraction: float = 0.03,
                 packages: tuple[str, ...] = ()) -> Corpus:
    """Build the corpus; sizes are upper bounds in characters per source; ``packages``: installed packages
    whose sources join the standard library's as code and docstrings."""
    packages = tuple(packages)
    docs = code_documents(code_chars, packages) + topic_documents() + docstring_documents(prose_chars, packages)
    docs += record_documents(seed, record_chars)
    rng = random.Random(seed + 1)
    corpus = Corpus()
    for d in docs:
        (corpus.heldout if rng.random() < heldout_fraction else corpus.train).append(d)
    rng.shuffle(corpus.train)
    return corpus


COPY_MARKERS = ["\n\n# copy of the block above\n", "\n\nAgain:\n", "\n\n---\n", "\n\nRepeated:\n",
                "\n\n# duplicate\n", "\n\nSame text:\n", "\n\nOnce more:\n", "\n\n# (repeated)\n",
                "\n\nNew version:\n", "\n\n# after the change\n"]


def copy_documents(docs: list[Document], seed: int, max_chars: int) -> list[Document]:
    """Copy-heavy documents: a stretch of a training document, a marker line, then the same stretch
    again (sometimes with one word renamed everywhere). They teach in-context copying, which plain
    stdlib text rarely needs within a training window. Built after the tokenizer, so they do not
    change it."""
    import re

    rng = random.Random(seed + 7)
    pool = [d for d in docs if len(d.text) > 400]
    out, total, i = [], 0, 0
    while pool and total < max_chars:
        if out and rng.random() < 0.5:  # several copy pairs in a row: more copying per window
            prev = out.pop()
            total -= len(prev.text)
        else:
            prev = None
        d = rng.choice(pool)
        lines = d.text.splitlines(keepends=True)
        start = rng.randrange(len(lines))
        chunk = ""
        size = rng.randint(60, 400)
        for line in lines[start:]:
            chunk += line
            if len(chunk) >= size:
                break
        if len(chunk) < 80:
            continue
        again = chunk
        if rng.random() < 0.3:
            words = sorted(set(re.findall(r"\b[a-z_]{4,}\b", chunk)))
            if len(words) >= 2:
                a, b = rng.sample(words, 2)
                again = re.sub(rf"\b{a}\b", b + "_" + a[:3], chunk)
        text = chunk.rstrip("\n") + rng.choice(COPY_MARKERS) + again
        if prev is not None:
            text = prev.text.rstrip("\n") + "\n\n" + text
        out.append(Document("copy", f"copy:{i}:{d.name}", text))
        total += len(text)
        i += 1
    return out


if __name__ == "__main__":  # pragma: no cover
    import time

    t = time.time()
    c = build_corpus(0)
    print(json.dumps(c.stats(), indent=1), c.fingerprint(), f"{time.time() - t:.1f}s")
