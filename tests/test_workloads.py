import json
from pathlib import Path

import pytest

from speclab.errors import SpeclabError
from speclab.workloads import (
    WORKLOADS,
    Prompt,
    list_workloads,
    load_all,
    load_specbench,
    load_workload,
)

SPECBENCH = Path(__file__).resolve().parents[1].parent / "shared" / "specbench" / "question.jsonl"


def test_standard_workloads_present():
    assert list_workloads()[: len(WORKLOADS)] == list(WORKLOADS)


@pytest.mark.parametrize("name", WORKLOADS)
def test_workload_loads(name):
    prompts = load_workload(name)
    assert len(prompts) >= 20
    assert all(isinstance(p, Prompt) and p.prompt and p.id and p.category for p in prompts)
    assert len({p.id for p in prompts}) == len(prompts)


def test_load_all():
    allw = load_all()
    assert set(WORKLOADS) <= set(allw)
    assert all(len(v) >= 20 for v in allw.values())


def test_prompts_fit_the_context():
    from transformers import AutoTokenizer

    from speclab.family import resolve

    d = resolve("target")
    if d is None:
        pytest.skip("family not trained")
    tok = AutoTokenizer.from_pretrained(str(d))
    for name, prompts in load_all().items():
        for p in prompts:
            assert len(tok(p.prompt)["input_ids"]) < 600, (name, p.id)


def test_load_by_path(tmp_path):
    f = tmp_path / "mine.jsonl"
    f.write_text(json.dumps({"id": "a", "category": "x", "prompt": "hello"}) + "\n\n"
                 + json.dumps({"id": 2, "prompt": "world"}) + "\n")
    ps = load_workload(f)
    assert [p.id for p in ps] == ["a", "2"]
    assert ps[1].category == "mine"
    assert load_workload(str(f)) == ps


def test_malformed_line_names_file_and_line(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"id": 1, "category": "c", "prompt": "ok"}\n{"id": 2, "prompt": \n')
    with pytest.raises(SpeclabError, match=r"bad\.jsonl:2: invalid JSON"):
        load_workload(f)


def test_missing_prompt_names_line(tmp_path):
    f = tmp_path / "noprompt.jsonl"
    f.write_text('{"id": 1, "prompt": "ok"}\n{"id": 2, "prompt": "ok"}\n{"id": 3}\n')
    with pytest.raises(SpeclabError, match=r"noprompt\.jsonl:3: missing"):
        load_workload(f)


def test_unknown_workload():
    with pytest.raises(SpeclabError, match="unknown workload"):
        load_workload("no_such_workload")


def test_specbench_format(tmp_path):
    f = tmp_path / "question.jsonl"
    f.write_text(json.dumps({"question_id": 81, "category": "writing", "turns": ["first", "second"]}) + "\n")
    assert load_specbench(f) == [Prompt("81", "writing", "first")]
    assert load_workload(f) == [Prompt("81", "writing", "first")]
    f.write_text(json.dumps({"question_id": 81, "category": "writing", "turns": []}) + "\n")
    with pytest.raises(SpeclabError, match=r"question\.jsonl:1: 'turns'"):
        load_specbench(f)


@pytest.mark.skipif(not SPECBENCH.exists(), reason="no shared Spec-Bench copy")
def test_specbench_copy():
    ps = load_specbench(SPECBENCH)
    assert len(ps) == 480
    assert len({p.id for p in ps}) == 480
    assert all(p.prompt for p in ps)
