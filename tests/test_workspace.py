"""Kernel workspace probes (``memcompile/analysis/workspace.py``): what they materialize."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode

from memcompile.analysis import workspace
from memcompile.analysis.workspace import probe_workspaces

aten = torch.ops.aten


def _slices_graph(dtype: torch.dtype, op: Any) -> tuple[fx.GraphModule, list[fx.Node]]:
    """``op`` of each row of one (8, 64) input: 8 probes (each row at its own storage offset,
    so each its own probe key) of one storage."""
    graph = fx.Graph()
    with FakeTensorMode():
        x = graph.placeholder("x")
        x.meta["val"] = torch.ones(8, 64, dtype=dtype)
        ops = []
        for k in range(8):
            row = graph.call_function(aten.select.int, (x, 0, k))
            row.meta["val"] = x.meta["val"].select(0, k)
            node = graph.call_function(op, (row,))
            node.meta["val"] = op(row.meta["val"])
            ops.append(node)
    graph.output(tuple(ops))
    return fx.GraphModule({}, graph), ops


def _fills(monkeypatch: pytest.MonkeyPatch, name: str) -> list[tuple[int, ...]]:
    """Records the sizes ``torch.<name>`` is called with from then on."""
    calls: list[tuple[int, ...]] = []
    real = getattr(torch, name)

    def counting(*size: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(size)
        return real(*size, **kwargs)

    monkeypatch.setattr(torch, name, counting)
    return calls


def test_probes_reading_one_floating_point_storage_fill_it_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An unrolled recurrence's steps read slices of one projection: one random fill for all
    # of them (the GRU small's probes drew 96 fills of a 9 MiB buffer, per planned graph).
    workspace.clear_cache()
    gm, _ = _slices_graph(torch.float32, aten.exp.default)
    fills = _fills(monkeypatch, "randn")
    found = probe_workspaces(gm)
    assert found is not None and fills == [(8 * 64,)]


def test_integer_storages_stay_each_probes_own(monkeypatch: pytest.MonkeyPatch) -> None:
    # Zeros, so indices stay in range: shared, another probe's out= write could change them.
    workspace.clear_cache()
    gm, ops = _slices_graph(torch.int64, aten.neg.default)
    fills = _fills(monkeypatch, "zeros")
    found = probe_workspaces(gm)
    assert found is not None and fills == [(8 * 64,)] * len(ops)
