"""benchmarks/anchors.py's budget names: the digits after ``mc_<tier>`` are a fraction."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "anchors.py"


@pytest.fixture(scope="module")
def anchors():
    spec = importlib.util.spec_from_file_location("anchors_bench", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("config", "fraction"),
    [("mc_r25", 0.25), ("mc_h15", 0.15), ("mc_h02", 0.02), ("mc_h015", 0.015), ("mc_h00", 0.0)],
)
def test_a_budget_is_resident_plus_the_named_fraction_of_eagers_step_peak(
    anchors, config, fraction
):
    eager = {"resident": 1000, "step_peak": 200_000}
    assert anchors.budget_for(config, eager) == int(1000 + fraction * 200_000)
    assert config in anchors.CONFIGS


@pytest.mark.parametrize("config", ["eager", "checkpoint", "mc_none"])
def test_configs_without_a_budget_get_none(anchors, config):
    assert anchors.budget_for(config, {"resident": 1, "step_peak": 2}) is None
