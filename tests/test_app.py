"""The Gradio lab: validation and configuration (fast, in-process), then the real app started with
``python app.py`` on a free local port and driven through ``gradio_client`` (slow).

Models: the embedded family when its weights are present (target + its weakest draft, and the
``mismatch`` model), otherwise tiny random Llamas built in a temporary directory.
"""

from __future__ import annotations

import csv
import threading

import pytest

from speclab.app import advice, config, decode, jobs, load_tab, sweep, timing
from speclab.app.testing import AppProcess, build_tiny_models, family_models, models_for_tests
from speclab.errors import SpeclabError

STATUSES = {"accepted", "rejected", "recovered", "bonus", "target"}


# ------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return models_for_tests(tmp_path_factory.mktemp("tiny-models"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_models(tmp_path_factory.mktemp("tiny-only"))


@pytest.fixture(scope="module")
def server(models):
    args = ["--target", models["target"], "--draft", models["draft"]]
    if models.get("mismatch"):
        args += ["--drafts", models["mismatch"]]
    app = AppProcess(args)
    yield app
    app.close()


@pytest.fixture(scope="module")
def client(server):
    from gradio_client import Client

    return Client(server.url, verbose=False)


def decode_via_api(client, prompt="def add(a, b):\n    return", target=None, draft=None, k=4, batch=1,
           fill=decode.FILL_WORKLOAD, workload="code", temperature=0.0, top_p=1.0, max_new_tokens=32, seed=0, pace=0,
           rows="all rows", **kw):
    cfg = kw.pop("models")
    out = client.predict(prompt, target or cfg["target"], draft or cfg["draft"], k, batch, fill, workload,
                         temperature, top_p, max_new_tokens, seed, pace, rows, api_name="/decode")
    status, cards, tokens_html, result, _rows, _k_chart, _tree_pick, _tree = out
    return status, cards, tokens_html, result


# ------------------------------------------------------------------------------ fast: no server
def test_config_defaults_to_family_or_given_models(tiny, monkeypatch):
    cfg = config.AppConfig.build(target=tiny["target"], draft=tiny["draft"])
    assert cfg.default_target == tiny["target"] and cfg.targets[0] == tiny["target"]
    assert cfg.default_draft == tiny["draft"]
    assert cfg.drafts[-2:] == ("ngram", "none") and not cfg.allow_custom_models
    fam = family_models()
    if fam is not None:  # with the family shipped, a bare app offers it
        bare = config.AppConfig.build()
        assert bare.default_target == fam["target"]
        assert fam["draft"] in bare.drafts and bare.default_draft != "none"
    monkeypatch.setenv("SPECLAB_TARGET", tiny["target"])
    monkeypatch.setenv("SPECLAB_DRAFTS", f"{tiny['draft']},{tiny['mismatch']}")
    monkeypatch.setenv("SPECLAB_ALLOW_CUSTOM_MODELS", "1")
    env = config.AppConfig.from_env()
    assert env.default_target == tiny["target"] and env.allow_custom_models
    assert tiny["mismatch"] in env.drafts
    assert config.AppConfig.from_env(target="other").default_target == "other"  # a flag beats the env
    for off in ("0", "", "no", "off", "2"):
        monkeypatch.setenv("SPECLAB_ALLOW_CUSTOM_MODELS", off)
        assert not config.AppConfig.from_env().allow_custom_models, off
    monkeypatch.setenv("SPECLAB_ALLOW_CUSTOM_MODELS", " Yes ")
    assert config.AppConfig.from_env().allow_custom_models


def test_validate_decode_ranges(tiny):
    cfg = config.AppConfig.build(target=tiny["target"], draft=tiny["draft"])
    ok = dict(prompt="hi", target=tiny["target"], draft="ngram", k=4, batch=2, temperature=0.7, top_p=0.9,
              max_new_tokens=16, seed=3)
    s = decode.validate_decode(cfg, **ok)
    assert (s.k, s.batch, s.max_new_tokens, s.seed) == (4, 2, 16, 3) and isinstance(s.k, int)
    assert decode.validate_decode(cfg, **{**ok, "k": 4.0}).k == 4  # sliders send floats
    bad = {"prompt": ["", "   ", None, "x" * (decode.MAX_PROMPT_CHARS + 1)], "k": [-1, 17, 2.5, "abc", None, True],
           "batch": [0, config.MAX_BATCH + 1], "temperature": [-0.1, 2.5, float("nan")], "top_p": [0, -1, 1.5],
           "top_k": [-1, 1.5, decode.MAX_TOP_K + 1, "x"], "policy": ["bogus", 3],
           "max_new_tokens": [0, config.MAX_NEW_TOKENS + 1], "seed": [-1, 1.5],
           "draft": ["bogus", "/etc", "", None], "target": ["nope", ""]}
    for key, values in bad.items():
        for v in values:
            with pytest.raises(SpeclabError):
                decode.validate_decode(cfg, **{**ok, key: v})


def test_custom_models_need_the_flag(tiny):
    strict = config.AppConfig.build(target=tiny["target"], draft="ngram")
    with pytest.raises(SpeclabError, match="allow-custom-models"):
        config.check_model_choice(strict, tiny["draft"], "draft")
    loose = config.AppConfig.build(target=tiny["target"], draft="ngram", allow_custom_models=True)
    assert config.check_model_choice(loose, tiny["draft"], "draft") == tiny["draft"]
    assert config.check_model_choice(loose, "NONE", "draft") == "none"


def test_no_target_is_a_message_not_a_crash(monkeypatch):
    monkeypatch.setattr(config, "_family", lambda: [])
    cfg = config.AppConfig.build(presets=False)
    assert cfg.targets == () and cfg.default_target is None and cfg.default_draft == "ngram"
    with pytest.raises(SpeclabError, match="--target"):
        decode.validate_decode(cfg, "hello", None, "ngram", 2, 1, 0, 1, 8, 0)
    # the hub presets are offered, never the default: the first screen must not start a download
    cfg = config.AppConfig.build()
    assert cfg.default_target is None and cfg.default_draft == "ngram" and "qwen2.5-7b" in cfg.targets
    with pytest.raises(SpeclabError, match="--target"):
        decode.validate_decode(cfg, "hello", None, "ngram", 2, 1, 0, 1, 8, 0)


def test_presets_are_offered_with_their_download_and_fail_offline_in_one_line(tiny, monkeypatch):
    from speclab.app.ui.common import label

    cfg = config.AppConfig.build(target=tiny["target"], draft=tiny["draft"])
    assert cfg.default_target == tiny["target"] and cfg.default_draft == tiny["draft"]
    assert {"smollm2-360m", "qwen2.5-7b", "llama-3.1-8b"} <= set(cfg.targets) & set(cfg.drafts)
    assert cfg.drafts[-2:] == ("ngram", "none")
    assert label("qwen2.5-7b", "target").startswith("qwen2.5-7b: Qwen/Qwen2.5-7B-Instruct (hub, ~15.2 GB")
    assert label("qwen2.5-7b", "draft").startswith("qwen2.5-7b: Qwen/Qwen2.5-0.5B-Instruct (hub, ~1.0 GB")
    monkeypatch.setenv("SPECLAB_PRESETS", "0")
    assert "qwen2.5-7b" not in config.AppConfig.from_env(target=tiny["target"]).targets
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    s = decode.validate_decode(cfg, "hello", "qwen2.5-7b", "ngram", 2, 1, 0, 1, 8, 0)
    with pytest.raises(SpeclabError, match=r"preset 'qwen2.5-7b' needs Qwen/Qwen2.5-7B-Instruct .*HF_HUB_OFFLINE.*"
                                           r"embedded family works offline") as e:
        list(decode.run_decode(cfg, s))
    assert "\n" not in str(e.value)


def test_batch_rows_and_sweep_validation(tiny):
    cfg = config.AppConfig.build(target=tiny["target"], draft=tiny["draft"])
    s = decode.validate_decode(cfg, "my prompt", tiny["target"], "ngram", 2, 3, 0, 1, 8, 0, decode.FILL_WORKLOAD,
                               "code")
    rows = decode.batch_prompts(s)
    assert len(rows) == 3 and rows[0] == "my prompt" and rows[1] != "my prompt"
    s2 = decode.validate_decode(cfg, "my prompt", tiny["target"], "ngram", 2, 3, 0, 1, 8, 0, decode.FILL_COPIES)
    assert decode.batch_prompts(s2) == ["my prompt"] * 3
    sw = sweep.validate_sweep(cfg, tiny["target"], ["code"], ["ngram", "none"], [2, "4"], [1, 2], 2, 8, 0)
    assert sw.drafts == ("ngram",) and sw.ks == (2, 4) and sw.cells == 2 * (1 + 2)
    for bad in (dict(workloads=[]), dict(workloads=["nope"]), dict(drafts=["none"]), dict(ks=[0]), dict(ks=[99]),
                dict(batches=[config.MAX_BATCH + 1]),
                dict(ks=sweep.SWEEP_KS, batches=sweep.SWEEP_BATCHES, workloads=["code", "json", "copy"])):
        args = dict(workloads=["code"], drafts=["ngram"], ks=[2], batches=[1])
        args.update(bad)
        with pytest.raises(SpeclabError):
            sweep.validate_sweep(cfg, tiny["target"], args["workloads"], args["drafts"], args["ks"], args["batches"],
                                 2, 8, 0)


def test_drafters_are_per_run_models_shared(tiny):
    """Two concurrent runs (two users' sweeps) must not share a model drafter's KV cache."""
    from speclab.analysis.sweep import cached_model, new_drafter

    target = cached_model(tiny["target"], role="target")
    a, b = new_drafter(tiny["draft"], target), new_drafter(tiny["draft"], target)
    assert a is not b and a.lm is b.lm  # fresh drafter state, one loaded draft model
    assert new_drafter("none", target) is None


def test_run_decode_streams_then_measures_baseline(tiny):
    cfg = config.AppConfig.build(target=tiny["target"], draft=tiny["draft"])
    s = decode.validate_decode(cfg, "def f(x):", tiny["target"], tiny["draft"], 3, 2, 0, 1, 24, 0, pace_ms=1)
    views = [(v.phase, len(v.tokens)) for v in decode.run_decode(cfg, s)]
    assert views[0][0] == "speculative" and views[-1][0] == "done"
    assert sum(1 for p, _ in views if p == "speculative") >= 3  # streamed round by round
    assert ("baseline", 2) in views


def test_stop_gate_ends_the_run_before_stop_returns():
    """Stop waits for the run to end, so no update can land after the page says "stopped" (Gradio's own
    cancel raced the round already on its way, and the status went back to "decoding")."""
    import copy
    import time

    closed = threading.Event()

    def updates():
        try:
            for i in range(1000):
                time.sleep(0.03)  # a round
                yield i
        finally:
            closed.set()

    gate = jobs.StopGate()
    seen, done = [], threading.Event()

    def page():
        for u in jobs.StopGate.guard(updates(), gate):
            seen.append(u)
            time.sleep(0.02)  # the update on its way to the page
        done.set()

    threading.Thread(target=page, daemon=True).start()
    deadline = time.monotonic() + 60
    while len(seen) < 3 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert len(seen) >= 3, seen
    assert gate.stop(timeout=5)
    assert closed.is_set()  # stop() returned only once the run had ended (closed, not left to run its rounds)
    n = len(seen)
    assert done.wait(1)
    time.sleep(0.2)
    assert len(seen) == n < 1000
    # a run that begins right after Stop (Gradio sends the control change it kept during the run as soon
    # as the stream closes) was asked for before Stop: refused, nothing reaches the page
    assert list(jobs.StopGate.guard(iter(range(3)), gate)) == []
    # once the quiet window has passed, the next run on the same page starts unstopped
    time.sleep(jobs.StopGate.QUIET_S + 0.05)
    assert list(jobs.StopGate.guard(iter(range(3)), gate)) == [0, 1, 2]
    # a page's copy is a fresh gate; no run: returns at once
    fresh = copy.deepcopy(gate)
    assert fresh is not gate and fresh.stop(timeout=0)


def test_stop_says_stopped_again_after_late_updates_unless_a_run_goes():
    """Stop's answer and the run's last updates travel on two streams, so the page may get a round's status after
    "stopped"; a moment later Stop says it again (inside the gate's quiet window, when no new run can have begun).
    With a run going it says nothing."""
    import time

    import gradio as gr

    from speclab.app.ui import common

    gate = jobs.StopGate()
    t = time.monotonic()
    assert common.restate(gate, "⏹ stopped") == "⏹ stopped"
    assert 0.5 * jobs.StopGate.QUIET_S <= time.monotonic() - t < jobs.StopGate.QUIET_S  # before a new run may start
    running = jobs.StopGate()
    assert running.begin() and not running.idle
    assert isinstance(common.restate(running, "⏹ stopped"), type(gr.skip()))


def test_command_line_defaults_are_local(monkeypatch):
    import subprocess
    import sys
    from pathlib import Path

    from speclab.app import parse_args

    monkeypatch.delenv("GRADIO_SERVER_NAME", raising=False)
    monkeypatch.delenv("GRADIO_SERVER_PORT", raising=False)
    a = parse_args([])
    assert (a.host, a.port, a.share, a.allow_custom_models) == ("127.0.0.1", 7860, False, None)
    a = parse_args(["--target", "t", "--draft", "d", "--allow-custom-models", "--port", "9", "--host", "0.0.0.0"])
    assert (a.target, a.draft, a.allow_custom_models, a.port, a.host) == ("t", "d", True, 9, "0.0.0.0")
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(root / "app.py"), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--allow-custom-models" in out.stdout and "--share" in out.stdout


def test_requirements_match_pyproject():
    """requirements.txt (the Space's install list) = pyproject's dependencies + the [app] extra."""
    from pathlib import Path

    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")

    root = Path(__file__).resolve().parents[1]
    proj = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    want = {d.replace(" ", "") for d in proj["dependencies"] + proj["optional-dependencies"]["app"]}
    lines = [ln.split("#")[0].strip() for ln in (root / "requirements.txt").read_text().splitlines()]
    have = {ln.replace(" ", "") for ln in lines if ln and not ln.startswith("-")}
    assert have == want
    # a CPU Space must not pull PyPI's CUDA build of torch
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in lines


def test_spaces_decorator_is_a_noop_without_spaces():
    import importlib.util

    from speclab.app.ui import common

    if importlib.util.find_spec("spaces") is None:
        def f(x):
            return x

        assert common.gpu(60)(f) is f


# ------------------------------------------------------------------------------ slow: the running app
@pytest.mark.slow
def test_decode_endpoint_returns_tokens_and_metrics(client, models):
    status, cards, html, res = decode_via_api(client, models=models, k=4, batch=2, max_new_tokens=40)
    assert res["error"] is None, res
    assert status.startswith("✓") and "speedup" in status
    assert len(res["tokens"]) == 2 and len(res["prompts"]) == 2
    seen = {t["status"] for row in res["tokens"] for t in row}
    assert seen <= STATUSES and {"accepted", "rejected"} <= seen, seen
    for row in res["tokens"]:
        emitted = [t for t in row if t["status"] != "rejected"]
        assert len(emitted) <= 40 and emitted
        for t in row:
            assert isinstance(t["token"], int) and isinstance(t["text"], str) and t["round"] >= 0
            assert t["target_prob"] is None or 0.0 <= t["target_prob"] <= 1.0
    m, b = res["metrics"], res["baseline_metrics"]
    for key in ("acceptance_rate", "mean_accepted_length", "tokens_per_s", "ttft_ms", "tpot_ms"):
        assert m[key] is not None, key
    assert 0.0 <= m["acceptance_rate"] <= 1.0 and m["mean_accepted_length"] >= 1.0
    assert b["drafted_tokens"] == 0 and b["tokens_per_s"] > 0
    assert res["speedup"] == pytest.approx(m["tokens_per_s"] / b["tokens_per_s"])
    assert res["settings"]["k"] == 4 and res["settings"]["batch"] == 2
    assert "tok-accepted" in html and "tok-rejected" in html and "speedup vs k=0" in cards
    # the baseline reproduces the speculative output exactly (greedy)
    spec_ids = [[t["token"] for t in row if t["status"] != "rejected"] for row in res["tokens"]]
    _, _, _, base = decode_via_api(client, models=models, draft="none", k=4, batch=2, max_new_tokens=40)
    assert [[t["token"] for t in row] for row in base["tokens"]] == spec_ids
    assert base["speedup"] == pytest.approx(1.0) and base["metrics"]["mean_accepted_length"] == 1.0


@pytest.mark.slow
def test_decode_streams_updates(client, models):
    job = client.submit("def area(r):", models["target"], models["draft"], 2, 1, decode.FILL_COPIES, "code", 0.0,
                        1.0, 24, 0, 20, "all rows", api_name="/decode")
    final = job.result(timeout=120)
    assert final[3]["error"] is None
    outs = job.outputs()
    assert len(outs) >= 4, "expected several streamed updates"
    assert any(o[0].startswith("▶ decoding") for o in outs)


@pytest.mark.slow
def test_bad_input_is_a_message_and_the_app_keeps_serving(client, models, server):
    cases = [
        (dict(prompt=""), "prompt is empty"),
        (dict(prompt="   \n"), "prompt is empty"),
        (dict(k=99), "between 0 and 16"),
        (dict(batch=0), "batch size"),
        (dict(temperature=-3), "temperature"),
        (dict(top_p=0), "top-p"),
        (dict(max_new_tokens=100000), "max new tokens"),
        (dict(draft="no-such-model"), "unknown draft"),
        (dict(draft="/tmp"), "allow-custom-models"),
        (dict(target="gpt-5"), "unknown target"),
    ]
    if models.get("mismatch"):
        cases.append((dict(draft=models["mismatch"]), "different tokenizers"))
    for kw, expected in cases:
        status, _, _, res = decode_via_api(client, models=models, **kw)
        assert expected in res["error"], (kw, res)
        assert expected in status and "Traceback" not in status
    assert server.alive()
    _, _, _, res = decode_via_api(client, models=models, max_new_tokens=8)
    assert res["error"] is None and res["tokens"][0]


@pytest.mark.slow
def test_concurrent_sessions_get_their_own_runs(server, models):
    from gradio_client import Client

    a, b = Client(server.url, verbose=False), Client(server.url, verbose=False)
    out = {}

    def go(name, c, k, batch, prompt):
        out[name] = c.predict(prompt, models["target"], models["draft"], k, batch, decode.FILL_COPIES, "code", 0.0,
                              1.0, 16, 0, 5, "all rows", api_name="/decode")[3]

    ts = [threading.Thread(target=go, args=("a", a, 2, 1, "import os\n")),
          threading.Thread(target=go, args=("b", b, 5, 3, "class Stack:\n"))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(180)
    assert out["a"]["settings"]["k"] == 2 and len(out["a"]["tokens"]) == 1
    assert out["a"]["prompts"] == ["import os\n"]
    assert out["b"]["settings"]["k"] == 5 and len(out["b"]["tokens"]) == 3
    assert out["b"]["prompts"] == ["class Stack:\n"] * 3


@pytest.mark.slow
def test_sweep_endpoint_returns_rows_and_csv(client, models):
    out = client.predict(models["target"], ["code"], [models["draft"], "ngram"], [2], [1, 2], 2, 8, 0.0,
                         api_name="/sweep")
    status, p_acc, p_k, p_batch, p_pos, table, cross, csv_path = out
    assert status.startswith("✓"), status
    headers, data = table["headers"], table["data"]
    assert {"workload", "batch", "draft", "k", "acceptance_rate", "tokens_per_s", "speedup"} <= set(headers)
    assert len(data) == 2 * (1 + 2)  # per batch size: the baseline + two drafts at k = 2
    rows = [dict(zip(headers, r)) for r in data]
    assert {r["draft"] for r in rows} == {"none", "ngram", models["draft"]}
    assert all(r["speedup"] > 0 for r in rows)
    for plot in (p_acc, p_k, p_batch, p_pos):
        assert plot["type"] == "altair" and '"$schema"' in plot["plot"]
    with open(csv_path, newline="") as f:
        assert len(list(csv.DictReader(f))) == len(data)
    assert {"crossover_batch"} <= set(cross["headers"])


@pytest.mark.slow
def test_sweep_and_timing_bad_input(client, models):
    out = client.predict(models["target"], [], ["ngram"], [2], [1], 2, 8, 0.0, api_name="/sweep")
    assert "workload" in out[0]
    out = client.predict(models["target"], ["code"], ["ngram"], [99], [1], 2, 8, 0.0, api_name="/sweep")
    assert "between 1 and 16" in out[0]  # the app's k range
    out = client.predict("", models["target"], "ngram", 4, 16, api_name="/timing")
    assert "prompt is empty" in out[0]


@pytest.mark.slow
def test_timing_endpoint(client, models):
    status, gaps, cum, ttft, table, phases = client.predict("def fibonacci(n):\n", models["target"], models["draft"],
                                                            4, 24, api_name="/timing")
    assert status.startswith("✓"), status
    assert gaps["type"] == "altair" and ttft["type"] == "altair" and phases["type"] == "altair"
    methods = [r[0] for r in table["data"]]
    assert methods[0] == "baseline (k=0)" and len(methods) == 2
    assert all(r[1] > 0 for r in table["data"])  # TTFT for both


def test_timing_runs_are_warmed_and_interleaved(models, monkeypatch):
    """Speculation does nothing for the prefill, so neither method may pay the process's first, slow forwards:
    both paths are warmed on the prompt, then the measured runs alternate (baseline, speculative, ...)."""
    cfg = config.AppConfig.build(target=models["target"], draft=models["draft"])
    prompt = '{"name": "Ada", "email": "ada@example.com", "city": "'
    s = decode.validate_decode(cfg, prompt, models["target"], models["draft"], 4, 1, 0.0, 1.0, 24, 0)
    from speclab.engine import SpeculativeDecoder

    calls = []  # k of every run on this prompt, in the order the timing tab makes them
    real = SpeculativeDecoder._run

    def spy(self, prompts, k, *a, **kw):
        if list(prompts) == [prompt]:
            calls.append(k)
        return real(self, prompts, k, *a, **kw)

    monkeypatch.setattr(SpeculativeDecoder, "_run", spy)
    r = timing.run_timing(cfg, s, repeats=3)
    # a warm-up run of each path, then the three measured pairs, interleaved
    assert calls == [0, 4] + [0, 4] * 3, calls
    assert list(r["ttft"]["repeats"]) == [3, 3] and (r["ttft"]["ttft_ms"] > 0).all()
    assert r["speedup"] is not None and r["speedup"] > 0
    ph = r["phases"]  # a round phase by phase, each method beside its floor
    assert {"baseline (k=0)", "floor: plain step"} <= set(ph["method"]) and (ph["ms"] >= 0).all()
    assert ph[ph["method"] == "baseline (k=0)"]["ms"].sum() > 0


@pytest.mark.slow
def test_advisor_endpoint(client):
    status, verdicts, chart, rubric, notes = client.predict(
        advice.ACCEPTANCE_TYPED, "json:0.85,creative:0.08", None, "h100", "llama-3.1-8b", advice.DRAFT_BY_COST, 0.05,
        4, 8, 0, 0, 256, api_name="/advise")
    assert status.startswith("✓"), status
    rows = {r[0]: r for r in verdicts["data"]}
    assert rows["json"][1] == "enable" and rows["creative"][1] == "do not enable"
    assert "low acceptance" in rows["creative"][2]
    assert chart["type"] == "altair" and rubric["data"] and "Not covered" in notes
    bad = client.predict(advice.ACCEPTANCE_TYPED, "json:1.7", None, "h100", "llama-3.1-8b", advice.DRAFT_BY_COST, 0.05,
                         4, 8, 0, 0, 256, api_name="/advise")
    assert "⚠" in bad[0] and "json" in bad[0]
    bad = client.predict(advice.ACCEPTANCE_SHIPPED, "", None, "tpu-v9", "llama-3.1-8b", advice.DRAFT_BY_COST, 0.05,
                         4, 8, 0, 0, 256, api_name="/advise")
    assert "unknown hardware" in bad[0]


def test_load_validation(models):
    cfg = config.AppConfig.build(target=models["target"], draft=models["draft"])
    ok = dict(server=load_tab.LOAD_IN_PROCESS, url="", target=models["target"], draft=models["draft"],
              policies=["off", "fixed"], k=4, levels=[4, 1], workload="json", requests=4, max_tokens=16)
    s = load_tab.validate_load(cfg, **ok)
    assert s.levels == (1, 4) and s.cells == 4 and s.url is None
    bad = {"server": ["bogus", load_tab.LOAD_REMOTE], "policies": [[], ["bogus"]], "levels": [[], [0], [999]],
           "workload": ["nope"], "requests": [0], "k": [0, 99]}
    for key, values in bad.items():
        for v in values:
            with pytest.raises(SpeclabError):
                load_tab.validate_load(cfg, **{**ok, key: v})
    with pytest.raises(SpeclabError, match="allow-remote-servers"):
        load_tab.validate_load(cfg, **{**ok, "server": load_tab.LOAD_REMOTE, "url": "http://127.0.0.1:9"})
    remote = config.AppConfig.build(target=models["target"], draft=models["draft"], allow_remote_servers=True)
    assert load_tab.validate_load(remote, **{**ok, "server": load_tab.LOAD_REMOTE,
                                             "url": "http://127.0.0.1:9/v1"}).url == "http://127.0.0.1:9"
    with pytest.raises(SpeclabError, match="URL"):
        load_tab.validate_load(remote, **{**ok, "server": load_tab.LOAD_REMOTE, "url": "ftp://x"})


@pytest.mark.slow
def test_load_tab_measures_its_own_server_and_reads_the_pacing(models):
    """The Load tab's job: speclab serve started in this process per policy, speclab load at two levels; plain
    decoding reads smooth, fixed-k speculation bursty, and the acceptance comes from /metrics."""
    cfg = config.AppConfig.build(target=models["target"], draft=models["draft"])
    s = load_tab.validate_load(cfg, load_tab.LOAD_IN_PROCESS, "", models["target"], models["draft"],
                               ["off", "fixed"], 4, [1, 2], "json", 3, 32)
    job = load_tab.LoadJob(cfg, s).start()
    assert job.wait(300) and job.error is None, job.error
    table, acc = load_tab.load_tables(job.results)
    assert set(table["policy"]) == {"off", "fixed"} and len(table) == 4
    assert (table["failed"] == 0).all() and (table["tok_s"] > 0).all()
    assert set(table[table["policy"] == "off"]["verdict"]) == {"plain"}
    assert set(table[table["policy"] == "fixed"]["verdict"]) == {"speculative"}
    assert len(acc) == 4 and (acc["policy"] == "fixed").all() and (acc["acceptance_rate"] > 0).all()
    assert sorted(acc["workload"]) == ["all", "all", "json", "json"]  # the level, and the one workload tag it sent


def test_load_tab_dead_server_is_one_line(models):
    cfg = config.AppConfig.build(target=models["target"], draft=models["draft"], allow_remote_servers=True)
    s = load_tab.validate_load(cfg, load_tab.LOAD_REMOTE, "http://127.0.0.1:9", models["target"], models["draft"],
                               [], 4, [1], "json", 1, 8)
    job = load_tab.LoadJob(cfg, s).start()
    assert job.wait(120)
    assert isinstance(job.error, SpeclabError) and "failed" in str(job.error) and "\n" not in str(job.error)


def test_tree_decode_draws_the_rounds(models):
    """Heads and trees in the Decode tab: a tree proposal's rounds come back with their trees, drawn as SVG
    (fates coloured, the accepted path highlighted); early exit refuses trees in one line."""
    from speclab.app.ui import tab_decode
    from speclab.drafters.heads import list_heads

    if not any(h["name"] == "eagle" for h in list_heads()):
        pytest.skip("no shipped EAGLE head")
    cfg = config.AppConfig.build()
    assert {"eagle", "early-exit"} <= set(cfg.drafts)
    s = decode.validate_decode(cfg, '{"name": "', cfg.default_target, "eagle", 8, 1, 0.0, 1.0, 24, 0,
                               tree="dynamic", nodes=8)
    assert s.drafter_spec == "eagle:tree=dynamic:nodes=8"
    view = list(decode.run_decode(cfg, s))[-1].to_dict()
    assert view["trees"] and all(len(t["tree"]["tokens"]) <= 8 for t in view["trees"])
    svg = tab_decode.tree_html(cfg, view, tab_decode.ALL_ROWS, 1)
    assert "<svg" in svg and "#1a7f37" in svg and "round" in svg
    assert "No token trees" in tab_decode.tree_html(cfg, {"trees": []}, tab_decode.ALL_ROWS, 1)
    with pytest.raises(SpeclabError, match="chains only"):
        decode.validate_decode(cfg, "x", cfg.default_target, "early-exit", 4, 1, 0.0, 1.0, 8, 0, tree="static")


def test_stop_gate_refuses_a_run_that_begins_while_stop_waits():
    """The run Gradio dispatches when the cancelled one's stream closes can arrive while Stop still waits for
    the old run: it must end at once, not clear the stop and keep the old run (and Stop) going."""
    import time

    gate = jobs.StopGate()
    old = jobs.StopGate.guard(iter(range(3)), gate)
    assert next(old) == 0  # the old run's update is on its way to the page: it has not ended yet
    stopped = []
    t = threading.Thread(target=lambda: stopped.append(gate.stop(timeout=5)), daemon=True)
    t.start()
    time.sleep(0.05)  # Stop is waiting for the old run
    assert not stopped
    assert list(jobs.StopGate.guard(iter(range(3)), gate)) == []  # the late run: refused
    assert list(jobs.StopGate.guard(iter(range(3)), gate, refused="no change")) == ["no change"]
    assert list(old) == []  # resumed, the old run sees the stop (not cleared by the late run) and ends
    t.join(5)
    assert stopped == [True]


# ------------------------------------------------------------------------------ start-up and the Space
def test_busy_port_is_one_line(capsys):
    import socket

    from speclab.app import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cannot listen on 127.0.0.1:{port}" in err and "--port" in err


@pytest.mark.slow
def test_start_up_names_the_apps_own_share_flag(server):
    import time

    deadline = time.time() + 60  # the port answers while launch() is still returning; the lines follow it
    while "--share" not in server.log() and time.time() < deadline:
        time.sleep(0.5)
    log = server.log()
    assert f"speclab app on http://127.0.0.1:{server.port}/" in log
    assert "python app.py --share" in log and "share=True" not in log and "Traceback" not in log


def _space_check():
    import importlib.util
    from importlib.machinery import SourceFileLoader
    from pathlib import Path

    path = str(Path(__file__).resolve().parents[1] / "scripts" / "space_check")
    spec = importlib.util.spec_from_file_location("space_check", path, loader=SourceFileLoader("space_check", path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _git_repo(root, files: dict[str, bytes], attributes: str = "", hfignore: str = ""):
    import subprocess

    for rel, data in {**files, ".gitattributes": attributes.encode(), ".hfignore": hfignore.encode()}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    subprocess.run(["git", "-C", str(root), "add", "-A"], check=True)
    return root


def test_space_files_honour_hfignore_and_lfs(tmp_path):
    sc = _space_check()
    big = b"x" * (sc.HUB_LIMIT + 1)
    files = {"app.py": b"print()", "w/model.safetensors": b"\0\1", "tests/t.py": b"", "docs/results/r.json": b"{}",
             "docs/a.md": b"#", "big.txt": big, "img.png": b"\x89PNG\0"}
    repo = _git_repo(tmp_path / "r", files, hfignore="tests/\ndocs/results/\n",
                     attributes="*.safetensors filter=lfs diff=lfs merge=lfs -text\n")
    got = sc.space_files(repo)
    assert set(got) == {"app.py", "w/model.safetensors", "docs/a.md", "big.txt", "img.png", ".gitattributes",
                        ".hfignore"}
    with pytest.raises(sc.CheckFailed, match=r"2 binary or > 10 MB file\(s\) not stored through LFS.*big.txt.*img.png"):
        sc.check_storage(repo, got)
    (repo / ".gitattributes").write_text("*.safetensors filter=lfs\n*.png filter=lfs\nbig.txt filter=lfs\n")
    assert sc.check_storage(repo, got)[0] == 3


def test_space_requirements_drop_only_unreachable_indexes(tmp_path):
    sc = _space_check()
    src = tmp_path / "requirements.txt"
    src.write_text(f"--extra-index-url http://127.0.0.1:9/whl/cpu\n--extra-index-url file://{tmp_path}\ntorch==2\n")
    notes = sc.requirements_here(src, tmp_path / "out.txt")
    assert len(notes) == 1 and "127.0.0.1:9" in notes[0]
    assert (tmp_path / "out.txt").read_text().split("\n")[:2] == [f"--extra-index-url file://{tmp_path}", "torch==2"]


def test_the_repository_is_a_space_the_hub_accepts():
    """Every binary or > 10 MB file the Space holds is stored through LFS (the Hub refuses the rest)."""
    sc = _space_check()
    files = sc.space_files(sc.REPO)
    assert "app.py" in files and "requirements.txt" in files and not any(f.startswith("tests/") for f in files)
    assert sc.check_storage(sc.REPO, files)[0] >= 1  # the family's weights


@pytest.mark.slow
def test_space_builds_from_requirements_and_decodes(tmp_path):
    """scripts/space_check end to end: a fresh venv from requirements.txt alone, the staged files, app.py's first
    screen and one Decode run through gradio_client (minutes: the venv installs torch and gradio)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "space_check"
    r = subprocess.run([sys.executable, str(script), "--venv", str(tmp_path / "venv"), "--timeout", "600"],
                       capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[ok] the Space builds and serves" in r.stdout and "torch 2.13.0" in r.stdout and "(CPU)" in r.stdout
    assert "one Decode run returned" in r.stdout
