"""The planner: which saved tensors to recompute so a fragment fits its byte target.

Greedy on the joint model (``joint.py``), by bytes saved per second of recompute:

    S = eager's saved set;  e = evaluate(S)
    while e.peak > target:
        candidates = storages in S live at the peak moment, recomputable
        for s in candidates by  nbytes(s) / recompute_time(s | S)  (best first):
            e' = evaluate(S - {s})
            if e' is better (its phase peaks, largest first, compare lower): S -= {s}; break
        else: stop            # nothing live at the peak can go: this is the smallest peak found

It never trades memory it does not need: with the peak at or under the target it stops, and
without a budget it keeps eager's saved set. The result is a :class:`FragmentPlan`; an
infeasible target still yields the smallest plan found (``feasible=False``), which the caller
turns into ``MemoryBudgetError`` or, with ``on_infeasible="best_effort"``, a warning.
"""

from __future__ import annotations

import logging

from memcompile.passes.joint import JointEval, JointModel
from memcompile.passes.plan import FragmentPlan, TensorDecision

log = logging.getLogger(__name__)

__all__ = ["SearchResult", "plan_fragment", "search_saved_set"]


def _rank(e: JointEval) -> tuple[int, int, int]:
    # Phase peaks, largest first: lowering any of two equal maxima is progress.
    return tuple(sorted((e.forward_peak, e.backward_peak, e.accumulate_peak), reverse=True))  # type: ignore[return-value]


class SearchResult:
    """The saved set the search ended with, its evaluation and the eager baseline's."""

    def __init__(self, saved: frozenset[int], final: JointEval, baseline: JointEval) -> None:
        self.saved = saved
        self.final = final
        self.baseline = baseline


def search_saved_set(model: JointModel, target: int | None) -> SearchResult:
    """Greedy search for a saved set whose tracked peak is at most ``target`` (see module doc).

    With ``target=None`` the eager saved set is returned unchanged.
    """
    saved = model.default_saved() | model.must_save()
    baseline = current = model.evaluate(saved)
    if target is None or current.peak <= target:
        return SearchResult(current.saved, current, baseline)
    must = model.must_save()
    rejected: set[int] = set()
    steps = 0
    while current.peak > target:
        candidates = [
            s for s in current.live_at_peak & current.saved if s not in must and s not in rejected
        ]
        scored = []
        for s in candidates:
            cost = model.recompute_cost(s, current.saved)
            if cost == float("inf"):
                rejected.add(s)
                continue
            scored.append((-model.nbytes[s] / max(cost, 1e-12), s))
        scored.sort()
        for _, s in scored:
            trial = model.evaluate(current.saved - {s})
            steps += 1
            if trial.feasible and _rank(trial) < _rank(current):
                current = trial
                break
            rejected.add(s)
        else:
            break
    log.debug(
        "planner: %d evaluations, peak %d -> %d B (target %d B), recompute %.3f ms",
        steps,
        baseline.peak,
        current.peak,
        target,
        current.recompute_time * 1e3,
    )
    return SearchResult(current.saved, current, baseline)


def plan_fragment(model: JointModel, *, target: int | None, resident_bytes: int) -> FragmentPlan:
    """Plan one fragment: the decisions, backward order and predictions for ``target``.

    Args:
        model: the fragment's joint model.
        target: tracked bytes the fragment may peak at (``None``: no budget).
        resident_bytes: what else counts against the budget (parameters, inputs, other fragments);
            added to the predicted peaks to make them absolute.
    """
    result = search_saved_set(model, target)
    final, baseline = result.final, result.baseline
    decisions = tuple(
        TensorDecision(
            tensor=model.describe(s),
            nbytes=model.nbytes[s],
            action="keep" if s in final.saved else "recompute",
        )
        for s in sorted(baseline.saved | final.saved)
    )
    return FragmentPlan(
        fragment="",
        decisions=decisions,
        backward_order=tuple(model.nodes[i].name for i in final.backward_order),
        target=target,
        resident_bytes=resident_bytes,
        predicted_peak=resident_bytes + final.peak,
        baseline_peak=resident_bytes + baseline.peak,
        recompute_time=final.recompute_time,
        feasible=target is None or final.peak <= target,
    )
