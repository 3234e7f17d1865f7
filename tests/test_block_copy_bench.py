"""benchmarks/block_copy.py: the host cost per fetched block, its copies in one call and one by
one, and the training rows."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import block_copy  # noqa: E402


@pytest.mark.parametrize("threaded", [False, True])
def test_the_micro_rows_time_both_layouts_of_a_block(threaded: bool) -> None:
    rows = block_copy.micro(20, "expert", threaded=threaded)
    assert [r["way"] for r in rows] == ["one by one", "one call"]
    assert all(r["tensors"] == 4 and r["block_kib"] > 0 for r in rows)
    assert all(r["block_us"] == r["prefetch_us"] + r["hits_us"] > 0 for r in rows)


def test_the_blocks_are_the_moes_layer_and_expert_on_the_host() -> None:
    assert [len(block_copy._block(kind)) for kind in block_copy.BLOCKS] == [9, 4]


def test_main_writes_the_table_and_rows(tmp_path: Path) -> None:
    def train(steps: int, rounds: int) -> list[dict[str, Any]]:
        assert (steps, rounds) == (12, 1)
        return [
            {"run": "pilot, one call per block", "pilot": "lightgbm", "batched": True,
             "step_ms_p50": 2.0, "step_ms_rounds": [2.0], "hit_rate": 0.9, "same_losses": True},
            {"run": "off", "pilot": "off", "batched": True, "step_ms_p50": 1.0,
             "step_ms_rounds": [1.0], "hit_rate": None, "same_losses": False},
        ]  # fmt: skip

    md = block_copy.main(
        ["--reps", "10", "--steps", "12", "--rounds", "1", "--out", str(tmp_path)], train=train
    )
    text = md.read_text()
    assert "| expert (4 tensors, 257.5 KiB) | copy thread | one call |" in text
    assert "| pilot, one call per block | 2.0 | 2.0 | 90.0 % | yes |" in text
    assert "| off | 1.0 | 1.0 | - | NO |" in text
    rows = json.loads((tmp_path / "block_copy.json").read_text())["rows"]
    assert {r["measure"] for r in rows} == {"host_cost", "training"} and len(rows) == 10


def test_steps_0_writes_the_host_cost_alone(tmp_path: Path) -> None:
    def train(steps: int, rounds: int) -> list[dict[str, Any]]:
        raise AssertionError("no training with --steps 0")

    md = block_copy.main(["--reps", "5", "--steps", "0", "--out", str(tmp_path)], train=train)
    assert "## Host cost per fetched block" in md.read_text()
    assert "## Zoo MoE" not in md.read_text()


@pytest.mark.usefixtures("fresh_dynamo")
def test_the_training_runs_give_the_same_losses() -> None:
    rows = block_copy.training(11, 1)
    assert [r["run"] for r in rows] == [
        "pilot, one call per block", "pilot, one by one", "off (fetch on demand)"
    ]  # fmt: skip
    assert all(r["same_losses"] for r in rows)
    assert rows[0]["hit_rate"] and rows[2]["hit_rate"] is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_device_cuda_without_a_gpu_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        block_copy.main(["--device", "cuda"])
    assert e.value.code == 2 and "--device cuda: no CUDA device here" in capsys.readouterr().err
