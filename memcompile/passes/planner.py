"""The planner: which saved tensors to recompute so a fragment fits its byte target.

Greedy on the joint model (``joint.py``), by bytes saved per second of recompute:

    S = eager's saved set;  W = {} (swaps);  e = evaluate(S, W)
    while e.peak > target:
        moves = for each storage s in S live at the peak moment:
                    recompute s  (cost: recompute_time(s | S))     if recompute is allowed
                    swap s       (cost: copy out + copy back)      if a tier is allowed
        for the move with the most bytes per second first:
            e' = evaluate after the move
            if e' is better (its phase peaks, largest first, compare lower): apply it; break
        else: stop            # nothing live at the peak can go: this is the smallest peak found

It never trades memory it does not need: with the peak at or under the target it stops, and
without a budget it keeps eager's saved set. The result is a :class:`FragmentPlan`; an
infeasible target still yields the smallest plan found (``feasible=False``), which the caller
turns into ``MemoryBudgetError`` or, with ``on_infeasible="best_effort"``, a warning.
"""

from __future__ import annotations

import logging

from memcompile.passes.joint import JointEval, JointModel
from memcompile.passes.plan import Action, FragmentPlan, TensorDecision

log = logging.getLogger(__name__)

__all__ = ["SearchResult", "plan_fragment", "search_saved_set"]


def _rank(e: JointEval) -> tuple[int, int, int]:
    # Phase peaks, largest first: lowering any of two equal maxima is progress.
    return tuple(sorted((e.forward_peak, e.backward_peak, e.accumulate_peak), reverse=True))  # type: ignore[return-value]


class SearchResult:
    """The saved set and swaps the search ended with, its evaluation and the eager baseline's."""

    def __init__(self, final: JointEval, baseline: JointEval) -> None:
        self.final = final
        self.baseline = baseline


def search_saved_set(
    model: JointModel,
    target: int | None,
    *,
    recompute: bool = True,
    swap_tier: str | None = None,
    reorder: bool = True,
) -> SearchResult:
    """Greedy search for a saved set (and swaps) whose tracked peak is at most ``target``.

    Args:
        model: the fragment's joint model.
        target: tracked bytes; ``None`` keeps eager's saved set.
        recompute: recomputing saved tensors is allowed.
        swap_tier: swap saved tensors to this tier (``host``/``disk``), or never (``None``).
        reorder: try the memory-aware order of each graph (free: same ops, another order).
    """
    baseline = current = model.evaluate(model.default_saved() | model.must_save())
    best = model.evaluate(current.saved, schedule=True) if reorder else current
    if target is None or best.peak <= target:
        return SearchResult(best, baseline)
    must = model.must_save()
    swapped: dict[int, str] = {}
    rejected: set[tuple[int, str]] = set()
    steps = 0
    while current.peak > target:
        moves: list[tuple[float, int, str]] = []
        for s in sorted(current.live_at_peak & current.saved):
            if s in swapped:
                continue
            if recompute and s not in must and (s, "recompute") not in rejected:
                cost = model.recompute_cost(s, current.saved)
                if cost < float("inf"):
                    moves.append((-model.nbytes[s] / max(cost, 1e-12), s, "recompute"))
            if swap_tier is not None and s in current.swappable and (s, "swap") not in rejected:
                # Each copy also pays a fixed launch cost: tiny tensors are not worth a swap.
                copy = model.profile.launch_overhead + model.profile.copy_time(
                    model.nbytes[s], swap_tier
                )
                moves.append((-model.nbytes[s] / (2 * copy), s, "swap"))
        moves.sort(key=lambda m: (m[0], -model.nbytes[m[1]], m[1]))  # ties: larger first
        for _, s, kind in moves:
            if kind == "recompute":
                trial = model.evaluate(current.saved - {s}, swapped)
            else:
                trial = model.evaluate(current.saved, {**swapped, s: swap_tier})  # type: ignore[dict-item]
            steps += 1
            if trial.feasible and _rank(trial) < _rank(current):
                current = trial
                swapped = dict(trial.swapped)
                if reorder:  # the search prices moves in torch's order; the plan may reorder
                    ordered = model.evaluate(current.saved, swapped, schedule=True)
                    best = ordered if ordered.peak < current.peak else current
                    if best.peak <= target:
                        return SearchResult(best, baseline)
                break
            rejected.add((s, kind))
        else:
            break
    log.debug(
        "planner: %d evaluations, peak %d -> %d B (target %d B), recompute %.3f ms, swap %.3f ms",
        steps,
        baseline.peak,
        current.peak,
        target,
        current.recompute_time * 1e3,
        current.swap_time * 1e3,
    )
    if reorder:
        ordered = model.evaluate(current.saved, swapped, schedule=True)
        if ordered.peak < current.peak:
            current = ordered
    return SearchResult(current, baseline)


def plan_fragment(
    model: JointModel,
    *,
    target: int | None,
    resident_bytes: int,
    recompute: bool = True,
    swap_tier: str | None = None,
    reorder: bool = True,
) -> FragmentPlan:
    """Plan one fragment: the decisions, backward order and predictions for ``target``.

    Args:
        model: the fragment's joint model.
        target: tracked bytes the fragment may peak at (``None``: no budget).
        resident_bytes: what else counts against the budget (parameters, inputs, other fragments);
            added to the predicted peaks to make them absolute.
        recompute, swap_tier, reorder: the techniques allowed (see :func:`search_saved_set`).
    """
    result = search_saved_set(
        model, target, recompute=recompute, swap_tier=swap_tier, reorder=reorder
    )
    final, baseline = result.final, result.baseline
    swapped = dict(final.swapped)

    def action(s: int) -> Action:
        if s not in final.saved:
            return "recompute"
        return swapped.get(s, "keep")  # type: ignore[return-value]

    decisions = tuple(
        TensorDecision(tensor=model.describe(s), nbytes=model.nbytes[s], action=action(s))
        for s in sorted(baseline.saved | final.saved)
    )
    return FragmentPlan(
        fragment="",
        decisions=decisions,
        backward_order=tuple(model.nodes[i].name for i in final.backward_order),
        forward_order=tuple(model.nodes[i].name for i in final.forward_order),
        target=target,
        resident_bytes=resident_bytes,
        predicted_peak=resident_bytes + final.peak,
        baseline_peak=resident_bytes + baseline.peak,
        recompute_time=final.recompute_time,
        swap_time=final.swap_time,
        feasible=target is None or final.peak <= target,
    )
