"""The array liveness replay (``memcompile/analysis/liveness.py``) against the node-by-node loop it
replaced, kept here as the oracle: on hypothesis-generated graphs (views, multi-output nodes,
persistent storages, arbitrary orders, storages live on entry, kept or swapped in late) and on
every replay of a planner search on zoo models."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memcompile.analysis.joint_model import _FW, JointModel
from memcompile.analysis.liveness import Liveness
from memcompile.planning.planner import search_saved_set

from helpers import capture_joint


def _loop_replay(
    storages: Sequence[Sequence[int]],
    inputs: Sequence[Sequence[int]],
    forward: Sequence[bool],
    persistent: Collection[int],
    nbytes: Sequence[int],
    workspace: Sequence[int],
    order: Sequence[int],
    live_on_entry: Iterable[int],
    keep: Collection[int],
    late: Collection[int] = (),
) -> tuple[int, int, int, frozenset[int]]:
    """The node-by-node replay (``JointModel._replay`` before the arrays), verbatim in what it
    computes: copies of storages a recomputed forward node makes again, late storages live from
    their first read, frees after the last reader, the storages live at the first highest
    position."""
    entry = set(live_on_entry) | set(late)
    copy_of: dict[int, int] = {}  # copy key (negative) -> storage it copies
    dup: dict[int, dict[int, int]] = {}  # recomputed node -> {storage: copy key}
    if entry:
        for i in order:
            if not forward[i]:
                continue
            read = {s for j in inputs[i] for s in storages[j]}
            for s in storages[i]:
                if s in entry and s not in read and s not in persistent:
                    key = -1 - len(copy_of)
                    copy_of[key] = s
                    dup.setdefault(i, {})[s] = key

    def size(s: int) -> int:
        return nbytes[copy_of[s] if s < 0 else s]

    last: dict[int, int] = {}
    for p, i in enumerate(order):
        for j in inputs[i]:
            copies = dup.get(j, {})
            for s in storages[j]:
                last[copies.get(s, s)] = p
    live = dict.fromkeys(s for s in live_on_entry if s not in persistent)
    for s in live:
        last.setdefault(s, -1)
    for s in keep:
        last[s] = len(order)
    current = sum(size(s) for s in live)
    peak, peak_pos, at_peak = current, -1, frozenset(live)
    frees: dict[int, list[int]] = {}
    for s, p in last.items():
        frees.setdefault(p, []).append(s)
    for s in frees.pop(-1, []):
        if s in live:
            del live[s]
            current -= size(s)
    for p, i in enumerate(order):
        for j in inputs[i]:
            copies = dup.get(j, {})
            for s in storages[j]:
                if s in late and s not in live and s not in copies:
                    live[s] = None
                    current += size(s)
        copies = dup.get(i, {})
        for s in (copies.get(s, s) for s in storages[i]):
            if s not in live and s not in persistent:
                live[s] = None
                current += size(s)
                last.setdefault(s, p)
                if last[s] == p:
                    frees.setdefault(p, []).append(s)
        here = current + workspace[i]
        if here > peak:
            peak, peak_pos, at_peak = here, p, frozenset(live)
        for s in frees.get(p, []):
            if s in live:
                del live[s]
                current -= size(s)
    return peak, current, peak_pos, frozenset(s for s in at_peak if s >= 0)


@st.composite
def _graphs(draw: Any) -> dict[str, Any]:
    """A random graph (nodes in index order, each reading earlier ones; a node's value is a new
    storage, a view of one it reads, or two new storages) and a random replay of it."""
    n = draw(st.integers(1, 24))
    storages: list[tuple[int, ...]] = []
    inputs: list[tuple[int, ...]] = []
    n_storages = 0
    for i in range(n):
        ins = tuple(sorted(draw(st.sets(st.integers(0, i - 1), max_size=3)))) if i else ()
        kind = draw(st.sampled_from(["new", "view", "pair", "none"]))
        if kind == "view" and ins:
            storages.append(storages[draw(st.sampled_from(ins))])
        elif kind == "pair":
            storages.append((n_storages, n_storages + 1))
            n_storages += 2
        elif kind == "none":
            storages.append(())
        else:
            storages.append((n_storages,))
            n_storages += 1
        inputs.append(ins)
    every = st.integers(0, max(n_storages - 1, 0))
    some = st.sets(every, max_size=n_storages) if n_storages else st.just(set())
    # Orders need not be topological: the replay takes any sequence of distinct nodes.
    order = draw(st.permutations(range(n)))[: draw(st.integers(0, n))]
    return dict(
        storages=storages,
        inputs=inputs,
        forward=draw(st.lists(st.booleans(), min_size=n, max_size=n)),
        persistent=draw(some),
        nbytes=draw(st.lists(st.integers(0, 1000), min_size=n_storages, max_size=n_storages)),
        workspace=draw(st.lists(st.integers(0, 300), min_size=n, max_size=n)),
        order=list(order),
        live_on_entry=sorted(draw(some)),
        keep=draw(some),
        late=draw(some),
    )


@settings(max_examples=400, deadline=None, derandomize=True, database=None)
@given(case=_graphs())
def test_the_array_replay_answers_as_the_loop_on_random_graphs(case: dict[str, Any]) -> None:
    graph = {k: case[k] for k in ("storages", "inputs", "forward", "persistent", "nbytes")}
    liveness = Liveness(**graph, workspace=case["workspace"])
    run = {k: case[k] for k in ("order", "live_on_entry", "keep", "late")}
    expected = _loop_replay(**graph, workspace=case["workspace"], **run)
    assert liveness.replay(**run) == expected


def test_a_node_making_a_storage_again_after_its_death_keeps_it_to_the_end() -> None:
    # Node 1 makes storage 0 again (a second writer that does not read it) after node 2, its
    # last reader: the loop counted it live from there to the end (it is never freed again),
    # where it peaks (with node 1's scratch).
    graph = dict(
        storages=[(0,), (0,), (1,)],
        inputs=[(), (), (0,)],
        forward=[False] * 3,
        persistent=(),
        nbytes=[100, 10],
        workspace=[0, 50, 0],
    )
    run = dict(order=[0, 2, 1], live_on_entry=(), keep=())
    expected = _loop_replay(**graph, **run)
    assert expected == (150, 100, 2, frozenset({0}))
    assert Liveness(**graph).replay(**run) == expected


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("name", ["gpt", "gru"])
def test_every_replay_of_a_search_on_a_zoo_model_answers_as_the_loop(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The planner's searches (forward and backward orders, sinks, schedules, swaps) on a zoo
    model's joint graph, each replay checked against the loop."""
    model: JointModel = capture_joint(name)["model"]
    replay = Liveness.replay
    checked = []

    def checking(self: Liveness, order: Any, live_on_entry: Any, keep: Any, late: Any = ()) -> Any:
        live_on_entry, keep, late = list(live_on_entry), set(keep), set(late)
        found = replay(self, order, live_on_entry, keep, late)
        expected = _loop_replay(
            model.storages,
            model.inputs,
            [k == _FW for k in model.kind],
            model.persistent,
            model.nbytes,
            model.workspace,
            order,
            live_on_entry,
            keep,
            late,
        )
        assert found == expected
        checked.append(bool(late))
        return found

    monkeypatch.setattr(Liveness, "replay", checking)
    baseline = model.evaluate(model.default_saved())
    for swap_tier in (None, "host"):
        search_saved_set(model, baseline.peak * 6 // 10, swap_tier=swap_tier)
    assert len(checked) > 50 and any(checked)
