"""benchmarks/gpu_check.py: the dry run writes its report; deadlines keep what was measured;
the targets are checked; bad arguments are refused. (cuda_anchors.py runs inside it.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPT = BENCH / "gpu_check.py"
sys.path.insert(0, str(BENCH))

import gpu_check  # noqa: E402


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--stages", "tests,nope"], "--stages: any of tests, blocks, anchors, moe"),
        (["--dry-run", "--budget-s", "0"], "--budget-s must be positive"),
        ([], "no CUDA device here: run it on a lent GPU, or with --dry-run"),
    ],
)
def test_bad_arguments_are_refused_with_their_reason(args: list[str], message: str) -> None:
    out = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert message in out.stderr, out.stderr


def test_dry_run_writes_the_report_with_machine_rows_and_targets(tmp_path: Path) -> None:
    rc = gpu_check.main(
        ["--dry-run", "--out", str(tmp_path), "--stages", "anchors", "--configs", "eager,mc_r50"]
    )
    assert rc == 0
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["dry_run"] and result["torch"] and result["date"] and result["commit"]
    assert [s["status"] for s in result["stages"]] == ["ok"]
    rows = {r["config"]: r for r in result["anchors"]}
    assert set(rows) == {"eager", "mc_r50"}
    mc = rows["mc_r50"]
    assert mc["fits"] and mc["within_budget"] and mc["loss_equal"] and mc["grads_equal"]
    assert any(t.startswith("PASS mc_r50") for t in result["targets"]), result["targets"]
    md = (tmp_path / "gpu_check.md").read_text()
    assert "dry run on the CPU" in md and "| gpt | mc_r50 |" in md
    # Within the device tool's limits: at most 8 plain files, none in folders.
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["gpu_check.json", "gpu_check.md", "stages.log"], files


def test_dry_run_times_a_blocks_prefetch_and_leaves_its_files_out(tmp_path: Path) -> None:
    rc = gpu_check.main(["--dry-run", "--out", str(tmp_path), "--stages", "blocks"])
    assert rc == 0
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [(s["stage"], s["status"]) for s in result["stages"]] == [("blocks", "ok")]
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["gpu_check.json", "gpu_check.md", "stages.log"], files


def test_a_stage_past_its_deadline_is_killed_and_keeps_its_rows(tmp_path: Path) -> None:
    # The child prints one row, then hangs with a grandchild (as Inductor's workers would).
    code = (
        'import subprocess, sys, time; print(\'{"config": "eager"}\', flush=True); '
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        "print('oops', file=sys.stderr, flush=True); time.sleep(60)"
    )
    t0 = time.perf_counter()
    stage = gpu_check._run_stage(
        "anchors", [sys.executable, "-c", code], 3.0, tmp_path / "out", tmp_path / "err"
    )
    assert time.perf_counter() - t0 < 20
    assert stage["status"] == "timed out" and stage["limit_s"] == 3.0
    assert gpu_check._json_lines(tmp_path / "out") == [{"config": "eager"}]
    assert "oops" in (tmp_path / "err").read_text()


def test_targets_fail_over_budget_or_off_prediction_and_compare_with_inductor() -> None:
    def row(config: str, **kw: object) -> dict[str, object]:
        return {"config": config, "fits": True, **kw}

    rows = [
        row("mc_r25", budget=100, peak=104, within_budget=False, prediction_error=0.0),
        row("mci_r25", budget=100, peak=99, within_budget=True, prediction_error=-0.05),
        row("mc_r50", budget=100, peak=99, within_budget=True, prediction_error=0.01),
        row("inductor_amb50", step_ms=10.0),
        row("mci_amb50", step_ms=9.0, budget=100, peak=100, within_budget=True, prediction_error=0),
        row("inductor", step_ms=10.0),
        row("mci_none", step_ms=11.0),
    ]
    got = gpu_check.targets(rows)
    assert got[0].startswith("FAIL mc_r25: measured 1.040×")
    assert got[1].startswith("FAIL mci_r25") and "-5.0 %" in got[1]
    assert got[2].startswith("PASS mc_r50")
    assert "PASS mci_amb50 9.0 ms ≤ inductor_amb50 10.0 ms at its peak" in got
    assert "n/a mci_amb10 vs inductor_amb10: not both measured" in got
    assert got[-1] == "FAIL mci_none 1.10× plain torch.compile's time (≤ 1.05)"


def test_the_anchors_name_each_inner_compiler_by_prefix() -> None:
    import cuda_anchors

    assert cuda_anchors._split("mc_r25") == ("mc_r25", "eager", False)
    assert cuda_anchors._split("mci_h25s") == ("mc_h25", "inductor", True)
    assert cuda_anchors._split("mca_r25") == ("mc_r25", "auto", False)
    assert "mca_r25" in gpu_check.ANCHOR_CONFIGS  # a lent GPU shows auto's choice


def test_the_report_finds_memcompile_where_it_is_not_installed(tmp_path: Path) -> None:
    # On the device machine memcompile is this checkout, not a package: the report's import of
    # cuda_anchors (which imports memcompile) must work from any directory, without PYTHONPATH.
    code = (
        "import runpy, sys; runpy.run_path(sys.argv[1], run_name='gpu_check'); "
        "import cuda_anchors, memcompile; print(memcompile.__file__)"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "-c", code, str(SCRIPT)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()).is_relative_to(BENCH.parent), out.stdout
