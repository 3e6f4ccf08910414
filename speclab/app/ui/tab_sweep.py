"""The Sweep tab: workloads x drafts x k x batch, each cell against the k = 0 baseline measured in the same sweep;
charts of acceptance against throughput, speedup against k and batch, per-position acceptance, the crossover."""

from __future__ import annotations

import os
import tempfile
import time

import gradio as gr

from ... import viz
from ...errors import SpeclabError
from .. import config, jobs, sweep
from .common import Shared, error_md, gpu, lenient, one_line, run_and_stop


def build(sh: Shared) -> None:
    cfg, workloads, custom, target_choices = sh.cfg, sh.workloads, sh.custom, sh.target_choices
    draft_choices = sh.draft_choices
    with gr.Tab("Sweep", id="sweep"):
        gr.Markdown("Every cell runs the same prompts with and without speculation (the k = 0 baseline is "
                    "measured in the same sweep); speedup = tokens/s ÷ baseline tokens/s.")
        with gr.Row():
            sw_target = lenient(gr.Dropdown(target_choices, value=cfg.default_target, label="target",
                                            allow_custom_value=custom))
            sw_wl = lenient(gr.CheckboxGroup(workloads, value=workloads[:2], label="workloads",
                                            elem_id="sweep-workloads"))
            sw_drafts = lenient(gr.CheckboxGroup(
                [c for c in draft_choices if c[1] != "none"],
                value=[d for d in (cfg.default_draft, "ngram") if d != "none"][:2], label="drafts"))
        with gr.Row():
            sw_ks = lenient(gr.CheckboxGroup(sweep.SWEEP_KS, value=[2, 4, 8], label="k values"))
            sw_batches = lenient(gr.CheckboxGroup(sweep.SWEEP_BATCHES, value=[1, 4], label="batch sizes"))
        with gr.Row():
            sw_prompts = lenient(gr.Slider(1, 32, value=4, step=1, label="prompts per workload"))
            sw_max_new = lenient(gr.Slider(1, 128, value=32, step=1, label="max new tokens"))
            sw_temp = lenient(gr.Slider(0, config.MAX_TEMPERATURE, value=0.0, step=0.05, label="temperature"))
        with gr.Row():
            sw_btn = gr.Button("Run sweep", variant="primary", elem_id="sweep-run")
            sw_stop = gr.Button("Stop", variant="stop")
        sw_status = gr.Markdown("", label="status", elem_classes="speclab-status", elem_id="sweep-status")
        with gr.Row():
            p_acc = gr.Plot(label="acceptance vs throughput", show_label=False, elem_id="plot-acc")
            p_k = gr.Plot(label="speedup vs k (smallest batch size)", show_label=False, elem_id="plot-k")
        with gr.Row():
            p_batch = gr.Plot(label="speedup vs batch size", show_label=False, elem_id="plot-batch")
            p_pos = gr.Plot(label="per-position acceptance", show_label=False, elem_id="plot-pos")
        sw_table = gr.Dataframe(label="results", interactive=False, wrap=True)
        sw_cross = gr.Dataframe(label="crossover batch (smallest batch where speculation stops paying)",
                                interactive=False)
        sw_csv = gr.File(label="download the table (CSV)", interactive=False)

        sweep_inputs = [sw_target, sw_wl, sw_drafts, sw_ks, sw_batches, sw_prompts, sw_max_new, sw_temp]
        sweep_outputs = [sw_status, p_acc, p_k, p_batch, p_pos, sw_table, sw_cross, sw_csv]

        sw_gate = gr.State(jobs.StopGate)

        @gpu(600)
        def _sweep(target_, wl_, drafts_, ks_, batches_, prompts_, max_new_, temp_, gate_=None,
                   progress=gr.Progress()):
            updates = _sweep_updates(target_, wl_, drafts_, ks_, batches_, prompts_, max_new_, temp_,
                                     progress)
            yield from jobs.StopGate.guard(updates, gate_, tuple(gr.skip() for _ in sweep_outputs))

        def _sweep_updates(target_, wl_, drafts_, ks_, batches_, prompts_, max_new_, temp_, progress):
            skip = tuple(gr.skip() for _ in sweep_outputs[1:])
            try:
                s = sweep.validate_sweep(cfg, target_, wl_, drafts_, ks_, batches_, prompts_, max_new_, temp_)
            except SpeclabError as e:
                gr.Warning(str(e))
                yield (error_md(str(e)),) + skip
                return
            job = sweep.SweepJob(cfg, s).start()
            try:
                t0 = time.perf_counter()
                while not job.wait(0.5):
                    progress(job.progress, desc=job.desc)
                    yield (f"▶ {job.desc} ({job.progress:.0%}, {time.perf_counter() - t0:.0f} s)",) + skip
            finally:
                job.cancel()  # closed (Stop, page left): stop after the current cell
            if job.error is not None:
                msg = one_line(job.error)
                gr.Warning(msg)
                yield (error_md(msg),) + skip
                return
            try:
                yield sweep_view(job.df, s, time.perf_counter() - t0)
            except Exception as e:  # noqa: BLE001
                msg = one_line(e)
                yield (error_md(msg),) + skip

        run_and_stop(sw_btn, sw_stop, _sweep, sweep_inputs, sweep_outputs, sw_gate, "sweep")


def sweep_view(df, s: sweep.SweepSettings, seconds: float):
    from ...analysis.sweep import crossover_batch

    if df is None or not len(df):
        return (error_md("the sweep was cancelled before any cell finished"),) + (gr.skip(),) * 7
    table = sweep.sweep_table(df)
    cross = crossover_batch(df)
    path = os.path.join(tempfile.mkdtemp(prefix="speclab-sweep-"), "speclab_sweep.csv")
    table.to_csv(path, index=False)
    over = over_workloads(df)
    n_spec = int((df["k"] > 0).sum())
    msg = f"✓ {len(df)} cells ({n_spec} speculative, {len(df) - n_spec} baselines) in {seconds:.1f} s"
    if len(df) < s.cells:
        msg += f" (stopped early: {s.cells - len(df)} cells not run)"
    return (msg, viz.acceptance_vs_throughput(df), viz.speedup_vs_k(at_smallest_batch(df)).properties(
                title=f"batch size {int(df['batch'].min())}"),
            viz.speedup_vs_batch(over, crossover_batch(over)),
            viz.per_position_chart(df), table, cross if len(cross) else None, path)


def at_smallest_batch(df):
    """Speedup vs k at one batch size (lines over k would otherwise mix batch sizes)."""
    return df[df["batch"] == df["batch"].min()]


def over_workloads(df):
    """Speedup vs batch: the mean over the chosen workloads, one line per (draft, k)."""
    if df["workload"].nunique() <= 1:
        return df
    g = df.groupby(["draft", "k", "batch"], as_index=False).agg(speedup=("speedup", "mean"),
                                                                tokens_per_s=("tokens_per_s", "mean"))
    g["workload"] = "mean of " + ", ".join(sorted(df["workload"].unique()))
    return g
