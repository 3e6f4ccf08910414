"""The notebooks in notebooks/: committed clean, and each runs top to bottom (small parameters).

The slow test executes every notebook with nbclient in a ``python3`` kernel that is pinned to this
interpreter (a temporary kernelspec put first on JUPYTER_PATH), so CI needs no
``ipykernel install`` step. When the embedded family has no trained weights, a tiny random family
is built and passed in through the SPECLAB_NB_* parameters. SPECLAB_NB_TEST_TINY=1 forces that.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")

NB_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NB_DIR.glob("[0-9][0-9]_*.ipynb"))
EXPECTED = ["01_first_look", "02_acceptance_by_workload", "03_batch_and_load", "04_cost_model", "05_adaptive",
            "06_serving", "07_trees_and_heads"]


def test_every_notebook_is_listed():
    assert [p.stem for p in NOTEBOOKS] == EXPECTED


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{path.name} cell {i} has outputs: clear them before committing"
            assert cell.execution_count is None, f"{path.name} cell {i} has an execution count"
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_structure(path):
    nb = nbformat.read(path, as_version=4)
    first, last = nb.cells[0], nb.cells[-1]
    assert first.cell_type == "markdown" and "**Question:**" in first.source
    params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1 and "setting(" in params[0].source
    # the closing cell computes its conclusions from the run: f-strings, not typed-in numbers
    assert last.cell_type == "code" and "print(f" in last.source
    assert any("enable_offline_altair" in c.source for c in nb.cells if c.cell_type == "code")


# ------------------------------------------------------------------------------------------ execution


@pytest.fixture(scope="session")
def notebook_env(tmp_path_factory):
    """Env vars for a small run: SPECLAB_NB_SMALL=1, one torch thread, and the models to use."""
    from speclab.family import DEFAULT_DRAFT, DEFAULT_TARGET
    from speclab.nb import family_available
    from speclab.testing import tiny_family

    env = {"SPECLAB_NB_SMALL": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    shipped = family_available(DEFAULT_TARGET, DEFAULT_DRAFT, "draft-xs", "draft-xs-distill")
    if os.environ.get("SPECLAB_NB_TEST_TINY") == "1" or not shipped:
        d = tiny_family(tmp_path_factory.mktemp("nb_models"))
        env.update(SPECLAB_NB_TARGET=d["tiny-target"], SPECLAB_NB_DRAFT=d["tiny-draft"],
                   SPECLAB_NB_DRAFTS=f"{d['tiny-draft']},ngram")
    # a python3 kernelspec that runs *this* interpreter (the venv with speclab), first on the path
    kdir = tmp_path_factory.mktemp("jupyter") / "kernels" / "python3"
    kdir.mkdir(parents=True)
    (kdir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (speclab tests)", "language": "python"}))
    env["JUPYTER_PATH"] = os.pathsep.join([str(kdir.parents[1]), os.environ.get("JUPYTER_PATH", "")]).rstrip(os.pathsep)
    return env


def _outputs(nb):
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            yield cell, o


def _execute(path: Path, env: dict) -> tuple:
    """Run one notebook top to bottom in its own kernel (``env``: the kernel's environment); (notebook, seconds,
    the exception or None)."""
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(NB_DIR)}})
    t = time.perf_counter()
    try:
        client.execute(env=env)  # raises CellExecutionError on the first failing cell
    except Exception as e:  # noqa: BLE001 - reported by the notebook's own test
        return nb, time.perf_counter() - t, e
    return nb, time.perf_counter() - t, None


@pytest.fixture(scope="session")
def executed(request, notebook_env):
    """Every notebook this pytest run selected, run two at a time (each kernel has one torch thread, the machine two
    cores: the notebooks take half the wall time they take one after another)."""
    pytest.importorskip("nbclient")
    from concurrent.futures import ThreadPoolExecutor

    from jupyter_client.kernelspec import KernelSpecManager

    wanted = [item.callspec.params["path"] for item in request.session.items
              if getattr(item, "originalname", None) == "test_notebook_runs"]
    with pytest.MonkeyPatch.context() as mp:
        for k, v in notebook_env.items():
            mp.setenv(k, v)
        spec = KernelSpecManager().get_kernel_spec("python3")
        assert spec.argv[0] == sys.executable, spec.argv  # the kernel is this venv's interpreter
        env = dict(os.environ)
        with ThreadPoolExecutor(2) as pool:
            futures = {p.stem: pool.submit(_execute, p, env) for p in wanted}
        return {stem: f.result() for stem, f in futures.items()}


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, executed):
    nb, took, error = executed[path.stem]
    print(f"{path.name}: {took:.1f} s")
    if error is not None:
        raise error

    errors = [o for _, o in _outputs(nb) if o.get("output_type") == "error"]
    assert not errors
    mimes = {m for _, o in _outputs(nb) for m in o.get("data", {})}
    if path.stem == "01_first_look":
        html = "".join(o["data"]["text/html"] for _, o in _outputs(nb) if "text/html" in o.get("data", {}))
        assert 'class="speclab-tokens"' in html and 'data-status="' in html
        assert "application/vnd.jupyter.widget-view+json" in mimes  # the live controls
    # charts render offline: static SVG from vl-convert, no CDN-loading HTML
    assert "image/svg+xml" in mimes
    html_all = "".join(str(o.get("data", {}).get("text/html", "")) for _, o in _outputs(nb))
    assert "cdn.jsdelivr.net" not in html_all
    # the closing cell printed its conclusions
    last = nb.cells[-1]
    printed = "".join(o.get("text", "") for o in last.outputs if o.get("output_type") == "stream")
    assert printed.strip(), "the last cell printed nothing"
