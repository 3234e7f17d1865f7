"""benchmarks/overhead.py refuses bad arguments with one line saying why (before any work)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "overhead.py"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--rounds", "0"], "--rounds and --batches must be >= 1"),
        (["--batches", "-1"], "--rounds and --batches must be >= 1"),
        (["--models", "gpt,nope"], "unknown zoo workload(s) ['nope']"),
        (["--sizes", "huge"], "got models ['branchy'"),
        (["--sizes", "huge"], "sizes ['huge']"),
        (["--models", ","], "--models and --sizes need zoo names and sizes"),
    ],
)
def test_bad_arguments_are_refused_with_their_reason(args: list[str], message: str) -> None:
    out = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert message in out.stderr, out.stderr
