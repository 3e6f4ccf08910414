"""The held-out workloads: text the family never trained on, each prompt with its source, none of it in the
training corpus, rebuilt the same by scripts/build_heldout.py, and shipped in the wheel."""

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from speclab.workloads import HELDOUT_WORKLOADS, list_workloads, load_workload

ROOT = Path(__file__).resolve().parents[1]
WINDOW, STRIDE = 32, 16  # any shared stretch of 47 characters covers one whole window


def _rows(name):
    return [json.loads(line) for line in (ROOT / "datasets" / f"{name}.jsonl").read_text().splitlines()]


def heldout_windows_in(text: str) -> list[tuple[str, str]]:
    """(prompt id, window) of every held-out prompt's WINDOW-character stretch at STRIDE that occurs in ``text``."""
    found = []
    for name in HELDOUT_WORKLOADS:
        for p in load_workload(name):
            starts = range(0, max(1, len(p.prompt) - WINDOW + 1), STRIDE)
            found += [(p.id, p.prompt[i:i + WINDOW]) for i in starts if p.prompt[i:i + WINDOW] in text]
    return found


@pytest.mark.parametrize("name", HELDOUT_WORKLOADS)
def test_heldout_workload_loads_with_sources(name):
    prompts = load_workload(name)
    rows = _rows(name)
    assert len(prompts) == len(rows) >= 20
    assert len({p.prompt for p in prompts}) == len(prompts)
    assert all("==" in r["source"] and ":" in r["source"] for r in rows)
    assert name in list_workloads()


def test_heldout_sources_are_not_the_standard_library():
    # the corpus's code is the standard library's; the held-out code comes from installed packages
    import sysconfig

    stdlib = {p.stem for p in Path(sysconfig.get_paths()["stdlib"]).iterdir()}
    for r in _rows("heldout_code"):
        assert r["source"].split("==")[0] not in stdlib, r["source"]


@pytest.mark.slow
def test_no_heldout_prompt_occurs_in_the_training_corpus():
    from speclab.family import load_manifest
    from speclab.family.corpus import build_corpus

    corpus = build_corpus(0)
    info = load_manifest()
    if info and info.get("corpus") != corpus.fingerprint():
        pytest.skip("this Python's standard library builds a different corpus from the family's")
    text = "\x00".join(d.text for d in corpus.train + corpus.heldout)
    found = heldout_windows_in(text)
    assert not found, found[:5]


@pytest.mark.slow
def test_no_heldout_prompt_occurs_in_the_heads_package_code():
    """The heads also train on installed packages' code: none of those packages is a held-out source or a
    validation package, and no held-out prompt shares a window with the text they train or choose on."""
    from speclab.family.corpus import package_code_documents
    from speclab.family.heads import HEAD_CODE_PACKAGES, HEAD_SPECS, RECIPE_SPECS, VALIDATION_PACKAGES, heldout_windows

    sys.path.insert(0, str(ROOT / "scripts"))
    from build_heldout import CODE_PACKAGES, JSON_PACKAGES

    assert not set(HEAD_CODE_PACKAGES) & set(CODE_PACKAGES + JSON_PACKAGES + VALIDATION_PACKAGES)
    assert not set(VALIDATION_PACKAGES) & set(CODE_PACKAGES + JSON_PACKAGES)
    specs = HEAD_SPECS + RECIPE_SPECS
    packages = sorted({p for s in specs for p in s.code_packages + s.prompt_packages} | set(VALIDATION_PACKAGES))
    per_package = max(s.chars_per_package for s in specs)
    text = "\x00".join(d.text for d in package_code_documents(tuple(packages), per_package, exclude=heldout_windows()))
    assert len(text) > 5_000_000
    found = heldout_windows_in(text)
    assert not found, found[:5]


@pytest.mark.slow
def test_build_script_is_deterministic(tmp_path):
    """Two builds from this environment's installed packages write the same files. (The committed files were built
    from the packages the lab's set-up installs; another environment holds other packages or versions, so
    ``build_heldout.py --check`` against the committed files is a check to run where those match.)"""
    outs = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        r = subprocess.run([sys.executable, str(ROOT / "scripts" / "build_heldout.py"), "--out", str(tmp_path / name)],
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        outs.append({p.name: p.read_bytes() for p in sorted((tmp_path / name).glob("heldout_*.jsonl"))})
    assert set(outs[0]) == {"heldout_json.jsonl", "heldout_code.jsonl", "heldout_prose.jsonl"}
    assert outs[0] == outs[1]


@pytest.mark.slow
def test_wheel_carries_the_one_datasets_folder(tmp_path):
    assert not (ROOT / "speclab" / "datasets").exists()  # one copy, at the top level
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    (wheel,) = tmp_path.glob("speclab-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for p in (ROOT / "datasets").glob("*.jsonl"):
        assert f"speclab/datasets/{p.name}" in names
