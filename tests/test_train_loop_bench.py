"""benchmarks/train_loop.py: one child row (the tiny GPT under memcompile, 2 micro-batches)
measures the whole iteration and matches its eager copy bit for bit; budgets follow the names."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from helpers import run_benchmark

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "train_loop.py"


@pytest.fixture(scope="module")
def train_loop() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_loop_bench", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass resolves annotations through it
    spec.loader.exec_module(module)
    return module


def test_a_memcompile_row_measures_the_iteration_and_is_identical_to_eager() -> None:
    args = ["--one", "gpt", "--config", "mc_60", "--size", "tiny", "--micro", "2"]
    out = run_benchmark("train_loop.py", *args, "--reps", "1", "--budget", str(2**30))
    assert out.returncode == 0, out.stderr[-2000:]
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert "error" not in row, row
    assert row["model"] == "gpt_2l" and row["config"] == "mc_60" and row["micro"] == 2
    assert row["peak"] > row["resident"] > 0 and row["iter_peak"] == row["peak"] - row["resident"]
    assert row["measure_complete"] and row["within_budget"]
    assert row["identical"] is True and row["identity_iters"] == 4
    assert row["loss_max_diff"] == 0.0 and row["param_max_diff"] == 0.0
    assert row["budget_warnings"] == 0 and row["predicted_peak"] > 0
    assert row["iteration"]["micro_batches"] == 2
    assert len(row["time_ratios"]) == 1 and row["time_ratio"] > 0


@pytest.mark.parametrize(("config", "fraction"), [("mc_60", 0.6), ("mc_40", 0.4), ("mc_25", 0.25)])
def test_a_budget_is_eagers_resident_plus_the_named_fraction(train_loop, config, fraction) -> None:
    eager = {"resident": 1000, "iter_peak": 200_000}
    assert train_loop.budget_for(config, eager) == int(1000 + fraction * 200_000)
    assert train_loop.budget_for("checkpoint", eager) is None
