"""``speclab models``: the family's models and every drafter beside them (heads, early exit, prompt lookup,
suffix decoding), each with the acceptance the family's report measured, "not measured" where it has none;
``speclab models measure`` fills a report in."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from speclab.family import list_models
from speclab.family.drafters import list_drafters, load_acceptance, merge_acceptance
from speclab.family.listing import NOT_MEASURED, format_listing, listing

DRAFTERS = ("eagle", "medusa", "early-exit:3:tuned", "early-exit", "ngram", "suffix")


def _cli(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "speclab", *args], capture_output=True, text=True, timeout=timeout)


def _greedy(report: dict) -> dict:
    return {(r["workload"], r["drafter"]): r["acceptance_rate"] for r in report["rows"] if r["temperature"] == 0.0}


@pytest.fixture(scope="module")
def shipped():
    if not list_models():
        pytest.skip("family not trained")
    return load_acceptance()


def test_the_json_lists_models_and_every_drafter_with_the_reports_figures(shipped):
    out = _cli("models", "--json")
    assert out.returncode == 0, out.stderr
    entries = json.loads(out.stdout)
    names = [e["name"] for e in entries]
    assert [m["name"] for m in list_models()] == names[:len(list_models())]  # the models first, as before
    assert set(DRAFTERS) <= set(names) and len(names) == len(set(names))
    greedy = _greedy(shipped)
    for e in entries:
        assert {"name", "role", "parameters", "tokenizer", "path", "about", "acceptance"} <= set(e)
        if e["role"] in ("target", "mismatched"):
            assert e["acceptance"] is None  # not a drafter
            continue
        assert list(e["acceptance"]) == shipped["workloads"]
        for w, x in e["acceptance"].items():  # a figure is the report's own, or None: never anything else
            assert x == greedy.get((w, e["name"])), (e["name"], w)
    heads = {e["name"]: e for e in entries if e["role"].endswith(("head", "heads")) or e["name"].endswith("tuned")}
    assert {"eagle", "medusa", "early-exit:3:tuned"} <= set(heads)
    assert all(h["parameters"] > 0 and h["path"] for h in heads.values())


def test_the_table_says_not_measured_where_the_report_has_no_rows(tmp_path, shipped):
    report = dict(shipped, rows=[r for r in shipped["rows"] if r["drafter"] != "ngram"])
    path = tmp_path / "acceptance.json"
    path.write_text(json.dumps(report))
    entries = listing(acceptance=path)
    ngram = next(e for e in entries if e["name"] == "ngram")
    assert all(v is None for v in ngram["acceptance"].values())
    text = format_listing(entries, acceptance=path)
    table = text[text.index("drafter (--draft)"):].splitlines()  # the drafters' table, after the models'
    line = next(ln for ln in table if ln.startswith("ngram "))
    assert line.rstrip().endswith(NOT_MEASURED)
    assert "speclab models measure" in text
    measured = next(e for e in entries if e["role"] == "distilled-draft")
    row = next(ln for ln in table if ln.startswith(measured["name"] + " "))
    assert f"{measured['acceptance'][shipped['workloads'][0]]:.2f}" in row


def test_measure_stores_rows_that_the_listing_then_shows(tmp_path, shipped):
    path = tmp_path / "acceptance.json"
    out = _cli("models", "measure", "--drafter", "suffix", "--workload", "json", "--prompts", "2",
               "--max-new-tokens", "12", "--temperature", "0", "--file", str(path), "--threads", "1")
    assert out.returncode == 0, out.stderr
    report = json.loads(path.read_text())
    (row,) = report["rows"]
    assert (row["workload"], row["drafter"], row["prompts"], row["k"]) == ("json", "suffix", 2, 4)
    assert 0.0 <= row["acceptance_rate"] <= 1.0
    by = {d["name"]: d for d in list_drafters(acceptance=path)}
    assert by["suffix"]["acceptance"] == {"json": row["acceptance_rate"]}
    assert by["ngram"]["acceptance"] == {"json": None}
    again = _cli("models", "measure", "--drafter", "suffix", "--workload", "json", "--prompts", "2",
                 "--max-new-tokens", "16", "--temperature", "0", "--file", str(path))
    assert again.returncode == 2 and again.stderr.count("\n") == 1 and "max_new_tokens" in again.stderr
    assert json.loads(path.read_text()) == report  # a refused run leaves the file as it was


def test_merging_replaces_a_row_and_keeps_the_rest(tmp_path):
    old = {"k": 4, "max_new_tokens": 64, "target": "target", "workloads": ["json"], "drafters": ["ngram"],
           "rows": [{"workload": "json", "drafter": "ngram", "temperature": 0.0, "acceptance_rate": 0.3}]}
    new = {"k": 4, "max_new_tokens": 64, "target": "target", "workloads": ["json", "code"],
           "drafters": ["ngram", "suffix"],
           "rows": [{"workload": "json", "drafter": "ngram", "temperature": 0.0, "acceptance_rate": 0.4},
                    {"workload": "code", "drafter": "suffix", "temperature": 0.0, "acceptance_rate": 0.5}]}
    p = tmp_path / "acceptance.json"
    p.write_text(json.dumps(old))
    merged = merge_acceptance(new, p)
    assert merged["workloads"] == ["json", "code"] and merged["drafters"] == ["ngram", "suffix"]
    assert _greedy(merged) == {("json", "ngram"): 0.4, ("code", "suffix"): 0.5}
    with pytest.raises(ValueError, match="k = 2"):
        merge_acceptance(dict(new, k=2), p)
