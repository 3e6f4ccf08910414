"""The Load tab: `speclab serve` with each policy (or a server at a URL), measured from outside by `speclab load` at
rising concurrency; throughput and p95 TPOT against load, pacing strips, scraped acceptance."""

from __future__ import annotations

import time

import gradio as gr

from ...errors import SpeclabError
from .. import config, jobs, load_tab
from ..config import DEFAULT_K
from .common import Shared, error_md, gpu, lenient, one_line, run_and_stop


def build(sh: Shared) -> None:
    cfg, workloads, first_wl, policies = sh.cfg, sh.workloads, sh.first_wl, sh.policies
    custom, target_choices, draft_choices = sh.custom, sh.target_choices, sh.draft_choices
    with gr.Tab("Load", id="load"):
        gr.Markdown("Serving under load: `speclab serve` with each policy (started here, one after "
                    "another), measured from outside by `speclab load` at rising concurrency. Speculation "
                    "pays when traffic is quiet and loses once concurrency fills the forward pass; an "
                    "adaptive policy should follow the better of the two. The pacing verdict reads the "
                    "stream only: bursty (speculative), smooth (plain), or adaptive (bursty at low load, "
                    "smooth at high).")
        remote_ok = cfg.allow_remote_servers
        with gr.Row():
            with gr.Column():
                ld_server = lenient(gr.Radio([load_tab.LOAD_IN_PROCESS] + ([load_tab.LOAD_REMOTE] if remote_ok
                                                                         else []),
                                             value=load_tab.LOAD_IN_PROCESS, label="server"))
                ld_url = gr.Textbox("", label="URL (with --allow-remote-servers)", visible=remote_ok,
                                    placeholder="http://127.0.0.1:8000")
                ld_target = lenient(gr.Dropdown(target_choices, value=cfg.default_target, label="target",
                                                allow_custom_value=custom))
                ld_draft = lenient(gr.Dropdown(draft_choices, value=cfg.default_draft, label="draft",
                                               allow_custom_value=custom))
            with gr.Column():
                ld_policies = lenient(gr.CheckboxGroup(policies, value=[p for p in ("off", "fixed", "goodput")
                                                                        if p in policies],
                                                       label="policies (off = plain decoding)"))
                ld_k = lenient(gr.Slider(1, config.MAX_K, value=DEFAULT_K, step=1, label="k (largest k)"))
                ld_levels = lenient(gr.CheckboxGroup(load_tab.LOAD_LEVELS, value=[1, 4, 16],
                                                     label="concurrency levels"))
            with gr.Column():
                ld_wl = lenient(gr.Dropdown(workloads, value=first_wl, label="workload"))
                ld_reqs = lenient(gr.Slider(1, 64, value=8, step=1, label="requests per level (at least "
                                            "the concurrency)"))
                ld_max = lenient(gr.Slider(8, 256, value=48, step=8, label="max tokens"))
                ld_split = gr.Checkbox(False, label="one token per SSE chunk (the gaps alone must tell)")
        with gr.Row():
            ld_btn = gr.Button("Run the load", variant="primary", elem_id="load-run")
            ld_stop = gr.Button("Stop", variant="stop")
        ld_status = gr.Markdown("", elem_classes="speclab-status", elem_id="load-status")
        ld_chart = gr.Plot(label="throughput and p95 TPOT vs load", show_label=False, elem_id="plot-load")
        with gr.Row():
            ld_low = gr.Plot(label="pacing at low load", show_label=False, elem_id="plot-pace-low")
            ld_high = gr.Plot(label="pacing at high load", show_label=False, elem_id="plot-pace-high")
        ld_table = gr.Dataframe(label="per policy and load level", interactive=False, wrap=True)
        ld_acc = gr.Dataframe(label="acceptance scraped from /metrics over each level", interactive=False)
        load_outputs = [ld_status, ld_chart, ld_low, ld_high, ld_table, ld_acc]

        ld_gate = gr.State(jobs.StopGate)

        @gpu(600)
        def _load(server_, url_, target_, draft_, pols_, k_, levels_, wl_, reqs_, max_, split_, gate_=None,
                  progress=gr.Progress()):
            updates = _load_updates(server_, url_, target_, draft_, pols_, k_, levels_, wl_, reqs_, max_,
                                    split_, progress)
            yield from jobs.StopGate.guard(updates, gate_, tuple(gr.skip() for _ in load_outputs))

        def _load_updates(server_, url_, target_, draft_, pols_, k_, levels_, wl_, reqs_, max_, split_,
                          progress):
            skip = tuple(gr.skip() for _ in load_outputs[1:])
            try:
                s = load_tab.validate_load(cfg, server_, url_, target_, draft_, pols_, k_, levels_, wl_, reqs_,
                                           max_, split_)
            except SpeclabError as e:
                gr.Warning(str(e))
                yield (error_md(str(e)),) + skip
                return
            job = load_tab.LoadJob(cfg, s).start()
            t0 = time.perf_counter()
            try:
                while not job.wait(0.5):
                    progress(job.progress, desc=job.desc)
                    yield (f"▶ {job.desc} ({job.progress:.0%}, {time.perf_counter() - t0:.0f} s)",) + skip
            finally:
                job.cancel()
            if job.error is not None:
                msg = one_line(job.error)
                gr.Warning(msg)
                yield (error_md(msg),) + skip
                return
            if not job.results:
                yield (error_md("stopped before any level finished"),) + skip
                return
            yield load_view(job.results, time.perf_counter() - t0)

        run_and_stop(ld_btn, ld_stop, _load, [ld_server, ld_url, ld_target, ld_draft, ld_policies, ld_k,
                                              ld_levels, ld_wl, ld_reqs, ld_max, ld_split], load_outputs,
                     ld_gate, "load")


def load_view(results: dict, seconds: float):
    from ...load.charts import load_chart, pacing_strip

    table, acc = load_tab.load_tables(results)
    verdicts = "; ".join(f"{name}: **{r['verdict']['verdict']}**" for name, r in results.items())
    msg = f"✓ {len(table)} cells in {seconds:.0f} s. Pacing verdicts: {verdicts}"
    chart = load_chart(table.rename(columns={"policy": "policy"}).to_dict("records"), series="policy")
    spec = next((n for n in results if n not in ("off", "remote")), next(iter(results)))
    levels = results[spec]["levels"]

    def strip(lv):
        ok = [r for r in lv["requests"] if r.get("ok")]
        if not ok:
            return None
        rec = max(ok, key=lambda r: len(r["chunk_times"]))
        return pacing_strip(rec, title=f"{spec} at {lv['level']['label']}: {lv['fingerprint']['call']}")

    cols = ["policy", "load", "completed", "failed", "tok_s", "ttft_p50_ms", "tpot_mean_ms", "tpot_p95_ms",
            "e2e_p95_ms", "tokens_per_burst", "call", "verdict"]
    return (msg, chart, strip(levels[0]), strip(levels[-1]) if len(levels) > 1 else None,
            table[[c for c in cols if c in table.columns]].round(2), acc.round(3) if len(acc) else None)
