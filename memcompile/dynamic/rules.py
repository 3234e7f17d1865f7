"""A structural rule learnt from observed outputs: "the router said so".

An MoE router emits per-expert token counts, and the orchestration then calls exactly the
experts with a nonzero count, in expert order. So once a block's small integer output ``v`` is
seen (runtime/small_ints.py's ``small_int_outputs``), the next blocks may be determined by it.
The rule encodes that shape and nothing model-specific:

    after block B emits v in output slot o, the next blocks are X[p] for each p with v[p] > 0,
    in increasing p, then one "exit" block E

and learns ``X`` and ``E`` per ``(B, o)`` from the stream: every emission is checked against the
blocks that actually follow it; position ``p`` (with its value, see below) votes for the block
seen in its place, the block after the run votes for ``E``. A ``(B, o)`` is *trusted* once at
least ``min_checks`` of its emissions could be predicted in full and at least ``min_accuracy``
of the last ``window`` of those were exactly right; only trusted slots make plans, so an output
that does not list blocks (token ids, an ``arange``) never predicts anything, and once a full
window of its checks is under half right it is retired (no more checks: they cost time in
:meth:`observe`). ``E`` is used only when it is trusted the same way.

Reads (runtime/scalar_reads.py) are the other form: the model's Python turned a block's output into
ints itself (``e = int(router(x).argmax())``, ``top.indices.tolist()``) and calls the blocks
they name, in the order read. A read ``r`` after block ``B`` is learnt like an output in slot
``READ_SLOT + k`` (its ``k``-th read since ``B``), with positions ``r[0], r[1], ...`` in that
order, each of value 1: the next blocks are ``X[r[0]], X[r[1]], ...``, then ``E``.

The votes are keyed by ``(p, min(v[p], 2))`` first, falling back to ``p`` alone: Dynamo
specialises a graph for sizes 0 and 1, so an expert given one token runs another fragment (a
different block id) than the same expert given several.

    rule = RoutingRule()
    rule.observe(b)              # a block ran (ids as the pilot numbers them)
    rule.emitted(b, outputs)     # ...and returned these small integer outputs
    rule.emitted(b, reads, indices=True)   # ...or Python read these ints after it
    rule.ahead(1)                # the block 1 call ahead, or UNKNOWN
    rule.end_step()              # pending checks of the step are misses
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from memcompile.dynamic.markov import UNKNOWN

log = logging.getLogger(__name__)

__all__ = ["READ_SLOT", "RoutingRule", "RuleSlotStats"]

#: The rule slot of a block's first read (its outputs' slots are 0, 1, ...).
READ_SLOT = 1000

_Key = tuple[int, int]  # (emitting block id, output slot)


def _bucket(value: int) -> int:
    return value if value < 2 else 2


def _vote(votes: dict[int, int], best: dict[Any, tuple[int, int]], key: Any, b: int) -> None:
    """One more vote for ``b`` in ``votes``; keep ``best[key]``, the most voted block (the
    smallest id on ties), up to date: only ``b``'s count changed, so it wins or nothing does."""
    n = votes[b] = votes.get(b, 0) + 1
    top = best.get(key)
    if top is None or n > top[1] or (n == top[1] and b < top[0]):
        best[key] = (b, n)


def _most_voted(votes: dict[int, int]) -> tuple[int, int]:
    return max(votes.items(), key=lambda kv: (kv[1], -kv[0]))


class _Recent:
    """The last ``maxlen`` check results and how many of them were right (kept as it goes:
    the rule reads the accuracy on every emission)."""

    __slots__ = ("items", "right")

    def __init__(self, maxlen: int) -> None:
        self.items: deque[bool] = deque(maxlen=maxlen)
        self.right = 0

    def append(self, ok: bool) -> None:
        items = self.items
        if len(items) == items.maxlen:
            self.right -= items[0]
        items.append(ok)
        self.right += ok

    def extend(self, oks: Any) -> None:
        for ok in oks:
            self.append(bool(ok))

    def accuracy(self) -> float | None:
        n = len(self.items)
        return self.right / n if n else None

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Any:
        return iter(self.items)

    @property
    def maxlen(self) -> int | None:
        return self.items.maxlen


@dataclass
class _Slot:
    # (position, bucket) -> {block id: votes}; position -> {block id: votes}
    by_value: dict[tuple[int, int], dict[int, int]] = field(default_factory=dict)
    by_position: dict[int, dict[int, int]] = field(default_factory=dict)
    exit_votes: dict[int, int] = field(default_factory=dict)
    checks: int = 0  # emissions whose run was seen to the end (or cut by the step's end)
    recent: _Recent = field(default_factory=lambda: _Recent(50))
    exit_recent: _Recent = field(default_factory=lambda: _Recent(50))
    retired: bool = False  # a full window of checks, under half right: checked no more
    # the most voted block and its votes, per key of by_value / by_position, and for the exit
    best_value: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)
    best_position: dict[int, tuple[int, int]] = field(default_factory=dict)
    best_exit: dict[None, tuple[int, int]] = field(default_factory=dict)

    def label(self, p: int, value: int) -> tuple[int, bool]:
        """The block voted for at position ``p`` with this value, and whether the vote was for
        this value's bucket (``False``: for the position, any value)."""
        top = self.best_value.get((p, value if value < 2 else 2))
        if top is not None:
            return top[0], True
        top = self.best_position.get(p)
        return (top[0], False) if top is not None else (UNKNOWN, False)

    def exit_label(self) -> int:
        top = self.best_exit.get(None)
        return top[0] if top is not None else UNKNOWN

    def vote(self, p: int, value: int, b: int) -> None:
        key = (p, _bucket(value))
        _vote(self.by_value.setdefault(key, {}), self.best_value, key, b)
        _vote(self.by_position.setdefault(p, {}), self.best_position, p, b)

    def vote_exit(self, b: int) -> None:
        _vote(self.exit_votes, self.best_exit, None, b)

    def rebuild_best(self) -> None:
        """Recompute the most voted blocks from the votes (after loading them)."""
        self.best_value = {k: _most_voted(v) for k, v in self.by_value.items() if v}
        self.best_position = {k: _most_voted(v) for k, v in self.by_position.items() if v}
        self.best_exit = {None: _most_voted(self.exit_votes)} if self.exit_votes else {}


@dataclass
class _Check:
    key: _Key
    # (p, v[p]) of the nonzero entries, increasing p; of a read, (r[i], 1) in the read's order
    positions: tuple[tuple[int, int], ...]
    run: tuple[int, ...] | None  # the predicted run (None: not every (p, bucket) seen before)
    exit: int  # the predicted exit (UNKNOWN: none yet)
    seen: list[int] = field(default_factory=list)
    new: bool = False  # a block in its run or exit was seen for the first time


@dataclass(frozen=True)
class RuleSlotStats:
    """How one ``(block, output slot)`` has done as a rule.

    Attributes:
        block: the emitting block's label.
        slot: the output's index among the block's small integer outputs.
        checks: emissions checked against the blocks that followed.
        accuracy: of the last checks whose run was predicted in full, the fraction exactly right
            (``None``: none yet).
        trusted: whether it makes plans.
    """

    block: str
    slot: int
    checks: int
    accuracy: float | None
    trusted: bool


class RoutingRule:
    """Learns and applies the rule of the module docstring.

    Args:
        min_checks: fully predicted emissions needed before a slot is trusted.
        min_accuracy: the fraction of them (of the last ``window``) that must have been right.
        window: recent checks the accuracy is taken over.
    """

    def __init__(
        self, *, min_checks: int = 3, min_accuracy: float = 0.95, window: int = 50
    ) -> None:
        if min_checks < 1:
            raise ValueError(f"RoutingRule: min_checks must be >= 1; got {min_checks}")
        if not 0.0 < min_accuracy <= 1.0:
            raise ValueError(f"RoutingRule: min_accuracy must be in (0, 1]; got {min_accuracy}")
        self.min_checks, self.min_accuracy, self.window = min_checks, min_accuracy, window
        self._slots: dict[_Key, _Slot] = {}
        self._pending: list[_Check] = []
        self._known: set[int] = set()  # blocks observed so far
        self._plan: tuple[int, ...] = ()
        self._done = 0  # plan blocks already seen
        self._plan_accuracy = 0.0  # of the slot that made the plan
        self._run_len = 0  # blocks of the plan that the output listed (the rest: the exit)
        self.substitutions = 0  # plan blocks that turned out to be another block
        self.plans = 0  # plans made
        self.plan_values: tuple[int, ...] = ()  # the output the latest plan was made from

    # -- the stream -------------------------------------------------------------------------
    def observe(self, block: int) -> None:
        """Block ``block`` ran: check pending emissions, follow (or drop) the current plan."""
        known = self._known
        new = block not in known
        if new:
            known.add(block)
        if self._pending:
            still: list[_Check] = []
            for c in self._pending:
                c.seen.append(block)
                c.new |= new
                if len(c.seen) > len(c.positions):
                    self._finish(c, complete=True)
                else:
                    still.append(c)
            self._pending = still
        plan, done = self._plan, self._done
        if done < len(plan):
            # A wrong block in the run still takes its place (the output gave the run's
            # length; a position's guess may name the wrong fragment variant): the plan goes on.
            # An expected exit that does not come ends the plan.
            if plan[done] == block or done < self._run_len:
                self._done = done + 1
                if plan[done] != block:
                    self.substitutions += 1
                return
        self._plan, self._done = (), 0

    def emitted(
        self, block: int, outputs: Sequence[Sequence[int]], *, indices: bool = False, first: int = 0
    ) -> None:
        """The block just observed returned these small integer outputs (per-position counts).
        ``indices``: these are reads after it instead, each the indices of the blocks that run
        next in their order, the first of them the block's read number ``first`` (its slot is
        ``READ_SLOT + first``; module docstring)."""
        best: tuple[float, tuple[int, ...], Sequence[int], int] | None = None
        base = READ_SLOT + first if indices else 0
        for slot, values in enumerate(outputs, base):
            if not values or any(v < 0 for v in values):
                continue
            key = (block, slot)
            s = self._slots.get(key)
            if s is not None and s.retired:
                continue
            if s is None:
                s = self._slots[key] = _Slot(
                    recent=_Recent(self.window), exit_recent=_Recent(self.window)
                )
            positions = (
                tuple((p, 1) for p in values)
                if indices
                else tuple((p, v) for p, v in enumerate(values) if v > 0)
            )
            found = [s.label(p, v) for p, v in positions]
            labels = tuple(b for b, _ in found)
            # Scored only when every (position, bucket) has been seen: an unseen bucket is a
            # guess (the position's block), not a test of the rule.
            scored = all(exact for _, exact in found)
            exit_ = s.exit_label()
            self._pending.append(_Check(key, positions, labels if scored else None, exit_))
            run = None if UNKNOWN in labels else labels
            acc = s.recent.accuracy()
            if run is not None and acc is not None and len(s.recent) >= self.min_checks:
                if acc >= self.min_accuracy and (best is None or acc > best[0]):
                    trusted_exit = s.exit_recent.accuracy()
                    tail = (
                        (exit_,)
                        if exit_ != UNKNOWN
                        and trusted_exit is not None
                        and len(s.exit_recent) >= self.min_checks
                        and trusted_exit >= self.min_accuracy
                        else ()
                    )
                    best = (acc, run + tail, values, len(run))
        # A plan in progress is kept unless the new one comes from a more accurate slot: an
        # expert's own small output (its token ids) must not cut its router's plan short.
        if best is not None and (self._done >= len(self._plan) or best[0] > self._plan_accuracy):
            self._plan, self._done, self._plan_accuracy = best[1], 0, best[0]
            self._run_len = best[3]
            self.plan_values = tuple(best[2])
            self.plans += 1

    def end_step(self) -> None:
        """The step is over: emissions whose run did not finish count as misses."""
        for c in self._pending:
            self._finish(c, complete=False)
        self._pending = []
        self._plan, self._done = (), 0

    def ahead(self, j: int) -> int:
        """The block ``j`` calls ahead by the current plan (:data:`UNKNOWN`: not covered)."""
        i = self._done + j - 1
        plan = self._plan
        return plan[i] if i < len(plan) else UNKNOWN

    def plan_ahead(self, k: int) -> tuple[int, ...]:
        """The blocks ``1..k`` calls ahead that the current plan covers, in one call: the
        :meth:`ahead` values before the first :data:`UNKNOWN` (a plan holds no unknown block,
        so it covers a prefix of the horizons)."""
        done = self._done
        return self._plan[done : done + k]

    @property
    def left(self) -> int:
        """Blocks of the current plan still to come (0: no plan)."""
        return len(self._plan) - self._done

    # -- learning ---------------------------------------------------------------------------
    def _finish(self, c: _Check, *, complete: bool) -> None:
        s = self._slots[c.key]
        s.checks += 1
        m = len(c.positions)
        seen = c.seen
        for (p, v), b in zip(c.positions, seen, strict=False):
            s.vote(p, v, b)
        # A block never seen before followed: the first call of an expert, or the stream
        # changed under the rule (a fragment compiled again mid-step). No output could have
        # named it: the check votes (that is how the rule learns it) but does not count
        # against the rule's accuracy.
        if c.run is not None and not c.new:
            s.recent.append(complete and tuple(seen[:m]) == c.run)
            if len(s.recent) == s.recent.maxlen and s.recent.right < len(s.recent) / 2:
                s.retired = True  # this output does not list blocks: stop paying for checks
        if complete:
            s.vote_exit(seen[m])
            if c.exit != UNKNOWN and not c.new:
                s.exit_recent.append(seen[m] == c.exit)

    def trusted(self, key: _Key) -> bool:
        s = self._slots.get(key)
        if s is None or len(s.recent) < self.min_checks:
            return False
        acc = s.recent.accuracy()
        return acc is not None and acc >= self.min_accuracy

    def slot_stats(self, labels: Sequence[str]) -> tuple[RuleSlotStats, ...]:
        """Per ``(block, slot)`` seen, in key order; ``labels`` maps block ids to labels."""
        return tuple(
            RuleSlotStats(
                block=labels[b],
                slot=o,
                checks=s.checks,
                accuracy=s.recent.accuracy(),
                trusted=self.trusted((b, o)),
            )
            for (b, o), s in sorted(self._slots.items())
        )

    # -- files ------------------------------------------------------------------------------
    def to_json(self, labels: Sequence[str]) -> list[dict[str, Any]]:
        """The learnt votes and recent checks, with block labels (for the pilot's meta.json)."""
        return [
            {
                "block": labels[b],
                "slot": o,
                "checks": s.checks,
                "by_value": [
                    [p, v, {labels[x]: n for x, n in sorted(votes.items())}]
                    for (p, v), votes in sorted(s.by_value.items())
                ],
                "by_position": [
                    [p, {labels[x]: n for x, n in sorted(votes.items())}]
                    for p, votes in sorted(s.by_position.items())
                ],
                "exit": {labels[x]: n for x, n in sorted(s.exit_votes.items())},
                "recent": [int(x) for x in s.recent],
                "exit_recent": [int(x) for x in s.exit_recent],
                "retired": s.retired,
            }
            for (b, o), s in sorted(self._slots.items())
        ]

    def load_json(self, data: Any, block_id: Any) -> None:
        """Replace the learnt state by :meth:`to_json`'s; ``block_id`` maps labels to ids.

        Raises:
            ValueError, KeyError, TypeError: malformed data.
        """
        if not isinstance(data, list):
            raise ValueError("rules must be a list")
        slots: dict[_Key, _Slot] = {}
        for d in data:
            s = _Slot(recent=_Recent(self.window), exit_recent=_Recent(self.window))
            s.checks = int(d["checks"])
            for p, v, votes in d["by_value"]:
                s.by_value[(int(p), int(v))] = {block_id(str(x)): int(n) for x, n in votes.items()}
            for p, votes in d["by_position"]:
                s.by_position[int(p)] = {block_id(str(x)): int(n) for x, n in votes.items()}
            s.exit_votes = {block_id(str(x)): int(n) for x, n in d["exit"].items()}
            s.recent.extend(bool(x) for x in d["recent"])
            s.exit_recent.extend(bool(x) for x in d["exit_recent"])
            s.retired = bool(d.get("retired", False))
            s.rebuild_best()
            slots[(block_id(str(d["block"])), int(d["slot"]))] = s
        self._slots = slots
        # The blocks the votes name were seen by the rule that learnt them.
        self._known = {b for b, _ in slots} | {
            x
            for slot in slots.values()
            for votes in (*slot.by_value.values(), *slot.by_position.values(), slot.exit_votes)
            for x in votes
        }
        self._pending = []
        self._plan, self._done = (), 0
