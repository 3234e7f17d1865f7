"""benchmarks/natural.py: a quick run (tiny MoE written naturally, budget 0.75x) writes its
results, trains bit-identically to eager and counts the regions."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import run_benchmark


def test_a_tiny_run_writes_identical_rows_with_regions(tmp_path: Path) -> None:
    args = ["--size", "tiny", "--models", "moe_natural", "--configs", "mc,mc_75"]
    out = run_benchmark("natural.py", *args, "--reps", "1", "--warmup", "3", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads((tmp_path / "natural.json").read_text())["rows"]
    assert [r["config"] for r in rows] == ["eager", "mc", "mc_75"]
    assert all(r["identical"] for r in rows)
    eager, _, budgeted = rows
    assert budgeted["budget"] == int(0.75 * eager["measured_peak"])
    assert budgeted["regions"] == 14 and budgeted["fragments"] == 5
    assert "| moe_natural | mc_75 |" in (tmp_path / "natural.md").read_text()


def test_an_unknown_config_is_an_error(tmp_path: Path) -> None:
    out = run_benchmark("natural.py", "--configs", "mc_10", "--out", str(tmp_path))
    assert out.returncode == 2
    assert (
        "unknown config(s) ['mc_10']; choose from eager, mc, mc_watched, mc_75_off, mc_75, mc_50"
        in out.stderr
    )
