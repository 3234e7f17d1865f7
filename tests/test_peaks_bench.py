"""benchmarks/peaks.py refuses bad ``--budgets`` with one line saying why (before any work)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "peaks.py"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("0.7,x", "--budgets takes comma-separated fractions, e.g. 0.7,0.4; got '0.7,x'"),
        ("2", "--budgets fractions must be in (0, 1]; got '2'"),
        ("0", "--budgets fractions must be in (0, 1]; got '0'"),
    ],
)
def test_bad_budgets_are_refused_with_their_reason(value: str, message: str) -> None:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--budgets", value], capture_output=True, text=True
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert message in out.stderr
