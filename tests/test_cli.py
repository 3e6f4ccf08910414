"""The CLI: JSON output fields, colours, and one-line errors with exit status 2 for bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from speclab.cli import main


def run(argv, capsys):
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_json(tiny, capsys):
    code, out, err = run(["generate", "--prompt", "hello world", "--target", tiny["target"], "--draft",
                          tiny["draft_close"], "-k", "4", "--max-new-tokens", "12", "--json"], capsys)
    assert code == 0, err
    obj = json.loads(out)
    assert isinstance(obj["text"], list) and len(obj["text"]) == 1
    tok = obj["tokens"][0][0]
    assert set(tok) >= {"token", "text", "status", "round", "draft_prob", "target_prob"}
    assert {t["status"] for t in obj["tokens"][0]} <= {"accepted", "rejected", "recovered", "bonus", "target"}
    for key in ("acceptance_rate", "mean_accepted_length", "per_position_acceptance", "tokens_per_s", "ttft_ms",
                "tpot_ms", "rounds"):
        assert key in obj["metrics"]


def test_generate_with_an_adaptive_policy(tiny, capsys):
    """`--policy goodput` calibrates the step costs first (untimed: ``seed_costs``), then decodes."""
    code, out, err = run(["generate", "--prompt", "hello world", "--target", tiny["target"], "--draft",
                          tiny["draft_close"], "--policy", "goodput", "-k", "3", "--max-new-tokens", "10", "--json"],
                         capsys)
    assert code == 0, err
    obj = json.loads(out)
    assert len(obj["text"]) == 1 and obj["metrics"]["rounds"] > 0


def test_generate_batch_and_sampling(tiny, capsys):
    code, out, _ = run(["generate", "--prompt", "abc abc abc", "--target", tiny["target"], "--draft", "ngram",
                        "--batch", "3", "--temperature", "0.9", "--top-p", "0.95", "--seed", "3",
                        "--max-new-tokens", "10", "--json"], capsys)
    obj = json.loads(out)
    assert code == 0 and len(obj["text"]) == 3 and len(obj["tokens"]) == 3


def test_generate_coloured(tiny, capsys):
    code, out, _ = run(["generate", "--prompt", "hello", "--target", tiny["target"], "--draft", tiny["target"],
                        "-k", "3", "--max-new-tokens", "10", "--colour"], capsys)
    assert code == 0
    assert "\x1b[32m" in out  # accepted tokens in green
    assert "acceptance rate" in out and "TTFT" in out


@pytest.mark.parametrize("argv,needle", [
    (["--target", "/no/such/model"], "unknown target model '/no/such/model'"),
    (["--draft", "/no/such/draft"], "unknown draft model '/no/such/draft'"),
    (["-k", "-1"], "between 0 and 32"),
    (["-k", "33"], "between 0 and 32"),
    (["--batch", "0"], "batch size must be between 1"),
    (["--max-new-tokens", "300"], "exceeds the context"),
    (["--threads", "0"], "--threads must be between 1 and 1024"),  # was torch's default, silently
    (["--threads", "-3"], "--threads must be between 1 and 1024"),  # was a torch RuntimeError traceback
])
def test_bad_input_one_line(tiny, capsys, argv, needle):
    base = {"--target": tiny["target"], "--draft": "ngram"}
    args = ["generate", "--prompt", "hello"]
    for key in ("--target", "--draft"):
        if key not in argv:
            args += [key, base[key]]
    code, out, err = run(args + argv, capsys)
    assert code == 2
    assert needle in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("argv,needle", [
    (["policies", "--batches", "abc"], "--batches: 'abc' is not a number"),
    (["policies", "--batches", "0"], "--batches wants whole numbers > 0"),
    (["policies", "--k", "0"], "plain decoding, k = 0, is always there"),
    (["synthetic", "--k", "0"], "plain decoding, k = 0, is always there"),
    (["synthetic", "--alphas", "x"], "--alphas: 'x' is not a number"),
    (["synthetic", "--alphas", "1.5"], "--alphas wants numbers >= 0 and <= 1"),
    (["compare", "--k", "-1"], "--k wants whole numbers >= 0"),
    (["heads", "--k", "0"], "--k (plain decoding, k = 0, is always there) wants whole numbers > 0"),
    (["policies", "--reps", "0"], "--reps must be between 1"),
    (["compare", "--prompts-per-workload", "0"], "--prompts-per-workload must be between 1"),
    (["acceptance", "--max-new-tokens", "0"], "--max-new-tokens must be between 1"),
    (["serve", "--requests", "0"], "--requests must be between 1"),
    (["serve", "--max-concurrency", "0"], "--max-concurrency must be between 1"),
])
def test_bench_refuses_bad_numbers_in_one_line_before_loading_anything(capsys, argv, needle):
    """Each was a traceback, a silent default (0 read as 'not given') or a run with nonsense settings."""
    code, out, err = run(["bench", *argv], capsys)
    assert code == 2 and needle in err, err
    assert err.count("\n") == 1 and "Traceback" not in err and not out


@pytest.mark.parametrize("argv,needle", [
    (["bench", "--compare", "--ks", "2"], "`speclab bench --compare` is now `speclab bench compare`"),
    (["bench", "--serve-experiment"], "is now `python benchmarks/serve_experiment.py`"),
    (["bench", "--layouts"], "is now `python benchmarks/layouts.py`"),
    (["bench", "--workload", "json"], "the acceptance report is now `speclab bench acceptance`"),
    (["bench", "compare", "--ks", "2"], "speclab bench: --ks is now --k"),
    (["bench", "acceptance", "--drafter", "ngram"], "speclab bench: --drafter is now --draft"),
    (["bench", "heads", "--json", "x.json"], "speclab bench: --json is now --out DIR"),
    (["bench", "policies", "--policy-list", "ema"], "--policy-list is now --policy"),
    (["advise", "--check-cpu"], "`speclab advise --check-cpu` is now `python benchmarks/cpucheck.py`"),
    (["advise", "--validate"], "`speclab advise --validate` is now `speclab advise validate`"),
    (["advise", "--measure-cpu"], "is now `speclab advise measure-cpu`"),
    (["advise", "--target-params", "8e9"], "--target-params is now --target-model"),
])
def test_old_spellings_name_the_new_command(capsys, argv, needle):
    """No silent first-flag-wins: an old command line fails in one line naming what replaced it."""
    code, out, err = run(argv, capsys)
    assert code == 2 and needle in err, err
    assert err.count("\n") == 1 and not out


@pytest.mark.parametrize("command", [["bench", sub] for sub in ("acceptance", "compare", "serve", "policies",
                                                                "synthetic", "heads")]
                         + [["advise"], ["advise", "validate"], ["advise", "measure-cpu"], ["advise", "what-if"]])
def test_no_help_shows_more_than_25_flags(command, capsys):
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    flags = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  -")]
    assert 0 < len(flags) <= 25, flags


def test_empty_prompt(tiny, capsys):
    code, _, err = run(["generate", "--prompt", "  ", "--target", tiny["target"], "--draft", "none"], capsys)
    assert code == 2 and "prompt is empty" in err


def test_mismatched_tokenizers_named(tiny, capsys):
    code, _, err = run(["generate", "--prompt", "hello", "--target", tiny["target"], "--draft", tiny["other_tok"]],
                       capsys)
    assert code == 2
    assert "different tokenizers" in err and "other_tok" in err and "target" in err


@pytest.mark.slow
def test_console_script_exit_status(tiny):
    """A real process: one line on stderr, exit status 2, no traceback."""
    p = subprocess.run([sys.executable, "-m", "speclab", "generate", "--prompt", "hi", "--target", "nope/none-here",
                        "--draft", "none"], capture_output=True, text=True, env={"HF_HUB_OFFLINE": "1",
                                                                                "PATH": "/usr/bin:/bin"})
    assert p.returncode == 2, p.stderr
    assert p.stderr.startswith("speclab: error: cannot load target model 'nope/none-here'")
    assert "Traceback" not in p.stderr and p.stderr.count("\n") == 1


def test_unreachable_hub_fails_fast(tiny, monkeypatch):
    """A hub id with no network: one line, after one connection attempt with a short timeout (no retries)."""
    import socket

    import speclab.models as models
    from speclab.errors import SpeclabError

    attempts = []
    connect = socket.create_connection

    def counted(address, timeout=None, *args, **kwargs):
        attempts.append((address, timeout))
        return connect(address, timeout, *args, **kwargs)

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", "https://127.0.0.1:9")  # nothing listens there
    monkeypatch.setattr(socket, "create_connection", counted)
    with pytest.raises(SpeclabError, match="unreachable") as err:
        models.load_model("someorg/some-model", role="target")
    assert "\n" not in str(err.value)
    # the hub client's one request and speclab's one probe, each with a timeout of seconds: no retry loop
    assert 1 <= len(attempts) <= 2 and all(a == ("127.0.0.1", 9) and 0 < t <= 10 for a, t in attempts)


def test_help_imports_no_torch():
    """`speclab --help` and each command's --help stay instant: argument parsing never imports torch,
    transformers or the app (the commands import them when they run)."""
    import subprocess
    import sys

    code = ("import sys, speclab.cli as c\n"
            "for argv in (['--help'], ['bench', '--help'], ['train', '--help'], ['serve', '--help'],\n"
            "             ['load', '--help'], ['advise', '--help'], ['generate', '--help']):\n"
            "    try:\n"
            "        c.main(argv)\n"
            "    except SystemExit:\n"
            "        pass\n"
            "print(sorted(m for m in ('torch', 'transformers', 'gradio') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"
