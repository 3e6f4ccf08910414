"""The Gradio Blocks: Decode, Sweep and Timing tabs.

Every handler catches :class:`speclab.errors.SpeclabError` (and any other exception) and shows one
line in the page; the app keeps serving. Run state lives in ``gr.State`` (one per browser session),
and a run's settings are frozen into a dataclass when it starts.
"""

from __future__ import annotations

import html
import logging
import os
import tempfile
import time
import traceback

import gradio as gr

from .. import viz
from ..errors import SpeclabError
from . import advice, config, decode, jobs, load_tab, models, sweep, timing
from .config import DEFAULT_K, DEFAULT_POLICY, DEFAULT_WORKLOAD, AppConfig

log = logging.getLogger("speclab.app")

try:  # Hugging Face ZeroGPU: a GPU is attached while a decorated function runs
    import spaces  # type: ignore

    def gpu(duration: int = 120):
        return spaces.GPU(duration=duration)
except ImportError:  # anywhere else: a no-op
    def gpu(duration: int = 120):
        return lambda fn: fn

ALL_ROWS = "all rows"
CSS = """
.speclab-rowhead { font-size: 12px; color: #57606a; margin: 10px 0 2px 0; font-family: ui-sans-serif, system-ui; }
.speclab-rows { max-height: 640px; overflow-y: auto; }
.speclab-status { min-height: 1.5em; }
.speclab-error { color: #cf222e; font-weight: 600; }
"""
INTRO = """# speclab: speculative decoding, token by token
A small **draft** proposes *k* tokens, the **target** checks them all in one forward pass and keeps the
longest prefix it agrees with, then adds one token of its own. Output is exactly what the target alone would
produce; the question is whether it comes faster."""


# ------------------------------------------------------------------------------------ helpers
def _lenient(comp):
    """Let out-of-range or off-list values sent through the API reach the handler, which validates
    them itself and answers with a readable message (instead of Gradio's generic error)."""
    orig = comp.preprocess

    def preprocess(payload):
        try:
            return orig(payload)
        except Exception:  # noqa: BLE001 - validated by the handler
            return payload

    comp.preprocess = preprocess
    return comp


def _one_line(e: BaseException) -> str:
    if isinstance(e, SpeclabError):
        return str(e)
    log.error("unexpected error in the app:\n%s", "".join(traceback.format_exception(e)))
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"internal error ({type(e).__name__}{': ' + msg[:200] if msg else ''}); the app keeps running"


def _error_md(msg: str) -> str:
    return f'<div class="speclab-error">⚠ {html.escape(msg)}</div>'


def _clip(prompt: str, n: int = 400) -> str:
    return prompt if len(prompt) <= n else "…" + prompt[-n:]


def rows_html(view: dict | None, which: str = ALL_ROWS) -> str:
    """Every row stacked (or one row): prompt in grey, then the tokens coloured by status."""
    if not view or not view.get("tokens"):
        return viz.TOKEN_CSS + '<div class="speclab-tokens speclab-empty">Run a prompt to see its tokens here.</div>'
    parts = [viz.TOKEN_CSS, '<div class="speclab-rows">']
    reasons = view.get("finish_reasons") or []
    for b, toks in enumerate(view["tokens"]):
        if which not in (None, ALL_ROWS, f"row {b}"):
            continue
        n = sum(1 for t in toks if t["status"] != "rejected")
        rej = sum(1 for t in toks if t["status"] == "rejected")
        why = f" · {reasons[b]}" if b < len(reasons) and reasons[b] else ""
        parts.append(f'<div class="speclab-rowhead">row {b} · {n} tokens · {rej} rejected drafts{why}</div>')
        prompt = view["prompts"][b] if b < len(view.get("prompts") or []) else None
        parts.append(viz.tokens_html(toks, prompt=_clip(prompt) if prompt else None, css=False))
    parts.append("</div>")
    return "".join(parts)


def _run_and_stop(run_btn, stop_btn, fn, inputs: list, outputs: list, gate, name: str) -> None:
    """A tab's Run (one run at a time, as API ``name``) and Stop (ends it; the status, ``outputs[0]``, says so
    after the run's last update)."""
    ev = run_btn.click(fn, inputs + [gate], outputs, api_name=name, concurrency_limit=1, concurrency_id=name)
    _stop_button(stop_btn, gate, outputs[0], f"⏹ {name} stopped", [ev])


def _stop_button(stop_btn, gate, status, said: str, cancels: list) -> None:
    """Stop: cancel ``cancels``, end the run the ``gate`` guards, say ``said`` in ``status``; then say it again once
    updates the run had already sent have landed (:func:`_restate`)."""
    stop_btn.click(lambda g: _stop(g, said), gate, status, cancels=cancels, api_visibility="private").then(
        lambda g: _restate(g, said), gate, status, api_visibility="private")


def _stop(gate: jobs.StopGate, said: str) -> str:
    """Stop: end the tab's run, then say so (after its last update, never before)."""
    if gate.stop():
        return said
    return said + " (still finishing its current step)"


def _restate(gate: jobs.StopGate, said: str):
    """Say "stopped" again a moment after Stop. An update the run yielded just before Stop travels on the run's own
    stream, and the page may get it after Stop's answer, which travels on another: in CI a round's status landed
    after "stopped" and the page said "decoding" for good. Safe: the gate refuses runs for ``QUIET_S`` after a stop,
    so no new run's status can be overwritten this soon; if one is going anyway, nothing is said."""
    time.sleep(0.6 * jobs.StopGate.QUIET_S)
    return said if gate.idle else gr.skip()


def _status(view: decode.RunView) -> str:
    s = view.settings
    pol = f", policy {s.policy}" if s.policy != "fixed" else ""
    what = f"**{_label(s.draft)}** k={s.k}{pol}" if s.speculative else "**baseline** (no draft)"
    n = sum(sum(1 for t in r if t["status"] != "rejected") for r in view.tokens)
    if view.phase == "speculative":
        return f"▶ decoding with {what}: round {view.round}, {n} tokens"
    if view.phase == "baseline":
        return f"▶ {what} done ({n} tokens, {view.round} rounds); now the k = 0 baseline with the same settings…"
    sp = view.speedup
    tail = f"; speedup vs k=0: **{sp:.2f}×**" if sp is not None and s.speculative else ""
    if sp is not None and s.speculative and sp < 1.0:
        tail += (" — **slower than plain decoding** with these settings (try another draft, a smaller k, or the "
                 "adaptive policy)")
    cancelled = " (cancelled)" if view.cancelled else ""
    return f"✓ {what} on `{_label(s.target)}`, batch {s.batch}: {n} tokens in {view.round} rounds{tail}{cancelled}"


def _row_choices(batch: int) -> list[str]:
    return [ALL_ROWS] + [f"row {b}" for b in range(batch)]


def _workload_examples() -> dict[str, list]:
    try:
        from ..workloads import list_workloads, load_workload

        return {w: load_workload(w) for w in list_workloads()}
    except Exception as e:  # noqa: BLE001 - the app still works with typed prompts
        log.warning("no workloads: %s", e)
        return {}


def _example_choices(examples: dict, workload: str | None) -> list[tuple[str, str]]:
    out = []
    for p in examples.get(workload or "", []):
        first = p.prompt.strip().splitlines()[0] if p.prompt.strip() else ""
        out.append((f"{p.id}: {first[:60]}", p.id))
    return out


def _label(name: str) -> str:
    if name in config.DRAFT_LABELS:
        return config.DRAFT_LABELS[name]
    return os.path.basename(os.path.normpath(name)) if os.path.isdir(name) else name


# ------------------------------------------------------------------------------------ the Blocks
def build_demo(cfg: AppConfig | None = None) -> gr.Blocks:
    cfg = cfg or AppConfig.from_env()
    examples = _workload_examples()
    workloads = list(examples)
    # the first screen opens on a workload where speculation pays on the embedded family (JSON records)
    first_wl = DEFAULT_WORKLOAD if DEFAULT_WORKLOAD in workloads else (workloads[0] if workloads else None)
    first_prompt = examples[first_wl][0].prompt if first_wl else "def fibonacci(n):\n"
    policies = config.policy_names()
    custom = cfg.allow_custom_models
    custom_info = " · or type a local directory / hub id" if custom else ""
    target_choices = [(_label(t), t) for t in cfg.targets]
    draft_choices = [(_label(d), d) for d in cfg.drafts]

    with gr.Blocks(title="speclab: speculative decoding lab", analytics_enabled=False) as demo:
        gr.Markdown(INTRO)
        if not cfg.targets:
            gr.Markdown(_error_md("No target model: the embedded family is not trained yet. Start the app with "
                                  "--target PATH (or set SPECLAB_TARGET)."))
        with gr.Tabs():
            # ============================================================ Decode
            with gr.Tab("Decode", id="decode"):
                with gr.Row():
                    with gr.Column(scale=3):
                        with gr.Row():
                            workload = gr.Dropdown(workloads, value=first_wl, label="examples from workload",
                                                   scale=1)
                            example = gr.Dropdown(_example_choices(examples, first_wl), value=None,
                                                  label="example prompt", scale=2, elem_id="example")
                        prompt = gr.Textbox(first_prompt, label="prompt", lines=6, max_lines=16,
                                            elem_id="prompt")
                        with gr.Row():
                            run_btn = gr.Button("Run", variant="primary", elem_id="run")
                            stop_btn = gr.Button("Stop", variant="stop", elem_id="stop")
                            auto = gr.Checkbox(True, label="re-run when a control changes")
                    with gr.Column(scale=2):
                        with gr.Row():
                            target = _lenient(gr.Dropdown(target_choices, value=cfg.default_target, label="target",
                                                          allow_custom_value=custom, info="the model whose output "
                                                          "is reproduced exactly" + custom_info))
                            draft = _lenient(gr.Dropdown(draft_choices, value=cfg.default_draft, label="draft",
                                                         allow_custom_value=custom, elem_id="draft",
                                                         info="embedded drafts, heads on the target, ngram "
                                                         "prompt lookup, or none" + custom_info))
                        with gr.Row():
                            k = _lenient(gr.Slider(0, config.MAX_K, value=DEFAULT_K, step=1,
                                                   label="k (draft tokens per round; the largest k for an "
                                                   "adaptive policy)", elem_id="k", scale=2))
                            policy = _lenient(gr.Dropdown(policies, value=DEFAULT_POLICY if DEFAULT_POLICY in policies
                                                          else policies[0], label="policy",
                                                          info="how k is chosen each round", elem_id="policy",
                                                          scale=1))
                        with gr.Row():
                            tree = _lenient(gr.Radio(list(decode.TREE_SHAPES), value="chain", label="proposal",
                                                     info="a chain of k drafts, or a token tree verified in one "
                                                     "pass", elem_id="tree-shape", scale=2))
                            nodes = _lenient(gr.Slider(2, decode.MAX_NODES, value=8, step=1, label="tree nodes",
                                                       scale=1))
                        batch = _lenient(gr.Slider(1, config.MAX_BATCH, value=1, step=1, label="batch size"))
                        fill = gr.Radio([decode.FILL_WORKLOAD, decode.FILL_COPIES], value=decode.FILL_WORKLOAD,
                                        label="rows after the first (batch > 1)")
                        with gr.Accordion("sampling", open=False):
                            temperature = _lenient(gr.Slider(0, config.MAX_TEMPERATURE, value=0.0, step=0.05,
                                                             label="temperature (0 = greedy)"))
                            top_p = _lenient(gr.Slider(0.05, 1.0, value=1.0, step=0.05, label="top-p"))
                            top_k = _lenient(gr.Slider(0, decode.MAX_TOP_K, value=0, step=1, label="top-k (0 = off)",
                                                       elem_id="top-k"))
                            max_new = _lenient(gr.Slider(1, config.MAX_NEW_TOKENS, value=64, step=1,
                                                         label="max new tokens"))
                            seed = _lenient(gr.Number(0, label="seed", precision=0, minimum=0))
                            pace = _lenient(gr.Slider(0, 500, value=0, step=10,
                                                      label="pause per round (ms, to watch rounds arrive)",
                                                      elem_id="pace"))
                status = gr.Markdown("", label="status", elem_classes="speclab-status", elem_id="decode-status")
                cards = gr.HTML(viz.metric_cards_html(None, None, ""), label="metrics", elem_id="cards")
                with gr.Row():
                    gr.HTML(viz.TOKEN_CSS + viz.legend_html() + '<div class="speclab-rowhead">hover a token: '
                            'draft & target probability, round</div>')
                    rows = gr.Dropdown(_row_choices(1), value=ALL_ROWS, label="show", scale=0, min_width=160)
                tokens = gr.HTML(rows_html(None), label="tokens", elem_id="tokens")
                k_plot = gr.Plot(label="draft length per round", show_label=False, elem_id="plot-k-rounds")
                with gr.Accordion("token trees (tree proposals)", open=True):
                    tree_pick = gr.Slider(1, 2, value=1, step=1, label="tree round (of the rows shown)")
                    tree_view = gr.HTML("", elem_id="tree-view")
                with gr.Accordion("raw result (JSON, as returned by the API)", open=False):
                    result = gr.JSON(label="result")
                state = gr.State(None)
                gate = gr.State(jobs.StopGate)  # Stop waits on it, so no late round overwrites "stopped"

                decode_inputs = [prompt, target, draft, k, batch, fill, workload, temperature, top_p, max_new, seed,
                                 pace, rows, top_k, policy, tree, nodes, gate]
                decode_outputs = [status, cards, tokens, result, state, rows, k_plot, tree_pick, tree_view]

                @gpu(180)
                def _decode(prompt_, target_, draft_, k_, batch_, fill_, workload_, temp_, top_p_, max_new_,
                            seed_, pace_, rows_, top_k_=0, policy_="fixed", tree_="chain", nodes_=8, gate_=None,
                            auto_run=False):
                    updates = _decode_updates(prompt_, target_, draft_, k_, batch_, fill_, workload_, temp_, top_p_,
                                              max_new_, seed_, pace_, rows_, top_k_, policy_, tree_, nodes_, auto_run)
                    yield from jobs.StopGate.guard(updates, gate_, tuple(gr.skip() for _ in decode_outputs))

                def _decode_updates(prompt_, target_, draft_, k_, batch_, fill_, workload_, temp_, top_p_, max_new_,
                                    seed_, pace_, rows_, top_k_, policy_, tree_, nodes_, auto_run):
                    try:
                        s = decode.validate_decode(cfg, prompt_, target_, draft_, k_, batch_, temp_, top_p_,
                                                   max_new_, seed_, fill_, workload_, pace_, top_k_, policy_, tree_,
                                                   nodes_)
                    except SpeclabError as e:
                        if auto_run:  # a control moved with no valid run to redo: stay quiet
                            yield tuple(gr.skip() for _ in decode_outputs)
                            return
                        gr.Warning(str(e))
                        yield (_error_md(str(e)), gr.skip(), gr.skip(), {"error": str(e)}, gr.skip(), gr.skip(),
                               gr.skip(), gr.skip(), gr.skip())
                        return
                    which = rows_ if rows_ in _row_choices(s.batch) else ALL_ROWS
                    row_update = gr.update(choices=_row_choices(s.batch), value=which)
                    yield (f"▶ loading `{s.target}`" + (f" and `{s.draft}`" if s.speculative else "") + "…",
                           viz.metric_cards_html(None, None, "speculative"), gr.skip(), gr.skip(), gr.skip(),
                           row_update, gr.skip(), gr.skip(), gr.skip())
                    runs = decode.run_decode(cfg, s)
                    try:
                        for view in runs:
                            d = view.to_dict()
                            done = view.phase == "done"
                            chart, pick, drawn = gr.skip(), gr.skip(), gr.skip()
                            if done:
                                chart = viz.k_per_round_chart(view.rounds) if view.rounds else None
                                trees = _trees_of(d, which)
                                pick = gr.update(minimum=1, maximum=max(2, len(trees)), value=max(1, len(trees)))
                                drawn = _tree_html(cfg, d, which, len(trees))
                            yield (_status(view), viz.metric_cards_html(view.metrics, view.baseline, view.phase),
                                   gr.skip() if view.phase == "baseline" else rows_html(d, which),
                                   d if done else gr.skip(), d if done else gr.skip(), gr.skip(), chart, pick,
                                   drawn)
                    except Exception as e:  # noqa: BLE001 - one line in the page, never a traceback
                        msg = _one_line(e)
                        gr.Warning(msg)
                        yield (_error_md(msg), gr.skip(), gr.skip(), {"error": msg}, gr.skip(), gr.skip(),
                               gr.skip(), gr.skip(), gr.skip())
                    finally:
                        runs.close()  # between rounds: the decoder stops there

                def _decode_auto(*args):
                    yield from _decode(*args, auto_run=True)

                def _decode_auto_gated(*args):
                    *rest, auto_ = args
                    if not auto_:
                        yield tuple(gr.skip() for _ in decode_outputs)
                        return
                    yield from _decode_auto(*rest)

                run_ev = gr.on([run_btn.click, prompt.submit], _decode, decode_inputs, decode_outputs,
                               api_name="decode", trigger_mode="always_last", concurrency_id="decode",
                               show_progress="minimal", show_progress_on=tokens)
                auto_ev = gr.on([k.release, batch.release, temperature.release, top_p.release, max_new.release,
                                 pace.release, seed.submit, draft.input, target.input, fill.input, top_k.release,
                                 policy.input, tree.input, nodes.release],
                                _decode_auto_gated, decode_inputs + [auto], decode_outputs,
                                api_visibility="private", trigger_mode="always_last", concurrency_id="decode",
                                show_progress="minimal", show_progress_on=tokens)
                _stop_button(stop_btn, gate, status, "⏹ stopped (the tokens so far stay on the page)",
                             [run_ev, auto_ev])

                def _pick_workload(w):
                    return gr.update(choices=_example_choices(examples, w), value=None)

                def _pick_example(w, ex):
                    for p in examples.get(w or "", []):
                        if p.id == ex:
                            return p.prompt
                    return gr.skip()

                workload.input(_pick_workload, workload, example, api_visibility="private")
                ex_ev = example.input(_pick_example, [workload, example], prompt, api_visibility="private")
                ex_run = ex_ev.then(_decode_auto_gated, decode_inputs + [auto], decode_outputs,
                                    api_visibility="private", trigger_mode="always_last", concurrency_id="decode",
                                    show_progress="minimal", show_progress_on=tokens)
                stop_btn.click(None, None, None, cancels=[ex_run], api_visibility="private")

                def _show_rows(view, which):
                    return rows_html(view, which)

                rows.input(_show_rows, [state, rows], tokens, api_visibility="private")
                tree_pick.release(lambda view, which, i: _tree_html(cfg, view, which, i), [state, rows, tree_pick],
                                  tree_view, api_visibility="private")

            # ============================================================ Sweep
            with gr.Tab("Sweep", id="sweep"):
                gr.Markdown("Every cell runs the same prompts with and without speculation (the k = 0 baseline is "
                            "measured in the same sweep); speedup = tokens/s ÷ baseline tokens/s.")
                with gr.Row():
                    sw_target = _lenient(gr.Dropdown(target_choices, value=cfg.default_target, label="target",
                                                     allow_custom_value=custom))
                    sw_wl = _lenient(gr.CheckboxGroup(workloads, value=workloads[:2], label="workloads",
                                                    elem_id="sweep-workloads"))
                    sw_drafts = _lenient(gr.CheckboxGroup(
                        [c for c in draft_choices if c[1] != "none"],
                        value=[d for d in (cfg.default_draft, "ngram") if d != "none"][:2], label="drafts"))
                with gr.Row():
                    sw_ks = _lenient(gr.CheckboxGroup(sweep.SWEEP_KS, value=[2, 4, 8], label="k values"))
                    sw_batches = _lenient(gr.CheckboxGroup(sweep.SWEEP_BATCHES, value=[1, 4], label="batch sizes"))
                with gr.Row():
                    sw_prompts = _lenient(gr.Slider(1, 32, value=4, step=1, label="prompts per workload"))
                    sw_max_new = _lenient(gr.Slider(1, 128, value=32, step=1, label="max new tokens"))
                    sw_temp = _lenient(gr.Slider(0, config.MAX_TEMPERATURE, value=0.0, step=0.05, label="temperature"))
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
                        yield (_error_md(str(e)),) + skip
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
                        msg = _one_line(job.error)
                        gr.Warning(msg)
                        yield (_error_md(msg),) + skip
                        return
                    try:
                        yield _sweep_outputs(job.df, s, time.perf_counter() - t0)
                    except Exception as e:  # noqa: BLE001
                        msg = _one_line(e)
                        yield (_error_md(msg),) + skip

                _run_and_stop(sw_btn, sw_stop, _sweep, sweep_inputs, sweep_outputs, sw_gate, "sweep")

            # ============================================================ Timing
            with gr.Tab("Timing", id="timing"):
                gr.Markdown("The same prompt decoded twice, without and with speculation. Speculation delivers "
                            "tokens in **bursts** (all tokens of a round arrive together, then a longer pause); "
                            "time to first token is the prefill either way.")
                with gr.Row():
                    tm_prompt = gr.Textbox(first_prompt, label="prompt", lines=4, scale=3)
                    with gr.Column(scale=2):
                        tm_target = _lenient(gr.Dropdown(target_choices, value=cfg.default_target, label="target",
                                                         allow_custom_value=custom))
                        tm_draft = _lenient(gr.Dropdown([c for c in draft_choices if c[1] != "none"],
                                                        value=cfg.default_draft if cfg.default_draft != "none"
                                                        else "ngram", label="draft", allow_custom_value=custom))
                        tm_k = _lenient(gr.Slider(1, config.MAX_K, value=4, step=1, label="k"))
                        tm_max_new = _lenient(gr.Slider(1, config.MAX_NEW_TOKENS, value=64, step=1,
                                                        label="max new tokens"))
                tm_btn = gr.Button("Compare timing", variant="primary", elem_id="timing-run")
                tm_status = gr.Markdown("", label="status", elem_classes="speclab-status", elem_id="timing-status")
                tm_gaps = gr.Plot(label="inter-token gaps", show_label=False, elem_id="plot-gaps")
                with gr.Row():
                    tm_cum = gr.Plot(label="tokens over time", show_label=False, elem_id="plot-cum")
                    tm_ttft = gr.Plot(label="time to first token", show_label=False, elem_id="plot-ttft")
                tm_table = gr.Dataframe(label="summary", interactive=False)

                @gpu(120)
                def _timing(prompt_, target_, draft_, k_, max_new_):
                    skip = (gr.skip(),) * 4
                    try:
                        s = decode.validate_decode(cfg, prompt_, target_, draft_, k_, 1, 0.0, 1.0, max_new_, 0)
                        if not s.speculative:
                            raise SpeclabError("pick a draft and k >= 1 to compare against the baseline")
                        r = timing.run_timing(cfg, s)
                    except Exception as e:  # noqa: BLE001
                        msg = _one_line(e)
                        gr.Warning(msg)
                        return (_error_md(msg),) + skip
                    ttft = r["ttft"].round(3)
                    sp = r["speedup"]
                    slower = " — slower than plain decoding with these settings" if sp is not None and sp < 1 else ""
                    n = int(ttft["repeats"].iloc[0]) if len(ttft) else 0
                    msg = (f"✓ medians of {n} interleaved runs per method, after a warm-up"
                           + (f"; speedup **{sp:.2f}×**{slower}" if sp is not None else "")
                           + ". Gaps of ~0 ms are tokens that arrived in the same round as the previous one.")
                    return (msg, viz.gaps_chart(r["gaps"]), viz.cumulative_tokens_chart(r["gaps"]),
                            viz.ttft_chart(r["ttft"]), ttft)

                tm_btn.click(_timing, [tm_prompt, tm_target, tm_draft, tm_k, tm_max_new],
                             [tm_status, tm_gaps, tm_cum, tm_ttft, tm_table], api_name="timing",
                             concurrency_id="decode")

            # ============================================================ Load
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
                        ld_server = _lenient(gr.Radio([load_tab.LOAD_IN_PROCESS] + ([load_tab.LOAD_REMOTE] if remote_ok
                                                                                 else []),
                                                      value=load_tab.LOAD_IN_PROCESS, label="server"))
                        ld_url = gr.Textbox("", label="URL (with --allow-remote-servers)", visible=remote_ok,
                                            placeholder="http://127.0.0.1:8000")
                        ld_target = _lenient(gr.Dropdown(target_choices, value=cfg.default_target, label="target",
                                                         allow_custom_value=custom))
                        ld_draft = _lenient(gr.Dropdown(draft_choices, value=cfg.default_draft, label="draft",
                                                        allow_custom_value=custom))
                    with gr.Column():
                        ld_policies = _lenient(gr.CheckboxGroup(policies, value=[p for p in ("off", "fixed", "goodput")
                                                                                 if p in policies],
                                                                label="policies (off = plain decoding)"))
                        ld_k = _lenient(gr.Slider(1, config.MAX_K, value=DEFAULT_K, step=1, label="k (largest k)"))
                        ld_levels = _lenient(gr.CheckboxGroup(load_tab.LOAD_LEVELS, value=[1, 4, 16],
                                                              label="concurrency levels"))
                    with gr.Column():
                        ld_wl = _lenient(gr.Dropdown(workloads, value=first_wl, label="workload"))
                        ld_reqs = _lenient(gr.Slider(1, 64, value=8, step=1, label="requests per level (at least "
                                                     "the concurrency)"))
                        ld_max = _lenient(gr.Slider(8, 256, value=48, step=8, label="max tokens"))
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
                        yield (_error_md(str(e)),) + skip
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
                        msg = _one_line(job.error)
                        gr.Warning(msg)
                        yield (_error_md(msg),) + skip
                        return
                    if not job.results:
                        yield (_error_md("stopped before any level finished"),) + skip
                        return
                    yield _load_outputs(job.results, time.perf_counter() - t0)

                _run_and_stop(ld_btn, ld_stop, _load, [ld_server, ld_url, ld_target, ld_draft, ld_policies, ld_k,
                                                       ld_levels, ld_wl, ld_reqs, ld_max, ld_split], load_outputs,
                              ld_gate, "load")

            # ============================================================ Advisor
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
                        ad_files = gr.File(label="results: speclab bench --json, a sweep, speclab load --json",
                                           file_count="multiple", type="filepath")
                    with gr.Column():
                        ad_hw = _lenient(gr.Dropdown(adv_ch["hardware"], value="h100", label="hardware"))
                        ad_target = _lenient(gr.Dropdown(adv_ch["shapes"], value="llama-3.1-8b", label="target"))
                        ad_draft = _lenient(gr.Dropdown([advice.DRAFT_BY_COST] + adv_ch["shapes"],
                                                        value=advice.DRAFT_BY_COST, label="draft"))
                        ad_cost = _lenient(gr.Slider(0.0, 0.5, value=0.05, step=0.01,
                                                     label="draft step / target step (when no draft model)"))
                    with gr.Column():
                        ad_conc = _lenient(gr.Slider(1, 256, value=8, step=1, label="expected concurrency"))
                        ad_kmax = _lenient(gr.Slider(1, config.MAX_K, value=8, step=1, label="largest k"))
                        ad_ttft = _lenient(gr.Number(0, label="measured TTFT ms (0 = model it)", minimum=0))
                        ad_tpot = _lenient(gr.Number(0, label="measured plain TPOT ms (0 = model it)", minimum=0))
                        ad_out = _lenient(gr.Number(256, label="output tokens per request", minimum=1))
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
                        msg = _one_line(e)
                        gr.Warning(msg)
                        return (_error_md(msg),) + skip
                    return _advice_outputs(a)

                ad_btn.click(_advise, [ad_src, ad_rates, ad_files, ad_hw, ad_target, ad_draft, ad_cost, ad_conc,
                                       ad_kmax, ad_ttft, ad_tpot, ad_out],
                             [ad_status, ad_verdicts, ad_chart, ad_rubric, ad_notes], api_name="advise")
    return demo


def _sweep_outputs(df, s: sweep.SweepSettings, seconds: float):
    from ..analysis.sweep import crossover_batch

    if df is None or not len(df):
        return (_error_md("the sweep was cancelled before any cell finished"),) + (gr.skip(),) * 7
    table = sweep.sweep_table(df)
    cross = crossover_batch(df)
    path = os.path.join(tempfile.mkdtemp(prefix="speclab-sweep-"), "speclab_sweep.csv")
    table.to_csv(path, index=False)
    over = _over_workloads(df)
    n_spec = int((df["k"] > 0).sum())
    msg = f"✓ {len(df)} cells ({n_spec} speculative, {len(df) - n_spec} baselines) in {seconds:.1f} s"
    if len(df) < s.cells:
        msg += f" (stopped early: {s.cells - len(df)} cells not run)"
    return (msg, viz.acceptance_vs_throughput(df), viz.speedup_vs_k(_at_smallest_batch(df)).properties(
                title=f"batch size {int(df['batch'].min())}"),
            viz.speedup_vs_batch(over, crossover_batch(over)),
            viz.per_position_chart(df), table, cross if len(cross) else None, path)


def _at_smallest_batch(df):
    """Speedup vs k at one batch size (lines over k would otherwise mix batch sizes)."""
    return df[df["batch"] == df["batch"].min()]


def _over_workloads(df):
    """Speedup vs batch: the mean over the chosen workloads, one line per (draft, k)."""
    if df["workload"].nunique() <= 1:
        return df
    g = df.groupby(["draft", "k", "batch"], as_index=False).agg(speedup=("speedup", "mean"),
                                                                 tokens_per_s=("tokens_per_s", "mean"))
    g["workload"] = "mean of " + ", ".join(sorted(df["workload"].unique()))
    return g


def _advice_outputs(a):
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


def _load_outputs(results: dict, seconds: float):
    from ..load.charts import load_chart, pacing_strip

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


def _trees_of(view: dict | None, which: str) -> list[dict]:
    trees = (view or {}).get("trees") or []
    if which not in (None, ALL_ROWS):
        trees = [t for t in trees if f"row {t['row']}" == which]
    return trees


def _tree_html(cfg: AppConfig, view: dict | None, which: str, i) -> str:
    """The i-th (1-based) tree round of the rows shown, drawn; a hint when the run had no trees."""
    trees = _trees_of(view, which)
    if not trees:
        return ('<div class="speclab-rowhead">No token trees in this run: pick a tree proposal (static or '
                'dynamic) to draw one.</div>')
    t = trees[min(max(int(i or 1), 1), len(trees)) - 1]
    try:
        lm = models.get_target(cfg, view["settings"]["target"])
    except Exception:  # noqa: BLE001 - labels fall back to ids
        lm = None
    text = lm.token_text if lm is not None else (lambda tok: str(tok))
    tr = t["tree"]
    n_acc = len(tr.get("path") or [])
    head = (f'<div class="speclab-rowhead">round {t["round"]}, row {t["row"]}: {len(tr["tokens"])} nodes, '
            f'{n_acc} accepted (green path), then the target\'s {tr.get("next_status") or "token"}; hover a node '
            f'for its probabilities</div>')
    return head + viz.tree_svg(tr, text)
