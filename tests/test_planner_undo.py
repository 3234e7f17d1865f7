"""The planner's undo pass with the memory-aware orders (``_Search.undo(schedule=True)``): a
trial that fits in torch's own orders is taken without scheduling it (those orders only lower
the peak; time, feasibility and held bytes do not depend on the order), and the search ends
with the plan it ended with when every trial was scheduled."""

from __future__ import annotations

import dataclasses
import math

import pytest

from memcompile.analysis.joint_model import JointModel
from memcompile.planning import planner
from memcompile.planning.planner import search_saved_set

from helpers import capture_joint, search_under

#: What a plan decides and predicts: equal for the pass and its reference.
_SAME = (
    "saved",
    "swapped",
    "peak",
    "forward_peak",
    "backward_peak",
    "recompute",
    "backward_order",
    "forward_order",
)


#: The pass itself (the tests patch ``_Search.undo`` with the reference).
_UNDO = planner._Search.undo


def _undo_scheduling_every_trial(self, current, applied, schedule):
    """The reference: the undo pass with no trial taken on torch's orders (their plans' time
    made infinite there), so that with ``schedule`` every trial is scheduled whole."""
    if not schedule:
        return _UNDO(self, current, applied, schedule)
    evaluate = JointModel.evaluate

    def never_taken(model, saved, swapped=None, *, schedule=False, sink=False):
        e = evaluate(model, saved, swapped, schedule=schedule, sink=sink)
        return e if schedule or sink else dataclasses.replace(e, recompute_time=math.inf)

    JointModel.evaluate = never_taken
    try:
        return _UNDO(self, current, applied, schedule)
    finally:
        JointModel.evaluate = evaluate


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
        _undone(undo, name) for undo in (_UNDO, _undo_scheduling_every_trial)
    )
    for field in _SAME:
        assert getattr(got, field) == getattr(want, field), field
    # Every trial fitted in torch's orders: at most the plan kept is scheduled (or found
    # scheduled already: the search's first plan, where every move is taken back).
    assert with_shortcut <= 1 < every


@pytest.mark.parametrize(
    ("name", "fraction", "swap_tier"),
    [("branchy", 0.8, None), ("resnet", 0.7, "host"), ("gpt_manual", 0.6, None)],
)
def test_searches_whose_undo_schedules_end_as_with_every_trial_scheduled(
    monkeypatch, name, fraction, swap_tier
):
    shortcut = search_under(name, fraction, swap_tier)
    monkeypatch.setattr(planner._Search, "undo", _undo_scheduling_every_trial)
    every = search_under(name, fraction, swap_tier)
    for field in _SAME:
        assert getattr(shortcut.final, field) == getattr(every.final, field), field
    assert shortcut.moves == every.moves
