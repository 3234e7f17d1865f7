"""benchmarks/dynamic_prefetch.py: a tiny run writes its table; bad arguments are refused."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from helpers import run_benchmark


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return run_benchmark("dynamic_prefetch.py", *args)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--kinds", "markov"], "--kinds: 'off' first"),
        (["--kinds", "off;oracle"], "got 'off;oracle'"),
        (["--kinds", "off;pilot, sync"], "--kinds: 'off' first"),  # the GPU's variant
        (["--device", "tpu"], "invalid choice: 'tpu'"),
        (["--set", "d_model"], "--set takes KEY=INTEGER; got 'd_model'"),
        (["--set", "d_model=big"], "--set takes KEY=INTEGER; got 'd_model=big'"),
        (["--set", "width=64"], "moe_workload: unknown setting 'width'"),
        (["--set", "hidden=0"], "moe_workload: hidden must be a positive int; got 0"),
    ],
)
def test_bad_arguments_are_refused_with_their_reason(args: list[str], message: str) -> None:
    out = _run(*args)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert message in out.stderr, out.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_the_gpu_run_needs_a_gpu() -> None:
    out = _run("--device", "cuda")
    assert out.returncode == 2 and "--device cuda: no CUDA device" in out.stderr, out.stderr


def test_a_tiny_run_of_two_predictors_writes_its_table(tmp_path: Path) -> None:
    out = _run(
        *("--size", "tiny", "--steps", "3", "--warmup", "2", "--kinds", "off;markov"),
        *("--set", "hidden=48"),
        *("--out", str(tmp_path)),
    )
    assert out.returncode == 0, out.stderr
    rows = json.loads((tmp_path / "dynamic_prefetch.json").read_text())
    assert [r["predictor"] for r in rows] == ["off", "markov"]
    assert all(r["bit_identical_losses"] for r in rows)
    assert rows[1]["gpu_miss_us"] is None  # nothing is timed on the GPU on the CPU device
    text = (tmp_path / "dynamic_prefetch.md").read_text()
    assert "--set hidden=48 --kinds 'off;markov'" in text and "| markov (markov) |" in text
