"""The Gradio Blocks: the page's frame and its tabs, one module each (``tab_decode``, ``tab_sweep``, ``tab_timing``,
``tab_load``, ``tab_advisor``), laid out over the Gradio-free modules of :mod:`speclab.app` that hold their logic.

Every handler catches :class:`speclab.errors.SpeclabError` (and any other exception) and shows one
line in the page; the app keeps serving. Run state lives in ``gr.State`` (one per browser session),
and a run's settings are frozen into a dataclass when it starts.
"""

from __future__ import annotations

import gradio as gr

from .. import config
from ..config import DEFAULT_WORKLOAD, AppConfig
from . import tab_advisor, tab_decode, tab_load, tab_sweep, tab_timing
from .common import CSS, Shared, error_md, label, log

__all__ = ["CSS", "INTRO", "build_demo"]

INTRO = """# speclab: speculative decoding, token by token
A small **draft** proposes *k* tokens, the **target** checks them all in one forward pass and keeps the
longest prefix it agrees with, then adds one token of its own. Output is exactly what the target alone would
produce; the question is whether it comes faster."""


def workload_examples() -> dict[str, list]:
    """Every workload's example prompts, by name (none when the workloads cannot be read)."""
    try:
        from ...workloads import list_workloads, load_workload

        return {w: load_workload(w) for w in list_workloads()}
    except Exception as e:  # noqa: BLE001 - the app still works with typed prompts
        log.warning("no workloads: %s", e)
        return {}


def build_demo(cfg: AppConfig | None = None) -> gr.Blocks:
    cfg = cfg or AppConfig.from_env()
    examples = workload_examples()
    workloads = list(examples)
    # the first screen opens on a workload where speculation pays on the embedded family (JSON records)
    first_wl = DEFAULT_WORKLOAD if DEFAULT_WORKLOAD in workloads else (workloads[0] if workloads else None)
    custom = cfg.allow_custom_models
    sh = Shared(cfg=cfg, examples=examples, workloads=workloads, first_wl=first_wl,
                first_prompt=examples[first_wl][0].prompt if first_wl else "def fibonacci(n):\n",
                policies=config.policy_names(), custom=custom,
                custom_info=" · or type a local directory / hub id" if custom else "",
                target_choices=[(label(t, "target"), t) for t in cfg.targets],
                draft_choices=[(label(d, "draft"), d) for d in cfg.drafts])
    with gr.Blocks(title="speclab: speculative decoding lab", analytics_enabled=False) as demo:
        gr.Markdown(INTRO)
        if not cfg.targets:
            gr.Markdown(error_md("No target model: the embedded family is not trained yet. Start the app with "
                                 "--target PATH (or set SPECLAB_TARGET)."))
        with gr.Tabs():
            for tab in (tab_decode, tab_sweep, tab_timing, tab_load, tab_advisor):
                tab.build(sh)
    return demo
