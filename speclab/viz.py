"""What the app and the notebooks show: token HTML, metric cards and Altair charts.

One module for both, built only from engine output (token dicts, metrics, sweep DataFrames);
nothing here decodes.
"""

from __future__ import annotations

import html

COLOURS = {"accepted": "#1a7f37", "rejected": "#cf222e", "recovered": "#d4760a", "bonus": "#0969da",
           "target": "#57606a"}

TOKEN_CSS = """
<style>
.speclab-tokens { font-family: ui-monospace, SFMono-Regular, Menlo, monospace; white-space: pre-wrap;
  line-height: 1.7; font-size: 14px; padding: 8px; border-radius: 6px; background: #fafbfc; color: #24292f; }
.speclab-tokens .prompt { color: #8c959f; }
.speclab-tokens .tok { border-radius: 3px; padding: 0 1px; margin: 0 0.5px; }
.speclab-tokens .tok-accepted { background: #dafbe1; color: #1a7f37; }
.speclab-tokens .tok-rejected { background: #ffebe9; color: #cf222e; text-decoration: line-through; }
.speclab-tokens .tok-recovered { background: #fff1e5; color: #bc4c00; }
.speclab-tokens .tok-bonus { background: #ddf4ff; color: #0969da; }
.speclab-tokens .tok-target { color: #24292f; }
.speclab-legend span { margin-right: 10px; font-size: 13px; }
.speclab-cards { display: flex; flex-wrap: wrap; gap: 8px; }
.speclab-card { border: 1px solid #d0d7de; border-radius: 8px; padding: 8px 12px; min-width: 110px; background: #fff; }
.speclab-card .v { font-size: 20px; font-weight: 600; color: #24292f; }
.speclab-card .l { font-size: 12px; color: #57606a; }
.speclab-card.speedup .v { color: #0969da; }
.speclab-card.slower .v { color: #cf222e; }
</style>
"""


def _fmt(p) -> str:
    return "–" if p is None else f"{p:.3f}"


def token_span(t: dict) -> str:
    title = (f"{t['status']} · round {t['round']} · draft p={_fmt(t.get('draft_prob'))} · "
             f"target p={_fmt(t.get('target_prob'))} · id {t['token']}")
    return (f'<span class="tok tok-{t["status"]}" data-status="{t["status"]}" title="{html.escape(title)}">'
            f'{html.escape(t["text"])}</span>')


def legend_html() -> str:
    items = "".join(f'<span class="tok tok-{s}">■ {s}</span>' for s in COLOURS)
    return f'<div class="speclab-tokens speclab-legend">{items}</div>'


def tokens_html(tokens: list[dict], prompt: str | None = None, css: bool = True) -> str:
    """A row's tokens as coloured spans; hovering shows status, round and both probabilities."""
    body = "".join(token_span(t) for t in tokens)
    pre = f'<span class="prompt">{html.escape(prompt)}</span>' if prompt else ""
    return (TOKEN_CSS if css else "") + f'<div class="speclab-tokens">{pre}{body}</div>'


def metric_cards_html(m: dict | None, baseline: dict | None = None, phase: str = "") -> str:
    """Metric cards; with a baseline, the speedup vs k = 0 (and a warning when speculation is slower).
    ``phase`` "speculative" / "baseline" shows the speedup card as pending while the runs go on."""
    from .metrics import speedup

    def f(x, spec):
        return "–" if x is None else format(x, spec)

    m = m or {}
    cards = [
        ("acceptance rate", f(m.get("acceptance_rate"), ".2f"), ""),
        ("mean accepted length", f(m.get("mean_accepted_length"), ".2f"), ""),
        ("tokens/s", f(m.get("tokens_per_s"), ".1f"), ""),
        ("TTFT ms", f(m.get("ttft_ms"), ".1f"), ""),
        ("TPOT ms", f(m.get("tpot_ms"), ".2f"), ""),
    ]
    if baseline is not None:
        sp = speedup(m, baseline)
        cards.append(("baseline tokens/s (k=0)", f(baseline.get("tokens_per_s"), ".1f"), ""))
        if sp is not None and sp < 1.0:
            cards.append(("speedup vs k=0: slower than plain decoding", f"{sp:.2f}×", "speedup slower"))
        else:
            cards.append(("speedup vs k=0", f(sp, ".2f") + ("×" if sp is not None else ""), "speedup"))
    elif phase in ("speculative", "baseline"):
        cards.append(("speedup vs k=0", "measuring…" if phase == "baseline" else "after the run", "speedup"))
    inner = "".join(f'<div class="speclab-card {c}"><div class="v">{v}</div><div class="l">{lab}</div></div>'
                    for lab, v, c in cards)
    return TOKEN_CSS + f'<div class="speclab-cards">{inner}</div>'


# ------------------------------------------------------------------------------------- charts
def acceptance_vs_throughput(df):
    import altair as alt

    d = df[df["k"] > 0]
    return alt.Chart(d).mark_circle(size=90).encode(
        x=alt.X("acceptance_rate:Q", title="acceptance rate", scale=alt.Scale(domain=[0, 1])),
        y=alt.Y("tokens_per_s:Q", title="tokens/s"),
        color=alt.Color("draft:N"),
        shape=alt.Shape("k:O"),
        tooltip=["workload", "draft", "k", "batch", alt.Tooltip("acceptance_rate:Q", format=".2f"),
                 alt.Tooltip("tokens_per_s:Q", format=".1f"), alt.Tooltip("speedup:Q", format=".2f")],
    ).properties(width=220, height=180, title="acceptance vs throughput").facet(column="workload:N")


def speedup_vs_k(df):
    import altair as alt

    d = df[df["draft"] != "none"]
    lines = alt.Chart().mark_line(point=True).encode(
        x=alt.X("k:Q", title="draft length k"), y=alt.Y("speedup:Q", title="speedup vs k=0"), color="draft:N",
        tooltip=["workload", "draft", "k", "batch", alt.Tooltip("speedup:Q", format=".2f")])
    one = alt.Chart().mark_rule(strokeDash=[4, 4], color="gray").encode(y=alt.datum(1.0))
    return alt.layer(lines, one, data=d).properties(width=220, height=180, title="speedup vs k").facet(
        column="workload:N")


def speedup_vs_batch(df, crossover=None):
    """Speedup against batch size, one line per (draft, k); a red cross marks each line's crossover
    (the first batch size where speculation stops paying, as from ``sweep.crossover_batch``)."""
    import altair as alt

    d = df[df["k"] > 0].copy()
    d["series"] = d["draft"] + " k=" + d["k"].astype(str)
    batches = sorted(int(b) for b in d["batch"].unique())
    x = alt.X("batch:Q", title="batch size", scale=alt.Scale(type="log", base=2),
              axis=alt.Axis(values=batches, format="d"))
    y = alt.Y("speedup:Q", title="speedup vs k=0")
    tip = ["workload", "draft", "k", "batch", alt.Tooltip("speedup:Q", format=".2f")]
    layers = [alt.Chart(d).mark_line(point=True).encode(x=x, y=y, color=alt.Color("series:N", title="draft, k"),
                                                        tooltip=tip),
              alt.Chart(d).mark_rule(strokeDash=[4, 4], color="gray").encode(y=alt.datum(1.0))]
    if crossover is not None and len(crossover) and crossover["crossover_batch"].notna().any():
        keys = [c for c in ("workload", "draft", "k") if c in crossover.columns]
        cx = crossover.dropna(subset=["crossover_batch"]).merge(
            d, left_on=keys + ["crossover_batch"], right_on=keys + ["batch"], suffixes=("_c", ""))
        layers.append(alt.Chart(cx).mark_point(shape="cross", size=160, color="#cf222e", filled=True).encode(
            x=x, y=y, tooltip=["draft", "k", alt.Tooltip("batch:Q", title="crossover batch"),
                               alt.Tooltip("speedup:Q", format=".2f")]))
    sub = "red ✕: first batch where speculation stops paying"
    if df["workload"].nunique() == 1:
        sub = f"{df['workload'].iloc[0]}; {sub}"
    return alt.layer(*layers).properties(width=300, height=200,
                                         title=alt.TitleParams("speedup vs batch size", subtitle=sub))


def per_position_chart(df):
    import altair as alt
    import pandas as pd

    recs = []
    for _, r in df[df["k"] > 0].iterrows():
        for i, a in enumerate(r["per_position_acceptance"] or []):
            recs.append(dict(workload=r["workload"], draft=r["draft"], k=r["k"], batch=r["batch"], position=i + 1,
                             acceptance=a))
    d = pd.DataFrame(recs, columns=["workload", "draft", "k", "batch", "position", "acceptance"])
    return alt.Chart(d).mark_line(point=True).encode(
        x=alt.X("position:O", title="draft position"),
        y=alt.Y("mean(acceptance):Q", title="P(accepted | verified)", scale=alt.Scale(domain=[0, 1])),
        color="draft:N", strokeDash="workload:N",
        tooltip=["workload", "draft", "position", alt.Tooltip("mean(acceptance):Q", format=".2f")],
    ).properties(width=300, height=200, title="per-position acceptance")


def gaps_chart(gaps_df):
    """Inter-token gaps over time, one series per method (baseline vs speculative)."""
    import altair as alt

    return alt.Chart(gaps_df).mark_bar(size=3).encode(
        x=alt.X("t_ms:Q", title="time since request (ms)"),
        y=alt.Y("gap_ms:Q", title="gap before token (ms)"),
        color=alt.Color("method:N"),
        row=alt.Row("method:N", title=None),
        tooltip=["method", "index", alt.Tooltip("gap_ms:Q", format=".2f"), alt.Tooltip("t_ms:Q", format=".1f")],
    ).properties(width=520, height=110, title="inter-token gaps: speculation arrives in bursts")


def ttft_chart(df):
    """df: method, ttft_ms, tpot_ms."""
    import altair as alt

    return alt.Chart(df).mark_bar().encode(
        x=alt.X("ttft_ms:Q", title="TTFT (ms)"), y=alt.Y("method:N", title=None), color="method:N",
        tooltip=["method", alt.Tooltip("ttft_ms:Q", format=".1f"), alt.Tooltip("tpot_ms:Q", format=".2f")],
    ).properties(width=400, height=80, title="time to first token (prefill is unchanged by speculation)")


# =============================================================================================
# Notebooks: offline chart rendering and the charts of notebooks 03 and 04.


def enable_offline_altair(renderer: str = "svg") -> str:
    """Make Altair charts render with no internet.

    Altair's default Jupyter renderer emits HTML that loads vega / vega-lite / vega-embed from a
    CDN, so on an offline machine JupyterLab shows an empty box. ``"svg"`` (default) and ``"png"``
    render the chart to a static image in the kernel with vl-convert-python (Vega bundled in a Rust
    library, no network, no browser), so the output is an ``image/svg+xml`` / ``image/png`` that
    JupyterLab, nbviewer, GitHub and nbconvert all show. Tooltips and zoom are lost. ``"jupyter"``
    (interactive, offline bundle) needs the ``anywidget`` package, not a speclab dependency.
    Returns the renderer name enabled.
    """
    import altair as alt

    if renderer == "jupyter":
        alt.renderers.enable("jupyter", offline=True)
        return renderer
    if renderer not in ("svg", "png"):
        raise ValueError(f"offline renderer must be 'svg', 'png' or 'jupyter', got {renderer!r}")
    try:
        import vl_convert  # noqa: F401
    except ImportError as e:  # pragma: no cover - a declared dependency of the notebooks extra
        raise ImportError("offline Altair charts need vl-convert-python: pip install 'speclab[notebooks]'") from e
    alt.renderers.enable(renderer)
    return renderer


def policy_throughput_chart(df):
    """df: batch, policy (e.g. 'always on', 'off under load', 'never'), tokens_per_s."""
    import altair as alt

    return alt.Chart(df).mark_line(point=True).encode(
        x=alt.X("batch:Q", title="batch size", scale=alt.Scale(type="log", base=2)),
        y=alt.Y("tokens_per_s:Q", title="tokens/s (all rows)"),
        color=alt.Color("policy:N", title="policy"),
        strokeDash=alt.StrokeDash("policy:N", title="policy"),
        tooltip=["policy", "batch", "k", alt.Tooltip("tokens_per_s:Q", format=".1f")],
    ).properties(width=360, height=220, title="throughput under load: always speculate vs turn it off")


def cost_model_chart(df):
    """df: k, speedup, kind ('measured' | 'predicted (...)'), optionally draft/workload columns.
    Predicted curves as lines, measurements as points; dashed rule at speedup 1."""
    import altair as alt

    base = alt.Chart(df).encode(
        x=alt.X("k:Q", title="draft length k"),
        y=alt.Y("speedup:Q", title="speedup vs k=0"),
        color=alt.Color("kind:N", title=None),
        tooltip=[c for c in ("draft", "workload", "kind", "k") if c in df.columns]
        + [alt.Tooltip("speedup:Q", format=".2f")],
    )
    pred = base.transform_filter(alt.datum.kind != "measured").mark_line(point=False)
    meas = base.transform_filter(alt.datum.kind == "measured").mark_point(size=80, filled=True)
    one = alt.Chart(df).mark_rule(strokeDash=[4, 4], color="gray").encode(y=alt.datum(1.0))
    chart = alt.layer(pred, meas, one).properties(width=240, height=190)
    if "draft" in df.columns and df["draft"].nunique() > 1:
        chart = chart.facet(column="draft:N")
    return chart.properties(title="cost model vs measurement")


def cumulative_tokens_chart(gaps_df):
    """Tokens delivered over time (row 0), one step line per method: speculation climbs in steps."""
    import altair as alt

    d = gaps_df
    if "row" in d:
        d = d[d["row"] == 0]
    d = d.assign(tokens=d["index"] + 1)
    return alt.Chart(d).mark_line(interpolate="step-after", point=True).encode(
        x=alt.X("t_ms:Q", title="time since request (ms)"),
        y=alt.Y("tokens:Q", title="tokens delivered"),
        color=alt.Color("method:N"),
        tooltip=["method", "tokens", alt.Tooltip("t_ms:Q", format=".1f")],
    ).properties(width=360, height=200, title="tokens over time")


def k_per_round_chart(rounds):
    """Each row's draft length per round (records or a DataFrame with round, row, k, k_reason): what an
    adaptive policy decided, and why (tooltip)."""
    import altair as alt
    import pandas as pd

    d = pd.DataFrame(rounds)
    if not len(d):
        d = pd.DataFrame(columns=["round", "row", "k", "k_reason", "drafted", "accepted"])
    d["row"] = d["row"].astype(str)
    return alt.Chart(d).mark_line(point=True, interpolate="step-after").encode(
        x=alt.X("round:Q", title="round"),
        y=alt.Y("k:Q", title="draft length k"),
        color=alt.Color("row:N", title="row"),
        tooltip=["round", "row", "k", "k_reason", "drafted", "accepted"],
    ).properties(width=520, height=160, title="draft length chosen per round and row")


def advisor_curves_chart(curves: dict):
    """The advisor's predicted speedup against batch per workload (``Advice.curves``), best k per batch."""
    import altair as alt
    import pandas as pd

    recs = [dict(workload=w, **r) for w, rows in (curves or {}).items() for r in rows]
    d = pd.DataFrame(recs, columns=["workload", "batch", "best_k", "speedup"])
    x = alt.X("batch:Q", title="concurrent requests (batch)", scale=alt.Scale(type="log", base=2))
    lines = alt.Chart(d).mark_line(point=True).encode(
        x=x, y=alt.Y("speedup:Q", title="predicted speedup vs plain"), color=alt.Color("workload:N"),
        tooltip=["workload", "batch", "best_k", alt.Tooltip("speedup:Q", format=".2f")])
    one = alt.Chart(d).mark_rule(strokeDash=[4, 4], color="gray").encode(y=alt.datum(1.0))
    return alt.layer(lines, one).properties(width=520, height=220,
                                            title="predicted speedup vs load (best k at each batch)")


TREE_COLOURS = {"accepted": ("#dafbe1", "#1a7f37"), "rejected": ("#ffebe9", "#cf222e"),
                "discarded": ("#f6f8fa", "#8c959f"), "root": ("#ddf4ff", "#0969da")}


def tree_svg(tree: dict, token_text, root_text: str = "·") -> str:
    """One round's token tree as SVG: the newest committed token (root) on the left, nodes by depth to the
    right, each coloured by its fate (accepted / rejected / discarded under a rejected node), the accepted
    path drawn thick, and the target's own next token after the path. ``tree`` is ``RowRound.tree``;
    ``token_text(id)`` gives a token's text."""
    import html as _html

    tokens, parents, fates = tree["tokens"], tree["parents"], tree["fates"]
    path = set(tree.get("path") or [])
    n = len(tokens)
    children: dict[int, list[int]] = {-1: []}
    for i in range(n):
        children.setdefault(i, [])
        children.setdefault(parents[i], []).append(i)
    # y: leaves in depth-first order, a parent centred on its children
    ys: dict[int, float] = {}
    nxt = [0]

    def place(v: int) -> float:
        kids = children.get(v, [])
        if not kids:
            ys[v] = nxt[0]
            nxt[0] += 1
        else:
            ys[v] = sum(place(c) for c in kids) / len(kids)
        return ys[v]

    place(-1)
    depth = {-1: 0, **{i: d for i, d in enumerate(tree["depth"])}}
    W, H, BW, BH = 110, 34, 92, 24
    rows = max(nxt[0], 1)
    extra = 1 if tree.get("next_token") is not None else 0
    width = (max(depth.values()) + 1 + extra) * W + 20
    height = rows * H + 20

    def xy(v):
        return 10 + depth[v] * W, 10 + ys[v] * H

    def label(t):
        s = token_text(t).replace("\n", "⏎")
        return _html.escape(s if len(s) <= 11 else s[:10] + "…")

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'font-family="ui-monospace, monospace" font-size="12">']
    for i in range(n):  # edges first, under the boxes
        (x0, y0), (x1, y1) = xy(parents[i]), xy(i)
        on = i in path
        parts.append(f'<line x1="{x0 + BW}" y1="{y0 + BH / 2}" x2="{x1}" y2="{y1 + BH / 2}" '
                     f'stroke="{"#1a7f37" if on else "#d0d7de"}" stroke-width="{3 if on else 1}"/>')
    nodes = [(-1, "root", root_text)] + [(i, fates[i], label(tokens[i])) for i in range(n)]
    for v, fate, text in nodes:
        x, y = xy(v)
        fill, stroke = TREE_COLOURS.get(fate, TREE_COLOURS["discarded"])
        thick = 3 if v in path else 1
        tip = "newest committed token" if v < 0 else (
            f"{fate} · depth {depth[v]} · draft p={_fmt(tree['draft_probs'][v])} · "
            f"target p={_fmt(tree['target_probs'][v])}")
        parts.append(f'<g><title>{_html.escape(tip)}</title><rect x="{x}" y="{y}" width="{BW}" height="{BH}" '
                     f'rx="4" fill="{fill}" stroke="{stroke}" stroke-width="{thick}"/>'
                     f'<text x="{x + 6}" y="{y + 16}" fill="{stroke}">{text}</text></g>')
    if extra:  # the target's own token after the accepted path (recovered or bonus)
        last = max(path, key=lambda v: depth[v]) if path else -1
        x, y = xy(last)
        nx = x + W
        status = tree.get("next_status") or "recovered"
        fill, stroke = {"bonus": ("#ddf4ff", "#0969da")}.get(status, ("#fff1e5", "#bc4c00"))
        parts.append(f'<line x1="{x + BW}" y1="{y + BH / 2}" x2="{nx}" y2="{y + BH / 2}" stroke="{stroke}" '
                     f'stroke-dasharray="4 3"/>')
        parts.append(f'<g><title>{status}: the target\'s own token</title><rect x="{nx}" y="{y}" width="{BW}" '
                     f'height="{BH}" rx="4" fill="{fill}" stroke="{stroke}"/><text x="{nx + 6}" y="{y + 16}" '
                     f'fill="{stroke}">{label(tree["next_token"])}</text></g>')
    parts.append("</svg>")
    return "".join(parts)
