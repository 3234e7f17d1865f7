"""benchmarks/linear_ce_cost.py: bad arguments are refused with their reason."""

from __future__ import annotations

import pytest
import torch

from helpers import run_benchmark


def _run(*args: str):
    return run_benchmark("linear_ce_cost.py", *args)


def test_reps_below_one_are_refused():
    done = _run("--reps", "0")
    assert done.returncode == 2 and "--reps must be >= 1; got 0" in done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is there")
def test_cuda_without_a_device_is_refused():
    done = _run("--device", "cuda")
    assert done.returncode == 2 and "--device cuda: no CUDA device" in done.stderr
