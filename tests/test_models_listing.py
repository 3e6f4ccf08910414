"""``speclab models``: beside the family's models, every drafter (heads, early exit, prompt lookup, suffix
decoding, the hybrid), each with the acceptance a file measured, "not measured" where there is none."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from speclab.drafters.catalog import FAMILY_REPORT, drafter_entries, measured_acceptance
from speclab.family import list_models

DRAFTERS = ("eagle", "medusa", "early-exit:3:tuned", "early-exit", "ngram", "suffix", "suffix-match", "eagle+suffix")


@pytest.fixture(scope="module")
def shipped():
    if not list_models():
        pytest.skip("family not trained")


def test_the_json_lists_every_drafter_with_only_the_measured_figures(shipped):
    out = subprocess.run([sys.executable, "-m", "speclab", "models", "--json"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    entries = json.loads(out.stdout)
    names = [e["name"] for e in entries]
    assert names[:len(list_models())] == [m["name"] for m in list_models()]  # the models first, as before
    assert set(DRAFTERS) <= set(names) and len(names) == len(set(names))
    figures = measured_acceptance().get("drafters", {})
    for e in entries:
        assert e["acceptance"] == figures.get(e["name"], {}), e["name"]  # the file's own figures, or none
    roles = {e["name"]: e["role"] for e in entries}
    assert roles["suffix"] == "suffix decoding" and roles["suffix-match"] == "suffix match"


def test_the_table_says_not_measured_where_there_are_no_figures(shipped, capsys):
    from speclab.family.cli import cmd_models

    class Args:
        json = False
        presets = False

    cmd_models(Args())
    text = capsys.readouterr().out
    table = text[text.index("\nacceptance"):].splitlines()
    figures = measured_acceptance().get("drafters", {})
    for name in DRAFTERS:
        line = next(ln for ln in table if ln.split() and ln.split()[0] == name)
        if figures.get(name):
            workload, value = next(iter(figures[name].items()))
            assert f"{value:.2f}" in line and "not measured" not in line
        else:
            assert line.rstrip().endswith("not measured")
    assert not any(ln.startswith(("target ", "mismatch ")) for ln in table)  # not drafters
    if not all(figures.get(n) for n in DRAFTERS):
        assert "python -m speclab.analysis.drafter_acceptance" in text


def test_figures_come_from_the_catalog_file_else_the_familys_report(tmp_path):
    missing = tmp_path / "acceptance.json"
    report = json.loads(FAMILY_REPORT.read_text()) if FAMILY_REPORT.is_file() else None
    fallback = measured_acceptance(missing)
    if report is None:
        assert fallback == {}
    else:
        greedy = {(r["drafter"], r["workload"]): r["acceptance_rate"] for r in report["rows"] if r["temperature"] == 0}
        assert {(d, w): x for d, ws in fallback["drafters"].items() for w, x in ws.items()} == greedy
        assert fallback["k"] == report["k"] and "family" in fallback["command"]
    missing.write_text(json.dumps({"k": 4, "prompts_per_workload": 2, "command": "test",
                                   "drafters": {"suffix": {"json": 0.5}}}))
    assert measured_acceptance(missing)["drafters"] == {"suffix": {"json": 0.5}}
    by = {e["name"]: e for e in drafter_entries(missing)}
    assert by["suffix"]["acceptance"] == {"json": 0.5} and by["ngram"]["acceptance"] == {}
    assert measured_acceptance(tmp_path / "none.json", fallback=None) == {}
