"""speclab bench heldout: drafters against plain decoding on the held-out workloads (real models, real runs)."""

import json
import subprocess
import sys

import pytest

from speclab.family import resolve


def _run(*args):
    return subprocess.run([sys.executable, "-m", "speclab.analysis.bench_heldout", *args], capture_output=True,
                          text=True, timeout=600)


@pytest.mark.parametrize("args", [["--k", "0"], ["--workload", "no-such-workload"], ["--prompts-per-workload", "0"]])
def test_bad_input_is_one_line(args):
    r = _run(*args)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.slow
@pytest.mark.skipif(resolve("target") is None, reason="family not trained")
def test_heldout_table_and_json(tmp_path):
    r = _run("--methods", "ngram,eagle+suffix", "--workload", "heldout_json", "--prompts-per-workload", "1",
             "--reps", "2", "--max-new-tokens", "12", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads((tmp_path / "heldout.json").read_text())["rows"]
    assert [x["method"] for x in rows] == ["plain again", "ngram", "eagle+suffix"]
    for x in rows:
        assert x["pairs"] == 2 and x["speedup"] > 0
    assert rows[2]["acceptance"] is not None and rows[2]["tokens_per_round"] >= 1
    assert "A/A" in r.stdout or "plain again" in r.stdout
