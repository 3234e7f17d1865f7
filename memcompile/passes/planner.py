"""The planner: which saved tensors to recompute or swap so a fragment fits its byte target.

Greedy on the joint model (``joint.py``), by bytes saved per second of recompute or copy, then
an undo pass:

    S = eager's saved set, less the device copies of host-placed parameters (fetched again in
        the backward);  W = {} (swaps);  e = evaluate(S, W)            # torch's orders
    while e.peak > target:
        moves = for each storage s in S live at the peak moment:
                    recompute s      (cost: what the backward would newly recompute, through
                                      the views it reads)
                    recompute s and its saved siblings (outputs of one multi-output op: dropping
                                      layer norm's mean alone just recomputes a copy of it)
                    swap s           (cost: copy out + copy back)      if a tier is allowed
        ranked by bytes per second:
            try the best independent moves together (none drops what another's recomputation
            reads), as many as cover e.peak - target: one evaluation for what is hundreds of
            single steps on a deep network
            else price the first 16 alone exactly and take the one removing the most excess
            per second
            a trial counts only if its phase peaks *over the target* (largest first) are lower:
            lowering a phase that already fits is no progress
        nothing helps: take back one accepted move (the latest first, at most 32 tried) if
            that lowers the phase ranking (a batch can carry a move that, once its neighbours
            went too, only adds its recomputation's memory where the peak now is), go on
        nothing helps either: stop      # the smallest peak found; the plan is infeasible
    for each accepted move, dearest first (a group's members one by one after it):   # undo
        undo it if the step still fits and gets cheaper (8 failures in a row: stop)
    reorder: evaluate the memory-aware orders once; if they lower the peak, undo again in them

It never trades memory it does not need: with the peak at or under the target it stops (the
undo pass takes back what later moves made unnecessary), and without a budget it keeps eager's
saved set. On random graphs of <= 60 nodes it is within 5 % of the exact MILP (``milp.py``,
``tests/test_milp.py``, ``benchmarks/planner_gap.py``). The result is a :class:`FragmentPlan`;
an infeasible target still yields the smallest plan found (``feasible=False``), which the
caller turns into ``MemoryBudgetError`` or, with ``on_infeasible="best_effort"``, a warning.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal

from memcompile.passes.joint import JointEval, JointModel
from memcompile.passes.plan import Action, FragmentPlan, TensorDecision

log = logging.getLogger(__name__)

__all__ = ["SearchResult", "plan_fragment", "search_saved_set"]


@dataclass(frozen=True)
class SearchResult:
    """The saved set and swaps the search ended with, its evaluation and the eager baseline's.

    Attributes:
        final: the plan's evaluation (in the orders the plan runs).
        baseline: eager's saved set (device copies of host-placed parameters fetched again),
            in torch's orders.
        evaluations: joint-model evaluations the search spent (the planner's cost).
        moves: moves the plan keeps after the undo pass.
    """

    final: JointEval
    baseline: JointEval
    evaluations: int = 0
    moves: int = 0


@dataclass(frozen=True)
class _Move:
    """Recompute ``storages`` (dropped from the saved set together) or swap one to ``tier``."""

    kind: Literal["recompute", "swap"]
    storages: tuple[int, ...]
    nbytes: int  # of those live at the peak moment it was chosen at
    cost: float  # predicted seconds it adds to a step
    tier: str = ""
    reads: frozenset[int] = frozenset()  # saved storages its recomputation reads

    @property
    def key(self) -> tuple[str, tuple[int, ...]]:
        return self.kind, self.storages

    @property
    def ratio(self) -> float:
        return self.nbytes / max(self.cost, 1e-12)


#: Single moves priced exactly per step (the rest only when none of those helps).
_EXACT = 16
#: The undo pass stops after this many undos in a row fail: on a deep network hundreds of
#: alike moves are all still needed, and each trial is a full evaluation.
_UNDO_MISSES = 8
#: Moves tried for taking back when the search is stuck above the target (see ``repair``).
_REPAIR = 32


def _rank(e: JointEval, target: int) -> tuple[int, ...]:
    # Phase peaks over the target, largest first: a phase that fits is not what binds, so
    # lowering it is no progress (and raising it up to the target costs nothing).
    return tuple(
        sorted(
            (max(p, target) for p in (e.forward_peak, e.backward_peak, e.accumulate_peak)),
            reverse=True,
        )
    )


class _Search:
    """State of one greedy search: the saved set, the swaps and the moves that made them."""

    def __init__(
        self, model: JointModel, target: int, recompute: bool, swap_tier: str | None
    ) -> None:
        self.model = model
        self.target = target
        self.recompute = recompute
        self.swap_tier = swap_tier
        self.must = model.must_save()
        self.evaluations = 0
        self.rejected: set[tuple[str, tuple[int, ...]]] = set()

    def evaluate(
        self, saved: frozenset[int], swapped: dict[int, str], *, schedule: bool = False
    ) -> JointEval:
        self.evaluations += 1
        return self.model.evaluate(saved, swapped, schedule=schedule)

    def moves(self, current: JointEval) -> list[_Move]:
        """Candidate moves at ``current``'s peak, best bytes per second first."""
        model, swapped = self.model, dict(current.swapped)
        live = current.live_at_peak
        candidates = sorted(live & current.saved - swapped.keys())
        out: dict[tuple[str, tuple[int, ...]], _Move] = {}
        if self.recompute:
            _, _, bw_inputs = model.backward_nodes(current.saved)
            done = frozenset(current.recompute)
            droppable = current.saved - self.must - swapped.keys()
            for s in candidates:
                if s not in droppable:
                    continue
                groups: list[tuple[int, ...]] = [(s,)]
                for i in model.holders.get(s, ()):
                    if model.is_tuple[i]:  # a multi-output op: its saved outputs together
                        group = tuple(sorted(t for t in model.storages[i] if t in droppable))
                        if len(group) > 1:
                            groups.append(group)
                for group in groups:
                    if ("recompute", group) in out:
                        continue
                    cost, reads = model.recompute_walk(
                        group, current.saved, bw_inputs=bw_inputs, recomputed=done
                    )
                    if cost < float("inf"):
                        nbytes = sum(model.nbytes[t] for t in group if t in live)
                        out["recompute", group] = _Move(
                            "recompute", group, nbytes, cost, reads=reads
                        )
        if self.swap_tier is not None:
            profile = model.profile
            for s in candidates:
                if s in current.swappable:
                    # Each copy also pays a fixed launch cost: tiny tensors are not worth a swap.
                    copy = profile.launch_overhead + profile.copy_time(
                        model.nbytes[s], self.swap_tier
                    )
                    out["swap", (s,)] = _Move(
                        "swap", (s,), model.nbytes[s], 2 * copy, self.swap_tier
                    )
        moves = [m for m in out.values() if m.key not in self.rejected]
        # Ties: larger first, then the storage ids (deterministic).
        moves.sort(key=lambda m: (-m.ratio, -m.nbytes, m.kind, m.storages))
        return moves

    @staticmethod
    def apply(
        saved: frozenset[int], swapped: dict[int, str], moves: list[_Move]
    ) -> tuple[frozenset[int], dict[int, str]]:
        swapped = dict(swapped)
        for m in moves:
            if m.kind == "recompute":
                saved = saved - set(m.storages)
            else:
                swapped.update(dict.fromkeys(m.storages, m.tier))
        return saved, swapped

    def step(self, current: JointEval) -> tuple[JointEval, list[_Move]] | None:
        """One accepted step from ``current`` (its evaluation and moves), or ``None``."""
        moves = self.moves(current)
        rank = _rank(current, self.target)
        # The best moves, as many as would cover the excess if each freed its bytes at the
        # peak: one evaluation instead of one per move (hundreds on a deep network).
        # Only independent moves: none drops what another's recomputation reads (dropping two
        # neighbouring layers recomputes a chain, priced as one layer each).
        batch: list[_Move] = []
        freed, dropped, read = 0, set[int](), set[int]()
        for m in moves:
            if dropped.isdisjoint(m.storages) and read.isdisjoint(m.storages):
                if not dropped.isdisjoint(m.reads):
                    continue
                batch.append(m)
                dropped.update(m.storages)
                read.update(m.reads)
                freed += m.nbytes
                if freed >= current.peak - self.target:
                    break
        if len(batch) > 1:
            trial = self.trial(current, batch)
            if trial.feasible and _rank(trial, self.target) < rank:
                return trial, batch
        # One move at a time: the first few priced exactly (the estimate misses copies of
        # multi-output ops, moments the storage is not live at, views), the best kept: most
        # bytes of excess removed per second added.
        best: tuple[float, JointEval, _Move] | None = None
        for n, m in enumerate(moves):
            if n >= _EXACT and best is not None:
                break
            trial = self.trial(current, [m])
            if not trial.feasible or _rank(trial, self.target) >= rank:
                self.rejected.add(m.key)
                continue
            gain = current.peak - max(trial.peak, self.target)
            score = gain / max(trial.time - current.time, 1e-12)
            if best is None or score > best[0]:
                best = (score, trial, m)
            if n >= _EXACT:  # past the exactly priced ones: the first that helps
                break
        return None if best is None else (best[1], [best[2]])

    def trial(self, current: JointEval, moves: list[_Move]) -> JointEval:
        saved, swapped = self.apply(current.saved, dict(current.swapped), moves)
        return self.evaluate(saved, swapped)

    def greedy(self, start: JointEval) -> tuple[JointEval, list[_Move]]:
        """Moves until ``start``'s orders fit the target (or nothing more helps)."""
        current, applied = start, []
        while current.peak > self.target:
            found = self.step(current)
            if found is not None:
                current, moves = found
                applied += moves
                continue
            # Stuck above the target: a batch may have carried a move that, once its
            # neighbours went too, no longer lowers the peak but raises it (its recomputation
            # needs memory where the peak now is). Take one back and go on; every accepted
            # trial lowers the ranking, so this ends.
            repaired = self.repair(current, applied)
            if repaired is None:
                break
            current = repaired
        return current, applied

    def repair(self, current: JointEval, applied: list[_Move]) -> JointEval | None:
        """``current`` with one of the ``applied`` moves taken back (a group's members one by
        one too) where that lowers the phase ranking, or ``None``. The latest moves first (a
        batch's cheapest-per-byte tail is the likeliest to be useless), at most
        ``_REPAIR`` trials: only reached when the search would otherwise stop infeasible."""
        rank = _rank(current, self.target)
        trials = 0
        for m in reversed(applied):
            parts = [m.storages] + ([(s,) for s in m.storages] if len(m.storages) > 1 else [])
            for storages in parts:
                swapped = dict(current.swapped)
                if m.kind == "recompute":
                    if not current.saved.isdisjoint(storages):
                        continue  # brought back already
                    saved = current.saved | set(storages)
                else:
                    if not set(storages) <= swapped.keys():
                        continue
                    saved = current.saved
                    for s in storages:
                        del swapped[s]
                if trials >= _REPAIR:
                    return None
                trials += 1
                trial = self.evaluate(saved, swapped)
                if trial.feasible and _rank(trial, self.target) < rank:
                    # Not to be made again: from here it only raises the peak.
                    self.rejected.add((m.kind, storages))
                    return trial
        return None

    def undo(self, current: JointEval, applied: list[_Move], schedule: bool) -> JointEval:
        """Take back the moves the fitting plan ``current`` does not need, dearest first (a
        group's members one by one when the whole group is still needed)."""
        model = self.model
        tries: list[_Move] = []
        for m in sorted(applied, key=lambda m: (-m.cost, m.kind, m.storages)):
            tries.append(m)
            if len(m.storages) > 1:
                tries += [
                    _Move(m.kind, (s,), model.nbytes[s], m.cost, m.tier)
                    for s in sorted(m.storages, key=lambda s: (-model.nbytes[s], s))
                ]
        misses = 0
        for m in tries:
            if misses >= _UNDO_MISSES:
                break
            swapped = dict(current.swapped)
            if m.kind == "recompute":
                if not current.saved.isdisjoint(m.storages):
                    continue  # brought back already (with its group)
                saved = current.saved | set(m.storages)
            else:
                if not set(m.storages) <= swapped.keys():
                    continue
                saved = current.saved
                for s in m.storages:
                    del swapped[s]
            # Everything saved and not swapped is live when the backward starts: a move whose
            # bytes do not fit there cannot be undone (saves an evaluation per move at scale).
            if sum(model.nbytes[s] for s in saved if s not in swapped) > self.target:
                continue
            trial = self.evaluate(saved, swapped, schedule=schedule)
            if trial.feasible and trial.peak <= self.target and trial.time < current.time:
                current, misses = trial, 0
            else:
                misses += 1
        return current

    def kept(self, current: JointEval, applied: list[_Move]) -> int:
        """How many of the ``applied`` moves ``current`` still makes."""
        swapped = dict(current.swapped)
        return sum(
            current.saved.isdisjoint(m.storages)
            if m.kind == "recompute"
            else all(s in swapped for s in m.storages)
            for m in applied
        )


def search_saved_set(
    model: JointModel,
    target: int | None,
    *,
    recompute: bool = True,
    swap_tier: str | None = None,
    reorder: bool = True,
    start: Collection[str] = (),
) -> SearchResult:
    """Greedy search for a saved set (and swaps) whose tracked peak is at most ``target``.

    Args:
        model: the fragment's joint model.
        target: tracked bytes; ``None`` keeps eager's saved set.
        recompute: recomputing saved tensors is allowed.
        swap_tier: swap saved tensors to this tier (``host``/``disk``), or never (``None``).
        reorder: try the memory-aware order of each graph (free: same ops, another order).
        start: names (:meth:`JointModel.describe`) of a saved set to search from as well, e.g.
            another graph's plan carried over to this one (``dropout.saved_after``); the better
            of the two ends is kept (fits at less time, else peaks lower).
    """
    # Eager's saved set, except the device copies of host-placed parameters: the backward
    # fetches those again (ZeRO-Offload's schedule), or a recurrent cell would keep one copy of
    # its weights per time step; no move of the search keeps one.
    baseline = model.evaluate((model.default_saved() - model.fetched_copies()) | model.must_save())
    best = model.evaluate(baseline.saved, schedule=True) if reorder else baseline
    if target is None or best.peak <= target:
        return SearchResult(best, baseline, 1 + reorder)
    search = _Search(model, target, recompute, swap_tier)
    # The moves are priced in torch's orders (one cheap evaluation each), and so is a first
    # undo pass; the memory-aware orders (a schedule per evaluation: several times dearer)
    # only come in at the end, where a second undo pass takes back what they make unnecessary.
    current, applied = search.greedy(baseline)
    if current.peak <= target:
        current = search.undo(current, applied, schedule=False)
    if reorder:
        ordered = search.evaluate(current.saved, dict(current.swapped), schedule=True)
        # Only where the memory-aware orders lower the plan's peak can they make a move
        # unnecessary that torch's orders still needed.
        if ordered.peak < current.peak and ordered.peak <= target:
            current = search.undo(ordered, applied, schedule=True)
        elif ordered.peak <= current.peak:
            current = ordered
    evaluations = search.evaluations + 1 + reorder
    if current.peak > target > 0:
        # Stuck above the target. The greedy ranks moves by how they close the gap to the
        # target, so a search for a lower target can end lower than this one did (seen: 991 KiB
        # for a 910 KiB target, 1.22 MiB for 1 MiB). Search for the smallest peak instead; what
        # it finds either fits (then take back the moves the target does not need) or is a
        # truthful smallest peak for the error message.
        least = _Search(model, 0, recompute, swap_tier)
        low, low_applied = least.greedy(baseline)
        if reorder:
            ordered = least.evaluate(low.saved, dict(low.swapped), schedule=True)
            low = ordered if ordered.peak <= low.peak else low
        evaluations += least.evaluations
        if low.peak < current.peak:
            log.debug("planner: the least-peak search ends at %d B (target %d B)", low.peak, target)
            current, applied = low, low_applied
            if current.peak <= target:
                current = search.undo(current, applied, schedule=reorder)
                evaluations += search.evaluations
    if start and recompute:
        warm, warm_applied, n = _search_from(model, target, start, recompute, swap_tier, reorder)
        evaluations += n
        if _better(warm, current, target):
            log.debug("planner: the search from the given start ends better: %d B", warm.peak)
            current, applied = warm, warm_applied
    log.debug(
        "planner: %d evaluations, %d moves (%d kept), peak %d -> %d B (target %d B), "
        "recompute %.3f ms, swap %.3f ms",
        evaluations,
        len(applied),
        search.kept(current, applied),
        baseline.peak,
        current.peak,
        target,
        current.recompute_time * 1e3,
        current.swap_time * 1e3,
    )
    return SearchResult(current, baseline, evaluations, search.kept(current, applied))


def _search_from(
    model: JointModel,
    target: int,
    start: Collection[str],
    recompute: bool,
    swap_tier: str | None,
    reorder: bool,
) -> tuple[JointEval, list[_Move], int]:
    """The greedy search started from the saved set named ``start`` (names this graph lacks are
    skipped): its end, its moves and its evaluations."""
    saved = set(model.must_save())
    for name in sorted(start):
        try:
            saved.add(model.storage_named(name))
        except (KeyError, ValueError):  # not in this graph, or not one storage
            log.debug("planner: start tensor %s skipped", name)
    search = _Search(model, target, recompute, swap_tier)
    current, applied = search.greedy(model.evaluate(frozenset(saved)))
    if current.peak <= target:
        current = search.undo(current, applied, schedule=False)
    if reorder:
        ordered = search.evaluate(current.saved, dict(current.swapped), schedule=True)
        current = ordered if ordered.peak <= current.peak else current
    return current, applied, search.evaluations + 1 + reorder


def _better(a: JointEval, b: JointEval, target: int) -> bool:
    """``a`` is the better plan: it fits and ``b`` does not, both fit and ``a`` is faster, or
    neither fits and ``a`` peaks lower."""
    fits_a, fits_b = a.feasible and a.peak <= target, b.feasible and b.peak <= target
    if fits_a != fits_b:
        return fits_a
    return a.time < b.time if fits_a else a.peak < b.peak


def plan_fragment(
    model: JointModel,
    *,
    target: int | None,
    resident_bytes: int,
    recompute: bool = True,
    swap_tier: str | None = None,
    reorder: bool = True,
    start: Collection[str] = (),
) -> FragmentPlan:
    """Plan one fragment: the decisions, backward order and predictions for ``target``.

    Args:
        model: the fragment's joint model.
        target: tracked bytes the fragment may peak at (``None``: no budget).
        resident_bytes: what else counts against the budget (parameters, inputs, other fragments);
            added to the predicted peaks to make them absolute.
        recompute, swap_tier, reorder: the techniques allowed (see :func:`search_saved_set`).
        start: a saved set to search from as well (see :func:`search_saved_set`).
    """
    result = search_saved_set(
        model, target, recompute=recompute, swap_tier=swap_tier, reorder=reorder, start=start
    )
    final, baseline = result.final, result.baseline
    swapped = dict(final.swapped)

    def action(s: int) -> Action:
        if s not in final.saved:
            return "recompute"
        return swapped.get(s, "keep")  # type: ignore[return-value]

    # Fetched parameter copies eager would keep are listed as what they are: fetched again.
    refetched = model.default_saved() & model.fetched_copies()
    decisions = tuple(
        TensorDecision(tensor=model.describe(s), nbytes=model.nbytes[s], action=action(s))
        for s in sorted(baseline.saved | final.saved | refetched)
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
