"""Every way to draft for the family's target, each with the acceptance measured per workload: what
``speclab models`` lists.

Drafters: the separate draft models (``family.json`` "models"), the self-drafting heads trained on the
target (EAGLE, Medusa, tuned early-exit adapters: ``family.json`` "heads"), early exit with the target's own
layers, and the model-free ones (prompt lookup, suffix decoding). Any other drafter measured into the
acceptance report is listed too.

Acceptance comes from ``acceptance.json`` beside ``family.json`` (the report :mod:`speclab.analysis.report`
writes: accepted / drafted tokens at k, per workload, greedy and sampled). A drafter with no row there is
"not measured" (``None``), never a guess; ``speclab models measure`` measures those and stores them.

Reading this module needs no weights and runs no model.
"""

from __future__ import annotations

import json
from pathlib import Path

from . import FAMILY_DIR, list_models, load_manifest

ACCEPTANCE = "acceptance.json"
GREEDY = 0.0
# no weights of their own: (name = the --draft spec, role, what it is)
BUILTIN = (
    ("early-exit", "early-exit", "the target's first layers, its own final norm and LM head"),
    ("ngram", "model-free", "prompt lookup: the continuation of the last n-gram's latest earlier occurrence"),
    ("suffix", "model-free", "suffix decoding: suffix trees over the request and earlier outputs"),
)
HEAD_ROLES = {"eagle": "eagle-head", "medusa": "medusa-heads", "exit": "early-exit"}


def acceptance_path(family_dir: Path | str | None = None) -> Path:
    return Path(family_dir or FAMILY_DIR) / ACCEPTANCE


def load_acceptance(path: Path | str | None = None) -> dict:
    """An acceptance report (default: the family's; ``{"rows": []}`` when absent or unreadable)."""
    path = Path(path) if path is not None else acceptance_path()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {"rows": []}
    return data if isinstance(data, dict) and isinstance(data.get("rows"), list) else {"rows": []}


def _head_entries(family_dir) -> list[dict]:
    base = Path(family_dir or FAMILY_DIR)
    out = []
    for h in load_manifest(base).get("heads", []):
        if not isinstance(h, dict) or "name" not in h or "kind" not in h:
            continue
        path = (base / h.get("path", f"heads/{h['name']}")).resolve()
        if not ((path / "head.json").is_file() and (path / "head.safetensors").is_file()):
            continue
        spec = h["name"]
        if h["kind"] == "exit":  # an exit adapter for layer m: early exit at m, tuned
            try:
                spec = f"early-exit:{int(str(h['name']).rsplit('-', 1)[1])}:tuned"
            except (IndexError, ValueError):
                continue
        out.append({"name": spec, "role": HEAD_ROLES.get(h["kind"], h["kind"]), "parameters": h.get("parameters"),
                    "tokenizer": None, "path": str(path),
                    "about": {"eagle": "EAGLE head over the target's features",
                              "medusa": "Medusa heads, one per draft position",
                              "exit": "early exit with a trained exit adapter"}.get(h["kind"], h["kind"])})
    return out


def list_drafters(family_dir: Path | str | None = None, acceptance: Path | str | None = None) -> list[dict]:
    """One dict per drafter: name (what ``--draft`` takes), role, parameters (None: no weights of its own),
    tokenizer, path, about, and ``acceptance``: workload -> greedy acceptance rate, None where not measured
    (read from ``acceptance``, default: the family directory's report)."""
    report = load_acceptance(acceptance or acceptance_path(family_dir))
    rows = [r for r in report["rows"] if isinstance(r, dict) and r.get("temperature") == GREEDY]
    workloads = list(report.get("workloads") or dict.fromkeys(r.get("workload") for r in rows))
    out = []
    for m in list_models(family_dir):
        if m["role"] in ("draft", "distilled-draft"):
            about = "draft model" + (" distilled from the target" if m["role"] == "distilled-draft" else "")
            out.append({k: m[k] for k in ("name", "role", "parameters", "tokenizer", "path")} | {"about": about})
    out += _head_entries(family_dir)
    out += [{"name": n, "role": role, "parameters": None, "tokenizer": None, "path": None, "about": about}
            for n, role, about in BUILTIN]
    known = {d["name"] for d in out}
    for name in dict.fromkeys(r.get("drafter") for r in rows):  # measured, and not one of the above
        if isinstance(name, str) and name not in known:
            out.append({"name": name, "role": "other", "parameters": None, "tokenizer": None, "path": None,
                        "about": "measured in the acceptance report"})
    for d in out:
        d["acceptance"] = {w: next((r.get("acceptance_rate") for r in rows
                                    if r.get("drafter") == d["name"] and r.get("workload") == w), None)
                           for w in workloads}
    return out


def acceptance_conditions(path: Path | str | None = None) -> dict:
    """How the listed acceptance was measured: k, new tokens per prompt, prompts per workload, the target."""
    path = Path(path) if path is not None else acceptance_path()
    report = load_acceptance(path)
    prompts = sorted({r.get("prompts") for r in report["rows"] if isinstance(r, dict) and r.get("prompts")})
    per = f"{prompts[0]}-{prompts[-1]}" if len(prompts) > 1 else prompts[0] if prompts else None
    return {"target": report.get("target"), "k": report.get("k"), "max_new_tokens": report.get("max_new_tokens"),
            "prompts_per_workload": per, "temperature": GREEDY, "workloads": list(report.get("workloads") or []),
            "file": str(path)}


def merge_acceptance(new: dict, path: Path | str | None = None) -> dict:
    """The report at ``path`` (default: the family's) with ``new``'s rows in it (a row replaces the one of the
    same workload, drafter and temperature); k, token count and target must agree, so that every row of the
    file was measured alike."""
    old = load_acceptance(path)
    for key in ("k", "max_new_tokens", "target"):
        if old.get(key) is not None and new.get(key) != old.get(key):
            raise ValueError(f"the new rows were measured with {key} = {new.get(key)}, the file's with {old.get(key)}")
    rows = {(r["workload"], r["drafter"], r["temperature"]): r for r in old["rows"] + new["rows"]}
    merged = {**old, **{k: v for k, v in new.items() if k not in ("rows", "workloads", "drafters", "wall_seconds")}}
    merged["workloads"] = list(dict.fromkeys([*old.get("workloads", []), *new.get("workloads", [])]))
    merged["drafters"] = list(dict.fromkeys([*old.get("drafters", []), *new.get("drafters", [])]))
    merged["rows"] = list(rows.values())
    return merged
