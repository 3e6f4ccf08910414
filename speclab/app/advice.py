"""The Advisor tab, free of Gradio: its inputs checked and handed to :mod:`speclab.analysis.advisor`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import SpeclabError
from ..limits import check_float, check_int
from .config import MAX_K

ACCEPTANCE_SHIPPED = "the embedded family's acceptance report"
ACCEPTANCE_TYPED = "typed rates"
ACCEPTANCE_FILES = "lab or load results (JSON/CSV)"
DRAFT_BY_COST = "a draft step as a fraction of the target's"


@dataclass(frozen=True)
class AdviceSettings:
    source: str
    rates: str
    files: tuple[str, ...]
    hardware: str
    target_model: str
    draft_model: str
    draft_cost: float
    concurrency: int
    k_max: int
    ttft_ms: float | None
    tpot_ms: float | None
    output_tokens: float


def advisor_choices() -> dict:
    """What the Advisor tab offers: hardware presets, named model shapes."""
    from ..analysis.roofline import SHAPES, preset_names

    return {"hardware": preset_names(), "shapes": list(SHAPES)}


def validate_advice(source, rates, files, hardware, target_model, draft_model, draft_cost, concurrency, k_max,
                    ttft_ms=0, tpot_ms=0, output_tokens=256) -> AdviceSettings:
    ch = advisor_choices()
    if source not in (ACCEPTANCE_SHIPPED, ACCEPTANCE_TYPED, ACCEPTANCE_FILES):
        raise SpeclabError(f"unknown acceptance source {source!r}")
    if hardware not in ch["hardware"]:
        raise SpeclabError(f"unknown hardware {hardware!r} (known: {', '.join(ch['hardware'])})")
    if target_model not in ch["shapes"]:
        raise SpeclabError(f"unknown target model {target_model!r} (known: {', '.join(ch['shapes'])})")
    if draft_model != DRAFT_BY_COST and draft_model not in ch["shapes"]:
        raise SpeclabError(f"unknown draft model {draft_model!r}")
    paths = tuple(str(getattr(f, "name", f)) for f in (files or []) if f)
    if source == ACCEPTANCE_FILES and not paths:
        raise SpeclabError("upload at least one result file (speclab bench, a sweep, speclab load --json)")
    if source == ACCEPTANCE_TYPED and not (isinstance(rates, str) and rates.strip()):
        raise SpeclabError("type acceptance rates, e.g. json:0.7,code:0.35")

    def opt(name, v):
        v = check_float(name, v or 0, 0.0, 1e6)
        return v or None

    return AdviceSettings(source, rates or "", paths, hardware, target_model, draft_model,
                          check_float("draft cost", draft_cost if draft_cost is not None else 0.05, 0.0, 1.0),
                          check_int("expected concurrency", concurrency, 1, 4096), check_int("k max", k_max, 1, MAX_K),
                          opt("TTFT ms", ttft_ms), opt("TPOT ms", tpot_ms),
                          check_float("output tokens", output_tokens, 1.0, 1e6))


def run_advice(s: AdviceSettings):
    """The advisor (speclab.analysis.advisor) on the tab's inputs: an Advice (rubric rows, verdicts, notes,
    what it does not cover, speedup vs batch curves)."""
    from ..analysis.advisor import advise, make_deployment
    from ..analysis.advisor_inputs import parse_acceptance, read_inputs
    from ..family import FAMILY_DIR

    if s.source == ACCEPTANCE_SHIPPED:
        inp = read_inputs([FAMILY_DIR / "acceptance.json"])
    elif s.source == ACCEPTANCE_FILES:
        inp = read_inputs(list(s.files))
    else:
        from ..analysis.advisor import Inputs

        inp = Inputs(workloads=parse_acceptance(s.rates))
    if s.ttft_ms is not None:
        inp.ttft_ms, inp.ttft_source = s.ttft_ms, "assumed"
    if s.tpot_ms is not None:
        inp.tpot_ms, inp.tpot_source, inp.tpot_is_plain = s.tpot_ms, "assumed", True
    inp.output_tokens, inp.output_source = s.output_tokens, "assumed"
    inp.concurrency, inp.concurrency_source = s.concurrency, "assumed"
    draft = dict(draft_model=s.draft_model) if s.draft_model != DRAFT_BY_COST else dict(draft_cost=s.draft_cost)
    dep = make_deployment(s.hardware, inputs=inp, target_model=s.target_model, k_max=s.k_max,
                          concurrency=s.concurrency, **draft)
    return advise(inp, dep, s.concurrency)
