"""benchmarks/copy_thread.py: the CPU's copy thread on and off, the store's copies timed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import copy_thread  # noqa: E402

from memcompile.runtime import copy_engine  # noqa: E402
from memcompile.runtime.store import TieredStore, register_store  # noqa: E402


def test_the_store_timer_counts_each_copy_and_puts_the_store_back(monkeypatch) -> None:
    monkeypatch.setattr(copy_engine, "MIN_BYTES", 0)
    timer = copy_thread.StoreTimer()
    original = TieredStore.put
    key = register_store(TieredStore())
    x = torch.randn(32, 32)
    with timer.installed(), copy_engine.using(True):
        host = torch.ops.memcompile.offload(x, key, 0)
        y = torch.ops.memcompile.reload(host, torch.device("cpu"), key, 0)
        torch.ops.memcompile.wait(y, key)
    assert TieredStore.put is original and torch.equal(y, x)
    taken = timer.take()
    assert [taken[k][1] for k in ("put", "get", "wait")] == [1, 1, 1]
    assert taken["put"][2] == taken["get"][2] == x.numel() * 4
    assert timer.take()["put"] == [0, 0, 0]  # taken: counted from zero again


@pytest.mark.usefixtures("fresh_dynamo")
def test_the_moe_rows_train_alike_with_and_without_the_thread() -> None:
    rows = copy_thread.moe_pilot(12)
    assert [r["run"] for r in rows] == [
        "pilot, thread (forced)",
        "pilot, sync",
        "off (fetch on demand)",
    ]
    assert rows[0]["losses"] == rows[1]["losses"] == rows[2]["losses"]
    assert rows[0]["hit_rate"] and rows[2]["hit_rate"] is None
    text = "\n".join(copy_thread._table({"budget": 1, "rows": []}, rows))
    assert "| pilot, thread (forced) |" in text and "| yes |" in text
