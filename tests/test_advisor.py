"""The advisor: the documented verdict on hand-built cases, the inputs it reads, the published-measurement
table, the CPU check, and one-line errors for bad input."""

from __future__ import annotations

import json

import pytest

from speclab.analysis.advisor import Deployment, Inputs, Workload, advise
from speclab.analysis.advisor_inputs import parse_acceptance, read_inputs
from speclab.analysis.roofline import RooflineCosts, hardware, shape
from speclab.cli import main

H100_8B = ["--hardware", "h100", "--target-model", "llama-3.1-8b", "--draft-model", "llama-3.2-1b",
           "--target", "meta-llama/Llama-3.1-8B-Instruct", "--draft", "meta-llama/Llama-3.2-1B-Instruct"]


def run(argv, capsys):
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def verdicts(folder):
    return {v["workload"]: v for v in json.loads((folder / "advice.json").read_text())["verdicts"]}


# ------------------------------------------------------------------------------- the three documented cases


def test_prefill_dominated_workload_is_not_enabled(tmp_path, capsys):
    # TTFT 1500 ms against 19 x 8 ms of decode: decode is 152 / 1652 = 9% of a request
    code, out, err = run(["advise", "what-if", *H100_8B, "--acceptance", "json:0.8", "--ttft-ms", "1500",
                          "--tpot-ms", "8", "--output-tokens", "20", "--out", str(tmp_path / "a")], capsys)
    assert code == 0, err
    v = verdicts(tmp_path / "a")["json"]
    assert not v["enable"] and v["reason"] == "prefill-bound" and v["k"] == 0
    assert "DO NOT ENABLE (prefill-bound)" in out
    assert "[FAIL] decode-bound share of request time (all): 9% decode" in out
    assert "Prefill-bound requests" in out and "Queueing under saturation" in out  # what the rubric does not cover
    assert "--speculative-config none" in v["flags"]["speclab"]


def test_saturated_deployment_is_not_enabled(tmp_path, capsys):
    # 256 concurrent rows of short context: the verify's matmuls are compute-bound (256 x 3 tokens is
    # past an H100's ridge), so no k pays; at 64 rows the same traffic still gains
    args = ["advise", "what-if", *H100_8B, "--acceptance", "chat:0.6", "--context", "256"]
    code, out, err = run([*args, "--concurrency", "256", "--out", str(tmp_path / "s")], capsys)
    assert code == 0, err
    v = verdicts(tmp_path / "s")["chat"]
    assert not v["enable"] and v["reason"] == "saturated" and v["crossover"] <= 256
    assert v["speedup_at_1"] > 1.1  # it would pay at low concurrency: the reason is the load
    assert "DO NOT ENABLE (saturated)" in out and "compute-bound" in out
    code, out, err = run([*args, "--concurrency", "64", "--out", str(tmp_path / "s64")], capsys)
    v64 = verdicts(tmp_path / "s64")["chat"]
    assert v64["enable"] and v64["policy"] == "goodput"  # the crossover is within 4x: switch off past it
    assert v64["pays_up_to"] == v["crossover"] - 1


def test_low_acceptance_creative_workload_is_not_enabled(tmp_path, capsys):
    code, out, err = run(["advise", "what-if", *H100_8B, "--acceptance", "json:0.8,creative:0.1", "--concurrency", "1",
                          "--out", str(tmp_path / "c")], capsys)
    assert code == 0, err
    vs = verdicts(tmp_path / "c")
    assert not vs["creative"]["enable"] and vs["creative"]["reason"] == "low acceptance"
    assert vs["json"]["enable"] and vs["json"]["k"] >= 3 and vs["json"]["throughput_change"] > 0.5
    assert "creative: DO NOT ENABLE (low acceptance)" in out and "json: ENABLE" in out


def test_enable_gives_k_tpot_and_the_engines_flags(tmp_path, capsys):
    code, out, err = run(["advise", "what-if", *H100_8B, "--acceptance", "json:0.8", "--concurrency", "8",
                          "--out", str(tmp_path / "e")], capsys)
    assert code == 0, err
    v = verdicts(tmp_path / "e")["json"]
    assert v["enable"] and v["tpot_ms"] < v["plain_tpot_ms"] and v["speedup"] > 1.5
    sl = v["flags"]["speclab"]
    assert sl.startswith("speclab serve --model meta-llama/Llama-3.1-8B-Instruct --speculative-config ")
    assert json.loads(sl.split("--speculative-config '")[1].split("'")[0]) == {
        "method": "draft_model", "model": "meta-llama/Llama-3.2-1B-Instruct", "num_speculative_tokens": v["k"]}
    cfg = json.loads(v["flags"]["vllm"].split("--speculative-config '")[1].split("'")[0])
    table = cfg["num_speculative_tokens_per_batch_size"]
    # vLLM's rules: inclusive (start, end, k) ranges from 1, sorted, non-overlapping, 0 <= k <= the max
    assert table[0][0] == 1 and all(a[1] < b[0] for a, b in zip(table, table[1:]))
    assert all(0 <= k <= cfg["num_speculative_tokens"] for _, _, k in table)
    assert next(k for s, e, k in table if s <= 8 <= e) == v["k"]  # the table agrees with the verdict
    sg = v["flags"]["sglang"]
    k = v["k"]
    assert f"--speculative-num-steps {k} --speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}" in sg
    assert "--speculative-algorithm STANDALONE" in sg


def test_tokenizer_mismatch_blocks(capsys):
    code, out, _ = run(["advise", "what-if", *H100_8B, "--acceptance", "json:0.8", "--tokenizer-match", "no"], capsys)
    assert code == 0 and "DO NOT ENABLE (tokenizer mismatch)" in out


def test_advise_function_on_measured_costs():
    # the function the app renders: a CPU-like deployment whose verify cost grows with the rows
    from speclab.analysis.costmodel import MeasuredCosts

    costs = MeasuredCosts({(1, 1): 3e-3, (1, 5): 5e-3, (8, 1): 12e-3, (8, 5): 60e-3}, {1: 0.6e-3, 8: 1.6e-3})
    dep = Deployment(costs, "cpu, timed", "measured", k_max=6, target_name="target", draft_name="draft-xs-distill")
    inp = Inputs([Workload("json", per_position=[0.9, 0.8, 0.7, 0.6], source="measured"),
                  Workload("creative", mean_length=1.5, k=4, source="measured")],
                 ttft_ms=20.0, ttft_source="measured", tpot_ms=3.0, tpot_source="measured", output_tokens=64,
                 tokenizer_match=True, tokenizer_source="measured")
    a = advise(inp, dep, concurrency=1)
    by = {v.workload: v for v in a.verdicts}
    assert by["json"].enable and by["json"].k > 0 and by["json"].policy == "goodput"  # crossover below 8
    assert by["creative"].reason == "low acceptance"
    assert {r.source for r in a.rubric} >= {"measured", "model"}
    assert json.dumps(a.to_dict(), allow_nan=False)  # the app and the JSON writer get plain data
    assert set(a.curves) == {"json", "creative"} and a.curves["json"][0]["batch"] == 1
    assert "DO NOT ENABLE (low acceptance)" in a.format()
    # at 8 concurrent rows the verify of 5 tokens costs 5 decode steps: saturated
    assert {v.workload: v.reason for v in advise(inp, dep, concurrency=8).verdicts}["json"] == "saturated"


# ------------------------------------------------------------------------------- inputs the advisor reads


def test_reads_a_load_result(tmp_path):
    # the fields of `speclab load --json` the advisor reads (docs/advisor.md lists them)
    level = lambda c, ttft, spec: {  # noqa: E731
        "level": {"kind": "concurrency", "value": c, "label": f"concurrency {c}"},
        "summary": {"completed": 10, "output_tokens": 640, "ttft_ms": {"mean": ttft, "p50": ttft},
                    "tpot_ms": {"mean": 4.0, "p50": 4.0}},
        "server": {"spec_decode": spec, "sglang": None}}
    spec = {"drafts": 100, "acceptance_rate": 0.6, "mean_acceptance_length": 2.9,
            "per_position_acceptance": [0.8, 0.6, 0.5, 0.3]}
    res = {"url": "http://127.0.0.1:8000", "levels": [level(1, 30.0, spec), level(16, 400.0, spec)]}
    path = tmp_path / "load.json"
    path.write_text(json.dumps(res))
    inp = read_inputs([path], workload_name="chat")
    w = inp.workloads[0]
    assert w.name == "chat" and w.source == "scraped" and w.per_position == [0.8, 0.6, 0.5, 0.3]
    assert inp.concurrency == 16 and inp.ttft_ms == 400.0 and inp.tpot_ms == 4.0 and inp.output_tokens == 64
    assert not inp.tpot_is_plain  # measured with speculation on: not a plain TPOT to calibrate with
    assert "TTFT p50 grows from 30 ms" in inp.queueing  # queueing: the second thing the rubric does not cover


@pytest.mark.slow
def test_reads_real_lab_results(tmp_path, capsys):
    """An acceptance report and a sweep made by the lab itself, on the embedded family."""
    from speclab.family import list_models

    if not {"target", "draft-xs-distill"} <= {m["name"] for m in list_models()}:
        pytest.skip("family not trained")
    from speclab.analysis.report import acceptance_report
    from speclab.analysis.sweep import SweepSpec, run_sweep

    rep = acceptance_report("json,creative", drafters=["draft-xs-distill"], k=2, max_new_tokens=8,
                            prompts_per_workload=2, temperatures=(0.0,))
    (tmp_path / "acc.json").write_text(json.dumps(rep))
    inp = read_inputs([tmp_path / "acc.json"])
    assert [w.name for w in inp.workloads] == ["json", "creative"] and inp.workloads[0].source == "measured"
    assert inp.workloads[0].k == 2 and inp.tokenizer_match is True
    df = run_sweep("target", SweepSpec(["json"], ["draft-xs-distill"], ks=[2], batches=[1, 2], max_new_tokens=8,
                                       prompts_per_workload=2))
    df.to_csv(tmp_path / "sweep.csv", index=False)
    inp = read_inputs([tmp_path / "sweep.csv"])
    w = inp.workloads[0]
    assert w.name == "json" and w.per_position and len(w.per_position) == 2 and w.crossover_measured
    assert inp.tpot_ms is not None and inp.tpot_source == "measured"
    code, out, err = run(["advise", "what-if", "--from", str(tmp_path / "acc.json"), "--hardware", "cpu",
                          "--target-model", "5.27e6", "--bytes-per-param", "4", "--draft-model", "4.2e5"], capsys)
    assert code == 0, err
    assert "(json)" in out and "measured" in out


# ------------------------------------------------------------------------------- validation and the CPU check


def test_validate_table_has_every_error(tmp_path, capsys):
    code, out, err = run(["advise", "validate", "--out", str(tmp_path)], capsys)
    assert code == 0, err
    rows = json.loads((tmp_path / "validation.json").read_text())
    assert len(rows) >= 12
    for r in rows:
        assert r["roofline_error"] is not None and r["source"].startswith("https://")
        if r["baseline"] or r["metric"] != "speedup":
            assert r["calibrated_error"] is not None
    plain = next(r for r in rows if r["id"] == "sglang-plain")
    assert plain["value"] == 158.34 and plain["calibrated_error"] == pytest.approx(0.0, abs=1e-9)
    assert plain["roofline"] == pytest.approx(1 / ((16.06e9 + 513 * 131072) / 3.35e12))
    assert "docs.sglang.io" in out and "Spec-Bench" in out


# ------------------------------------------------------------------------------- bad input: one line, exit 2


@pytest.mark.parametrize("argv,needle", [
    (["advise", "what-if", "--hardware", "tpu9", "--target-model", "llama-3.1-8b", "--draft-cost", "0",
      "--acceptance", "a:0.5"],
     "unknown hardware 'tpu9'"),
    (["advise", "what-if", *H100_8B, "--acceptance", "json=0.7"], "--acceptance wants NAME:RATE"),
    (["advise", "what-if", *H100_8B, "--acceptance", "json:1.7"], "is not a rate in [0, 1]"),
    (["advise", "what-if", *H100_8B], "no acceptance to judge"),
    (["advise", "what-if", *H100_8B, "--from", "/nonexistent/x.json"], "no such file"),
    (["advise", "what-if", "--hardware", "h100", "--draft-cost", "0", "--acceptance", "a:0.5"], "give the target"),
    (["advise", "what-if", "--hardware", "h100", "--target-model", "llama-3.1-8b", "--acceptance", "a:0.5"],
     "give the draft"),
    (["advise", "--acceptance", "a:0.5", "--target", "someorg/not-here"], "model its hardware with `speclab advise "
     "what-if --hardware PRESET"),
    (["advise", "what-if", *H100_8B, "--acceptance", "a:0.5", "--target-model", "8e9:32"],
     "--target-model wants a named shape or PARAMS"),
    (["advise", "what-if", *H100_8B, "--acceptance", "a:0.5", "--concurrency", "0"], "--concurrency"),
    (["advise", "what-if", *H100_8B, "--acceptance", "a:0.5", "--k-max", "99"], "k (draft length)"),
])
def test_bad_input_is_one_line(argv, needle, capsys):
    code, _, err = run(argv, capsys)
    assert code == 2
    assert err.startswith("speclab: error: ") and needle in err and err.count("\n") == 1


def test_unreadable_files_are_one_line(tmp_path, capsys):
    (tmp_path / "x.json").write_text('{"something": 1}')
    (tmp_path / "y.json").write_text("not json")
    for f, needle in (("x.json", "holds no acceptance the advisor can read"), ("y.json", "not a JSON or CSV file")):
        code, _, err = run(["advise", "what-if", *H100_8B, "--from", str(tmp_path / f)], capsys)
        assert code == 2 and needle in err and err.count("\n") == 1


def test_parse_acceptance_forms():
    ws = parse_acceptance("json:0.7, code:0.9/0.8/0.6")
    assert ws[0].alpha == 0.7 and ws[1].per_position == [0.9, 0.8, 0.6]
    assert ws[0].source == "assumed"


def test_roofline_deployment_object():
    costs = RooflineCosts(hardware("a100"), shape("vicuna-7b"), shape("vicuna-68m"), context=512)
    a = advise(Inputs([Workload("chat", alpha=0.6)]), Deployment(costs, "a100", "model"), concurrency=4)
    assert a.concurrency == 4 and a.verdicts[0].enable and a.verdicts[0].speedup > 1.3


def test_docs_table_matches_the_validation():
    """docs/advisor.md's validation table is the one `speclab advise validate` computes."""
    from pathlib import Path

    from speclab.analysis.published import format_value, validate

    doc = (Path(__file__).resolve().parents[1] / "docs" / "advisor.md").read_text()
    for r in validate():
        line = next((ln for ln in doc.splitlines() if ln.startswith(f"| `{r['id']}` |")), None)
        assert line is not None, r["id"]
        cells = [c.strip() for c in line.split("|")]
        assert format_value(r["metric"], r["value"]) in cells and f"{r['roofline_error']:+.0%}" in cells, r["id"]
        if r["calibrated_error"] is not None:
            assert f"{r['calibrated_error']:+.0%}" in cells, r["id"]


def test_ragged_batch_time_by_hand():
    from benchmarks.cpucheck import ragged_time
    from speclab.analysis.costmodel import MeasuredCosts

    costs = MeasuredCosts({(1, 1): 1.0, (2, 1): 1.5, (1, 3): 2.0, (2, 3): 3.0}, {1: 0.1, 2: 0.2})
    # k = 2; row 0 needs 6 tokens at 3 a round (2 rounds), row 1 12 at 2 (6 rounds): 2 rounds of both
    # rows (2 x 0.2 + 3 = 3.4 s) then 4 of row 1 alone (2 x 0.1 + 2 = 2.2 s): 6.8 + 8.8 = 15.6
    assert ragged_time(costs, 2, [6, 12], [3, 2], lambda n: 0.0) == pytest.approx(15.6)
    # plain decoding: 6 rounds of both (1.5 s), 6 of one (1 s); plus 0.1 s of host time a round
    assert ragged_time(costs, 0, [6, 12], [1, 1], lambda n: 0.1) == pytest.approx(6 * 1.6 + 6 * 1.1)


# ------------------------------------------------------------------------------- any result the lab writes


@pytest.mark.slow
def test_advise_from_a_real_load_result_with_no_other_flag(tmp_path, capsys):
    """`speclab load --json` against two real `speclab serve` processes on free ports (the family's default draft,
    and plain decoding), then `speclab advise --from` each file alone. The speculative run carries acceptance and
    latencies but no step costs: the advisor times them here and says so in one line. The plain run carries no
    acceptance: one line that names the flag which supplies it."""
    pytest.importorskip("fastapi")
    from concurrent.futures import ThreadPoolExecutor

    from speclab.family import DEFAULT_TARGET, resolve
    from speclab.load.servers import speclab_serve

    if resolve(DEFAULT_TARGET) is None:
        pytest.skip("family weights not present")
    with ThreadPoolExecutor(2) as pool:
        starting = [pool.submit(speclab_serve, threads=1),
                    pool.submit(speclab_serve, speculative_config="none", threads=1)]
    servers = [f.result() for f in starting if f.exception() is None]  # every one that came up is stopped below
    try:
        for f in starting:
            f.result()  # a server that failed to start fails the test here
        for server, name in zip(servers, ("spec", "plain")):
            code, _, err = run(["load", server.url, "--workload", "json", "--num-requests", "4", "--max-tokens",
                                "24", "--quiet", "--json", str(tmp_path / f"{name}.json")], capsys)
            assert code == 0, err
    finally:
        for s in servers:
            s.stop()
    code, printed, err = run(["advise", "--from", str(tmp_path / "spec.json"), "--out", str(tmp_path)], capsys)
    assert code == 0, err
    assert "step costs: the result has none, so they were timed on this machine" in printed
    assert "(served)" in printed and "scraped" in printed and "speclab serve --model target" in printed
    advice = json.loads((tmp_path / "advice.json").read_text())
    assert [v["workload"] for v in advice["verdicts"]] == ["served"]
    code, printed, err = run(["advise", "--from", str(tmp_path / "plain.json")], capsys)
    assert code == 2 and err.count("\n") == 1 and "hold no acceptance" in err and "--acceptance NAME:RATE" in err


def test_reads_a_bench_serve_result(tmp_path):
    """The rows `speclab bench serve` writes (:func:`speclab.analysis.bench_serve._row`, built from the load tool's
    level summaries): the speculative server's acceptance at the lowest load, plain decoding's TTFT and TPOT."""
    from speclab.analysis.bench_serve import _row

    def level(ttft, tpot, spec_len):
        return {"summary": {"completed": 4, "failed": 0, "output_throughput": 100.0, "request_throughput": 1.0,
                            "ttft_ms": {"p50": ttft, "mean": ttft}, "tpot_ms": {"mean": tpot, "p95": tpot},
                            "e2e_ms": {"p95": 500.0}},
                "fingerprint": {"call": "bursty" if spec_len else "smooth", "mean_tokens_per_burst": 1.0},
                "server": {"spec_decode": {"mean_acceptance_length": spec_len} if spec_len else None}}

    rows = [_row("speclab plain", "json", 1, level(20.0, 8.0, None)),
            _row("speclab speculative", "json", 1, level(22.0, 4.0, 3.1)),
            _row("speclab plain", "json", 4, level(40.0, 9.0, None)),
            _row("speclab speculative", "json", 4, level(45.0, 6.0, 2.9))]
    (tmp_path / "serve.json").write_text(json.dumps({"target": "target", "rows": rows}))
    inp = read_inputs([tmp_path / "serve.json"], concurrency=4)
    assert [(w.name, w.mean_length, w.source) for w in inp.workloads] == [("json", 3.1, "scraped")]
    assert inp.tpot_ms == 9.0 and inp.tpot_is_plain and inp.ttft_ms == 40.0 and inp.target == "target"


@pytest.mark.slow
def test_advise_from_bench_results_with_no_other_flag(tiny, tmp_path, capsys):
    """`speclab bench heads` and `speclab bench policies` on the tiny target, tiny settings, then `speclab advise
    --from` each result (with --target: a result names its model by its short name, and the tiny one's is the
    family target's); a synthetic-drafter result holds no measured acceptance: one line naming the flag."""
    code, _, err = run(["bench", "heads", "--target", tiny["target"], "--workload", "json", "--max-new-tokens", "6",
                        "--budget", "3", "--k", "2", "--prompts-per-workload", "1", "--reps", "1", "--quiet",
                        "--out", str(tmp_path)], capsys)
    assert code == 0, err
    code, _, err = run(["bench", "policies", "--target", tiny["target"], "--draft", tiny["draft_close"],
                        "--workload", "json,code", "--batches", "1", "--k", "2", "--policy", "none",
                        "--prompts-per-workload", "1", "--reps", "1", "--max-new-tokens", "6", "--quiet",
                        "--out", str(tmp_path)], capsys)
    assert code == 0, err
    for name, workloads in (("heads", {"json"}), ("policies", {"json", "code"})):
        code, printed, err = run(["advise", "--from", str(tmp_path / f"{name}.json"), "--target", tiny["target"],
                                  "--out", str(tmp_path / name)], capsys)
        assert code == 0, (name, err)
        assert "timed on this machine" in printed
        assert set(verdicts(tmp_path / name)) == workloads
    (tmp_path / "synthetic.json").write_text(json.dumps({"cells": [{"alpha": 0.5, "k": 2, "batch": 1}]}))
    code, _, err = run(["advise", "--from", str(tmp_path / "synthetic.json")], capsys)
    assert code == 2 and "synthetic-drafter result" in err and "--acceptance NAME:RATE" in err
