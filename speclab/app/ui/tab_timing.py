"""The Timing tab: one prompt decoded without and with speculation, interleaved; the gaps between tokens, tokens over
time and time to first token show speculation's bursts."""

from __future__ import annotations

import gradio as gr

from ... import viz
from ...analysis.bench_round import phases_chart
from ...errors import SpeclabError
from .. import config, decode, timing
from .common import Shared, error_md, gpu, lenient, one_line


def build(sh: Shared) -> None:
    cfg, first_prompt, custom, target_choices = sh.cfg, sh.first_prompt, sh.custom, sh.target_choices
    draft_choices = sh.draft_choices
    with gr.Tab("Timing", id="timing"):
        gr.Markdown("The same prompt decoded twice, without and with speculation. Speculation delivers "
                    "tokens in **bursts** (all tokens of a round arrive together, then a longer pause); "
                    "time to first token is the prefill either way.")
        with gr.Row():
            tm_prompt = gr.Textbox(first_prompt, label="prompt", lines=4, scale=3)
            with gr.Column(scale=2):
                tm_target = lenient(gr.Dropdown(target_choices, value=cfg.default_target, label="target",
                                                allow_custom_value=custom))
                tm_draft = lenient(gr.Dropdown([c for c in draft_choices if c[1] != "none"],
                                               value=cfg.default_draft if cfg.default_draft != "none"
                                               else "ngram", label="draft", allow_custom_value=custom))
                tm_k = lenient(gr.Slider(1, config.MAX_K, value=4, step=1, label="k"))
                tm_max_new = lenient(gr.Slider(1, config.MAX_NEW_TOKENS, value=64, step=1,
                                               label="max new tokens"))
        tm_btn = gr.Button("Compare timing", variant="primary", elem_id="timing-run")
        tm_status = gr.Markdown("", label="status", elem_classes="speclab-status", elem_id="timing-status")
        tm_gaps = gr.Plot(label="inter-token gaps", show_label=False, elem_id="plot-gaps")
        with gr.Row():
            tm_cum = gr.Plot(label="tokens over time", show_label=False, elem_id="plot-cum")
            tm_ttft = gr.Plot(label="time to first token", show_label=False, elem_id="plot-ttft")
        tm_table = gr.Dataframe(label="summary", interactive=False)
        tm_phases = gr.Plot(label="a round, phase by phase", show_label=False, elem_id="plot-phases")

        @gpu(120)
        def _timing(prompt_, target_, draft_, k_, max_new_):
            skip = (gr.skip(),) * 5
            try:
                s = decode.validate_decode(cfg, prompt_, target_, draft_, k_, 1, 0.0, 1.0, max_new_, 0)
                if not s.speculative:
                    raise SpeclabError("pick a draft and k >= 1 to compare against the baseline")
                r = timing.run_timing(cfg, s)
            except Exception as e:  # noqa: BLE001
                msg = one_line(e)
                gr.Warning(msg)
                return (error_md(msg),) + skip
            ttft = r["ttft"].round(3)
            sp = r["speedup"]
            slower = " — slower than plain decoding with these settings" if sp is not None and sp < 1 else ""
            n = int(ttft["repeats"].iloc[0]) if len(ttft) else 0
            msg = (f"✓ medians of {n} interleaved runs per method, after a warm-up"
                   + (f"; speedup **{sp:.2f}×**{slower}" if sp is not None else "")
                   + ". Gaps of ~0 ms are tokens that arrived in the same round as the previous one.")
            return (msg, viz.gaps_chart(r["gaps"]), viz.cumulative_tokens_chart(r["gaps"]),
                    viz.ttft_chart(r["ttft"]), ttft, phases_chart(r["phases"]))

        tm_btn.click(_timing, [tm_prompt, tm_target, tm_draft, tm_k, tm_max_new],
                     [tm_status, tm_gaps, tm_cum, tm_ttft, tm_table, tm_phases], api_name="timing",
                     concurrency_id="decode")
