"""The planner: which saved tensors to recompute or swap so a fragment fits its byte target.

Greedy on the joint model (``joint.py``), by bytes saved per second of recompute or copy, then
an undo pass:

    S = eager's saved set, less the device copies of host-placed parameters (fetched again in
        the backward);  W = {} (swaps);  e = evaluate(S, W)   # torch's orders, with values
                                                              # waiting across the peak sunk
                                                              # to their readers (sink)
    while e.peak > target or held(e) > saved_cap:      # held: S - W and the activation inputs
                                                       # the backward reads (cap: optional)
        moves = for each storage s in S live at the peak moment (every s in S - W while held
                is over the cap):
                    recompute s      (cost: what the backward would newly recompute, through
                                      the views it reads)
                    recompute s and its saved siblings (outputs of one multi-output op: dropping
                                      layer norm's mean alone just recomputes a copy of it)
                    swap s           (cost: copy out + copy back)      if a tier is allowed
        ranked by bytes per second (bytes live at the peak, plus bytes off the held set
        while it is over the cap):
            try the best independent moves together (none drops what another's recomputation
            reads), as many as cover e.peak - target: one evaluation for what is hundreds of
            single steps on a deep network
            else price the first 16 alone exactly and take the one removing the most excess
            per second
            a trial counts only if its excesses (phase peaks over the target, held bytes over
            the cap; largest first) are lower: lowering a phase that already fits is no
            progress
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

A search is deterministic given its model, target, cap, techniques, pricing and start, so each
greedy run, each evaluation in the memory-aware orders and each trial's price (its phase peaks,
time and held bytes) is made once per joint model and remembered while the model lives (the
compiler plans one graph several times: for its target, recomputing or swapping only, then for
its smallest peak, whose greedy runs the search for the target has already made when it ended
above it, and whose trials retrace the target search's until their rankings part).

The cap is for fragments of a multi-fragment step whose saved sets are held while *other*
fragments run (an MoE expert called eight times, a tree cell called per node): their own graph
peak does not show those bytes, so a target alone never makes them give any up
(``planning/replan.py`` sets the cap when it re-plans a step predicted over budget).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import weakref
from collections.abc import Callable, Collection, Hashable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from memcompile.analysis.joint_model import JointEval, JointModel
from memcompile.errors import format_bytes
from memcompile.planning.plan import Action, FragmentPlan, TensorDecision

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
    nbytes: int  # of those live at the peak moment it was chosen at (peak over the target)
    cost: float  # predicted seconds it adds to a step
    tier: str = ""
    reads: frozenset[int] = frozenset()  # saved storages its recomputation reads
    held: int = 0  # bytes it takes off the held saved set (while that is over its cap)

    @property
    def key(self) -> tuple[str, tuple[int, ...]]:
        return self.kind, self.storages

    @property
    def ratio(self) -> float:
        return (self.nbytes + self.held) / max(self.cost, 1e-12)


@dataclass(frozen=True)
class _Priced:
    """What a step compares of a trial's evaluation (:meth:`_Search.priced`): its phase peaks,
    feasibility, time and held bytes; ``full``, the evaluation itself where it was made for
    this trial (``None``: remembered from an earlier one)."""

    forward_peak: int
    backward_peak: int
    accumulate_peak: int
    peak: int
    feasible: bool
    time: float
    held: int
    full: JointEval | None = None

    @staticmethod
    def of(e: JointEval, model: JointModel) -> _Priced:
        """``e``'s price, with ``e`` as its evaluation."""
        held = model.held_bytes(e)
        return _Priced(
            e.forward_peak, e.backward_peak, e.accumulate_peak, e.peak, e.feasible, e.time, held, e
        )


#: Single moves priced exactly per step (the rest only when none of those helps).
_EXACT = 16
#: The undo pass stops after this many undos in a row fail: on a deep network hundreds of
#: alike moves are all still needed, and each trial is a full evaluation.
_UNDO_MISSES = 8
#: Moves tried for taking back when the search is stuck above the target (see ``repair``).
_REPAIR = 32


#: The peak target of a search with a saved-set cap and no budget (``target=None``).
_UNBOUNDED = 1 << 62

#: Greedy runs and scheduled evaluations already made, per joint model (see the module
#: docstring): gone with the model.
_MEMO: weakref.WeakKeyDictionary[JointModel, dict[Hashable, Any]] = weakref.WeakKeyDictionary()


def _scheduled(
    model: JointModel,
    saved: Collection[int],
    swapped: dict[int, str] | None = None,
    search: _Search | None = None,
) -> JointEval:
    """``model.evaluate(saved, swapped, schedule=True)`` (which sinks whatever the search's
    pricing), once per model: several schedules of each graph make it the dearest evaluation,
    and every search of a graph starts with the same one. Counted in ``search``'s
    evaluations when made."""
    key = ("scheduled", frozenset(saved), tuple(sorted((swapped or {}).items())))
    memo = _MEMO.setdefault(model, {})
    if key not in memo:
        if search is not None:
            search.evaluations += 1
        memo[key] = model.evaluate(saved, swapped, schedule=True)
    found: JointEval = memo[key]
    return found


class _Search:
    """State of one greedy search: the saved set, the swaps and the moves that made them."""

    def __init__(
        self,
        model: JointModel,
        target: int,
        recompute: bool,
        swap_tier: str | None,
        saved_cap: int | None = None,
        sink: bool = False,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        self.model = model
        #: Told where the greedy is after each step (``search_saved_set``'s ``progress``).
        self.progress = progress
        # Every evaluation sinks waiting values past the peak (``schedule.sink``) when the
        # plan may reorder: the moves are then priced where that order peaks, not where torch's
        # does (bench GPT, recompute only: the least peak found went 46.1 -> 39.1 MiB).
        self.sink = sink
        self.target = target
        self.saved_cap = saved_cap
        self.recompute = recompute
        self.swap_tier = swap_tier
        self.must = model.must_save()
        self.evaluations = 0
        self.rejected: set[tuple[str, tuple[int, ...]]] = set()

    def saved_excess(self, e: JointEval | _Priced) -> int:
        """Bytes by which ``e``'s held saved set exceeds the cap (0: within it, or no cap)."""
        if self.saved_cap is None:
            return 0
        held = e.held if isinstance(e, _Priced) else self.model.held_bytes(e)
        return max(0, held - self.saved_cap)

    def excess(self, e: JointEval | _Priced) -> int:
        """Bytes over the limits: the peak over the target, plus the saved set over its cap."""
        return max(0, e.peak - self.target) + self.saved_excess(e)

    def fits(self, e: JointEval) -> bool:
        return e.feasible and e.peak <= self.target and not self.saved_excess(e)

    def rank(self, e: JointEval | _Priced) -> tuple[int, ...]:
        """Phase peaks over the target and the saved set over its cap, largest first: a phase
        that fits is not what binds, so lowering it is no progress (and raising it up to the
        target costs nothing); a move trading a phase's excess for less saved-set excess is
        progress when what is left over is smaller."""
        phases = (e.forward_peak, e.backward_peak, e.accumulate_peak)
        over = [max(0, p - self.target) for p in phases] + [self.saved_excess(e)]
        return tuple(sorted(over, reverse=True))

    def evaluate(
        self, saved: frozenset[int], swapped: dict[int, str], *, schedule: bool = False
    ) -> JointEval:
        if schedule:
            return _scheduled(self.model, saved, swapped, self)
        self.evaluations += 1
        return self.model.evaluate(saved, swapped, schedule=schedule, sink=self.sink)

    def moves(self, current: JointEval) -> list[_Move]:
        """Candidate moves at ``current``'s peak (and, while the held saved set is over its cap,
        every saved storage), best bytes per second first: bytes of the peak live at the peak
        moment, plus bytes taken off the saved set while that is over the cap."""
        model, swapped = self.model, dict(current.swapped)
        live = current.live_at_peak if current.peak > self.target else frozenset()
        over_cap = self.saved_excess(current) > 0
        pool = current.saved if over_cap else live & current.saved
        candidates = sorted(pool - swapped.keys())

        def held(group: tuple[int, ...]) -> int:
            return sum(model.nbytes[t] for t in group) if over_cap else 0

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
                            "recompute", group, nbytes, cost, reads=reads, held=held(group)
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
                        "swap",
                        (s,),
                        model.nbytes[s] if s in live else 0,
                        2 * copy,
                        self.swap_tier,
                        held=held((s,)),
                    )
        moves = [m for m in out.values() if m.key not in self.rejected]
        # Ties: larger first, then the storage ids (deterministic).
        moves.sort(key=lambda m: (-m.ratio, -(m.nbytes + m.held), m.kind, m.storages))
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
        rank = self.rank(current)
        # The best moves, as many as would cover the excess if each freed its bytes at the
        # peak (and took them off the saved set): one evaluation instead of one per move
        # (hundreds on a deep network).
        # Only independent moves: none drops what another's recomputation reads (dropping two
        # neighbouring layers recomputes a chain, priced as one layer each).
        batch: list[_Move] = []
        freed, taken, dropped, read = 0, 0, set[int](), set[int]()
        over_peak, over_cap = current.peak - self.target, self.saved_excess(current)
        for m in moves:
            if dropped.isdisjoint(m.storages) and read.isdisjoint(m.storages):
                if not dropped.isdisjoint(m.reads):
                    continue
                batch.append(m)
                dropped.update(m.storages)
                read.update(m.reads)
                freed += m.nbytes
                taken += m.held
                if freed >= over_peak and taken >= over_cap:
                    break
        if len(batch) > 1:
            priced = self.priced(current, batch)
            if priced.feasible and self.rank(priced) < rank:
                return self.made(priced, current, batch), batch
        # One move at a time: the first few priced exactly (the estimate misses copies of
        # multi-output ops, moments the storage is not live at, views), the best kept: most
        # bytes of excess (peak over the target, saved set over its cap) removed per second
        # added.
        best: tuple[float, _Priced, _Move] | None = None
        excess = self.excess(current)
        for n, m in enumerate(moves):
            if n >= _EXACT and best is not None:
                break
            trial = self.priced(current, [m])
            if not trial.feasible or self.rank(trial) >= rank:
                self.rejected.add(m.key)
                continue
            gain = excess - self.excess(trial)
            score = gain / max(trial.time - current.time, 1e-12)
            if best is None or score > best[0]:
                best = (score, trial, m)
            if n >= _EXACT:  # past the exactly priced ones: the first that helps
                break
        return None if best is None else (self.made(best[1], current, [best[2]]), [best[2]])

    def priced(self, current: JointEval, moves: list[_Move]) -> _Priced:
        """What a step compares of ``current`` with ``moves`` applied, evaluated once per model
        and pricing: a later search that passes the same saved sets (the search for the
        smallest peak retraces the search for the target until their rankings part: the GRU
        small's recompute-only plan priced 42 % of its trials twice) finds it remembered."""
        saved, swapped = self.apply(current.saved, dict(current.swapped), moves)
        ids = np.fromiter(saved, dtype=np.int64, count=len(saved))
        ids.sort()
        # A digest of the saved set and the swaps: the sets themselves, ~30 KB each, would
        # hold ~50 MB on the GRU small.
        digest = hashlib.blake2b(ids.tobytes(), digest_size=16)
        digest.update(repr(sorted(swapped.items())).encode())
        key = ("priced", digest.digest(), len(ids), len(swapped), self.sink)
        memo = _MEMO.setdefault(self.model, {})
        known: _Priced | None = memo.get(key)
        if known is not None:
            return known
        found = _Priced.of(self.evaluate(saved, swapped), self.model)
        memo[key] = dataclasses.replace(found, full=None)  # (the evaluation is not kept)
        return found

    def made(self, priced: _Priced, current: JointEval, moves: list[_Move]) -> JointEval:
        """The evaluation ``priced`` summarizes (``current`` with ``moves`` applied): made
        again where it was remembered."""
        if priced.full is not None:
            return priced.full
        saved, swapped = self.apply(current.saved, dict(current.swapped), moves)
        return self.evaluate(saved, swapped)

    def greedy(self, start: JointEval) -> tuple[JointEval, list[_Move]]:
        """Moves until ``start``'s orders fit the target and the cap (or nothing more helps).
        Run once per model, search settings and start (``_MEMO``)."""
        key = (
            "greedy",
            self.target,
            self.saved_cap,
            self.recompute,
            self.swap_tier,
            self.sink,
            start.saved,
            start.swapped,
            frozenset(self.rejected),  # empty but in a search that ran one already
        )
        memo = _MEMO.setdefault(self.model, {})
        if key not in memo:
            memo[key] = self._greedy(start)
        end, applied = memo[key]
        return end, list(applied)

    def _greedy(self, start: JointEval) -> tuple[JointEval, list[_Move]]:
        current, applied = start, []
        first = self.excess(start)
        while current.peak > self.target or self.saved_excess(current):
            found = self.step(current)
            if found is not None:
                current, moves = found
                applied += moves
                if self.progress is not None:
                    self.progress(self._where(first, current, len(applied)))
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

    def _where(self, first: int, current: JointEval, moves: int) -> str:
        """Where the greedy is, for the notice of a compile that runs long: the share of the
        excess it started with that its moves took off (a search for the smallest peak, whose
        target is 0, cannot end at 100 %: its lowest peak so far)."""
        if self.target <= 0:
            return f"{moves} moves, the peak down to {format_bytes(current.peak)}"
        gone = 1.0 - self.excess(current) / first if first else 1.0
        return f"{moves} moves, {gone:.0%} of the {format_bytes(first)} over the target gone"

    def repair(self, current: JointEval, applied: list[_Move]) -> JointEval | None:
        """``current`` with one of the ``applied`` moves taken back (a group's members one by
        one too) where that lowers the phase ranking, or ``None``. The latest moves first (a
        batch's cheapest-per-byte tail is the likeliest to be useless), at most
        ``_REPAIR`` trials: only reached when the search would otherwise stop infeasible."""
        rank = self.rank(current)
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
                if trial.feasible and self.rank(trial) < rank:
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
        # Where torch's own orders fit, the memory-aware ones do (an evaluation with
        # ``schedule`` keeps whichever order peaks lower, and its sink moves a value only where
        # the peak drops), and a plan's time, feasibility and held bytes do not depend on its
        # order: such a trial is taken on torch's orders, and the orders searched only for the
        # plan taken last (``pending``: its arguments). The LSTM (T=64) re-planned with its
        # optimizer's state: 106 of 117 scheduled trials fitted, 0.3 s each.
        pending: tuple[frozenset[int], dict[int, str]] | None = None
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
            # bytes do not fit there (or over the cap) cannot be undone (saves an evaluation
            # per move at scale).
            kept = sum(model.nbytes[s] for s in saved if s not in swapped)
            if kept > self.target or (self.saved_cap is not None and kept > self.saved_cap):
                continue
            if schedule:
                self.evaluations += 1
                plain = model.evaluate(saved, swapped)
                if self.fits(plain) and plain.time < current.time:
                    current, misses, pending = plain, 0, (frozenset(saved), swapped)
                    continue
            trial = self.evaluate(saved, swapped, schedule=schedule)
            if self.fits(trial) and trial.time < current.time:
                current, misses, pending = trial, 0, None
            else:
                misses += 1
        if pending is not None:
            current = self.evaluate(*pending, schedule=True)
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
    saved_cap: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> SearchResult:
    """Greedy search for a saved set (and swaps) whose tracked peak is at most ``target`` and
    whose held bytes are at most ``saved_cap``.

    Args:
        model: the fragment's joint model.
        target: tracked bytes; ``None`` keeps eager's saved set (unless ``saved_cap`` asks
            for less).
        recompute: recomputing saved tensors is allowed.
        swap_tier: swap saved tensors to this tier (``host``/``disk``), or never (``None``).
        reorder: try the memory-aware order of each graph (free: same ops, another order).
        start: names (:meth:`JointModel.describe`) of a saved set to search from as well, e.g.
            another graph's plan carried over to this one (``dropout.saved_after``); the better
            of the two ends is kept (fits at less time, else peaks lower).
        saved_cap: bytes the forward may leave held for the backward
            (:meth:`JointModel.held_bytes`: saved storages not swapped, activation inputs the
            backward reads), ``None``: no cap. In a multi-fragment step those bytes are held
            while other fragments run, where this graph's own peak does not show them
            (``planning/replan.py``).
        progress: told after each greedy step where the search is (a line of text: the
            search, its moves, the share of the excess over the target they took off), for
            the notice of a compile that runs long (``pipeline/stage.py``).

    Raises:
        ValueError: ``saved_cap`` is negative.
    """
    if saved_cap is not None and saved_cap < 0:
        raise ValueError(f"saved_cap must be >= 0 bytes, got {saved_cap}")
    # Eager's saved set (the user's activation checkpointing recomputing what it does), except
    # the device copies of host-placed parameters: the backward fetches those again
    # (ZeRO-Offload's schedule), or a recurrent cell would keep one copy of its weights per
    # time step; no move of the search keeps one.
    baseline = model.evaluate((model.eager_saved() - model.fetched_copies()) | model.must_save())
    best = _scheduled(model, baseline.saved) if reorder else baseline
    limit = _UNBOUNDED if target is None else target

    def told(what: str) -> Callable[[str], None] | None:
        return None if progress is None else lambda where: progress(f"{what}: {where}")

    search = _Search(
        model, limit, recompute, swap_tier, saved_cap, sink=reorder, progress=told("the target")
    )
    if (target is None and saved_cap is None) or search.fits(best):
        return SearchResult(best, baseline, 1 + reorder)
    # The moves are priced in torch's orders, polished by ``schedule.sink`` when reordering is
    # allowed (a few linear replays per evaluation), and so is a first undo pass; the
    # memory-aware orders (a schedule per evaluation: several times dearer) only come in at
    # the end, where a second undo pass takes back what they make unnecessary.
    current, applied = search.greedy(search.evaluate(baseline.saved, {}) if reorder else baseline)
    if search.fits(current):
        current = search.undo(current, applied, schedule=False)
    if reorder:
        ordered = search.evaluate(current.saved, dict(current.swapped), schedule=True)
        # Only where the memory-aware orders lower the plan's peak can they make a move
        # unnecessary that torch's orders still needed (the order leaves the saved set as is).
        if ordered.peak < current.peak and search.fits(ordered):
            current = search.undo(ordered, applied, schedule=True)
        elif ordered.peak <= current.peak:
            current = ordered
    evaluations = search.evaluations + 1 + reorder
    if not search.fits(current) and target is not None:
        # Stuck above the target. The greedy ranks moves by how they close the gap to the
        # target, so a search for a lower target can end lower than this one did (seen: 991 KiB
        # for a 910 KiB target, 1.22 MiB for 1 MiB). Search for the smallest peak instead
        # (within the cap); what it finds either fits (then take back the moves the target
        # does not need) or is a truthful smallest peak for the error message.
        # The greedy's end depends on the orders its moves are priced in: with the waiting
        # values sunk it ends lower on the bench GPT (39.1 vs 46.1 MiB, recompute only), in
        # torch's plain orders on the tiny GPT (0.377 vs 0.471 MiB, host tier); try both.
        pricings: tuple[bool, ...] = (True, False) if reorder else (False,)
        if target <= 0:  # the search above was a least-peak search, in its own pricing
            pricings = tuple(p for p in pricings if p != reorder)
        ends: list[tuple[JointEval, list[_Move]]] = []
        for sink in pricings:
            least = _Search(
                model,
                0,
                recompute,
                swap_tier,
                saved_cap,
                sink=sink,
                progress=told("the smallest peak"),
            )
            end, end_applied = least.greedy(least.evaluate(baseline.saved, {}))
            if reorder:
                ordered = least.evaluate(end.saved, dict(end.swapped), schedule=True)
                end = ordered if ordered.peak <= end.peak else end
            evaluations += least.evaluations
            log.debug("planner: the least-peak search (sink=%s) ends at %d B", sink, end.peak)
            if not ends or _better(end, ends[0][0], search):
                ends.insert(0, (end, end_applied))
        if ends and _better(ends[0][0], current, search):
            current, applied = ends[0]
            log.debug(
                "planner: the least-peak search ends at %d B (target %d B)", current.peak, limit
            )
            if search.fits(current):
                current = search.undo(current, applied, schedule=reorder)
                evaluations += search.evaluations
    if start and recompute:
        warm, warm_applied, n = _search_from(
            model, search, start, reorder, told("the target from the given start")
        )
        evaluations += n
        if _better(warm, current, search):
            log.debug("planner: the search from the given start ends better: %d B", warm.peak)
            current, applied = warm, warm_applied
    log.debug(
        "planner: %d evaluations, %d moves (%d kept), peak %d -> %d B (target %s B), held "
        "%d -> %d B (cap %s B), recompute %.3f ms, swap %.3f ms",
        evaluations,
        len(applied),
        search.kept(current, applied),
        baseline.peak,
        current.peak,
        target,
        model.held_bytes(baseline),
        model.held_bytes(current),
        saved_cap,
        current.recompute_time * 1e3,
        current.swap_time * 1e3,
    )
    return SearchResult(current, baseline, evaluations, search.kept(current, applied))


def _search_from(
    model: JointModel,
    limits: _Search,
    start: Collection[str],
    reorder: bool,
    progress: Callable[[str], None] | None = None,
) -> tuple[JointEval, list[_Move], int]:
    """The greedy search (with ``limits``' target, cap and techniques) started from the saved
    set named ``start`` (names this graph lacks are skipped): its end, its moves and its
    evaluations; ``progress``: told where it is (``search_saved_set``)."""
    saved = set(model.must_save())
    for name in sorted(start):
        try:
            saved.add(model.storage_named(name))
        except (KeyError, ValueError):  # not in this graph, or not one storage
            log.debug("planner: start tensor %s skipped", name)
    search = _Search(
        model,
        limits.target,
        limits.recompute,
        limits.swap_tier,
        limits.saved_cap,
        sink=limits.sink,
        progress=progress,
    )
    current, applied = search.greedy(search.evaluate(frozenset(saved), {}))
    if search.fits(current):
        current = search.undo(current, applied, schedule=False)
    if reorder:
        ordered = search.evaluate(current.saved, dict(current.swapped), schedule=True)
        current = ordered if ordered.peak <= current.peak else current
    return current, applied, search.evaluations + 1 + reorder


def _better(a: JointEval, b: JointEval, limits: _Search) -> bool:
    """``a`` is the better plan within ``limits`` (target and cap): it fits and ``b`` does
    not, both fit and ``a`` is faster, or neither fits and ``a`` is less over them (without
    a cap: peaks lower)."""
    fits_a, fits_b = limits.fits(a), limits.fits(b)
    if fits_a != fits_b:
        return fits_a
    if fits_a:
        return a.time < b.time
    if a.feasible != b.feasible:
        return a.feasible
    return (limits.excess(a), a.peak) < (limits.excess(b), b.peak)


def plan_fragment(
    model: JointModel,
    *,
    target: int | None,
    resident_bytes: int,
    recompute: bool = True,
    swap_tier: str | None = None,
    reorder: bool = True,
    start: Collection[str] = (),
    saved_cap: int | None = None,
    progress: Callable[[str], None] | None = None,
    searched: Callable[[SearchResult], None] | None = None,
) -> FragmentPlan:
    """Plan one fragment: the decisions, backward order and predictions for ``target``.

    Args:
        model: the fragment's joint model.
        target: tracked bytes the fragment may peak at (``None``: no budget).
        resident_bytes: what else counts against the budget (parameters, inputs, other fragments);
            added to the predicted peaks to make them absolute.
        recompute, swap_tier, reorder: the techniques allowed (see :func:`search_saved_set`).
        start: a saved set to search from as well (see :func:`search_saved_set`).
        saved_cap: bytes the plan may hold from forward to backward (see
            :func:`search_saved_set`); the plan is feasible only within it too.
        progress: told where the search is (see :func:`search_saved_set`).
        searched: given the search's result (the plan's evaluation: what is live at its
            peak, ``JointModel.decided_at_peak``) before the plan is made of it.
    """
    result = search_saved_set(
        model,
        target,
        recompute=recompute,
        swap_tier=swap_tier,
        reorder=reorder,
        start=start,
        saved_cap=saved_cap,
        progress=progress,
    )
    if searched is not None:
        searched(result)
    final, baseline = result.final, result.baseline
    swapped = dict(final.swapped)
    held = model.held_bytes(final)

    def action(s: int) -> Action:
        if s not in final.saved:
            return "recompute"
        return swapped.get(s, "keep")  # type: ignore[return-value]

    # Fetched parameter copies eager would keep are listed as what they are: fetched again.
    refetched = model.default_saved() & model.fetched_copies()
    decisions = tuple(
        TensorDecision(tensor=model.describe(s), nbytes=model.nbytes[s], action=action(s))
        for s in sorted(baseline.saved | final.saved | refetched | model.checkpointed())
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
        feasible=final.feasible
        and (target is None or final.peak <= target)
        and (saved_cap is None or held <= saved_cap),
        saved_cap=saved_cap,
        saved_input_bytes=sum(model.nbytes[s] for s in final.saved_inputs),
    )
