"""The memory-aware list scheduler (``memcompile/analysis/schedule.py``) on small hand-built graphs.

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
from memcompile.analysis.schedule import SinkMemo, schedule, sink

MiB = 2**20


class _Model(SimpleNamespace):
    @property
    def effect_nodes(self) -> tuple[int, ...]:  # as JointModel's, from has_effect as set now
        return tuple(i for i, e in enumerate(self.has_effect) if e)


def _model(spec: dict[int, tuple[list[int], int]]) -> Any:
    """node -> (input nodes, bytes of its own storage); storage ids are node ids."""
    n = max(spec) + 1
    inputs = [spec.get(i, ([], 0))[0] for i in range(n)]
    storages = [(i,) for i in range(n)]
    return _Model(
        inputs=inputs,
        users=[[u for u in range(n) if i in inputs[u]] for i in range(n)],
        storages=storages,
        nodes_holding=lambda s: tuple(i for i in range(n) if s in storages[i]),
        input_storages=[frozenset(ins) for ins in inputs],
        nbytes={i: spec.get(i, ([], 0))[1] for i in range(n)},
        persistent=frozenset(),
        has_effect=[False] * n,
        sink_memo=SinkMemo(),
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


def _replay(model: Any, entry: tuple[int, ...], keep: set[int]) -> Any:
    """A liveness replay as ``JointModel._replay``'s: (peak, end, peak position, live there);
    a storage is freed after its last reader (or right away if nothing reads it)."""

    def run(order: list[int]) -> tuple[int, int, int, frozenset[int]]:
        last = {s: p for p, i in enumerate(order) for s in model.input_storages[i]}
        live = set(entry)
        current = sum(model.nbytes[s] for s in live)
        peak, at, at_peak = current, -1, frozenset(live)
        for p, i in enumerate(order):
            for s in model.storages[i]:
                if s not in live:  # a view allocates nothing
                    live.add(s)
                    current += model.nbytes[s]
            if current > peak:
                peak, at, at_peak = current, p, frozenset(live)
            for s in sorted(live):
                if s not in keep and last.get(s, p) <= p:
                    live.discard(s)
                    current -= model.nbytes[s]
        return peak, current, at, at_peak

    return run


def test_sink_moves_a_waiting_gradient_past_a_recomputation() -> None:
    # torch's order: the gradient g (8 MiB, read only by b) waits while the recomputation r
    # (8 MiB) and its consumer c run: 17 MiB. Computed right before b instead: 10 MiB.
    model = _model(_CHAIN)
    replay = _replay(model, (0,), {_B})
    assert replay([_G, _R, _C, _B])[0] == 17 * MiB
    order, replayed = sink(model, [_G, _R, _C, _B], replay)
    assert order == [_R, _C, _G, _B]
    assert replayed == replay(order) and replayed[0] == 10 * MiB


def test_sink_keeps_a_move_only_where_the_peak_drops() -> None:
    # g reads an 8 MiB entry value that dies at g. Computing g later keeps that value alive
    # across r and c (8 + 8 + 1 = 17 MiB at c), no lower than torch's order (8 + 8 + 1 = 17
    # MiB with g, r and c live), so the move is priced and dropped.
    spec = {**_CHAIN, 0: ([], 8 * MiB)}
    model = _model(spec)
    replay = _replay(model, (0,), {_B})
    calls: list[list[int]] = []

    def counted(order: list[int]) -> Any:
        calls.append(list(order))
        return replay(order)

    order, replayed = sink(model, [_G, _R, _C, _B], counted)
    assert order == [_G, _R, _C, _B] and replayed[0] == 17 * MiB
    assert [_R, _C, _G, _B] in calls  # the move was tried and priced, then dropped


def test_sink_moves_no_effect_and_nothing_past_a_write_to_what_it_reads() -> None:
    model = _model(_CHAIN)
    replay = _replay(model, (0,), {_B})
    model.has_effect[_G] = True  # g draws random numbers: it keeps its place
    assert sink(model, [_G, _R, _C, _B], replay)[0] == [_G, _R, _C, _B]
    # c writes into the entry value 0, which g reads: g must read it before c runs.
    model = _model({**_CHAIN, _C: ([_R, 0], 1 * MiB)})
    model.has_effect[_C] = True
    replay = _replay(model, (0,), {_B})
    assert sink(model, [_G, _R, _C, _B], replay)[0] == [_G, _R, _C, _B]


def test_sink_moves_a_value_with_its_views() -> None:
    # As above, but b reads g through a view v (node 5, no storage of its own: g's): g and
    # v move together, v after g.
    v = 5
    model = _model({**_CHAIN, _B: ([v, _C], 1 * MiB), v: ([_G], 0)})
    model.storages[v] = (_G,)
    model.input_storages[_B] = frozenset({_G, _C})
    replay = _replay(model, (0,), {_B})
    order, replayed = sink(model, [_G, v, _R, _C, _B], replay)
    assert order == [_R, _C, _G, v, _B] and replayed[0] == 10 * MiB


def test_sink_stops_after_its_replay_budget() -> None:
    model = _model(_CHAIN)
    replay = _replay(model, (0,), {_B})
    calls = []

    def counted(order: list[int]) -> Any:
        calls.append(order)
        return replay(order)

    order, _ = sink(model, [_G, _R, _C, _B], counted, max_replays=1)
    assert order == [_G, _R, _C, _B] and len(calls) == 1


def test_tiny_gpt_smallest_host_tier_plan() -> None:
    """The tiny GPT's smallest plan (host tier): 0.502 MiB with only torch's order and the free
    list schedule to choose from, 0.377 MiB with the windowed reordering, which runs the last
    MLP's recomputed GELU and W2's gradient before the gradient of the GELU's output."""
    torch._dynamo.reset()
    wl = zoo.build("gpt", size="tiny")
    compiled = memcompile.compile(wl.model, budget=1, on_infeasible="error")
    with pytest.raises(MemoryBudgetError) as info, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wl.train(compiled, 1)
    assert info.value.min_feasible is not None
    assert info.value.min_feasible <= 0.4 * MiB, info.value.min_feasible


def test_tiny_gpt_smallest_recompute_only_plan_sinks_waiting_gradients() -> None:
    """Recompute only, the tiny GPT's smallest plan: 1,339,340 B when the search prices its
    moves in torch's orders (the memory-aware ones only at its end), 1,331,080 B with the
    gradients that wait across the peak sunk to their readers in every evaluation."""
    torch._dynamo.reset()
    wl = zoo.build("gpt", size="tiny")
    compiled = memcompile.compile(
        wl.model, budget=1, swap=False, offload_params=False, on_infeasible="error"
    )
    with pytest.raises(MemoryBudgetError) as info, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wl.train(compiled, 1)
    assert info.value.min_feasible is not None
    assert info.value.min_feasible <= 1_331_080, info.value.min_feasible


def test_sink_reuses_the_callers_replay_of_the_order() -> None:
    model = _model(_CHAIN)
    replay = _replay(model, (0,), {_B})
    given = replay([_G, _R, _C, _B])
    calls: list[list[int]] = []

    def counted(order: list[int]) -> Any:
        calls.append(list(order))
        return replay(order)

    order, replayed = sink(model, [_G, _R, _C, _B], counted, given)
    assert order == [_R, _C, _G, _B] and replayed[0] == 10 * MiB
    assert [_G, _R, _C, _B] not in calls and calls  # only the moved orders were replayed
