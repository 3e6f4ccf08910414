"""What the server runs: ``--speculative-config`` parsed the way vLLM reads it, and the target, drafter and
draft-length policy built from it.

``--speculative-config`` is vLLM's JSON::

    {"method": "draft_model", "model": "draft-xs-distill", "num_speculative_tokens": 4}
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    {"method": "suffix", "num_speculative_tokens": 4}   (suffix decoding, speclab.drafters.suffix_tree)
    {"method": "eagle3", "model": "eagle3", "num_speculative_tokens": 4}   (an EAGLE-3 head in the speculators
        format: the family's own "eagle3", or a directory, which vLLM reads with the same JSON)
    {"method": "synthetic", "model": "synthetic:0.8", "num_speculative_tokens": 4}   (speclab only)

``method`` may be left out: "ngram" when ``model`` is "ngram", else "draft_model". ``num_speculative_tokens``
defaults to 4 (0 = no speculation). Prompt lookup takes vLLM's defaults: neither bound given means 5 and 5,
one given means both equal it. ``none`` (or JSON ``null``) turns speculation off.

Without the flag: a model of the embedded family speculates with the family's default draft
(:func:`speclab.defaults.default_draft`) at k = 4; any other model decodes plainly (vLLM's default).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import SpeclabError
from ..limits import MAX_K, check_int

METHODS = ("draft_model", "ngram", "suffix", "synthetic", "eagle3")
KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")
DEFAULT_K = 4
OFF_WORDS = ("none", "null", "off", "")


@dataclass(frozen=True)
class SpecConfig:
    method: str | None  # None: plain decoding
    model: str | None = None  # the draft model (draft_model), or the synthetic spec
    k: int = 0  # num_speculative_tokens: the fixed k, or the largest k of an adaptive policy
    lookup_max: int = 5
    lookup_min: int = 5

    @property
    def enabled(self) -> bool:
        return self.method is not None and self.k > 0

    def to_json(self) -> dict | None:
        """vLLM's ``--speculative-config`` object for this config (None: plain decoding); parsing it gives
        this config back."""
        if not self.enabled:
            return None
        d = {"method": self.method, "num_speculative_tokens": self.k}
        if self.method == "ngram":
            d.update(prompt_lookup_max=self.lookup_max, prompt_lookup_min=self.lookup_min)
        else:
            d["model"] = self.model
        return d

    def describe(self) -> str:
        if not self.enabled:
            return "none (plain decoding)"
        if self.method == "ngram":
            return f"ngram (prompt lookup {self.lookup_min}..{self.lookup_max}), k={self.k}"
        return f"{self.method} {self.model}, k={self.k}"


OFF = SpecConfig(None)


def parse_speculative_config(text: str | None, default: SpecConfig | None = None) -> SpecConfig:
    """``text`` from the command line (None: ``default``, else no speculation). Errors are one line."""
    if text is None:
        return default or OFF
    if text.strip().lower() in OFF_WORDS:
        return OFF
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise SpeclabError(f"--speculative-config is not valid JSON ({e.msg} at character {e.pos}): {text!r}") from None
    if d is None:
        return OFF
    if not isinstance(d, dict):
        raise SpeclabError(f"--speculative-config must be a JSON object, got {text!r}")
    unknown = sorted(set(d) - set(KEYS))
    if unknown:
        raise SpeclabError(f"--speculative-config: unknown key(s) {', '.join(unknown)} (known: {', '.join(KEYS)})")
    model = d.get("model")
    if model is not None and not isinstance(model, str):
        raise SpeclabError(f"--speculative-config: 'model' must be a string, got {model!r}")
    method = d.get("method")
    if method is None:
        method = "ngram" if model in ("ngram", "[ngram]") else "draft_model"
    if method not in METHODS:
        raise SpeclabError(f"--speculative-config: unknown method {method!r} (known: {', '.join(METHODS)})")
    try:
        k = check_int("num_speculative_tokens", d.get("num_speculative_tokens", DEFAULT_K), 0, MAX_K)
        lo, hi = d.get("prompt_lookup_min"), d.get("prompt_lookup_max")
        lo = None if lo is None else check_int("prompt_lookup_min", lo, 1, 64)
        hi = None if hi is None else check_int("prompt_lookup_max", hi, 1, 64)
    except SpeclabError as e:
        raise SpeclabError(f"--speculative-config: {e}") from None
    if k == 0:
        return OFF
    if method == "ngram":
        lo, hi = (5, 5) if lo is None and hi is None else (lo or hi, hi or lo)
        if lo > hi:
            raise SpeclabError(f"--speculative-config: prompt_lookup_min ({lo}) exceeds prompt_lookup_max ({hi})")
        return SpecConfig("ngram", None, k, hi, lo)
    if method == "draft_model" and not model:
        from ..defaults import default_draft

        model = default_draft()
    if method == "suffix":  # the drafter's spec string; its knobs: "model": "suffix:depth=24:min_prob=0.1"
        model = model if model and model.startswith("suffix") else "suffix"
    if method == "synthetic":
        model = model if model and model.startswith("synthetic") else f"synthetic:{model}" if model else "synthetic"
    if method == "eagle3":
        model = _eagle3_dir(model or "eagle3")
    return SpecConfig(method, model, k)


def _eagle3_dir(model: str) -> str:
    from ..drafters.speculators import speculators_dir

    path = speculators_dir(model)
    if path is None:
        raise SpeclabError(f"--speculative-config: method 'eagle3' reads a speculators directory; {model!r} is not one")
    return str(path)


def family_default(target) -> SpecConfig:
    """The speculation a user gets without the flag: for a family model, the default drafter (the EAGLE head with
    suffix decoding, chosen on the held-out set: ``speclab bench serve --prompt-mode fresh``) at k = 4; none for
    any other model."""
    from ..defaults import default_drafter

    try:
        from .. import family

        paths = {Path(m["path"]).resolve() for m in family.list_models()}
    except Exception:  # noqa: BLE001 - no family shipped: nothing to default to
        return OFF
    if Path(target.path).resolve() not in paths:
        return OFF
    draft = default_drafter()
    if draft == "ngram":
        return SpecConfig("ngram", None, DEFAULT_K, 3, 1)
    return SpecConfig("draft_model", draft, DEFAULT_K)


def build_drafter(spec: SpecConfig, target):
    """The drafter ``spec`` names for ``target`` (None: no speculation)."""
    from ..drafters import make_drafter

    if not spec.enabled:
        return None
    if spec.method == "ngram":
        return make_drafter("ngram", target, max_ngram=spec.lookup_max, min_ngram=spec.lookup_min)
    try:
        return make_drafter(spec.model, target)
    except ImportError as e:
        raise SpeclabError(f"speculative method {spec.method!r} is not available here: {e}") from None
