"""The README's two set-up commands, .ci/run, and the `memcompile` command."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _bash_blocks(text: str) -> list[str]:
    return re.findall(r"^```bash\n(.*?)\n```$", text, flags=re.S | re.M)


def test_readme_opens_with_exactly_two_setup_commands() -> None:
    text = (ROOT / "README.md").read_text()
    head = text.split("\n## ", 1)[0]  # everything before the first section
    blocks = _bash_blocks(head)
    assert len(blocks) == 2, blocks
    demo, tests = blocks
    assert "\n" not in demo and "\n" not in tests  # one command each
    assert "pip install -c constraints.txt" in demo and demo.endswith("memcompile demo")
    assert "pip install -c constraints.txt" in tests and "pytest" in tests
    assert (ROOT / "constraints.txt").read_text().split() == ["torch==2.13.0"]


def test_ci_runs_the_readme_test_command() -> None:
    script = (ROOT / ".ci" / "run").read_text()
    assert os.access(ROOT / ".ci" / "run", os.X_OK)
    extracted = subprocess.run(
        ["awk", "/^```bash$/{n++; next} /^```$/{next} n==2 {print; exit}", "README.md"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert extracted == _bash_blocks((ROOT / "README.md").read_text())[1]
    assert 'exec bash -c "$cmd"' in script and "set -euo pipefail" in script


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "memcompile", *args], capture_output=True, text=True, env=ENV
    )


def test_demo_json_prints_predicted_and_measured_peaks() -> None:
    out = _cli("demo", "--workload", "gpt", "--size", "tiny", "--steps", "2", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["workload"] == "gpt" and len(result["losses"]) == 2
    (frag,) = result["fragments"]
    assert frag["fragment"] == "F0" and frag["predicted_peak"] and frag["measured_peak"]
    assert abs(result["predicted_peak"] - result["measured_peak"]) <= 0.03 * result["measured_peak"]
    assert result["exact"] is True and result["fallbacks"] == []
    # Eager first, on a copy with the same weights; then memcompile in the default budget: 60 %
    # of what the eager step allocates above its resident bytes, held, with eager's losses.
    assert result["eager_peak"] > result["budget"] >= result["measured_peak"]
    assert result["within_budget"] is True
    assert result["losses"] == result["eager_losses"] and result["losses_equal_eager"] is True
    assert result["eager_step_seconds"] > 0 and result["step_seconds"] > 0


def test_demo_budget_option() -> None:
    out = _cli("demo", "--size", "tiny", "--steps", "1", "--budget", "1.4MiB", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["budget"] == int(1.4 * 2**20) >= result["measured_peak"]
    assert result["losses_equal_eager"] is True
    out = _cli("demo", "--budget", "lots")
    assert out.returncode == 1 and "cannot read 'lots' as a size" in out.stderr


def test_demo_table_output() -> None:
    out = _cli("demo", "--workload", "early_exit", "--size", "tiny", "--steps", "2")
    assert out.returncode == 0, out.stderr
    assert "fragment   calls    predicted     measured" in out.stdout
    assert "whole step (estimate; measured: CPU profiler)" in out.stdout
    assert "eager PyTorch, without memcompile:" in out.stdout and "budget held:" in out.stdout
    assert "losses: equal to eager's bit for bit in all 2 step(s)" in out.stdout


def test_cli_errors_are_one_line_without_traceback() -> None:
    out = _cli("demo", "--workload", "nope")
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        "memcompile: error: unknown zoo workload 'nope'; choose one of branchy, early_exit, "
        "early_exit_natural, gpt, gpt_manual, gru, moe, moe_natural, moe_natural_top2, resnet, "
        "tree_natural, treelstm"
    ]
    out = _cli("demo", "--steps", "0")
    assert out.returncode == 1 and out.stderr.strip() == "memcompile: error: --steps must be >= 1"
    out = _cli("demo", "--size", "huge")
    assert out.returncode == 1 and "size must be one of tiny, small, bench" in out.stderr
    assert "Traceback" not in out.stderr
