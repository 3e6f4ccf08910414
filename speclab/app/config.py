"""What the app offers and its shared checks, free of Gradio: the model choices (:class:`AppConfig`, from the
command line and the environment), the controls' ranges, the first screen's defaults (chosen by measurement:
a workload and settings where speculation pays on the embedded family on a CPU), and the checks of a model
or policy choice every tab uses.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..defaults import default_drafter
from ..errors import SpeclabError
from ..limits import truthy
from ..models.presets import find_preset, measured, preset_names

# the app's own ranges (what its controls offer); the checks themselves are speclab.limits'
MAX_K = 16
MAX_BATCH = 256  # far enough for speculation to stop paying on a 2-core CPU (see the README's crossover)
MAX_NEW_TOKENS = 256
MAX_TEMPERATURE = 2.0
MAX_SEED = 2**31 - 1
# what the first screen runs: chosen by measurement (README, "Defaults"): a workload and settings where
# speculation pays on the embedded family on a CPU
DEFAULT_WORKLOAD = "json"
DEFAULT_K = 4
DEFAULT_POLICY = "fixed"
BUILTIN_DRAFTS = ("ngram", "none")
SELF_DRAFTS = ("eagle+suffix", "eagle", "medusa", "early-exit")  # drafters from the target itself (when shipped)
DRAFT_LABELS = {"ngram": "ngram (prompt lookup, no model)", "none": "none (baseline, k = 0)",
                "eagle": "eagle (a head on the target's features)",
                "eagle+suffix": "eagle+suffix (suffix decoding where the text repeats, else the eagle head)",
                "medusa": "medusa (heads on the target)",
                "early-exit": "early-exit (the target's first layers)"}


def self_drafts() -> tuple[str, ...]:
    """The self-drafting heads shipped with the family (early exit needs no weights)."""
    try:
        from ..drafters.heads import list_heads

        have = {x for h in list_heads() for x in (h["kind"], h["name"])}
    except Exception:  # noqa: BLE001 - no heads: none offered
        have = set()
    return tuple(d for d in SELF_DRAFTS if d in have or d == "early-exit" or (d == "eagle+suffix" and "eagle" in have))


def _family() -> list[dict]:
    try:
        from ..family import list_models

        return list_models()
    except Exception:
        return []


def _family_defaults() -> tuple[str, str]:
    try:
        from ..family import DEFAULT_DRAFT, DEFAULT_TARGET

        return DEFAULT_TARGET, DEFAULT_DRAFT
    except Exception:
        return "target", "draft-distill"


@dataclass(frozen=True)
class AppConfig:
    """What the server offers. ``targets``/``drafts`` are the only model choices users get, unless
    ``allow_custom_models`` (then any local directory or hub id may be typed in)."""

    targets: tuple[str, ...]
    drafts: tuple[str, ...]  # model drafts, then "ngram", "none"
    default_target: str | None
    default_draft: str
    allow_custom_models: bool = False
    device: str | None = None
    family_present: bool = False
    allow_remote_servers: bool = False  # the Load tab may measure a server at a URL (off: only its own)

    @classmethod
    def build(cls, target: str | None = None, draft: str | None = None, extra_drafts: list[str] | None = None,
              allow_custom_models: bool = False, device: str | None = None,
              allow_remote_servers: bool = False, presets: bool = True) -> "AppConfig":
        fam = _family()
        fam_target, fam_draft = _family_defaults()
        names = [m["name"] for m in fam]
        fam_targets = [m["name"] for m in fam if m.get("role") == "target"]
        if fam_target in names and fam_target in fam_targets:
            fam_targets.remove(fam_target)
            fam_targets.insert(0, fam_target)
        order = {"distilled-draft": 0, "draft": 1, "mismatched": 3}
        fam_drafts = sorted((m for m in fam if m.get("role") != "target"),
                            key=lambda m: (order.get(m.get("role"), 2), -(m.get("parameters") or 0), m["name"]))
        fam_drafts = [m["name"] for m in fam_drafts]
        hub = preset_names() if presets else []  # curated hub pairs: offered, downloaded only when picked
        targets = ([target] if target else []) + [t for t in fam_targets + hub if t != target]
        drafts: list[str] = []
        offered = fam_drafts + (list(self_drafts()) if fam else []) + hub + list(BUILTIN_DRAFTS)
        for d in ([draft] if draft else []) + list(extra_drafts or []) + offered:
            if d and d not in drafts:
                drafts.append(d)
        if draft:
            default_draft = draft
        elif fam and default_drafter() in drafts:  # the winner on the held-out set (speclab bench heldout)
            default_draft = default_drafter()
        elif fam_draft in fam_drafts:
            default_draft = fam_draft
        else:  # never a preset: the first screen must run without a download
            default_draft = next((d for d in drafts if d not in BUILTIN_DRAFTS and d not in hub), "ngram")
        default_target = targets[0] if targets and targets[0] not in hub or target else None
        return cls(tuple(targets), tuple(drafts), default_target, default_draft,
                   allow_custom_models, device, bool(fam), allow_remote_servers)

    @classmethod
    def from_env(cls, **overrides) -> "AppConfig":
        """SPECLAB_TARGET, SPECLAB_DRAFT, SPECLAB_DRAFTS (comma list), SPECLAB_ALLOW_CUSTOM_MODELS,
        SPECLAB_DEVICE; keyword arguments (from command-line flags) win when not None."""
        env = os.environ
        kw = dict(target=env.get("SPECLAB_TARGET") or None, draft=env.get("SPECLAB_DRAFT") or None,
                  extra_drafts=[d.strip() for d in env.get("SPECLAB_DRAFTS", "").split(",") if d.strip()],
                  allow_custom_models=truthy(env.get("SPECLAB_ALLOW_CUSTOM_MODELS")),
                  allow_remote_servers=truthy(env.get("SPECLAB_ALLOW_REMOTE_SERVERS")),
                  device=env.get("SPECLAB_DEVICE") or None,
                  presets=env.get("SPECLAB_PRESETS", "1").strip().lower() not in ("0", "no", "off", "false"))
        for k, v in overrides.items():
            if v is not None and v != [] and v is not False:
                kw[k] = v
        return cls.build(**kw)

    def draft_choices(self) -> list[tuple[str, str]]:
        return [(DRAFT_LABELS.get(d, d), d) for d in self.drafts]


def check_model_choice(cfg: AppConfig, value, role: str) -> str:
    choices = cfg.targets if role == "target" else cfg.drafts
    if not isinstance(value, str) or not value.strip():
        if role == "target" and all(find_preset(c) for c in choices):
            raise SpeclabError("no target model: the embedded family is not trained yet; pick a hub preset, or "
                               "start the app with --target PATH (or set SPECLAB_TARGET)")
        raise SpeclabError(f"no {role} chosen")
    value = value.strip()
    if value in choices or (role == "draft" and value.lower() in BUILTIN_DRAFTS + SELF_DRAFTS):
        return value.lower() if value.lower() in BUILTIN_DRAFTS else value
    if cfg.allow_custom_models:
        return value
    offered = ", ".join(choices) or "none"
    raise SpeclabError(f"unknown {role} '{value}': choose one of {offered} (custom models need the app to be "
                       f"started with --allow-custom-models)")


def policy_names() -> list[str]:
    """Every draft-length policy the engine knows (``speclab.engine.policies.POLICIES``)."""
    from ..engine.policies import POLICIES

    return list(POLICIES)


def check_policy(policy) -> str:
    names = policy_names()
    if not isinstance(policy, str) or policy.strip().lower() not in names:
        raise SpeclabError(f"unknown policy {policy!r} (known: {', '.join(names)})")
    return policy.strip().lower()


def as_list(name: str, v) -> list:
    if v is None:
        return []
    if isinstance(v, (str, int, float)):
        v = [v]
    if not isinstance(v, (list, tuple)):
        raise SpeclabError(f"{name} must be a list, got {type(v).__name__}")
    return list(v)


def preset_label(name: str, role: str) -> str | None:
    """How a preset reads in a picker: its hub model and what picking it costs (a download, its size)."""
    p = find_preset(name)
    if p is None:
        return None
    hub, shape = (p.draft, p.draft_shape) if role == "draft" else (p.target, p.target_shape)
    gb = shape.parameters() * 2 / 1e9  # bf16 checkpoints: 2 bytes a parameter
    m = measured(p.name) if role != "draft" else None
    step = f"; a decode step ~{m['decode_ms']:.0f} ms, pays above {m['break_even_tokens_per_round']:.1f} tokens a " \
           f"round on a {m['measured_on'].split(',')[0]}" if m else ""
    return f"{p.name}: {hub} (hub, ~{gb:.1f} GB download on first use{step})"
