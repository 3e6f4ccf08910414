#!/usr/bin/env python
"""The README's picture of the lab: start ``python app.py`` on the embedded family, run the first
screen's defaults in headless Chromium (Debian's, driven by Playwright) and save the Decode tab, with
the tab bar, to docs/img/tabs.png (and each other tab to docs/img/<tab>.png).

    .venv/bin/python scripts/screenshots.py [--out docs/img]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]
FIND = "const e = document.querySelector('#' + id + ' .prose') || document.querySelector('#' + id);"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "img"))
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    from speclab.app.testing import AppProcess

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    app = AppProcess([])
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
            page = browser.new_page(viewport={"width": 1360, "height": 1000}, device_scale_factor=1)
            page.goto(app.url, wait_until="domcontentloaded", timeout=60_000)
            page.wait_for_selector("#run", timeout=60_000)
            page.locator("#run").click()
            page.wait_for_function("(id) => { " + FIND + " return e && /✓/.test(e.innerText); }",
                                   arg="decode-status", timeout=180_000)
            page.wait_for_timeout(1500)  # the k chart draws after the run
            page.screenshot(path=str(out / "tabs.png"), full_page=False)
            for tab in ("Sweep", "Timing", "Load", "Advisor"):
                page.get_by_role("tab", name=tab).click()
                page.wait_for_timeout(800)
                page.screenshot(path=str(out / f"{tab.lower()}.png"), full_page=False)
            browser.close()
    finally:
        app.close()
    print(f"wrote {out / 'tabs.png'} and one picture per tab")
    return 0


if __name__ == "__main__":
    sys.exit(main())
