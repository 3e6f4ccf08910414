"""The embedded model family: one tokenizer, a target, several drafts, trained by
:mod:`speclab.family.train` on a corpus every Python installation can rebuild.

Registry API (stable, used by the engine):

* ``FAMILY_DIR``: directory holding ``family.json`` and ``models/<name>/``;
* ``DEFAULT_TARGET`` / ``DEFAULT_DRAFT``: the names the engine uses when none is given (the default
  draft is the one that pays on a CPU: the cheapest distilled draft, chosen by ``speclab bench compare``);
* ``BEST_DRAFT``: the draft with the highest acceptance (the acceptance report's design goals use it);
* ``list_models()``: one dict per shipped model (name, role, parameters, tokenizer, path, ...);
* ``resolve(name)``: the directory of a shipped model, or ``None``.

Importing this module needs no weights; before training ``list_models()`` is empty.
"""

from __future__ import annotations

import json
from pathlib import Path

FAMILY_DIR: Path = Path(__file__).resolve().parent
MANIFEST: Path = FAMILY_DIR / "family.json"
DEFAULT_TARGET = "target"
DEFAULT_DRAFT = "draft-xs-distill"
BEST_DRAFT = "draft-distill"

__all__ = ["FAMILY_DIR", "MANIFEST", "DEFAULT_TARGET", "DEFAULT_DRAFT", "BEST_DRAFT", "list_models", "resolve",
           "load_manifest"]


def load_manifest(family_dir: Path | str | None = None) -> dict:
    """The parsed ``family.json`` (``{"models": []}`` when absent or unreadable)."""
    path = Path(family_dir) / "family.json" if family_dir is not None else MANIFEST
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {"models": []}
    if not isinstance(data, dict) or not isinstance(data.get("models"), list):
        return {"models": []}
    return data


def _is_model_dir(p: Path) -> bool:
    return (p / "config.json").is_file() and (p / "model.safetensors").is_file()


def list_models(family_dir: Path | str | None = None) -> list[dict]:
    """Shipped models whose weights are present. Each dict has at least ``name``, ``role``,
    ``parameters``, ``tokenizer`` and ``path`` (absolute, as a string); ``heldout_loss`` and
    ``tokens_seen`` are included when known."""
    base = Path(family_dir) if family_dir is not None else FAMILY_DIR
    out = []
    for entry in load_manifest(base).get("models", []):
        try:
            path = (base / entry["path"]).resolve()
        except (KeyError, TypeError):
            continue
        if not _is_model_dir(path):
            continue
        item = {
            "name": entry.get("name"),
            "role": entry.get("role"),
            "parameters": entry.get("parameters"),
            "tokenizer": entry.get("tokenizer"),
            "path": str(path),
        }
        for key in ("heldout_loss", "tokens_seen", "architecture"):
            if key in entry:
                item[key] = entry[key]
        out.append(item)
    return out


def resolve(name: str) -> Path | None:
    """Directory of the shipped model called ``name``; ``None`` if it is not a family name or its
    weights are not there (not trained yet)."""
    if not isinstance(name, str) or not name:
        return None
    for m in list_models():
        if m["name"] == name:
            return Path(m["path"])
    return None
