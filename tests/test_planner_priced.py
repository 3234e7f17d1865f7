"""The planner's trials priced once per model (``_Search.priced``): a search that passes saved
sets an earlier one priced (the search for the smallest peak retracing the search for the
target) decides as it would pricing each again, with fewer evaluations."""

from __future__ import annotations

import pytest

from memcompile.planning import planner
from memcompile.planning.planner import search_saved_set

from helpers import capture_joint, search_under


def _priced_anew(self, current, moves):
    """The reference: every trial evaluated, nothing remembered."""
    saved, swapped = self.apply(current.saved, dict(current.swapped), moves)
    return planner._Priced.of(self.evaluate(saved, swapped), self.model)


@pytest.mark.parametrize(
    ("name", "swap_tier", "retraced"),
    [("gru", None, True), ("gpt", None, False), ("gru", "host", False)],
)
def test_trials_priced_once_decide_as_trials_priced_every_time(
    monkeypatch, name, swap_tier, retraced
):
    # Under the smallest peak: the target search ends above it, then the least-peak searches.
    remembered = search_under(name, 0.05, swap_tier)
    monkeypatch.setattr(planner._Search, "priced", _priced_anew)
    anew = search_under(name, 0.05, swap_tier)
    for field in ("saved", "swapped", "peak", "recompute", "backward_order", "forward_order"):
        assert getattr(remembered.final, field) == getattr(anew.final, field), field
    assert remembered.moves == anew.moves
    if retraced:  # the least-peak search retraced the target's: its trials were remembered
        assert remembered.evaluations < anew.evaluations
    else:
        assert remembered.evaluations <= anew.evaluations


def test_a_trial_is_remembered_by_its_saved_set_swaps_and_pricing():
    # From one state, every single move priced with waiting values sunk and without, each
    # checked against its evaluation made anew: one remembered under another's key would
    # give another trial's (or the other pricing's) peaks.
    model = capture_joint("branchy")["model"]
    target = int(0.3 * search_saved_set(model, None).final.peak)
    searches = [planner._Search(model, target, True, "host", sink=sink) for sink in (True, False)]
    current = searches[0].evaluate(model.default_saved() | model.must_save(), {})
    moves = searches[0].moves(current)
    assert {m.kind for m in moves} == {"recompute", "swap"}
    differ = 0
    for m in moves:
        by_pricing = []
        for search in searches:
            got = search.priced(current, [m])
            saved, swapped = search.apply(current.saved, dict(current.swapped), [m])
            e = model.evaluate(saved, swapped, sink=search.sink)
            assert (got.peak, got.forward_peak, got.backward_peak, got.time) == (
                e.peak,
                e.forward_peak,
                e.backward_peak,
                e.time,
            )
            assert search.priced(current, [m]).full is None  # the second time, remembered
            by_pricing.append(got.peak)
        differ += by_pricing[0] != by_pricing[1]
    assert differ  # the pricings part on some trial: their keys must too
