"""One way to get a drafter from a name: what the CLI, the app, the sweeps and the server call."""

from __future__ import annotations

from ..models import check_same_tokenizer, load_model
from .lookup import PromptLookupDrafter
from .model import ModelDrafter

NONE_NAMES = ("", "none", "off", "baseline")
LOOKUP_NAMES = ("ngram", "prompt-lookup", "prompt_lookup", "pld")


def is_none(spec) -> bool:
    return spec is None or str(spec).strip().lower() in NONE_NAMES


def make_drafter(spec: str | None, target, load=load_model, **kw):
    """'none' (plain target decoding: returns None), 'ngram' (prompt lookup), or a draft model
    name / path / hub id (loaded with ``load``, e.g. a caching loader). Every drafter is fresh: drafters
    keep per-run state, so they are never shared between runs."""
    if is_none(spec):
        return None
    s = str(spec).strip()
    if s.lower() in LOOKUP_NAMES:
        return PromptLookupDrafter(**kw)
    if s.lower().startswith("synthetic"):
        from .synthetic import SyntheticDrafter

        return SyntheticDrafter.from_spec(s, target)
    draft = load(s, device=target.device, dtype=target.dtype, role="draft")
    check_same_tokenizer(target, draft)
    return ModelDrafter(draft, target.vocab_size)
