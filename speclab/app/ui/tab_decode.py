"""The Decode tab: one prompt (or a batch) decoded with speculation and then without, every token's fate drawn
as it arrives, the metrics against the k = 0 baseline, each row's draft length per round, and token trees."""

from __future__ import annotations

import gradio as gr

from ... import viz
from ...errors import SpeclabError
from .. import config, decode, jobs, models
from ..config import DEFAULT_K, DEFAULT_POLICY, AppConfig
from .common import Shared, error_md, gpu, label, lenient, one_line, stop_button

ALL_ROWS = "all rows"


def clip(prompt: str, n: int = 400) -> str:
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
        parts.append(viz.tokens_html(toks, prompt=clip(prompt) if prompt else None, css=False))
    parts.append("</div>")
    return "".join(parts)


def run_status(view: decode.RunView) -> str:
    s = view.settings
    pol = f", policy {s.policy}" if s.policy != "fixed" else ""
    what = f"**{label(s.draft, 'draft')}** k={s.k}{pol}" if s.speculative else "**baseline** (no draft)"
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
    return f"✓ {what} on `{label(s.target)}`, batch {s.batch}: {n} tokens in {view.round} rounds{tail}{cancelled}"


def row_choices(batch: int) -> list[str]:
    return [ALL_ROWS] + [f"row {b}" for b in range(batch)]


def example_choices(examples: dict, workload: str | None) -> list[tuple[str, str]]:
    out = []
    for p in examples.get(workload or "", []):
        first = p.prompt.strip().splitlines()[0] if p.prompt.strip() else ""
        out.append((f"{p.id}: {first[:60]}", p.id))
    return out


def trees_of(view: dict | None, which: str) -> list[dict]:
    trees = (view or {}).get("trees") or []
    if which not in (None, ALL_ROWS):
        trees = [t for t in trees if f"row {t['row']}" == which]
    return trees


def tree_html(cfg: AppConfig, view: dict | None, which: str, i) -> str:
    """The i-th (1-based) tree round of the rows shown, drawn; a hint when the run had no trees."""
    trees = trees_of(view, which)
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


def build(sh: Shared) -> None:
    cfg, examples, workloads, first_wl = sh.cfg, sh.examples, sh.workloads, sh.first_wl
    first_prompt, policies, custom, custom_info = sh.first_prompt, sh.policies, sh.custom, sh.custom_info
    target_choices, draft_choices = sh.target_choices, sh.draft_choices
    with gr.Tab("Decode", id="decode"):
        with gr.Row():
            with gr.Column(scale=3):
                with gr.Row():
                    workload = gr.Dropdown(workloads, value=first_wl, label="examples from workload",
                                           scale=1)
                    example = gr.Dropdown(example_choices(examples, first_wl), value=None,
                                          label="example prompt", scale=2, elem_id="example")
                prompt = gr.Textbox(first_prompt, label="prompt", lines=6, max_lines=16,
                                    elem_id="prompt")
                with gr.Row():
                    run_btn = gr.Button("Run", variant="primary", elem_id="run")
                    stop_btn = gr.Button("Stop", variant="stop", elem_id="stop")
                    auto = gr.Checkbox(True, label="re-run when a control changes")
            with gr.Column(scale=2):
                with gr.Row():
                    target = lenient(gr.Dropdown(target_choices, value=cfg.default_target, label="target",
                                                 allow_custom_value=custom, info="the model whose output "
                                                 "is reproduced exactly" + custom_info))
                    draft = lenient(gr.Dropdown(draft_choices, value=cfg.default_draft, label="draft",
                                                allow_custom_value=custom, elem_id="draft",
                                                info="embedded drafts, heads on the target, ngram "
                                                "prompt lookup, or none" + custom_info))
                with gr.Row():
                    k = lenient(gr.Slider(0, config.MAX_K, value=DEFAULT_K, step=1,
                                          label="k (draft tokens per round; the largest k for an "
                                          "adaptive policy)", elem_id="k", scale=2))
                    policy = lenient(gr.Dropdown(policies, value=DEFAULT_POLICY if DEFAULT_POLICY in policies
                                                 else policies[0], label="policy",
                                                 info="how k is chosen each round", elem_id="policy",
                                                 scale=1))
                with gr.Row():
                    tree = lenient(gr.Radio(list(decode.TREE_SHAPES), value="chain", label="proposal",
                                            info="a chain of k drafts, or a token tree verified in one "
                                            "pass", elem_id="tree-shape", scale=2))
                    nodes = lenient(gr.Slider(2, decode.MAX_NODES, value=8, step=1, label="tree nodes",
                                              scale=1))
                batch = lenient(gr.Slider(1, config.MAX_BATCH, value=1, step=1, label="batch size"))
                fill = gr.Radio([decode.FILL_WORKLOAD, decode.FILL_COPIES], value=decode.FILL_WORKLOAD,
                                label="rows after the first (batch > 1)")
                with gr.Accordion("sampling", open=False):
                    temperature = lenient(gr.Slider(0, config.MAX_TEMPERATURE, value=0.0, step=0.05,
                                                    label="temperature (0 = greedy)"))
                    top_p = lenient(gr.Slider(0.05, 1.0, value=1.0, step=0.05, label="top-p"))
                    top_k = lenient(gr.Slider(0, decode.MAX_TOP_K, value=0, step=1, label="top-k (0 = off)",
                                              elem_id="top-k"))
                    max_new = lenient(gr.Slider(1, config.MAX_NEW_TOKENS, value=64, step=1,
                                                label="max new tokens"))
                    seed = lenient(gr.Number(0, label="seed", precision=0, minimum=0))
                    pace = lenient(gr.Slider(0, 500, value=0, step=10,
                                             label="pause per round (ms, to watch rounds arrive)",
                                             elem_id="pace"))
        status = gr.Markdown("", label="status", elem_classes="speclab-status", elem_id="decode-status")
        cards = gr.HTML(viz.metric_cards_html(None, None, ""), label="metrics", elem_id="cards")
        with gr.Row():
            gr.HTML(viz.TOKEN_CSS + viz.legend_html() + '<div class="speclab-rowhead">hover a token: '
                    'draft & target probability, round</div>')
            rows = gr.Dropdown(row_choices(1), value=ALL_ROWS, label="show", scale=0, min_width=160)
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
                yield (error_md(str(e)), gr.skip(), gr.skip(), {"error": str(e)}, gr.skip(), gr.skip(),
                       gr.skip(), gr.skip(), gr.skip())
                return
            which = rows_ if rows_ in row_choices(s.batch) else ALL_ROWS
            row_update = gr.update(choices=row_choices(s.batch), value=which)
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
                        trees = trees_of(d, which)
                        pick = gr.update(minimum=1, maximum=max(2, len(trees)), value=max(1, len(trees)))
                        drawn = tree_html(cfg, d, which, len(trees))
                    yield (run_status(view), viz.metric_cards_html(view.metrics, view.baseline, view.phase),
                           gr.skip() if view.phase == "baseline" else rows_html(d, which),
                           d if done else gr.skip(), d if done else gr.skip(), gr.skip(), chart, pick,
                           drawn)
            except Exception as e:  # noqa: BLE001 - one line in the page, never a traceback
                msg = one_line(e)
                gr.Warning(msg)
                yield (error_md(msg), gr.skip(), gr.skip(), {"error": msg}, gr.skip(), gr.skip(),
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
        stop_button(stop_btn, gate, status, "⏹ stopped (the tokens so far stay on the page)",
                    [run_ev, auto_ev])

        def _pick_workload(w):
            return gr.update(choices=example_choices(examples, w), value=None)

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
        tree_pick.release(lambda view, which, i: tree_html(cfg, view, which, i), [state, rows, tree_pick],
                          tree_view, api_visibility="private")
