"""scripts/gpu_check.py: its pure helpers, its orchestration (sections in their own processes, budgets,
outputs), and the whole --dry-run end to end on the CPU (slow: every section, tiny sizes)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.py"
spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
gpu_check = importlib.util.module_from_spec(spec)
sys.modules["gpu_check"] = gpu_check  # dataclasses look their module up there
spec.loader.exec_module(gpu_check)


def _run(out: Path, *extra: str, timeout: int = 1500) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--dry-run", *extra], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


# ---------------------------------------------------------------------------------------------- helpers
def test_select_and_timeouts():
    args = argparse.Namespace(only=None, skip="compile,kernel", dry_run=False)
    names = [s[0] for s in gpu_check.select(args)]
    assert names == ["env", "roofline", "round", "crossover-1b", "exactness", "crossover-family"]  # train: opt-in
    args.dry_run = True
    assert "train" in [s[0] for s in gpu_check.select(args)]
    args.only, args.dry_run = "train,env", False
    assert [s[0] for s in gpu_check.select(args)] == ["env", "train"]
    args.only = "nope"
    with pytest.raises(SystemExit, match="unknown section 'nope'"):
        gpu_check.select(args)
    ns = argparse.Namespace(timeout=["30", "kernel=5.5"])
    assert gpu_check.timeouts(ns) == {"*": 30.0, "kernel": 5.5}


def test_device_peaks_by_name():
    assert gpu_check.device_peaks("NVIDIA H200") == (4800.0, 989.0)
    assert gpu_check.device_peaks("NVIDIA H100 80GB HBM3") == (3350.0, 989.0)
    assert gpu_check.device_peaks("NVIDIA H100 PCIe") == (2000.0, 756.0)
    assert gpu_check.device_peaks("NVIDIA GeForce RTX 4090") is None


def test_agreement_counts_rows_and_common_prefixes():
    same, share = gpu_check._agreement([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 9, 6]])
    assert same == 1 and share == pytest.approx(4 / 6)


def test_tie_gap_tells_summation_ties_from_real_mismatches():
    """Row 0 draws u = 0.5 on target [0.25, 0.25, 0.5]: the CDF step after token 1 is exactly at the
    draw, so tokens 1 and 2 are a tie (gap 0); tokens 0 and 2 are not (a whole token's mass between)."""
    tp = torch.tensor([[[0.25, 0.25, 0.5], [0.25, 0.25, 0.5]]])
    from speclab.engine.acceptance import AcceptResult

    res = AcceptResult(torch.tensor([1]), torch.tensor([1]), torch.tensor([True]))  # accepted its one draft
    args = (torch.tensor([[0]]), None, tp, torch.tensor([1]), res, torch.tensor([0.5]))
    assert gpu_check.tie_gap(0, 1, 2, *args) == pytest.approx(0.0)
    assert gpu_check.tie_gap(0, 0, 2, *args) == pytest.approx(0.25)
    # rejected (0 accepted of 1): the residual max(target - one-hot(draft 2), 0) = [0.25, 0.25, 0]
    rej = AcceptResult(torch.tensor([0]), torch.tensor([0]), torch.tensor([False]))
    args = (torch.tensor([[2]]), None, tp, torch.tensor([1]), rej, torch.tensor([0.5]))
    assert gpu_check.tie_gap(0, 0, 1, *args) == pytest.approx(0.0)  # the draw sits on the step between 0 and 1


def test_kernel_inputs_are_valid_acceptance_inputs():
    drafts, dp, tp, nd, ua, un = gpu_check.kernel_inputs(5, 3, 40, False, seed=0, dev="cpu")
    assert tp.shape == (5, 4, 40) and dp.shape == (5, 3, 40) and drafts.shape == (5, 3)
    assert torch.allclose(tp.sum(-1), torch.ones(5, 4)) and torch.allclose(dp.sum(-1), torch.ones(5, 3))
    pad = torch.arange(3)[None] >= nd[:, None]
    assert bool((drafts[pad] == -1).all()) and bool((drafts[~pad] >= 0).all())
    drafts, dp, *_ = gpu_check.kernel_inputs(4, 0, 10, True, seed=1, dev="cpu")
    assert dp is None and drafts.shape == (4, 0)


def test_train_specs_scale_batches_and_tokens_in_the_same_steps():
    from speclab.family.specs import DEFAULT_SPECS, scale_batches

    sz = gpu_check.Sizes()
    big = {s.name: s for s in scale_batches(gpu_check.train_specs(sz), int(sz.train_scale))}
    for s in DEFAULT_SPECS:
        b = big[s.name]
        assert b.tokens == 10 * s.tokens and b.batch == 10 * s.batch and b.hidden == s.hidden
        assert b.tokens // (b.batch * b.seq) == s.tokens // (s.batch * s.seq)  # same steps, same schedules
        assert b.copy_schedule == s.copy_schedule
    assert big["target"].tokens >= 10 * 17_000_000
    tiny = gpu_check.train_specs(gpu_check.Sizes.tiny())
    assert all(s.tokens == 2 * s.batch * s.seq for s in tiny)


def test_pack_splits_into_parts_that_join(tmp_path):
    src = tmp_path / "family"
    src.mkdir()
    (src / "blob.bin").write_bytes(torch.randint(0, 256, (100_000,), dtype=torch.uint8).numpy().tobytes())
    out = tmp_path / "out"
    out.mkdir()
    old = gpu_check.PART_BYTES
    gpu_check.PART_BYTES = 40_000
    try:
        parts = gpu_check.pack(src, out, "fam")
        with pytest.raises(RuntimeError, match="parts"):
            gpu_check.pack(src, out, "fam2", max_parts=1)
    finally:
        gpu_check.PART_BYTES = old
    assert parts == [f"fam.tar.gz.part{i:02d}" for i in range(len(parts))] and len(parts) >= 2
    joined = tmp_path / "fam.tar.gz"
    joined.write_bytes(b"".join((out / p).read_bytes() for p in parts))
    with tarfile.open(joined) as tar:
        assert tar.extractfile("fam/blob.bin").read() == (src / "blob.bin").read_bytes()


def test_weight_and_kv_bytes():
    sz = gpu_check.Sizes.tiny()
    lm = gpu_check.random_llama(sz.big, "cpu", "float32")
    d = sz.big
    per_layer = (d["hidden"] * (d["heads"] + 2 * d["kv_heads"]) * (d["hidden"] // d["heads"])  # q, k, v
                 + d["hidden"] * d["hidden"] + 3 * d["hidden"] * d["ffn"] + 2 * d["hidden"])  # o, mlp, norms
    want = (d["layers"] * per_layer + d["hidden"] + d["vocab"] * d["hidden"]) * 4  # + final norm + head, fp32
    assert gpu_check.weight_bytes(lm) == want  # the embedding table is not read by a step
    tied = gpu_check.random_llama(sz.big, "cpu", "float32", copy_head=True)
    assert gpu_check.weight_bytes(tied) == want  # the tied head is read once, as the head
    assert gpu_check.kv_bytes(lm, 2, 10) == 2 * d["layers"] * d["kv_heads"] * (d["hidden"] // d["heads"]) * 10 * 2 * 4
    # the copy head repeats the last token with a wide margin (what keeps bf16 greedy paths stable)
    from speclab.engine import SpeculativeDecoder

    out = SpeculativeDecoder(tied, None).generate([[5, 9, 7]], k=0, max_new_tokens=4, record=False)
    assert out.output_tokens[0] == [7, 7, 7, 7]


def test_markdown_and_headline_from_a_report():
    report = {"command": "python scripts/gpu_check.py --out x", "dry_run": False, "started": "now", "budget_s": 540,
              "wall_s": 100.0, "device": "NVIDIA H200", "sections": {
                  "roofline": {"title": "t", "status": "ok", "wall_s": 10, "budget_s": 90,
                               "summary": {"dtype": "bfloat16", "context": 512, "eager_ms": 2.0, "graphs_ms": 0.6,
                                           "roofline_ms": 0.45, "fraction_eager": 0.225, "fraction_graphs": 0.75,
                                           "graph_speedup": 3.33, "verify_graph_speedup": 3.0,
                                           "bandwidth_gbs": 3350.0},
                               "rows": [{"T": 1, "mode": "eager", "step_ms": 2.0}], "notes": ["a | note"],
                               "tables": {"kernels": [{"mode": "eager", "kind": "matmul", "busy_ms": 0.5}]}},
                  "round": {"title": "r", "status": "ok", "wall_s": 30, "budget_s": 100,
                            "summary": {"k": 4, "mode": "cuda graph", "dtype": "bfloat16", "batches": [1, 8, 64],
                                        "batch1": {"speculative": {"round_ms": 1.0, "floor_ms": 0.5, "draft_ms": 0.3,
                                                                   "verify_ms": 0.5, "accept_ms": 0.1,
                                                                   "bookkeeping_ms": 0.1}},
                                        "speedup": {"0.6": {"1": 1.5, "8": 1.1, "64": 0.7}},
                                        "crossover_batch": {"0.6": 64, "0.8": None},
                                        "fp32_identical": True, "graph_equals_eager_k4": True},
                            "rows": [{"batch": 1}], "notes": []},
                  "crossover-1b": {"title": "c", "status": "timeout", "reason": "stopped", "wall_s": 150,
                                   "budget_s": 150, "summary": {"crossover_batch": {"synthetic:0.6:0.1": 32,
                                                                                     "synthetic:0.8:0.1": None},
                                                                "batches": [1, 2, 256]}, "rows": [], "notes": []}}}
    report["headline"] = gpu_check.headline(report["sections"], dry=False)
    md = gpu_check.markdown(report)
    assert "| ... the engine's graphed step | 0.600 ms = 75% of roofline |  |" in md
    assert "(0.450 ms at 3350 GB/s)" in md
    assert "1.000 ms (draft 0.300, verify 0.500, accept 0.100, bookkeeping 0.100 ms); floor 0.500 ms = 50%" in md
    assert "alpha 0.6: b1 1.50x, b8 1.10x, b64 0.70x" in md and "alpha 0.6: 64, alpha 0.8: none up to 64" in md
    assert "### roofline: kernels" in md and "| eager | matmul | 0.5 |" in md
    assert "synthetic:0.6:0.1: 32, synthetic:0.8:0.1: none up to 256" in md
    assert "| crossover-1b | timeout | 150 / 150 | stopped |" in md
    assert "a \\| note" in md and "Dry run" not in md


# ---------------------------------------------------------------------------------------------- orchestration
@pytest.mark.slow
def test_one_section_writes_json_markdown_and_log(tmp_path):
    p = _run(tmp_path, "--only", "env", timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    rep = json.loads((tmp_path / "gpu_check.json").read_text())
    assert rep["dry_run"] and list(rep["sections"]) == ["env"]
    env = rep["sections"]["env"]
    assert env["status"] == "ok" and env["summary"]["torch"] == torch.__version__
    assert "[env] ok in" in (tmp_path / "gpu_check.log").read_text()
    assert "Dry run" in (tmp_path / "gpu_check.md").read_text()


@pytest.mark.slow
def test_a_section_past_its_timeout_is_stopped_and_recorded(tmp_path):
    p = _run(tmp_path, "--only", "env,roofline", "--timeout", "roofline=2", timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    rep = json.loads((tmp_path / "gpu_check.json").read_text())
    assert rep["sections"]["env"]["status"] == "ok"
    sec = rep["sections"]["roofline"]
    assert sec["status"] == "timeout" and "stopped at its budget (2s)" in sec["reason"] and sec["wall_s"] >= 2


@pytest.mark.slow
def test_real_run_without_cuda_is_refused(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    p = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and "no CUDA device" in p.stderr and "--dry-run" in p.stderr


@pytest.mark.slow
def test_dry_run_end_to_end(tmp_path):
    """Every section on the CPU with tiny sizes: all succeed, the tables hold their rows, the graph
    sections say they skipped capture and ran the static path, the weights come back packed."""
    p = _run(tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rep = json.loads((tmp_path / "gpu_check.json").read_text())
    secs = rep["sections"]
    assert list(secs) == [s[0] for s in gpu_check.SECTIONS]
    # the kernel section needs Triton (the gpu extra); without it the section says so and skips
    want = {n: "ok" for n in secs}
    if importlib.util.find_spec("triton") is None:
        want["kernel"] = "skipped"
    assert {n: s["status"] for n, s in secs.items()} == want, {n: s.get("reason") for n, s in secs.items()}
    if want["kernel"] == "ok":
        assert secs["kernel"]["summary"]["verdict"] == "exact"
    else:
        assert "Triton" in secs["kernel"]["reason"]
    modes = {r["mode"] for r in secs["roofline"]["rows"]}
    assert modes == {"eager", "static eager"}
    assert any("skipped: no CUDA" in n for n in secs["roofline"]["notes"])
    assert all(r["same_argmax"] for r in secs["roofline"]["rows"])
    assert {r["mode"] for r in secs["roofline"]["tables"]["kernels"]} == {"eager", "static eager"}
    # the round: plain and speculative at every batch, eagerly (no CUDA), with speedups, kernels and identity
    rnd = secs["round"]
    assert {(r["batch"], r["k"], r["mode"]) for r in rnd["rows"]} == {(b, k, "eager") for b in (1, 2) for k in (0, 4)}
    assert all(r["verify_ms"] > 0 and r["round_ms"] > 0 and r["floor_ms"] > 0 for r in rnd["rows"])
    assert {r["tokens_per_round"] for r in rnd["rows"] if r["k"] == 4} == {5.0}  # copy heads: all accepted
    assert {(r["batch"], r["alpha"]) for r in rnd["tables"]["speedup"]} == {(b, a) for b in (1, 2) for a in (0.6, 0.8)}
    assert {r["k"] for r in rnd["tables"]["kernels"]} == {0, 4}
    assert rnd["summary"]["fp32_identical"] is True and all(r["ok"] for r in rnd["tables"]["identity"])
    assert set(rnd["summary"]["crossover_batch"]) == {"0.6", "0.8"}
    comp = secs["compile"]
    assert [r["k"] for r in comp["tables"]["whole round, compiled"]] == [0, 4]
    assert comp["summary"]["round_compiled_ms"] > 0 and set(comp["summary"]["spec_speedup"]) == {"0.6", "0.8"}
    assert secs["exactness"]["summary"]["fp32_identical"] is True
    for name in ("crossover-1b", "crossover-family"):
        rows = secs[name]["rows"]
        assert {r["batch"] for r in rows} == {1, 2, 4}
        assert set(secs[name]["summary"]["crossover_batch"]) == {r["draft"] for r in rows if r["draft"] != "none"}
    fam = {r["draft"] for r in secs["crossover-family"]["rows"]}
    assert {"none", "ngram", "synthetic:0.6:0.1", "synthetic:0.8:0.1"} <= fam
    assert [r["model"] for r in secs["train"]["rows"]][0] == "target"
    assert secs["train"]["summary"]["weights"] == ["train_family.tar.gz.part00"]
    assert (tmp_path / "train_family.tar.gz.part00").stat().st_size > 10_000
    md = (tmp_path / "gpu_check.md").read_text()
    assert "Dry run" in md and "| metric | value | target |" in md
    for name in secs:
        assert f"## {name}:" in md
    assert len(list(tmp_path.iterdir())) <= 8  # what the device tool brings back
