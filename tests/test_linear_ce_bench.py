"""benchmarks/linear_ce_cost.py: bad arguments are refused with their reason."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "linear_ce_cost.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=600,
    )


def test_reps_below_one_are_refused():
    done = _run("--reps", "0")
    assert done.returncode == 2 and "--reps must be >= 1; got 0" in done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is there")
def test_cuda_without_a_device_is_refused():
    done = _run("--device", "cuda")
    assert done.returncode == 2 and "--device cuda: no CUDA device" in done.stderr
