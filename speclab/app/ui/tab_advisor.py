"""The Advisor tab: `speclab advise` in the page: the rubric applied to measured, scraped, typed or modelled numbers,
and a verdict per workload with the flags for speclab serve, vLLM and SGLang."""

from __future__ import annotations

import gradio as gr

from ... import viz
from .. import advice, config
from .common import Shared, error_md, lenient, one_line


def build(sh: Shared) -> None:
    with gr.Tab("Advisor", id="advisor"):
        gr.Markdown("Should this deployment speculate? The rubric (decode-bound, acceptance, concurrency "
                    "vs the crossover, same tokenizer) applied to numbers, each with its source "
                    "(measured, scraped, assumed or the cost model), and a verdict per workload with the "
                    "flags for speclab serve, vLLM and SGLang. The same as `speclab advise`.")
        adv_ch = advice.advisor_choices()
        with gr.Row():
            with gr.Column():
                ad_src = gr.Radio([advice.ACCEPTANCE_SHIPPED, advice.ACCEPTANCE_TYPED, advice.ACCEPTANCE_FILES],
                                  value=advice.ACCEPTANCE_SHIPPED, label="acceptance from")
                ad_rates = gr.Textbox("json:0.8,code:0.45,creative:0.25", label="typed rates (name:rate or "
                                      "name:r1/r2/r3 per position)")
                ad_files = gr.File(label="results: speclab bench, a sweep, speclab load --json",
                                   file_count="multiple", type="filepath")
            with gr.Column():
                ad_hw = lenient(gr.Dropdown(adv_ch["hardware"], value="h100", label="hardware"))
                ad_target = lenient(gr.Dropdown(adv_ch["shapes"], value="llama-3.1-8b", label="target"))
                ad_draft = lenient(gr.Dropdown([advice.DRAFT_BY_COST] + adv_ch["shapes"],
                                               value=advice.DRAFT_BY_COST, label="draft"))
                ad_cost = lenient(gr.Slider(0.0, 0.5, value=0.05, step=0.01,
                                            label="draft step / target step (when no draft model)"))
            with gr.Column():
                ad_conc = lenient(gr.Slider(1, 256, value=8, step=1, label="expected concurrency"))
                ad_kmax = lenient(gr.Slider(1, config.MAX_K, value=8, step=1, label="largest k"))
                ad_ttft = lenient(gr.Number(0, label="measured TTFT ms (0 = model it)", minimum=0))
                ad_tpot = lenient(gr.Number(0, label="measured plain TPOT ms (0 = model it)", minimum=0))
                ad_out = lenient(gr.Number(256, label="output tokens per request", minimum=1))
        ad_btn = gr.Button("Advise", variant="primary", elem_id="advise-run")
        ad_status = gr.Markdown("", elem_classes="speclab-status", elem_id="advise-status")
        ad_verdicts = gr.Dataframe(label="verdict per workload", interactive=False, wrap=True)
        ad_chart = gr.Plot(label="predicted speedup vs load", show_label=False, elem_id="plot-advice")
        ad_rubric = gr.Dataframe(label="the rubric, row by row (each number with its source)",
                                 interactive=False, wrap=True)
        ad_notes = gr.Markdown("", elem_id="advise-notes")

        def _advise(src_, rates_, files_, hw_, target_, draft_, cost_, conc_, kmax_, ttft_, tpot_, out_):
            skip = (gr.skip(),) * 4
            try:
                s = advice.validate_advice(src_, rates_, files_, hw_, target_, draft_, cost_, conc_, kmax_,
                                           ttft_, tpot_, out_)
                a = advice.run_advice(s)
            except Exception as e:  # noqa: BLE001
                msg = one_line(e)
                gr.Warning(msg)
                return (error_md(msg),) + skip
            return advice_view(a)

        ad_btn.click(_advise, [ad_src, ad_rates, ad_files, ad_hw, ad_target, ad_draft, ad_cost, ad_conc,
                               ad_kmax, ad_ttft, ad_tpot, ad_out],
                     [ad_status, ad_verdicts, ad_chart, ad_rubric, ad_notes], api_name="advise")


def advice_view(a):
    import pandas as pd

    on = [v.workload for v in a.verdicts if v.enable]
    off = [f"{v.workload} ({v.reason})" for v in a.verdicts if not v.enable]
    status = (f"✓ at concurrency {a.concurrency} on {a.deployment['description']}: "
              + (f"**enable** on {', '.join(on)}" if on else "enable on **none**")
              + (f"; **do not enable** on {', '.join(off)}" if off else ""))
    verdicts = pd.DataFrame([dict(workload=v.workload, verdict="enable" if v.enable else "do not enable",
                                  reason=v.reason, k=v.k, policy=v.policy, pays_up_to=v.pays_up_to,
                                  speedup_at_1=round(v.speedup_at_1, 2), speedup=round(v.speedup, 2),
                                  tpot_ms=f"{v.plain_tpot_ms:.2f} -> {v.tpot_ms:.2f}",
                                  throughput=f"{v.throughput_change:+.0%}",
                                  flags=" | ".join(f"{e}: {f}" for e, f in v.flags.items()))
                             for v in a.verdicts])
    rubric = pd.DataFrame([dict(criterion=r.criterion, workload=r.workload, value=r.value, threshold=r.threshold,
                                ok={True: "pass", False: "FAIL", None: "info"}[r.ok], source=r.source)
                           for r in a.rubric])
    notes = "\n".join([f"* {n}" for n in a.notes] + ["", "**Not covered by the rubric:**"]
                      + [f"* {n}" for n in a.not_covered])
    return status, verdicts, viz.advisor_curves_chart(a.curves), rubric, notes
