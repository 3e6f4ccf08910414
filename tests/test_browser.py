"""The app in a real browser: Playwright driving Debian's headless Chromium (no internet needed:
Gradio bundles vega-embed, so Altair charts render offline).

Models: the embedded family when present, else tiny random Llamas (see tests/test_app.py).
"""

from __future__ import annotations

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


def _wait_status(page, elem_id: str, timeout=120_000):
    page.wait_for_function(
        f"() => {{ const e = document.querySelector('#{elem_id}'); return e && /[✓⚠]/.test(e.innerText); }}",
        timeout=timeout)
    return page.locator(f"#{elem_id}").inner_text()


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
    page.locator("#prompt textarea").fill("")
    page.locator("#run").click()
    status = _wait_status(page, "decode-status", timeout=30_000)
    assert "prompt is empty" in status


def test_sweep_chart_renders_offline(page, tmp_path):
    page.get_by_role("tab", name="Sweep").click()
    page.locator("#sweep-run").click()
    status = _wait_status(page, "sweep-status", timeout=150_000)
    assert "✓" in status, status
    for plot in ("#plot-acc", "#plot-k", "#plot-batch", "#plot-pos"):
        page.wait_for_selector(f"{plot} canvas, {plot} svg", timeout=30_000)
    page.screenshot(path=str(tmp_path / "sweep.png"), full_page=True)
    assert not [e for e in page.page_errors if "vega" in e.lower()], page.page_errors
