"""benchmarks/ddp.py refuses bad arguments with one line saying why (before any work)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "ddp.py"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--models", "mlp,nope"], "--models: choose from mlp, gpt; got 'mlp,nope'"),
        (["--models", ","], "--models: choose from mlp, gpt; got ','"),
        (["--budgets", "lots"], "--budgets: fractions such as 0.6,0.3; got 'lots'"),
        (["--budgets", "0.5,1.5"], "--budgets: fractions in (0, 1]; got '0.5,1.5'"),
        (["--budgets", ","], "--budgets: fractions in (0, 1]; got ','"),
        (["--steps", "0"], "--steps and --timed must be >= 1"),
        (["--timed", "-1"], "--steps and --timed must be >= 1"),
    ],
)
def test_bad_arguments_are_refused_with_their_reason(args: list[str], message: str) -> None:
    out = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert message in out.stderr, out.stderr
