"""The memory-aware list scheduler (``memcompile/passes/schedule.py``) on small hand-built graphs.

A stub stands in for the joint model: the scheduler only reads each node's inputs, storages
and their sizes, so the graphs below spell out exactly the situation each test is about.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import memcompile
from memcompile import MemoryBudgetError, zoo
from memcompile.passes.schedule import schedule

from helpers import train

MiB = 2**20


def _model(spec: dict[int, tuple[list[int], int]]) -> Any:
    """node -> (input nodes, bytes of its own storage); storage ids are node ids."""
    n = max(spec) + 1
    inputs = [spec.get(i, ([], 0))[0] for i in range(n)]
    return SimpleNamespace(
        inputs=inputs,
        storages=[(i,) for i in range(n)],
        input_storages=[frozenset(ins) for ins in inputs],
        nbytes={i: spec.get(i, ([], 0))[1] for i in range(n)},
        persistent=frozenset(),
        has_effect=[False] * n,
    )


# Node 0 (1 MiB) is live on entry, read only by g. g (8 MiB, a gradient) lives until b, which
# also needs c; r (8 MiB, a recomputation) dies at its consumer c (1 MiB). By net change alone
# g (+7 MiB) goes before r (+8 MiB), and r's 8 MiB is then allocated on top of g's:
#     g, r, c, b: peak 17 MiB        r, c, g, b: peak 10 MiB
_G, _R, _C, _B = 1, 2, 3, 4
_CHAIN = {
    0: ([], 1 * MiB),
    _G: ([0], 8 * MiB),
    _R: ([], 8 * MiB),
    _C: ([_R], 1 * MiB),
    _B: ([_G, _C], 1 * MiB),
}


def test_a_recompute_and_its_consumer_go_before_a_long_lived_gradient() -> None:
    model = _model(_CHAIN)
    order = schedule(model, [_G, _R, _C, _B], entry=[0], keep={_B})
    assert order == [_R, _C, _G, _B]


def test_lookahead_one_compares_net_changes_only() -> None:
    model = _model(_CHAIN)
    order = schedule(model, [_G, _R, _C, _B], entry=[0], keep={_B}, lookahead=1)
    assert order == [_G, _R, _C, _B]


def test_a_window_keeps_far_nodes_waiting() -> None:
    # Three independent nodes; the last frees 5 MiB (the entry storage it last reads), so the
    # free schedule runs it first. With a window of 2 it is not ready until the first node ran.
    model = _model({0: ([], 5 * MiB), 1: ([], MiB), 2: ([], MiB), 3: ([0], 0)})
    assert schedule(model, [1, 2, 3], entry=[0], keep={1, 2, 3})[0] == 3
    windowed = schedule(model, [1, 2, 3], entry=[0], keep={1, 2, 3}, window=2)
    assert windowed[0] != 3 and sorted(windowed) == [1, 2, 3]


def test_tiny_gpt_smallest_host_tier_plan() -> None:
    """The tiny GPT's smallest plan (host tier): 0.502 MiB with only torch's order and the free
    list schedule to choose from, 0.377 MiB with the windowed reordering, which runs the last
    MLP's recomputed GELU and W2's gradient before the gradient of the GELU's output."""
    torch._dynamo.reset()
    wl = zoo.build("gpt", size="tiny")
    compiled = memcompile.compile(wl.model, budget=1, on_infeasible="error")
    with pytest.raises(MemoryBudgetError) as info, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(wl, compiled, "sgd", 1)
    assert info.value.min_feasible is not None
    assert info.value.min_feasible <= 0.4 * MiB, info.value.min_feasible
