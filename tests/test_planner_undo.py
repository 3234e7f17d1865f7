"""The planner's undo pass with the memory-aware orders (``_Search.undo(schedule=True)``): a
trial that fits in torch's own orders is taken without scheduling it (those orders only lower
the peak; time, feasibility and held bytes do not depend on the order), and the search ends
with the plan it ended with when every trial was scheduled."""

from __future__ import annotations

import pytest

from memcompile.analysis.joint_model import JointModel
from memcompile.planning import planner
from memcompile.planning.planner import search_saved_set

from helpers import capture_joint


def _undo_scheduling_every_trial(self, current, applied, schedule):
    """The reference: the undo pass as it was, every trial evaluated in the given mode."""
    model = self.model
    tries = []
    for m in sorted(applied, key=lambda m: (-m.cost, m.kind, m.storages)):
        tries.append(m)
        if len(m.storages) > 1:
            tries += [
                planner._Move(m.kind, (s,), model.nbytes[s], m.cost, m.tier)
                for s in sorted(m.storages, key=lambda s: (-model.nbytes[s], s))
            ]
    misses = 0
    for m in tries:
        if misses >= planner._UNDO_MISSES:
            break
        swapped = dict(current.swapped)
        if m.kind == "recompute":
            if not current.saved.isdisjoint(m.storages):
                continue
            saved = current.saved | set(m.storages)
        else:
            if not set(m.storages) <= swapped.keys():
                continue
            saved = current.saved
            for s in m.storages:
                del swapped[s]
        kept = sum(model.nbytes[s] for s in saved if s not in swapped)
        if kept > self.target or (self.saved_cap is not None and kept > self.saved_cap):
            continue
        trial = self.evaluate(saved, swapped, schedule=schedule)
        if self.fits(trial) and trial.time < current.time:
            current, misses = trial, 0
        else:
            misses += 1
    return current


def _undone(undo, name: str):
    """A search's moves at half the model's peak, then ``undo`` of them from the scheduled
    plan under a target every trial meets (torch's orders fit it); the scheduled
    evaluations the undo made."""
    model = capture_joint(name)["model"]
    peak = search_saved_set(model, None).final.peak
    search = planner._Search(model, peak // 2, True, None, sink=True)
    current, applied = search.greedy(search.evaluate(model.default_saved(), {}))
    assert applied
    roomy = planner._Search(model, 2 * peak, True, None, sink=True)
    ordered = roomy.evaluate(current.saved, dict(current.swapped), schedule=True)
    scheduled = []
    evaluate = JointModel.evaluate

    def counting(self, saved, swapped=None, *, schedule=False, sink=False):
        scheduled.append(schedule)
        return evaluate(self, saved, swapped, schedule=schedule, sink=sink)

    JointModel.evaluate = counting
    try:
        return undo(roomy, ordered, applied, True), sum(scheduled)
    finally:
        JointModel.evaluate = evaluate


@pytest.mark.parametrize("name", ["gpt", "branchy"])
def test_an_undo_takes_trials_that_fit_in_torchs_orders_without_scheduling_them(name):
    (got, with_shortcut), (want, every) = (
        _undone(undo, name) for undo in (planner._Search.undo, _undo_scheduling_every_trial)
    )
    for field in (
        "saved",
        "swapped",
        "peak",
        "forward_peak",
        "backward_peak",
        "recompute",
        "backward_order",
        "forward_order",
    ):
        assert getattr(got, field) == getattr(want, field), field
    # Every trial fitted in torch's orders: at most the plan kept is scheduled (or found
    # scheduled already: the search's first plan, where every move is taken back).
    assert with_shortcut <= 1 < every


def _search(name: str, fraction: float, swap_tier: str | None) -> planner.SearchResult:
    model = capture_joint(name)["model"]
    base = search_saved_set(model, None)
    return search_saved_set(model, int(fraction * base.final.peak), swap_tier=swap_tier)


@pytest.mark.parametrize(
    ("name", "fraction", "swap_tier"),
    [("branchy", 0.8, None), ("resnet", 0.7, "host"), ("gpt_manual", 0.6, None)],
)
def test_searches_whose_undo_schedules_end_as_with_every_trial_scheduled(
    monkeypatch, name, fraction, swap_tier
):
    shortcut = _search(name, fraction, swap_tier)
    monkeypatch.setattr(planner._Search, "undo", _undo_scheduling_every_trial)
    every = _search(name, fraction, swap_tier)
    for field in (
        "saved",
        "swapped",
        "peak",
        "forward_peak",
        "backward_peak",
        "recompute",
        "backward_order",
        "forward_order",
    ):
        assert getattr(shortcut.final, field) == getattr(every.final, field), field
    assert shortcut.moves == every.moves
