"""speclab bench round: a round's phases beside their floors, on the shipped family (real models, real runs)."""

import json
import subprocess
import sys

import pytest

from speclab.family import resolve

pytestmark = pytest.mark.skipif(resolve("target") is None, reason="family not trained")


def _run(*args):
    return subprocess.run([sys.executable, "-m", "speclab.analysis.bench_round", *args], capture_output=True,
                          text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["eagle", "ngram"])
def test_round_report_has_every_phase_and_floor(tmp_path, draft):
    r = _run("--draft", draft, "--k", "2", "--prompts-per-workload", "1", "--reps", "1", "--max-new-tokens", "12",
             "--workload", "heldout_json", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads((tmp_path / "round.json").read_text())
    phases = ("draft", "verify", "accept", "bookkeeping", "other")
    for part in ("spec_ms", "plain_ms", "plain_again_ms"):
        assert all(rep[part][p] >= 0 for p in phases)
        assert rep[part]["total"] > 0
    assert rep["rounds"]["plain"] > 0 and rep["rounds"]["spec"] > 0
    assert rep["floors_ms"]["verify"] > 0 and rep["floors_ms"]["bookkeeping"] == 0
    if draft == "ngram":  # prompt lookup reads no weights: its draft phase's floor is nothing
        assert rep["floors_ms"]["draft"] == 0
    else:
        assert rep["floors_ms"]["draft"] > 0
    assert rep["plain_ms"]["draft"] < rep["spec_ms"]["draft"] or draft == "ngram"
    assert "verify" in r.stdout and "A/A control" in r.stdout


def test_round_needs_a_drafter_and_k():
    r = _run("--k", "0")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1


def test_round_events_split_acceptance_from_bookkeeping():
    from speclab.drafters.registry import make_drafter
    from speclab.engine.decoder import SpeculativeDecoder
    from speclab.models import load_model

    target = load_model("target", device="cpu")
    dec = SpeculativeDecoder(target, make_drafter("ngram", target))
    seen = []
    dec.hooks.subscribe(lambda ev: seen.append(ev.timings) if getattr(ev, "phase", "") == "verify" else None)
    dec.generate("def add(a, b):\n    return", k=2, max_new_tokens=8, record=False)
    assert seen and all({"draft", "verify", "accept", "bookkeeping", "other"} <= set(t) for t in seen)


def test_bench_round_and_heldout_are_bench_subcommands():
    from speclab.analysis import bench_heldout, bench_round
    from speclab.cli import build_parser

    p = build_parser()
    args = p.parse_args(["bench", "round", "--draft", "ngram", "--k", "3"])
    assert args.mode == "round" and args.func is bench_round.run_from_args and args.draft == "ngram" and args.k == 3
    args = p.parse_args(["bench", "heldout", "--methods", "eagle"])
    assert args.func is bench_heldout.run_from_args and args.methods == "eagle"
    assert p.parse_args(["bench", "acceptance"]).func.__name__ == "cmd_bench"
