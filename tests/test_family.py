import json
from pathlib import Path

import pytest
import torch

from speclab import family
from speclab.family import DEFAULT_DRAFT, DEFAULT_TARGET, FAMILY_DIR, list_models, resolve

ROLES = {"target", "draft", "distilled-draft", "mismatched"}
MAX_BYTES = 80 * 1024 * 1024


def models_or_skip():
    ms = list_models()
    if not ms:
        pytest.skip("family not trained yet")
    return ms


def test_registry_importable_without_weights(tmp_path):
    assert isinstance(FAMILY_DIR, Path)
    assert DEFAULT_TARGET == "target"
    assert isinstance(DEFAULT_DRAFT, str)
    assert family.list_models(tmp_path) == []
    assert resolve("no-such-model") is None
    assert resolve("") is None


def test_list_models_fields():
    ms = models_or_skip()
    names = {m["name"] for m in ms}
    assert {"target", "draft-xs", "draft-s", "draft-distill", "draft-xs-distill", "mismatch"} <= names
    assert DEFAULT_TARGET in names and DEFAULT_DRAFT in names
    for m in ms:
        assert {"name", "role", "parameters", "tokenizer", "path"} <= set(m)
        assert m["role"] in ROLES
        assert isinstance(m["parameters"], int) and m["parameters"] > 0
        assert Path(m["path"]).is_absolute() and Path(m["path"]).is_dir()
        assert resolve(m["name"]) == Path(m["path"])
    roles = {m["name"]: m["role"] for m in ms}
    assert roles["target"] == "target" and roles["draft-distill"] == roles["draft-xs-distill"] == "distilled-draft"
    assert roles["mismatch"] == "mismatched"
    by = {m["name"]: m for m in ms}
    # one tokenizer for target and drafts, another for the mismatched model
    same = ("target", "draft-xs", "draft-s", "draft-distill", "draft-xs-distill")
    assert len({by[n]["tokenizer"] for n in same}) == 1
    assert by["mismatch"]["tokenizer"] != by["target"]["tokenizer"]
    # the target is clearly better than every draft
    drafts = [m for m in ms if m["role"] in ("draft", "distilled-draft")]
    smallest = min(drafts, key=lambda m: m["parameters"])
    assert by["target"]["heldout_loss"] <= smallest["heldout_loss"] - 0.4
    assert by["target"]["parameters"] > max(m["parameters"] for m in drafts)


def test_weights_budget():
    models_or_skip()
    total = sum(p.stat().st_size for p in (FAMILY_DIR / "models").rglob("*.safetensors"))
    assert total <= MAX_BYTES


def test_manifest_is_json():
    models_or_skip()
    data = json.loads((FAMILY_DIR / "family.json").read_text())
    for m in data["models"]:
        assert {"name", "role", "parameters", "tokenizer", "path", "heldout_loss", "tokens_seen"} <= set(m)
        assert not Path(m["path"]).is_absolute()


@pytest.mark.parametrize("name", ["target", "draft-xs", "draft-s", "draft-distill", "mismatch"])
def test_model_loads_with_transformers(name):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    models_or_skip()
    d = resolve(name)
    assert d is not None
    model = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(d))
    cfg = model.config
    assert cfg.model_type == "llama" and cfg.tie_word_embeddings and cfg.max_position_embeddings == 1024
    assert not cfg.attention_bias and not cfg.mlp_bias
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == cfg.eos_token_id
    assert len(tok) == cfg.vocab_size
    ids = tok("def main():\n", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.dtype == torch.float32 and logits.shape == (1, ids.shape[1], cfg.vocab_size)
    assert torch.isfinite(logits).all()


def test_mismatched_tokenizer_differs():
    from transformers import AutoTokenizer

    models_or_skip()
    a = AutoTokenizer.from_pretrained(str(resolve("target"))).get_vocab()
    b = AutoTokenizer.from_pretrained(str(resolve("mismatch"))).get_vocab()
    assert a != b
    for n in ("draft-xs", "draft-s", "draft-distill"):
        assert AutoTokenizer.from_pretrained(str(resolve(n))).get_vocab() == a


def test_models_command(capsys):
    from speclab.family.cli import cmd_models

    class A:
        json = True

    cmd_models(A())
    out = json.loads(capsys.readouterr().out)
    assert isinstance(out, list)
    for m in out:
        assert set(m) == {"name", "role", "parameters", "tokenizer", "path", "acceptance"}
    if out:  # beside the draft models: the heads, early exit and the lookups
        roles = {m["role"] for m in out}
        assert {"EAGLE head", "Medusa heads", "early exit", "prompt lookup", "suffix decoding", "hybrid"} <= roles


def test_models_presets_command(capsys):
    """``speclab models --presets``: every curated pair, its sizes, and the published number with its source."""
    from speclab.cli import main
    from speclab.models.presets import PRESETS

    assert main(["models", "--presets", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(rows) == set(PRESETS) >= {"smollm2-360m", "smollm2-1.7b", "qwen2.5-1.5b", "qwen2.5-7b",
                                         "llama-3.2-3b", "llama-3.1-8b"}
    assert rows["qwen2.5-7b"]["target"] == "Qwen/Qwen2.5-7B-Instruct"
    assert 7.4e9 < rows["qwen2.5-7b"]["target_parameters"] < 7.8e9  # the published 7.62B
    assert 1.2e8 < rows["smollm2-360m"]["draft_parameters"] < 1.4e8  # 135M
    assert rows["llama-3.1-8b"]["eagle3_head"] and rows["llama-3.1-8b"]["source"].startswith("https://")
    assert main(["models", "--presets"]) == 0
    text = capsys.readouterr().out
    assert "qwen2.5-7b" in text and "published:" in text and "--target" in text
    assert text.count("speculation pays above") == len(PRESETS) and "preset_step_time.py" in text


def test_every_preset_has_its_step_times_and_they_add_up():
    """preset_steps.json (benchmarks/preset_step_time.py --ship) measures every preset's models, and each pair's
    round is its k draft steps and one verify, its break-even that round over a plain step."""
    from speclab.app.config import preset_label
    from speclab.models.presets import PRESETS, step_times

    t = step_times()
    k = t["meta"]["k"]
    for name, p in PRESETS.items():
        draft, target, pair = t["models"][p.draft], t["models"][p.target], t["pairs"][name]
        assert pair["round_ms"] == pytest.approx(k * draft["decode_ms"] + target["verify_ms"], abs=0.5), name
        assert pair["break_even_tokens_per_round"] == pytest.approx(pair["round_ms"] / target["decode_ms"], abs=0.02)
        label = preset_label(name, "target")
        assert f"a decode step ~{target['decode_ms']:.0f} ms" in label and "pays above" in label
        assert "decode step" not in preset_label(name, "draft")


def test_train_command_sends_heads_to_the_head_trainer_and_the_module_entry_offers_models_only(capsys):
    """`speclab train --heads` goes to speclab.family.heads (its own check of the names answers, before any
    training); `python -m speclab.family.train` trains models only and refuses --heads."""
    from speclab.cli import main
    from speclab.family.train import main as train_main

    with pytest.raises(SystemExit, match=r"speclab train --heads: unknown head\(s\) \['no-such-head'\]"):
        main(["train", "--heads", "--only", "no-such-head"])
    with pytest.raises(SystemExit) as e:
        train_main(["--heads"])
    assert e.value.code == 2 and "unrecognized arguments: --heads" in capsys.readouterr().err


def test_quality_helpers():
    from speclab.family.quality import distinct_2, looks_like_python, python_line_rate

    assert distinct_2([1, 2, 1, 2, 1, 2]) == pytest.approx(2 / 5)
    assert distinct_2([1, 2, 3, 4]) == 1.0
    assert looks_like_python("def f(x):\n    return x + 1\n")
    assert looks_like_python("def f(x):\n    if x:\n        y = 1\n    for i in range(3):\n")
    assert not looks_like_python("The quick brown fox jumps over\nthe lazy dog again and again\n")
    assert python_line_rate("    if x:\n        return f(a,\n    else:\n") == 1.0
    assert python_line_rate("The quick brown fox jumps\nover the lazy dog.\n") == 0.0


@pytest.mark.slow
def test_training_end_to_end(tmp_path):
    from transformers import AutoModelForCausalLM

    from speclab.family.quality import quality_report
    from speclab.family.specs import ModelSpec, TrainConfig
    from speclab.family.train import train_family

    specs = [
        ModelSpec("target", "target", 32, 1, 2, 64, tokens=2048, lr=3e-3, batch=4, seq=32, warmup=2),
        ModelSpec("draft-s", "draft", 16, 1, 2, 32, tokens=1024, lr=3e-3, batch=4, seq=32, warmup=2),
        ModelSpec("draft-distill", "distilled-draft", 16, 1, 2, 32, tokens=512, lr=3e-3, batch=4, seq=32,
                  warmup=2, teacher="target", init_from="draft-s"),
        ModelSpec("mismatch", "mismatched", 16, 1, 2, 32, tokens=512, lr=3e-3, batch=4, seq=32, warmup=2,
                  tokenizer="alt"),
    ]
    cfg = TrainConfig(out_dir=tmp_path / "fam", runs_dir=tmp_path / "runs", specs=specs, vocab_size=300,
                      alt_vocab_size=280, eval_tokens=512, quality=False, acceptance=False, progress=False,
                      threads=1, corpus_kwargs=dict(code_chars=20_000, prose_chars=5_000, record_chars=10_000,
                                                    heldout_fraction=0.2))
    rep = train_family(cfg, log=lambda s: None)
    assert [m["name"] for m in rep["models"]] == ["target", "draft-s", "draft-distill", "mismatch"]
    ms = list_models(cfg.out_dir)
    assert len(ms) == 4
    assert ms[0]["tokenizer"] == ms[2]["tokenizer"] != ms[3]["tokenizer"]
    for m in ms:
        AutoModelForCausalLM.from_pretrained(m["path"])
    # a rerun finds everything done and trains nothing
    rep2 = train_family(cfg, log=lambda s: None)
    assert [m["tokens_seen"] for m in rep2["models"]] == [m["tokens_seen"] for m in rep["models"]]
    q = quality_report(cfg.out_dir / "models" / "target", ["hello"], ["def f():\n"], max_new_tokens=8)
    assert 0 <= q["distinct_2_mean"] <= 1 and q["code_parse_rate"] is not None


def test_report_format_and_checks():
    from speclab.analysis.report import check_targets, format_report

    rows = []
    for w, base in (("code", 0.7), ("json", 0.8), ("copy", 0.5), ("creative", 0.4)):
        for d, delta in (("draft-s", 0.0), ("draft-distill", 0.05), ("ngram", 0.0)):
            a = base + delta if d != "ngram" else (0.9 if w == "copy" else 0.2)
            rows.append({"workload": w, "drafter": d, "temperature": 0.0, "acceptance_rate": a,
                         "mean_accepted_length": 1 + 4 * a})
    rep = {"target": "target", "k": 4, "max_new_tokens": 8, "workloads": ["code", "json", "copy", "creative"],
           "drafters": ["draft-s", "draft-distill", "ngram"], "rows": rows}
    text = format_report(rep)
    assert "draft-distill" in text and "acc@T=0" in text
    checks = check_targets(rep, "draft-distill", pairs=[("draft-distill", "draft-s")])
    assert checks and all(checks.values())
    assert "T=0 draft-distill > draft-s on every workload" in checks
    # a distilled draft that loses on one workload fails its check
    for r in rows:
        if r["drafter"] == "draft-distill" and r["workload"] == "copy":
            r["acceptance_rate"] = 0.1
    checks = check_targets(rep, "draft-distill", pairs=[("draft-distill", "draft-s")])
    assert not checks["T=0 draft-distill > draft-s on every workload"]


def test_distill_pairs_match_architectures():
    from speclab.analysis.report import distill_pairs

    arch = lambda h: {"hidden": h, "layers": 2}  # noqa: E731
    models = [{"name": "a", "role": "draft", "architecture": arch(96)},
              {"name": "b", "role": "draft", "architecture": arch(160)},
              {"name": "a-d", "role": "distilled-draft", "architecture": arch(96)},
              {"name": "b-d", "role": "distilled-draft", "architecture": arch(160)},
              {"name": "t", "role": "target", "architecture": arch(96)}]
    assert sorted(distill_pairs(models)) == [("a-d", "a"), ("b-d", "b")]
    if family.list_models():
        assert {("draft-distill", "draft-s"), ("draft-xs-distill", "draft-xs")} <= set(distill_pairs())


def test_bench_smoke():
    from speclab.analysis.report import acceptance_report

    models_or_skip()
    rep = acceptance_report(["json"], drafters=["draft-xs", "ngram"], prompts_per_workload=2, max_new_tokens=8,
                            temperatures=(0.0,))
    assert len(rep["rows"]) == 2
    for r in rep["rows"]:
        assert r["mean_accepted_length"] is None or 1.0 <= r["mean_accepted_length"] <= 5.0
    # acceptance is accepted / drafted over every prompt, not a mean of per-batch rates
    from speclab.drafters import make_drafter
    from speclab.engine import SpeculativeDecoder
    from speclab.models import load_model
    from speclab.workloads import load_workload

    target = load_model("target")
    prompts = [p.prompt for p in load_workload("json")][:3]
    rep = acceptance_report(["json"], drafters=["ngram"], prompts_per_workload=3, max_new_tokens=8,
                            temperatures=(0.0,), batch_size=2)
    dec = SpeculativeDecoder(target, make_drafter("ngram", target))
    counts = [dec.generate(prompts[i:i + 2], k=4, max_new_tokens=8).recorder.counters() for i in (0, 2)]
    drafted, accepted = sum(c["drafted"] for c in counts), sum(c["accepted"] for c in counts)
    row = rep["rows"][0]
    assert row["acceptance_rate"] == round(accepted / drafted, 4)
    assert row["row_rounds"] == sum(c["row_rounds"] for c in counts)


def test_spec_schedules_and_shared_seed():
    from speclab.family.specs import DEFAULT_SPECS, ModelSpec

    s = ModelSpec("m", "draft", hidden=8, layers=1, heads=1, ffn=8, tokens=100, lr=1e-3,
                  copy_schedule=((0, 0.25), (10, 0.5)), code_schedule=((5, 0.34),))
    assert [s.copy_fraction_at(i) for i in (0, 9, 10)] == [0.25, 0.25, 0.5]
    assert [s.code_fraction_at(i) for i in (4, 5)] == [0.0, 0.34]
    # the mixture and the budget are not part of what a checkpoint resumes from; the model is
    import dataclasses

    assert dataclasses.replace(s, tokens=999, code_schedule=()).resume_key() == s.resume_key()
    assert dataclasses.replace(s, hidden=16).resume_key() != s.resume_key()
    # each distilled draft shares its seed (initial weights, batch order) with its cross-entropy twin
    by = {sp.name: sp for sp in DEFAULT_SPECS}
    for distilled, twin in (("draft-distill", "draft-s"), ("draft-xs-distill", "draft-xs")):
        d, t = by[distilled], by[twin]
        assert (d.seed_name or d.name) == (t.seed_name or t.name)
        assert (d.hidden, d.layers, d.tokens, d.copy_schedule, d.code_schedule) == \
            (t.hidden, t.layers, t.tokens, t.copy_schedule, t.code_schedule)
        assert d.teacher == "target" and t.teacher is None


@pytest.mark.slow
def test_corpus_packages_and_batch_scale():
    """The larger corpus of the GPU-trained family: package sources join the standard library's (named
    ``package/path``, the standard library's names unchanged), an unknown package is a clear error; and
    --batch-scale keeps every schedule (in steps) while multiplying batch and tokens."""
    from speclab.family.corpus import code_documents, source_files
    from speclab.family.specs import DEFAULT_SPECS, scale_batches

    files = source_files(("numpy",))
    names = [n for n, _ in files]
    assert any(n.startswith("numpy/") for n in names) and "json/__init__.py" in names
    assert names.index("json/__init__.py") < min(i for i, n in enumerate(names) if n.startswith("numpy/"))
    docs = code_documents(10**9, ("numpy",))
    assert any(d.name.startswith("numpy/") for d in docs)
    with pytest.raises(ValueError, match="not installed"):
        source_files(("no_such_package_xyz",))
    scaled = scale_batches(DEFAULT_SPECS, 10)
    for a, b in zip(DEFAULT_SPECS, scaled):
        assert b.batch == 10 * a.batch and b.tokens == 10 * a.tokens
        assert b.tokens // (b.batch * b.seq) == a.tokens // (a.batch * a.seq)  # same steps
        assert b.copy_schedule == a.copy_schedule and b.code_schedule == a.code_schedule
    assert scale_batches(DEFAULT_SPECS, 1) == list(DEFAULT_SPECS)


def test_bf16_autocast_only_where_the_device_runs_it_fast(monkeypatch):
    """Without bf16 instructions torch emulates bf16 matmuls many times slower than fp32: the default trains in fp32
    there and says so in one line; --no-bf16 always means fp32."""
    from speclab.family import specs

    said = []
    monkeypatch.setattr(specs, "bf16_runs_fast", lambda device="cpu": False)
    assert specs.bf16_setting(False, log=said.append) is False
    assert len(said) == 1 and "fp32" in said[0] and "\n" not in said[0]
    monkeypatch.setattr(specs, "bf16_runs_fast", lambda device="cpu": True)
    assert specs.bf16_setting(False, log=said.append) is True and specs.bf16_setting(True) is False


def test_contains_any_agrees_with_a_search_per_needle():
    """The hashed one-pass search finds exactly what ``needle in text`` finds, at the start, the end and in between."""
    import random

    from speclab.family.corpus import contains_any

    rng = random.Random(0)
    text = "".join(rng.choice("ab \n") for _ in range(5000))
    inside = (text[:12], text[2000:2012], text[-12:])
    outside = tuple("".join(rng.choice("ab \n") for _ in range(11)) + "c" for _ in range(50))
    for needle in inside:
        assert contains_any(text, (needle,) + outside[:3])
    assert not contains_any(text, outside)
    assert not contains_any(text, ())
    for _ in range(200):  # random needles: the same answer as a search for each
        needles = tuple("".join(rng.choice("ab \n") for _ in range(6)) for _ in range(3))
        assert contains_any(text, needles) == any(n in text for n in needles)


def test_package_code_leaves_out_vendored_copies_and_files_with_excluded_text(tmp_path, monkeypatch):
    """A head's package code: each package's own files in path order, no vendored copy of another project,
    no file that shares an excluded window, at most the per-package budget (the file that crosses it is the
    last), and nothing from a package that is not installed."""
    from speclab.family.corpus import package_code_documents

    pkg = tmp_path / "toypkg"
    (pkg / "_vendor" / "other").mkdir(parents=True)
    body = "def f(x):\n    return x + 1\n" * 10
    (pkg / "__init__.py").write_text("# toy\n" + body)
    (pkg / "a.py").write_text("# a\n" + body)
    (pkg / "b.py").write_text("# b\nSECRET_HELDOUT_TEXT = 1\n" + body)
    (pkg / "c.py").write_text("# c\n" + body)
    (pkg / "_vendor" / "other" / "d.py").write_text("# d\n" + body)
    monkeypatch.syspath_prepend(str(tmp_path))
    docs = package_code_documents(("toypkg",), 10**6, exclude=("SECRET_HELDOUT_TEXT",))
    assert [d.name for d in docs] == ["toypkg/__init__.py", "toypkg/a.py", "toypkg/c.py"]
    assert all(d.source == "code" for d in docs)
    assert [d.name for d in package_code_documents(("toypkg",), 300)] == ["toypkg/__init__.py", "toypkg/a.py"]
    assert package_code_documents(("no_such_package_xyz", "toypkg"), 300) == package_code_documents(("toypkg",), 300)
