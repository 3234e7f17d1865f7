"""``schedule.sink``'s lookups (``SinkMemo``: where each value live at the peak is first made,
and the views that move with a node) checked against the plain renderings they replaced, on
the orders the planner prices: the forward's and the backward's under random saved sets."""

from __future__ import annotations

import random

import pytest

from memcompile.analysis import schedule
from memcompile.analysis.schedule import SinkMemo

from helpers import capture_joint


def _reference_candidates(model, order, live, at) -> list[int]:
    """Where the candidates are first made, as ``sink`` found them before: every storage live
    at the peak looked up one by one, then sorted."""
    position = dict(zip(order, range(len(order)), strict=True))
    producer: dict[int, int] = {}
    for s in live:
        made = [position[j] for j in model.nodes_holding(s) if j in position]
        if made:
            producer[s] = min(made)
    candidates = sorted(
        (s for s in live if s in producer and producer[s] < at),
        key=lambda s: (-model.nbytes[s], producer[s]),
    )[: schedule._SINK_TRIES]
    return [producer[s] for s in candidates]


def _reference_members(model, head, position) -> set[int]:
    """The views of ``head`` that move with it, as ``_sink_move`` walked them before."""
    own = set(model.storages[head])
    start = position[head]
    members, stack = {head}, [head]
    while stack:
        j = stack.pop()
        for u in model.users[j]:
            if (
                u in position
                and u not in members
                and position[u] > start
                and set(model.storages[u]) <= own
                and not model.has_effect[u]
            ):
                members.add(u)
                stack.append(u)
    return members


def _orders(model, rng: random.Random):
    """(order, live on entry, kept) of the forward and of the backward under random saved
    sets: the orders ``evaluate`` replays and sinks."""
    saved = sorted(model.default_saved() - model.must_save())
    keep_fw = model._fw_output_storages
    yield list(model.forward_order), (), keep_fw | set(saved)
    for _ in range(6):
        kept = frozenset(rng.sample(saved, rng.randrange(len(saved) + 1))) | model.must_save()
        needed, _, inputs = model.backward_nodes(kept)
        entry = [s for i in inputs for s in model.storages[i]]
        bw_keep = {s for i in model.bw_outputs for s in model.storages[i]}
        yield model.backward_order(needed), entry, bw_keep


@pytest.mark.parametrize("name", ["gru", "gpt", "moe", "treelstm"])
def test_sink_finds_its_candidates_and_moving_views_as_the_plain_walks_did(name):
    model = capture_joint(name)["model"]
    rng = random.Random(0)
    compared = moved = 0
    for order, entry, keep in _orders(model, rng):
        memo = SinkMemo()
        _, _, peak_at, live = model._replay(order, entry, keep)
        position = dict(zip(order, range(len(order)), strict=True))
        for at in sorted({peak_at, 0, len(order) // 3, len(order) // 2, len(order) - 1}):
            assert memo.candidates(model, order, live, at) == _reference_candidates(
                model, order, live, at
            )
            compared += 1
        for head in rng.sample(order, min(60, len(order))):
            own = frozenset(model.storages[head])
            got = schedule._views_moving(model, head, own, position)
            assert got == _reference_members(model, head, position)
            moved += len(got) > 1
    assert compared >= 20 and moved  # values live at peaks, and heads with views, were seen
