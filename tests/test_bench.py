"""`speclab bench compare` end to end on the shipped family, tiny settings: the JSON has the fields
the README documents, every output is identical to HF generate, and the targets are computed."""

import json
import math

import pytest

from speclab.family import list_models


@pytest.mark.slow
def test_compare_smoke(tmp_path, capsys):
    if not {"target", "draft-xs"} <= {m["name"] for m in list_models()}:
        pytest.skip("family not trained")
    from speclab.cli import main

    out = tmp_path / "compare.json"
    rc = main(["bench", "compare", "--draft", "draft-xs", "--workload", "json,code", "--prompts-per-workload", "1",
               "--reps", "1", "--k", "2", "--batches", "1,2", "--max-new-tokens", "8", "--threads", "1",
               "--out", str(tmp_path), "--quiet"])
    assert rc == 0
    rep = json.loads(out.read_text())
    assert {"rows", "efficiency", "crossover_batch", "batch", "targets"} <= set(rep)
    methods = {r["method"] for r in rep["rows"]}
    assert {"hf-plain", "hf-assisted", "hf-pld", "speclab-plain", "speclab-draft", "speclab-ngram"} <= methods
    for r in rep["rows"]:
        assert {"method", "workload", "k", "batch", "tokens_per_s", "ratio_vs_hf_plain", "acceptance_rate",
                "identical"} <= set(r)
        assert r["identical"] and r["tokens_per_s"] > 0
    assert [b["batch"] for b in rep["batch"]] == [1, 2]
    for e in rep["efficiency"]["per_workload"]:
        # the shares divide by measured decode times (a run's minus its prefill's): on a busy machine even their
        # sign is noise, so only their presence is checked here; the benchmark reports their values
        assert e["predicted_speedup"] > 0
        assert math.isfinite(e["forward_share_plain"]) and math.isfinite(e["forward_share_spec"])
    t = rep["targets"]["spec_vs_plain_code"]
    assert t["method"] in ("speclab-draft", "speclab-ngram")
    assert t["value"] == max(b["value"] for b in t["by_method"].values())
    assert "target spec_vs_plain_json" in capsys.readouterr().out


def test_compare_grid_defaults():
    """A bare `speclab bench compare` runs the compact grid (about 3 minutes); --full the whole one; what the
    user gives always wins."""
    import argparse

    from speclab.analysis.compare import COMPACT, FULL, resolve_grid

    bare = argparse.Namespace(workload=None, prompts_per_workload=None, ks=None, batches=None, reps=None, full=False)
    resolve_grid(bare)
    assert {k: getattr(bare, k) for k in COMPACT} == COMPACT and "code" in bare.workload
    full = argparse.Namespace(workload=None, prompts_per_workload=None, ks="4", batches=None, reps=None, full=True)
    resolve_grid(full)
    assert full.ks == "4" and full.workload == FULL["workload"] and full.batches == FULL["batches"]


@pytest.mark.slow
def test_layouts_smoke(tmp_path, capsys):
    """`python benchmarks/layouts.py`: the target (21 MB of weights) is kept in both layouts and timed both ways, the
    draft in one; generate with the engine's choice gives the same tokens as with W^T everywhere."""
    if not {"target", "draft-xs-distill"} <= {m["name"] for m in list_models()}:
        pytest.skip("family not trained")
    from benchmarks.layouts import main
    from speclab.models.native_llama import FEW_ROWS

    out = tmp_path / "layouts.json"
    rc = main(["--draft", "draft-xs-distill", "--reps", "3", "--batches", "1,2", "--k", "0,2", "--max-new-tokens", "8",
               "--threads", "1", "--out", str(tmp_path)])
    assert rc == 0
    rep = json.loads(out.read_text())
    assert rep["few_rows"] == list(FEW_ROWS)
    tgt, drf = rep["forwards"]["target"], rep["forwards"]["draft-xs-distill"]
    assert all(r["w_ms"] > 0 and r["w_t_ms"] > 0 for r in tgt) and all("w_ms" not in r for r in drf)
    assert [(r["batch"], r["k"]) for r in rep["end_to_end"]] == [(1, 0), (1, 2), (2, 0), (2, 2)]
    assert all(r["identical"] and len(r["ratios"]) == 3 for r in rep["end_to_end"])
    assert "engine's choice" in capsys.readouterr().out


def test_bench_serve_takes_the_tokens_it_is_given():
    from speclab.analysis.bench_serve import request_tokens
    from speclab.cli import build_parser

    def parsed(*argv):
        return build_parser().parse_args(["bench", "serve", *argv])

    assert request_tokens(parsed()) == 32 and request_tokens(parsed("--full")) == 64
    assert request_tokens(parsed("--max-new-tokens", "64")) == 64  # the default of the other commands, asked for
    assert request_tokens(parsed("--max-new-tokens", "16", "--full")) == 16
