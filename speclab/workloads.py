"""Prompt workloads: the JSONL files in ``datasets/`` and the Spec-Bench / MT-Bench format.

Each workload line is ``{"id": ..., "category": ..., "prompt": ...}`` (held-out lines add ``"source"``: the
package and file the text was taken from). The files live in the repository's one ``datasets/`` folder; an
installed package carries the same files as ``speclab/datasets/`` (the build copies the folder there, see
``setup.py``; the source tree holds one copy).

Spec-Bench / MT-Bench ``question.jsonl`` lines are ``{"question_id", "category", "turns": [...]}``; the
first turn is the prompt. They are read from a path the user gives (:func:`load_specbench`), and
:func:`load_workload` recognises the format automatically.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from .errors import SpeclabError

PACKAGE_DATASETS = Path(__file__).resolve().parent / "datasets"  # where an install puts datasets/
REPO_DATASETS = Path(__file__).resolve().parents[1] / "datasets"
WORKLOADS = ("code", "json", "copy", "tech_prose", "creative")
# text the family never trained on (datasets/heldout_*.jsonl, built by scripts/build_heldout.py)
HELDOUT_WORKLOADS = ("heldout_json", "heldout_code", "heldout_prose")

__all__ = ["Prompt", "WORKLOADS", "HELDOUT_WORKLOADS", "datasets_dir", "list_workloads", "load_workload",
           "load_all", "load_specbench", "workload_names"]


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    prompt: str

    def to_dict(self) -> dict:
        return asdict(self)


def datasets_dir() -> Path:
    """The checkout's ``datasets/`` (next to ``pyproject.toml``), else the installed ``speclab/datasets/``."""
    if (REPO_DATASETS.parent / "pyproject.toml").is_file() and REPO_DATASETS.is_dir():
        return REPO_DATASETS
    return PACKAGE_DATASETS


def list_workloads() -> list[str]:
    """Names of the bundled workloads (file stems), the standard five first."""
    found = {p.stem for p in datasets_dir().glob("*.jsonl")}
    return [w for w in WORKLOADS if w in found] + sorted(found - set(WORKLOADS))


def workload_names(spec: str | list[str] | None) -> list[str]:
    """A command line's workload choice as names: ``"all"`` or None (every bundled workload), a
    comma list (``"code,json"``) or a list."""
    if spec is None or spec == "all":
        return list_workloads()
    if isinstance(spec, str):
        return [w.strip() for w in spec.split(",") if w.strip()]
    return list(spec)


def _display(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _read_jsonl(path: Path) -> list[tuple[int, dict]]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpeclabError(f"{_display(path)}: no such workload file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise SpeclabError(f"{_display(path)}: cannot read ({e})") from None
    rows = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpeclabError(f"{_display(path)}:{lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict):
            raise SpeclabError(f"{_display(path)}:{lineno}: expected a JSON object, got {type(obj).__name__}")
        rows.append((lineno, obj))
    return rows


def _prompt_from_row(path: Path, lineno: int, obj: dict, default_category: str) -> Prompt:
    where = f"{_display(path)}:{lineno}"
    if "turns" in obj or "question_id" in obj:  # Spec-Bench / MT-Bench
        turns = obj.get("turns")
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
            raise SpeclabError(f"{where}: 'turns' must be a non-empty list of strings")
        qid = obj.get("question_id")
        if qid is None:
            raise SpeclabError(f"{where}: missing 'question_id'")
        return Prompt(str(qid), str(obj.get("category") or default_category), turns[0])
    prompt = obj.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise SpeclabError(f"{where}: missing or empty 'prompt' (a string)")
    pid = obj.get("id")
    if pid is None or (isinstance(pid, str) and not pid):
        raise SpeclabError(f"{where}: missing 'id'")
    cat = obj.get("category", default_category)
    if not isinstance(cat, str):
        raise SpeclabError(f"{where}: 'category' must be a string")
    return Prompt(str(pid), cat, prompt)


def _resolve_path(name_or_path: str | Path) -> Path:
    p = Path(name_or_path)
    if isinstance(name_or_path, Path) or p.suffix or "/" in str(name_or_path) or p.exists():
        return p
    candidate = datasets_dir() / f"{name_or_path}.jsonl"
    if candidate.exists():
        return candidate
    known = ", ".join(list_workloads()) or "none"
    raise SpeclabError(f"unknown workload {name_or_path!r} (known: {known}; or give a path to a .jsonl file)")


def load_workload(name_or_path: str | Path) -> list[Prompt]:
    """Prompts of a bundled workload (``"code"``, ``"json"``, ...) or of a JSONL file at a path, in
    either the speclab format or the Spec-Bench / MT-Bench ``question.jsonl`` format."""
    path = _resolve_path(name_or_path)
    prompts = [_prompt_from_row(path, n, obj, path.stem) for n, obj in _read_jsonl(path)]
    if not prompts:
        raise SpeclabError(f"{_display(path)}: no prompts")
    return prompts


def load_specbench(path: str | Path) -> list[Prompt]:
    """Spec-Bench / MT-Bench ``question.jsonl`` (``question_id``, ``category``, ``turns``); the first turn
    of each question is its prompt."""
    path = Path(path)
    out = []
    for lineno, obj in _read_jsonl(path):
        if "turns" not in obj:
            raise SpeclabError(f"{_display(path)}:{lineno}: not a Spec-Bench question (no 'turns')")
        out.append(_prompt_from_row(path, lineno, obj, "specbench"))
    if not out:
        raise SpeclabError(f"{_display(path)}: no questions")
    return out


def load_all() -> dict[str, list[Prompt]]:
    """Every bundled workload, by name."""
    return {name: load_workload(name) for name in list_workloads()}
