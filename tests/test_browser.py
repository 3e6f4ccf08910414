"""The app in a real browser: Playwright driving Debian's headless Chromium (no internet needed:
Gradio bundles vega-embed, so Altair charts render offline).

Models: the embedded family when present, else tiny random Llamas (see tests/test_app.py).
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from speclab.app.testing import AppProcess, models_for_tests

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is absent (apt-get install chromium)"),
    # skip before the app starts (the fixtures would start it first)
    pytest.mark.skipif(importlib.util.find_spec("playwright") is None,
                       reason="playwright is absent (bash scripts/setup browser)"),
]


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    m = models_for_tests(tmp_path_factory.mktemp("tiny-models"))
    proc = AppProcess(["--target", m["target"], "--draft", m["draft"]])
    yield proc
    proc.close()


@pytest.fixture(scope="module")
def page(app):
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        pg = browser.new_page(viewport={"width": 1400, "height": 1100})
        errors: list[str] = []
        pg.on("pageerror", lambda e: errors.append(str(e)))
        pg.goto(app.url, wait_until="domcontentloaded", timeout=60_000)
        pg.wait_for_selector("#run", timeout=60_000)
        pg.page_errors = errors
        yield pg
        browser.close()


FIND = "const e = document.querySelector('#' + id + ' .prose') || document.querySelector('#' + id);"
STATUS_JS = "(id) => { " + FIND + " return e ? e.innerText : ''; }"


def _status(page, elem_id: str) -> str:
    return page.evaluate(STATUS_JS, elem_id)


def _wait_status(page, elem_id: str, before: str | None = None, timeout=120_000, contains: str = "") -> str:
    """Wait until the status shows a finished run (✓) or an error (⚠), different from ``before`` (and, with
    ``contains``, naming it: a control changed on the way may have re-run the previous configuration first)."""
    done = page.wait_for_function(
        "([id, before, has]) => { " + FIND + " return e && /[✓⚠]/.test(e.innerText) && e.innerText !== before"
        " && (/⚠/.test(e.innerText) || e.innerText.includes(has)) && e.innerText; }",
        arg=[elem_id, before, contains], timeout=timeout)
    return done.json_value()  # the text that met the condition (a re-run may already have replaced it)


def _wait_chart(page, plot: str) -> None:
    """vega-embed drew the chart: its canvas exists and has a real size."""
    marks = page.locator(f"{plot} .vega-embed canvas.marks, {plot} .vega-embed svg.marks").first
    marks.wait_for(timeout=30_000)
    box = marks.bounding_box()
    assert box and box["width"] > 100 and box["height"] > 50, (plot, box)


def test_decode_in_the_browser(page, tmp_path):
    page.locator("#prompt textarea").fill("def fibonacci(n):\n    if n < 2:\n        return n\n")
    page.locator("#run").click()
    status = _wait_status(page, "decode-status")
    assert "✓" in status and "speedup" in status, status
    acc = page.locator("#tokens .tok-accepted")
    rej = page.locator("#tokens .tok-rejected")
    assert acc.count() > 0 and rej.count() > 0
    title = rej.first.get_attribute("title")
    assert "draft p=" in title and "target p=" in title and "round" in title
    assert page.locator("#tokens .tok-rejected").first.evaluate(
        "e => getComputedStyle(e).textDecorationLine") == "line-through"
    assert "speedup vs k=0" in page.locator("#cards").inner_text()
    page.screenshot(path=str(tmp_path / "decode.png"), full_page=True)


def test_empty_prompt_shows_a_message(page):
    before = _status(page, "decode-status")
    page.locator("#prompt textarea").fill("")
    page.locator("#run").click()
    status = _wait_status(page, "decode-status", before, timeout=30_000)
    assert "prompt is empty" in status


def test_picking_an_example_fills_the_prompt_and_runs(page):
    before = _status(page, "decode-status")
    page.locator("#example input").click()
    option = page.locator("[role=option]").nth(1)  # the workload's second prompt
    option.wait_for(timeout=10_000)
    label = option.get_attribute("aria-label")  # "<id>: <first line>"
    option.click()
    first_line = label.split(": ", 1)[1]
    page.wait_for_function("(s) => document.querySelector('#prompt textarea').value.startsWith(s)", arg=first_line,
                           timeout=10_000)
    status = _wait_status(page, "decode-status", before)
    assert "✓" in status, status


def test_slider_release_reruns_and_stop_cancels(page):
    page.wait_for_timeout(500)
    page.locator("#prompt textarea").fill("import json\n\n\ndef load(path):\n")
    k_box = page.locator("#k input[type=number]")  # the slider's number box: commits (release) on blur
    k_box.fill("8")
    k_box.press("Tab")
    # (the number box may fire one release with the old value first; the last run is the one that counts)
    page.wait_for_function("() => { const t = document.querySelector('#decode-status').innerText;"
                           " return t.includes('✓') && t.includes('k=8'); }", timeout=120_000)
    page.get_by_text("sampling").click()
    pace = page.locator("#pace input[type=number]")
    pace.fill("300")
    pace.press("Tab")  # a number box commits on blur: a slow re-run, 0.3 s per round
    page.wait_for_function("() => document.querySelector('#decode-status').innerText.includes('decoding with')",
                           timeout=60_000)
    page.locator("#stop").click()
    page.wait_for_function("() => document.querySelector('#decode-status').innerText.includes('stopped')",
                           timeout=10_000)
    # a round already on its way to the page when Stop was pressed may still land (its update was queued
    # before the cancel); after that, nothing more arrives: rounds are 0.3 s apart, we watch for 1.5 s
    page.wait_for_timeout(400)
    n = page.locator("#tokens .tok").count()
    page.wait_for_timeout(1500)
    assert page.locator("#tokens .tok").count() == n  # nothing arrives after Stop
    assert "stopped" in _status(page, "decode-status")
    pace.fill("0")
    pace.press("Tab")
    _wait_status(page, "decode-status", "⏹ stopped (the tokens so far stay on the page)")


def test_a_control_changed_during_a_run_does_not_start_after_stop(page):
    """Gradio keeps the last control change made while a run goes (always_last) and sends it when the
    cancelled run's stream closes, just after Stop: that run was asked for before Stop and must not start."""
    page.wait_for_function("() => /[✓⚠⏹]/.test(document.querySelector('#decode-status').innerText)",
                           timeout=120_000)
    pace = page.locator("#pace input[type=number]")
    pace.fill("300")
    pace.press("Tab")
    page.wait_for_function("() => document.querySelector('#decode-status').innerText.includes('decoding with')",
                           timeout=60_000)
    k_box = page.locator("#k input[type=number]")
    k_box.fill("3")
    k_box.press("Tab")  # a change while the run goes: kept by the page for after it
    page.wait_for_timeout(300)
    page.locator("#stop").click()
    page.wait_for_function("() => document.querySelector('#decode-status').innerText.includes('stopped')",
                           timeout=10_000)
    page.wait_for_timeout(2500)  # the kept change would have started (and said "decoding with ... k=3") by now
    status = _status(page, "decode-status")
    assert "stopped" in status and "k=3" not in status, status
    pace.fill("0")
    pace.press("Tab")
    status = _wait_status(page, "decode-status", contains="k=3")
    assert "✓" in status, status


def test_sweep_chart_renders_offline(page, tmp_path):
    page.get_by_role("tab", name="Sweep").click()
    box = page.locator("#sweep-workloads").get_by_label("code", exact=True)
    box.uncheck()  # one workload of the default two: the charts are what is checked, in half the time
    assert not box.is_checked()
    page.locator("#sweep-run").click()
    status = _wait_status(page, "sweep-status", timeout=150_000)
    assert "✓" in status, status
    for plot in ("#plot-acc", "#plot-k", "#plot-batch", "#plot-pos"):
        _wait_chart(page, plot)
    page.screenshot(path=str(tmp_path / "sweep.png"), full_page=True)
    _assert_headers_one_line(page)
    assert not [e for e in page.page_errors if "vega" in e.lower()], page.page_errors


def _run_tab(page, tab: str, prefix: str, timeout: int, plots: tuple[str, ...]) -> str:
    """Open a tab, press its run button (#PREFIX-run), wait for its status (#PREFIX-status) and its charts."""
    page.get_by_role("tab", name=tab).click()
    page.locator(f"#{prefix}-run").click()
    status = _wait_status(page, f"{prefix}-status", timeout=timeout)
    for plot in plots:
        _wait_chart(page, plot)
    return status


def _header_lines(page) -> list[list[float]]:
    """Per table shown: the height of each header's text. A header broken letter by letter ("r e a s o n") stands
    taller than its one-line neighbours."""
    return page.evaluate("""() => [...document.querySelectorAll('table')].map(t =>
        [...t.querySelectorAll('th .header.text')].map(e => e.getBoundingClientRect().height).filter(h => h > 0))
        .filter(hs => hs.length)""")


def _assert_headers_one_line(page):
    tables = _header_lines(page)
    assert tables and all(max(hs) == min(hs) for hs in tables), tables


def test_timing_tab_renders(page, tmp_path):
    status = _run_tab(page, "Timing", "timing", 120_000, ("#plot-gaps", "#plot-cum", "#plot-ttft"))
    assert "✓" in status, status
    page.screenshot(path=str(tmp_path / "timing.png"), full_page=True)


def test_advisor_tab_renders(page, tmp_path):
    status = _run_tab(page, "Advisor", "advise", 60_000, ("#plot-advice",))
    assert "✓" in status and "enable" in status, status
    assert "Not covered" in page.locator("#advise-notes").inner_text()
    _assert_headers_one_line(page)  # the verdicts' short columns beside the long flags
    page.screenshot(path=str(tmp_path / "advisor.png"), full_page=True)


def test_load_tab_runs(page, tmp_path):
    status = _run_tab(page, "Load", "load", 300_000, ("#plot-load", "#plot-pace-low", "#plot-pace-high"))
    assert "✓" in status and "verdict" in status, status
    _assert_headers_one_line(page)
    page.screenshot(path=str(tmp_path / "load.png"), full_page=True)


def test_tree_round_is_drawn(page, tmp_path):
    """A tree proposal (the EAGLE head, dynamic tree) draws the last round's tree: nodes coloured by fate, the
    accepted path highlighted."""
    from speclab.drafters.heads import list_heads

    if not any(h["name"] == "eagle" for h in list_heads()):
        pytest.skip("no shipped EAGLE head")
    page.get_by_role("tab", name="Decode").click()
    page.locator("#tree-shape").get_by_label("dynamic").check()
    page.locator("#draft input").click()
    page.get_by_role("option", name="eagle (a head on the target's features)").click()
    before = _status(page, "decode-status")
    page.locator("#run").click()
    status = _wait_status(page, "decode-status", before=before, contains="eagle")
    assert "✓" in status and "eagle" in status, status
    page.locator("#tree-view svg").first.wait_for(timeout=60_000)
    assert page.locator("#tree-view svg rect").count() >= 3
    page.screenshot(path=str(tmp_path / "tree.png"), full_page=True)
