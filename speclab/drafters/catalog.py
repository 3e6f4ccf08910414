"""Every drafter a user can name, beside the draft models: the self-drafting heads, early exit, prompt lookup,
suffix decoding and the EAGLE + suffix hybrid, each with its acceptance per workload as measured on the shipped
family (``acceptance.json`` next to this file, written by ``python -m speclab.analysis.drafter_acceptance``).
``speclab models`` prints them."""

from __future__ import annotations

import json
from pathlib import Path

ACCEPTANCE_PATH = Path(__file__).resolve().parent / "acceptance.json"

# name (a make_drafter spec), role, what it reads
BUILTIN = (
    ("ngram", "prompt lookup", "the context's last 1-3 tokens matched earlier in it"),
    ("suffix", "suffix decoding", "suffix trees over the request and earlier outputs; draft length follows the match"),
    ("suffix-match", "suffix match", "the longest earlier match of the context's suffix; draft length follows it"),
    ("eagle+suffix", "hybrid", "suffix decoding where the context repeats, the EAGLE head elsewhere"),
)
HEAD_ROLES = {"eagle": "EAGLE head", "eagle3": "EAGLE-3 head (speculators format)", "medusa": "Medusa heads",
              "exit": "early exit (tuned)"}


FAMILY_REPORT = Path(__file__).resolve().parents[1] / "family" / "acceptance.json"


def measured_acceptance(path: Path = ACCEPTANCE_PATH, fallback: Path | None = FAMILY_REPORT) -> dict:
    """{"drafters": {spec: {workload: acceptance}}, ...conditions} or {} when not measured. Without the file, the
    greedy rows of the family's own acceptance report (``fallback``: written when the family was trained, the
    draft models and prompt lookup only), under that report's conditions."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        pass
    try:
        report = json.loads(fallback.read_text(encoding="utf-8")) if fallback is not None else {}
        rows = [r for r in report["rows"] if r["temperature"] == 0.0 and r["acceptance_rate"] is not None]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    drafters: dict[str, dict[str, float]] = {}
    for r in rows:
        drafters.setdefault(r["drafter"], {})[r["workload"]] = r["acceptance_rate"]
    counts = sorted({r["prompts"] for r in rows if r.get("prompts")})
    return {"target": report.get("target"), "k": report.get("k"), "max_new_tokens": report.get("max_new_tokens"),
            "prompts_per_workload": "-".join(map(str, counts[::max(len(counts) - 1, 1)])) or "?",
            "temperature": 0.0, "command": "the family's acceptance report, speclab/family/acceptance.json",
            "drafters": drafters}


def drafter_entries(path: Path = ACCEPTANCE_PATH) -> list[dict]:
    """The drafters that are not separate draft models: name (the spec to pass as ``--draft``), role, parameters,
    tokenizer, path, and acceptance per workload (empty when not measured)."""
    from .heads import list_heads

    acc = measured_acceptance(path).get("drafters", {})
    out = []
    for h in list_heads():
        name = h["name"] if h["kind"] != "exit" else f"early-exit:{h['name'].split('-')[-1]}:tuned"
        out.append({"name": name, "role": HEAD_ROLES.get(h["kind"], h["kind"]), "parameters": h.get("parameters"),
                    "tokenizer": f"the target's ({h.get('target')})", "path": h["path"],
                    "acceptance": acc.get(name, {})})
    out.append({"name": "early-exit", "role": "early exit", "parameters": 0, "tokenizer": "the target's",
                "path": "-", "acceptance": acc.get("early-exit", {})})
    for name, role, _ in BUILTIN:
        out.append({"name": name, "role": role, "parameters": 0 if name != "eagle+suffix" else
                    next((h.get("parameters") for h in list_heads() if h["kind"] == "eagle"), 0),
                    "tokenizer": "any" if name != "eagle+suffix" else "the target's", "path": "-",
                    "acceptance": acc.get(name, {})})
    return out


def model_acceptance(name: str, path: Path = ACCEPTANCE_PATH) -> dict:
    """A draft model's measured acceptance per workload (empty when not measured)."""
    return measured_acceptance(path).get("drafters", {}).get(name, {})
