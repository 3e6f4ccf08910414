"""Every drafter `speclab models` lists can be built by its name, and carries a measured acceptance for every
bundled workload (the file python -m speclab.analysis.drafter_acceptance writes)."""

import pytest

from speclab.drafters.catalog import ACCEPTANCE_PATH, drafter_entries, measured_acceptance
from speclab.family import list_models, resolve
from speclab.workloads import list_workloads

pytestmark = pytest.mark.skipif(resolve("target") is None, reason="family not trained")


def test_every_listed_drafter_builds_and_has_acceptance_per_workload():
    from speclab.drafters import make_drafter
    from speclab.models import load_model

    target = load_model("target", device="cpu")
    measured = measured_acceptance()["drafters"]
    names = [e["name"] for e in drafter_entries()]
    names += [m["name"] for m in list_models() if m["role"] in ("draft", "distilled-draft")]
    for name in names:
        assert make_drafter(name, target) is not None, name
        assert set(measured[name]) == set(list_workloads()), name
        assert all(0 <= a <= 1 for a in measured[name].values()), name


def test_acceptance_file_records_its_conditions():
    info = measured_acceptance(ACCEPTANCE_PATH)
    assert info["temperature"] == 0.0 and info["k"] >= 1 and "drafter_acceptance" in info["command"]
