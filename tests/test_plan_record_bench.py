"""benchmarks/plan_record.py: the suite's plans recorded per test, and the comparison that says
which tests' plans changed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "plan_record.py"


def _compare(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True)


def test_the_plugin_records_each_tests_plans_and_the_comparison_finds_changes(tmp_path) -> None:
    test = tmp_path / "test_tiny.py"
    test.write_text(
        "import torch, memcompile\n"
        "def test_one():\n"
        "    torch._dynamo.reset()\n"
        "    f = memcompile.compile(torch.nn.Linear(8, 8), budget='1GiB')\n"
        "    f(torch.randn(4, 8)).sum().backward()\n"
    )
    env = {
        **os.environ,
        "PLANREC_DIR": str(tmp_path / "a"),
        "PYTHONPATH": str(ROOT / "benchmarks"),
        "OMP_NUM_THREADS": "1",
    }
    run = [sys.executable, "-m", "pytest", "-q", "-p", "plan_record", str(test)]
    out = subprocess.run(run, capture_output=True, text=True, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    (recorded,) = (tmp_path / "a").glob("*.jsonl")
    name, plan = recorded.read_text().splitlines()[0].split("\t")
    assert name == "memcompile_plan_F0" and plan.startswith("{")
    same = _compare(str(tmp_path / "a"), str(tmp_path / "a"))
    assert same.returncode == 0 and "identical" in same.stdout
    changed = tmp_path / "b"
    changed.mkdir()
    (changed / recorded.name).write_text(recorded.read_text().replace("F0", "F1"))
    (changed / "other.jsonl").write_text("x\n")
    out = _compare(str(tmp_path / "a"), str(changed))
    assert out.returncode == 1
    assert f"differ: {recorded.name}" in out.stdout and "after only: other.jsonl" in out.stdout


def test_a_missing_folder_is_refused_with_its_name(tmp_path) -> None:
    out = _compare(str(tmp_path / "nope"), str(tmp_path))
    assert out.returncode == 2 and "is not a folder of recorded plans" in out.stderr
