"""Real model pairs people deploy, one name each: ``--target qwen2.5-7b`` is Qwen2.5-7B-Instruct, ``--draft
qwen2.5-7b`` its draft (Qwen2.5-0.5B-Instruct); ``speclab models --presets`` lists them.

Each preset names hub ids (downloaded on first use, into the Hugging Face cache, with a progress bar), the
shapes of both models (what the step-time benchmark builds with random weights, so the app can say what a
step costs before anything is downloaded), an EAGLE-3 head in the speculators format where one is published,
and the published acceptance or speedup with its source where one exists. Nothing here is downloaded at import
or by the tests: the embedded family stays the default, and offline a preset fails in one line that names it
and that fallback.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import SpeclabError

FALLBACK = "the embedded family works offline (--target target --draft draft-distill)"


@dataclass(frozen=True)
class Shape:
    """What a checkpoint's config.json says about its size (the fields the benchmark needs)."""

    arch: str  # llama | qwen2
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied: bool = False

    def parameters(self) -> int:
        d = self.hidden // self.heads
        attn = self.hidden * d * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.ffn
        return self.layers * (attn + mlp) + self.vocab * self.hidden * (1 if self.tied else 2)


@dataclass(frozen=True)
class Preset:
    name: str
    target: str  # hub id
    draft: str  # hub id
    target_shape: Shape
    draft_shape: Shape
    head: str | None = None  # an EAGLE-3 head in the speculators format, hub id
    published: str | None = None  # what its publisher (or a third party) measured, with the conditions
    source: str | None = None  # where that number is published
    notes: tuple[str, ...] = field(default_factory=tuple)


SMOL_135M = Shape("llama", 576, 30, 9, 3, 1536, 49152, tied=True)
SMOL_360M = Shape("llama", 960, 32, 15, 5, 2560, 49152, tied=True)
SMOL_1_7B = Shape("llama", 2048, 24, 32, 32, 8192, 49152, tied=True)
QWEN_0_5B = Shape("qwen2", 896, 24, 14, 2, 4864, 151936, tied=True)
QWEN_1_5B = Shape("qwen2", 1536, 28, 12, 2, 8960, 151936, tied=True)
QWEN_7B = Shape("qwen2", 3584, 28, 28, 4, 18944, 152064)
LLAMA_1B = Shape("llama", 2048, 16, 32, 8, 8192, 128256, tied=True)
LLAMA_3B = Shape("llama", 3072, 28, 24, 8, 8192, 128256, tied=True)
LLAMA_8B = Shape("llama", 4096, 32, 32, 8, 14336, 128256)

GATED = "Meta's Llama repositories are gated: accept the licence on the hub and log in (hf auth login) first"
ROPE = ("Llama 3.x uses 'llama3' rotary scaling, so it runs on the generic backend, where EAGLE heads are refused "
        "(EAGLE drafting needs the native backend)")

PRESETS: dict[str, Preset] = {p.name: p for p in [
    Preset("smollm2-360m", "HuggingFaceTB/SmolLM2-360M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct",
           SMOL_360M, SMOL_135M),
    Preset("smollm2-1.7b", "HuggingFaceTB/SmolLM2-1.7B-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct",
           SMOL_1_7B, SMOL_135M),
    Preset("qwen2.5-1.5b", "Qwen/Qwen2.5-1.5B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct", QWEN_1_5B, QWEN_0_5B),
    Preset("qwen2.5-7b", "Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct", QWEN_7B, QWEN_0_5B,
           notes=("the 7B's LM head is padded to 152064 rows, the 0.5B's to 151936: the same tokenizer, checked by "
                  "token ids",)),
    Preset("llama-3.2-3b", "meta-llama/Llama-3.2-3B-Instruct", "meta-llama/Llama-3.2-1B-Instruct", LLAMA_3B,
           LLAMA_1B, notes=(GATED,)),
    Preset("llama-3.1-8b", "meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.2-1B-Instruct", LLAMA_8B,
           LLAMA_1B, head="nm-testing/EAGLE3-LLaMA3.1-Instruct-8B-converted",
           published=("EAGLE-3 head (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B, of which this is the speculators "
                      "conversion): mean acceptance length 2.77 on MT-bench, 3.49 on HumanEval, 3.34 on GSM8K at "
                      "temperature 1 with 7 draft tokens"),
           source="https://huggingface.co/nebius/EAGLE3-Llama-3.3-70B-Instruct (comparison table)",
           notes=(GATED, ROPE)),
]}


def preset_names() -> list[str]:
    return list(PRESETS)


def find_preset(name) -> Preset | None:
    return PRESETS.get(str(name).strip().lower()) if name else None


def resolve(spec: str, role: str) -> tuple[str, Preset] | None:
    """A preset name -> (the hub id it stands for in this role, the preset); None for anything else. As a draft, a
    preset is its draft model; as a target (or any other role), its target."""
    p = find_preset(spec)
    if p is None:
        return None
    return (p.draft if role == "draft" else p.target), p


def offline_error(p: Preset, hub_id: str, why: str) -> SpeclabError:
    return SpeclabError(f"preset '{p.name}' needs {hub_id} from the hub, which {why}; {FALLBACK}")


@functools.lru_cache(maxsize=1)
def step_times() -> dict:
    """The step times measured at each preset's real shapes before any download (preset_steps.json, written by
    ``python benchmarks/preset_step_time.py --ship``): {"measured_on", "command", "models", "pairs"}; {} without."""
    path = Path(__file__).with_name("preset_steps.json")
    return json.loads(path.read_text()) if path.is_file() else {}


def measured(name: str) -> dict | None:
    """A preset's measured step costs: decode and verify ms of its target, the round at k = 4, the tokens a round
    must emit to pay, where they were measured; None if not measured."""
    t = step_times()
    p, pair = PRESETS.get(name), t.get("pairs", {}).get(name)
    if p is None or pair is None or p.target not in t.get("models", {}):
        return None
    return {**t["models"][p.target], **pair, "measured_on": t["measured_on"], "command": t["command"]}


def rows() -> list[dict]:
    """One row per preset for ``speclab models --presets`` and the app (plain data)."""
    out = []
    for p in PRESETS.values():
        out.append({"name": p.name, "target": p.target, "draft": p.draft, "eagle3_head": p.head,
                    "target_parameters": p.target_shape.parameters(), "draft_parameters": p.draft_shape.parameters(),
                    "published": p.published, "source": p.source, "notes": list(p.notes),
                    "measured": measured(p.name)})
    return out
