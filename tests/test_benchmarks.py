"""The scripts in benchmarks/: each runs as ``python benchmarks/NAME.py`` from the repository root (a real process),
refuses bad input in one line, and the CPU check and the policy oracle end to end on the family, tiny settings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if not p.stem.startswith("_"))


def test_the_scripts_are_the_ones_users_do_not_call():
    assert set(SCRIPTS) >= {"serve_experiment", "serve_judge", "serve_report", "policy_oracle", "tracker_fit",
                            "layouts", "cpucheck"}
    moved = {"serve_experiment", "serve_judge", "serve_report", "kind_oracle", "tracker_fit", "bench_layouts",
             "cpucheck"}
    assert not {p.stem for p in (ROOT / "speclab" / "analysis").glob("*.py")} & moved


def test_a_script_runs_from_the_repository_root():
    """As a user runs one: `python benchmarks/NAME.py`, from the root, with nothing on PYTHONPATH (its siblings import
    as the benchmarks package)."""
    p = subprocess.run([sys.executable, "benchmarks/serve_experiment.py", "--help"], cwd=ROOT, capture_output=True,
                       text=True, env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("usage: python benchmarks/serve_experiment.py") and "--out DIR" in p.stdout


@pytest.mark.parametrize("name", ["serve_experiment", "policy_oracle", "tracker_fit", "layouts", "cpucheck"])
def test_each_script_has_a_short_help(name, capsys):
    import importlib

    with pytest.raises(SystemExit) as e:
        importlib.import_module(f"benchmarks.{name}").main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith(f"usage: python benchmarks/{name}.py") and "--out DIR" in out
    flags = [line for line in out.splitlines() if line.startswith("  -")]
    assert 0 < len(flags) <= 25


@pytest.mark.parametrize("argv,needle", [
    (["-k", "0"], "needs k >= 1"),
    (["--batches", "1,x"], "--batches: 'x' is not a number"),
    (["--synthetic", "0.5"], "--synthetic wants ALPHA:COST"),
])
def test_cpucheck_bad_input_is_one_line(argv, needle, capsys, tmp_path):
    from benchmarks.cpucheck import main

    assert main([*argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python benchmarks/cpucheck.py: error: ") and needle in err and err.count("\n") == 1


@pytest.mark.slow
def test_cpucheck_small_run_and_advise_from_it(tmp_path, capsys):
    from benchmarks.cpucheck import main
    from speclab.cli import main as speclab
    from speclab.family import list_models

    if not {"target", "draft-xs-distill"} <= {m["name"] for m in list_models()}:
        pytest.skip("family not trained")
    code = main(["--workload", "json", "--batches", "1,2", "--max-new-tokens", "12", "--reps", "1", "-k", "3",
                 "--quiet", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0
    rep = json.loads((tmp_path / "cpucheck.json").read_text())
    assert [(c["workload"], c["batch"]) for c in rep["cells"]] == [("json", 1), ("json", 2)]
    for c in rep["cells"]:
        assert c["measured_speedup"] > 0 and c["predicted_speedup"] > 0 and c["roofline_speedup"] > 0
        assert c["error"] == pytest.approx(c["predicted_speedup"] / c["measured_speedup"] - 1)
    assert "within 20%" in out and rep["command"].startswith("python benchmarks/cpucheck.py")
    code = speclab(["advise", "--from", str(tmp_path / "cpucheck.json"), "--concurrency", "2"])
    out = capsys.readouterr().out
    assert code == 0
    assert "json:" in out and "step costs: measured" in out and "timed on this machine" not in out


@pytest.mark.slow
def test_policy_oracle_smoke(tmp_path, capsys):
    """`speclab bench policies`, then the mixed levels again with every fixed configuration beside the kind oracle;
    every output exact."""
    from benchmarks.policy_oracle import main
    from speclab.family import list_models

    if not {"target", "draft-xs-distill"} <= {m["name"] for m in list_models()}:
        pytest.skip("family not trained")
    rc = main(["--workload", "json,code", "--batches", "1,2", "--k", "1,2", "--policy", "none",
               "--prompts-per-workload", "1", "--reps", "2", "--max-new-tokens", "6", "--threads", "1", "--quiet",
               "--out", str(tmp_path)])
    assert rc == 0
    rep = json.loads((tmp_path / "policy_oracle.json").read_text())
    assert [o["batch"] for o in rep["oracle"]] == [1, 2]
    for o in rep["oracle"]:
        assert set(o["ks"]) == {"json", "code"} and o["identical"]
        assert set(o["speedup"]) == {"plain", "fixed-1", "fixed-2", "kind-oracle"} and o["speedup"]["plain"] == 1.0
        assert all(len(v) == 2 for v in o["speedups"].values())
    assert rep["targets"]["mixed_oracle_vs_best_single_k"]["value"] > 0
    assert "kind oracle" in capsys.readouterr().out
