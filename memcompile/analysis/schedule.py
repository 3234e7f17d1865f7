"""Memory-aware ordering: linearize parallel work so values die as early as possible.

A greedy list scheduler over a set of nodes of the joint graph (the forward, or the backward the
planner built). Among the nodes whose inputs are ready it runs the one that adds the least memory
(bytes it allocates minus bytes whose last use it is); ties go to the node enabled most recently
(so a branch is finished before the next one starts), then to the original order:

    breadth-first code                          scheduled
      h1 = mm(x, w1); ...; h8 = mm(x, w8)         h1 = mm(x, w1); g1 = gelu(h1); s1 = sum(g1)
      g1 = gelu(h1);  ...; g8 = gelu(h8)          h2 = mm(x, w2); g2 = gelu(h2); s2 = sum(g2)
      s1 = sum(g1);   ...; s8 = sum(g8)           ...

Net change alone misleads when the least-delta node allocates a tensor that lives long (a
gradient) and a recomputation's consumer would free what the recomputation allocates: then
``pick`` compares the few best ready nodes by the peak and net change of the chain each
enables (a node and its newly ready users, a few steps deep), and runs first the one that peaks
lowest followed by the others:

    torch's order (bench GPT, last MLP)         picked
      mm_2 = grad @ W2        # lives on          gelu_3 = gelu(x); mm_3 = grad^T @ gelu_3
      gelu_3 = gelu(x)                            mm_2 = grad @ W2   # gelu_3 is gone
      mm_3 = grad^T @ gelu_3  # 3 x 8 MiB live

With a ``window`` the scheduler only reorders locally: a node waits until it is within a few
positions of the first node not yet run, which keeps the given order's global shape.

It changes no op, only the order, so it costs no time. Random ops (dropout) and ops with side
effects keep their relative order: each draws from or changes state the next one sees, so
swapping two dropouts would swap their masks. The joint model replays both this order
and torch's, and keeps the lower peak (``JointModel.evaluate(..., schedule=True)``).

:func:`sink` then polishes the order that won, at its peak: a value computed before the peak
but first read after it is computed just before its first reader instead, if the replay says
the step peaks lower. Torch's order computes an input gradient as soon as its output gradient
exists; where the layer's recomputation comes after it, the two meet (bench GPT, first MLP,
recompute-only plan):

    torch's order                                 sunk
      mm_26 = grad @ W2          # 8 MiB, waits     addmm_2, gelu = recompute(...)
      addmm_2, gelu = recompute(...)                mm_27 = grad^T @ gelu   # gelu dies
      mm_27 = grad^T @ gelu      # 3 x 8 MiB live   mm_26 = grad @ W2
      gelu_backward_(mm_26, addmm_2)                gelu_backward_(mm_26, addmm_2)
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Protocol

import numpy as np

from memcompile.analysis.liveness import Replayed

__all__ = ["JointFacts", "SinkMemo", "schedule", "sink"]


class JointFacts(Protocol):
    """What the scheduler reads of a joint model (``joint_model.JointModel``), per node and
    storage: the model imports this module, so it is typed by what is read, not imported."""

    inputs: list[tuple[int, ...]]
    users: list[list[int]]
    storages: list[tuple[int, ...]]
    nbytes: list[int]
    persistent: frozenset[int]
    input_storages: list[frozenset[int]]
    has_effect: list[bool]
    effect_nodes: tuple[int, ...]
    #: What :func:`sink` finds once per model (:class:`SinkMemo`).
    sink_memo: SinkMemo

    def nodes_holding(self, storage: int) -> tuple[int, ...]: ...


# Chains scored ahead: at most this many users followed from each node.
_BRANCH = 4
# Ready nodes compared by pick() when the least-delta one allocates.
_CANDIDATES = 4
# sink(): values live at the peak tried per round (largest first), and replays in all.
_SINK_TRIES = 8
_SINK_REPLAYS = 48


def schedule(
    model: JointFacts,
    nodes: Sequence[int],
    *,
    entry: Iterable[int] = (),
    keep: Collection[int] = (),
    late: Collection[int] = (),
    lookahead: int = 3,
    window: int | None = None,
) -> list[int]:
    """A low-peak topological order of ``nodes`` (joint-graph indices, given in a valid order).

    Args:
        model: the joint model (inputs, storages and sizes of the nodes).
        nodes: the nodes to order; inputs outside this set are available from the start.
        entry: storages live before the first node (never counted as allocated by a node).
        keep: storages that survive the whole sequence (outputs, saved tensors).
        late: storages that come into being just before their first use (swapped in).
        lookahead: longest chain (a node and users it enables) that :func:`pick` scores; 1
            compares single nodes by their net change only.
        window: with a window, a ready node waits until it is fewer than ``window`` positions
            (in ``nodes``) after the first node not yet run: a local reordering of the given
            order, which keeps its global shape (torch's order, where recomputations sit next
            to their consumers) and only moves work past a few neighbours.
    """
    members = set(nodes)
    position = {i: p for p, i in enumerate(nodes)}
    live = set(entry) - model.persistent
    keep = set(keep)
    # Pending uses of each storage: a storage dies when the last node using it has run.
    pending: dict[int, int] = {}
    waiting: dict[int, int] = {}
    users: dict[int, list[int]] = {i: [] for i in nodes}
    previous_effect: int | None = None
    for i in nodes:
        deps = [j for j in model.inputs[i] if j in members]
        if model.has_effect[i]:
            if previous_effect is not None:
                deps.append(previous_effect)  # an ordering edge, not a data edge
            previous_effect = i
        waiting[i] = len(set(deps))
        for j in set(deps):
            users[j].append(i)
        for s in model.input_storages[i]:
            pending[s] = pending.get(s, 0) + 1

    inputs_storages = model.input_storages.__getitem__  # precomputed: called per step

    def delta(i: int) -> int:
        allocated = {s for s in model.storages[i] if s not in live and s not in model.persistent}
        allocated |= {s for s in inputs_storages(i) if s in late and s not in live}
        dying = {
            s
            for s in inputs_storages(i) | set(model.storages[i])
            if pending.get(s, 0) <= (1 if s in inputs_storages(i) else 0)
            and s not in keep
            and s not in model.persistent
        }
        return sum(model.nbytes[s] for s in allocated) - sum(model.nbytes[s] for s in dying)

    def job(head: int) -> tuple[int, int]:
        """(transient peak, net change) of the best chain head -> u1 -> u2 ... (each node
        enabled by the chain so far, at most ``lookahead`` long): the prefix of lowest net
        change, relative to the memory live now."""
        extra: set[int] = set()
        gone: set[int] = set()
        used: dict[int, int] = {}
        arrived: dict[int, int] = {}

        def is_live(s: int) -> bool:
            return (s in live or s in extra) and s not in gone

        def run(j: int) -> list[tuple[str, int]]:
            undo: list[tuple[str, int]] = []
            for s in inputs_storages(j):
                used[s] = used.get(s, 0) + 1
                undo.append(("u", s))
                if s in late and s not in extra:
                    extra.add(s)
                    undo.append(("e", s))
            for s in model.storages[j]:
                if s not in model.persistent and s not in extra:
                    extra.add(s)
                    undo.append(("e", s))
            for s in [*inputs_storages(j), *model.storages[j]]:
                if pending.get(s, 0) - used.get(s, 0) <= 0 and s not in keep and s not in gone:
                    gone.add(s)
                    undo.append(("g", s))
            for u in users[j]:
                arrived[u] = arrived.get(u, 0) + 1
                undo.append(("a", u))
            return undo

        def revert(undo: list[tuple[str, int]]) -> None:
            for kind, x in reversed(undo):
                if kind == "u":
                    used[x] -= 1
                elif kind == "e":
                    extra.discard(x)
                elif kind == "g":
                    gone.discard(x)
                else:
                    arrived[x] -= 1

        def step(j: int) -> tuple[int, int]:
            # (bytes allocated, bytes freed) by j on the overlay; outputs exist before
            # the inputs dying here are freed.
            ins = inputs_storages(j)
            allocated = {
                s for s in model.storages[j] if not is_live(s) and s not in model.persistent
            }
            allocated |= {s for s in ins if s in late and not is_live(s)}
            dying = {
                s
                for s in ins | set(model.storages[j])
                if pending.get(s, 0) - used.get(s, 0) <= (1 if s in ins else 0)
                and s not in keep
                and s not in model.persistent
                and s not in gone
            }
            return sum(model.nbytes[s] for s in allocated), sum(model.nbytes[s] for s in dying)

        def visit(j: int, net: int, peak: int, depth: int) -> tuple[int, int]:
            alloc, freed = step(j)
            peak = max(peak, net + alloc)
            net += alloc - freed
            best = (net, peak)
            if depth >= lookahead:
                return best
            undo = run(j)
            taken = 0
            for u in users[j]:
                if waiting[u] - arrived.get(u, 0) != 0:
                    continue
                best = min(best, visit(u, net, peak, depth + 1))
                taken += 1
                if taken >= _BRANCH:
                    break
            revert(undo)
            return best

        net, peak = visit(head, 0, 0, 1)
        return peak, net

    def pick(top: int) -> int:
        """The node to run instead of ``top`` (the least-delta ready node), if any.

        Greedy on the net change alone starts a tensor that lives long (a gradient) before
        a chain that would free what it allocates (a recompute and its consumer), so the
        chain's peak lands on top of the long-lived tensor. Of the few best ready nodes,
        run first the one whose chain, followed by the others' worst peak, peaks lowest:
        A before B when max(peak A, net A + peak B) < max(peak B, net B + peak A)."""
        others: list[tuple[int, int, int, int]] = []
        while ready and len(others) < _CANDIDATES - 1:
            _, neg_t, _, j = heapq.heappop(ready)
            others.append((delta(j), neg_t, position[j], j))
        jobs = {entry[3]: job(entry[3]) for entry in others}
        jobs[top] = job(top)
        worst = max(p for p, _ in jobs.values())
        second = sorted((p for p, _ in jobs.values()), reverse=True)[1] if len(jobs) > 1 else 0

        def cost(j: int) -> int:
            p, n = jobs[j]
            rest = second if p == worst else worst
            return max(p, n + rest)

        best = top
        for entry in others:
            if cost(entry[3]) < cost(best):
                best = entry[3]
        if best != top:
            others = [e for e in others if e[3] != best]
            others.append((delta(top), enabled_neg[top], position[top], top))
        for entry in others:
            heapq.heappush(ready, entry)
        return best

    clock = 0
    ready: list[tuple[int, int, int, int]] = []  # (delta, -enabled at, position, node)
    enabled: dict[int, int] = {}
    enabled_neg: dict[int, int] = {}  # -enabled at, of a node pick() may push back
    parked: list[tuple[int, int]] = []  # (position, node): ready but outside the window
    scheduled = [False] * len(nodes)
    frontier = 0  # position of the first node not yet run

    def enable(u: int, neg_t: int) -> None:
        if window is not None and position[u] >= frontier + window:
            heapq.heappush(parked, (position[u], u))
            enabled_neg[u] = neg_t
        else:
            heapq.heappush(ready, (delta(u), neg_t, position[u], u))

    for i in nodes:
        if waiting[i] == 0:
            enabled[i] = clock
            enable(i, 0)
    order: list[int] = []
    # Only storages a node touches can die when it runs; entry storages nobody reads go after
    # the first node (checking the whole live set at every step is quadratic on big graphs).
    unread_entry = [s for s in live if pending.get(s, 0) <= 0]
    while ready:
        _, neg_t, _, i = heapq.heappop(ready)
        # Scores go stale as memory changes: re-score once before committing to a node.
        fresh = (delta(i), neg_t, position[i], i)
        if ready and fresh > ready[0]:
            heapq.heappush(ready, fresh)
            continue
        if fresh[0] > 0 and ready and lookahead > 1:
            enabled_neg[i] = neg_t
            i = pick(i)
        order.append(i)
        clock += 1
        for s in inputs_storages(i):
            pending[s] -= 1
            if s in late:
                live.add(s)
        live.update(s for s in model.storages[i] if s not in model.persistent)
        for s in [*unread_entry, *inputs_storages(i), *model.storages[i]]:
            if pending.get(s, 0) <= 0 and s not in keep:
                live.discard(s)
        unread_entry = []
        scheduled[position[i]] = True
        while frontier < len(nodes) and scheduled[frontier]:
            frontier += 1
        for u in users[i]:
            waiting[u] -= 1
            if waiting[u] == 0:
                enabled[u] = clock
                enable(u, -clock)
        while parked and (window is None or parked[0][0] < frontier + window):
            _, u = heapq.heappop(parked)
            heapq.heappush(ready, (delta(u), enabled_neg[u], position[u], u))
    if len(order) != len(nodes):
        raise AssertionError("schedule: the nodes do not form a DAG closed under their inputs")
    return order


def sink(
    model: JointFacts,
    order: Sequence[int],
    replay: Callable[[Sequence[int]], Replayed],
    replayed: Replayed | None = None,
    *,
    max_replays: int = _SINK_REPLAYS,
) -> tuple[list[int], Replayed]:
    """``order`` with values that wait across its peak computed later, while that lowers it;
    and its replay.

    At the peak position ``p``, each storage live there (largest first, at most
    ``_SINK_TRIES``) whose producer ran before ``p`` and whose first reader runs after it is
    a candidate: its producer, with the views of it that run before that reader, moves to
    right before the reader. A move is kept if ``replay`` finds the whole order's peak lower
    (moving a node also keeps its inputs alive longer, which can raise another position);
    then the search starts again at the new peak. It stops when no candidate lowers the peak
    or after ``max_replays`` replays, so it costs at most that many linear replays.

    A node with effects (random, mutating) never moves, and no node moves past one with
    effects that touches a storage it reads or writes: the order of effects, and of the reads
    around an in-place write, stays as given.

    Args:
        model: the joint model (inputs, users, storages and sizes of the nodes).
        order: a valid order of the nodes of one graph (joint indices).
        replay: the liveness replay of an order (``JointModel._replay`` with the graph's
            entry and kept storages bound).
        replayed: ``replay(order)``, where the caller has it already (else it is replayed).
        max_replays: bound on the replays, that of ``order`` included (each is linear in the
            order's length).
    """
    order = list(order)
    result = replayed if replayed is not None else replay(order)
    replays = 1
    memo = model.sink_memo
    while replays < max_replays:
        peak, _, at, live = result
        candidates = memo.candidates(model, order, live, at)
        if not candidates:
            break
        position = dict(zip(order, range(len(order)), strict=True))
        # Positions of the nodes with effects, in order: a move checks only those it passes
        # (found from the few nodes with effects, not by a pass over the order).
        effects = sorted(position[j] for j in model.effect_nodes if j in position)
        improved = False
        for made in candidates:
            moved = _sink_move(model, order, position, made, at, effects)
            if moved is None:
                continue
            new = replay(moved)
            replays += 1
            if new[0] < peak:
                order, result = moved, new
                improved = True
                break
            if replays >= max_replays:
                break
        if not improved:
            break
    return order, result


class SinkMemo:
    """What :func:`sink` finds once per joint model and reuses in every call: the nodes holding
    each storage (as arrays), and the views of each node that move with it."""

    def __init__(self) -> None:
        self.views: dict[int, tuple[int, ...]] = {}
        self._arrays: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None

    def _holding(self, model: JointFacts) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(the nodes holding each storage, concatenated, for the storages any node holds;
        where each of those storages' nodes start in it; those storages; every storage's
        bytes)."""
        if self._arrays is None:
            n_storages = len(model.nbytes)
            held = [(s, model.nodes_holding(s)) for s in range(n_storages)]
            held = [(s, nodes) for s, nodes in held if nodes]
            flat = np.fromiter((i for _, nodes in held for i in nodes), dtype=np.int64)
            lengths = np.fromiter((len(nodes) for _, nodes in held), dtype=np.int64)
            starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
            storages = np.fromiter((s for s, _ in held), dtype=np.int64, count=len(held))
            nbytes = np.fromiter(
                (model.nbytes[s] for s in range(n_storages)), dtype=np.int64, count=n_storages
            )
            self._arrays = (flat, starts, storages, nbytes)
        return self._arrays

    def candidates(
        self, model: JointFacts, order: Sequence[int], live: Collection[int], at: int
    ) -> list[int]:
        """Where :func:`sink`'s candidates at peak position ``at`` of ``order`` are first made
        (the first node in the order holding each): the storages ``live`` there made before it,
        largest first, then the earliest made, then as ``live`` gives them; at most
        ``_SINK_TRIES``. In array operations: each evaluation of the GRU small's search
        looked up the ~540 storages live at its peak one by one."""
        if not live:
            return []
        flat, starts, storages, nbytes = self._holding(model)
        never = len(order)
        pos = np.full(len(model.storages), never, dtype=np.int64)
        pos[np.fromiter(order, dtype=np.int64, count=len(order))] = np.arange(never, dtype=np.int64)
        first = np.full(len(nbytes), never, dtype=np.int64)
        if len(flat):
            first[storages] = np.minimum.reduceat(pos[flat], starts)
        ids = np.fromiter(live, dtype=np.int64, count=len(live))
        made = first[ids]
        before = made < at
        ids, made = ids[before], made[before]
        picked = np.lexsort((made, -nbytes[ids]))[:_SINK_TRIES]  # stable: ties as given
        return made[picked].tolist()


def _views_moving(
    model: JointFacts, head: int, own: frozenset[int], position: dict[int, int]
) -> set[int]:
    """``head`` and its views in ``position``'s order that move with it: nodes making no storage
    of their own (theirs within ``own``, ``head``'s) and no effect, reading ``head`` or another
    of them, transitively. The views of each node in the whole graph are found once
    (:class:`SinkMemo`); where one of them is not in this order, only those reached
    through nodes that are."""
    views = model.sink_memo.views
    known = views.get(head)
    if known is None:
        known = tuple(sorted(_view_walk(model, head, own, None) - {head}))
        views[head] = known
    if all(u in position for u in known):
        return {head, *known}
    # (A user comes after what it reads in any order: each is after ``head``.)
    return _view_walk(model, head, own, position)


def _view_walk(
    model: JointFacts, head: int, own: frozenset[int], position: dict[int, int] | None
) -> set[int]:
    """``head`` and the nodes reading it or another of them, transitively, that make no
    storage outside ``own`` and no effect (and are in ``position``'s order, when given)."""
    members = {head}
    stack = [head]
    while stack:
        j = stack.pop()
        for u in model.users[j]:
            if (
                (position is None or u in position)
                and u not in members
                and own.issuperset(model.storages[u])
                and not model.has_effect[u]
            ):
                members.add(u)
                stack.append(u)
    return members


def _sink_move(
    model: JointFacts,
    order: list[int],
    position: dict[int, int],
    start: int,
    at: int,
    effects: Sequence[int],
) -> list[int] | None:
    """``order`` with the node at ``start`` and its views moved to right before their first
    other reader, if that reader runs after position ``at`` and the move is legal; else None.
    ``effects``: the positions of ``order``'s nodes with effects, ascending."""
    head = order[start]
    own = frozenset(model.storages[head])
    if model.has_effect[head] or own & model.input_storages[head]:
        return None  # an effect keeps its place; a view of an older value frees nothing
    members = _views_moving(model, head, own, position)
    readers = [
        position[u] for j in members for u in model.users[j] if u in position and u not in members
    ]
    if not readers:
        return None  # an output: nothing to move it next to
    first = min(readers)
    if first <= at:
        return None
    moving = sorted(position[j] for j in members if position[j] < first)
    touched = own.union(*(model.input_storages[order[p]] for p in moving))
    for p in effects[bisect.bisect_right(effects, start) : bisect.bisect_left(effects, first)]:
        j = order[p]
        if j in members:
            continue
        if touched & (model.input_storages[j] | set(model.storages[j])):
            return None
    # A view placed after the reader keeps its place: it reads the head, which still runs first.
    out: list[int] = []
    last = 0
    for p in moving:  # the order up to the reader without them (slices between them)
        out += order[last:p]
        last = p + 1
    out += order[last:first]
    out += [order[p] for p in moving]
    out += order[first:]
    return out
