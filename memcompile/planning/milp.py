"""Exact MILP for the saved set of small joint graphs: the yardstick of the greedy planner.

The greedy planner (``planner.py``) decides, for each storage eager autograd would save, whether
the forward keeps it, the backward recomputes it or it is swapped out in between. This module
solves the same decision problem exactly with ``scipy.optimize.milp`` (HiGHS), so tests can
measure the greedy plan's optimality gap. It is exact with respect to
:meth:`JointModel.evaluate` (``schedule=False``: the graph's own forward order and torch's
backward order) and meant for graphs of tens to a few hundred nodes.

Formulation (all variables in [0, 1]; only ``k`` and ``w`` are declared integral, every other
one is forced to 0/1 by its constraints once they are)::

    k_s   storage s is in the saved set S                       (candidates; must-save: 1)
    a_i   forward node i is available to the backward = AND_{s in i} k_s
    r_i   i is recomputed = (1 - a_i) AND OR_{c consumes i} need_c
              need_c = 1 for the fixed backward nodes, r_c for forward consumers
    x_i   i is an input of the backward = a_i AND OR_c need_c
    u_s   s is a saved tensor the backward reads = OR_{i holds s} x_i
    w_s   s is swapped out and back: w_s <= OR of its covering holders' x_i, and at most one
          holder is an input (``JointModel.swappable``)
    e_ig  i has been recomputed by the end of group g of the backward order (below)
    y_is  recomputed node i makes a fresh copy of saved storage s = r_i AND u_s

    minimise  sum_i cost_i r_i + sum_s 2 (launch + copy_s) w_s             (ns)
    subject to, at every moment m of the forward, the backward and the accumulation,
              bytes live at m (a linear function of u, w, e) + workspace_m <= P <= target

Why this mirrors ``evaluate`` exactly:

* The backward nodes that are not forward nodes (``B``: gradients and what they need) do not
  depend on S, and neither does their order: torch's ``reordering_to_mimic_autograd_engine``
  (``JointModel.backward_order``) inserts ``B`` root by root, each ``insert`` emitting a *group*
  of nodes in joint order. A recomputed node joins the group of its first needed consumer, so
  ``e_ig = r_i AND OR_c e_cg`` (for a node of ``B``, ``e_cg`` is the constant "its group <= g"),
  and the backward is a fixed sequence of *slots*: per group, in joint order, its ``B`` nodes and
  each forward node that may be recomputed there; slot (i, g) runs iff ``A = e_ig - e_i,g-1``.
* A storage is live at a slot iff it was started at or before it (on entry to the backward when
  saved and not swapped, ``u_s - w_s``; else at its first running producer or reader) and is
  touched at or after it (or is a gradient kept to the end): ``live >= F + L - 1`` with
  ``F``/``L`` running ORs over the slots. Only lower bounds are needed (liveness appears only in
  ``<= P`` rows), and a slot that does not run keeps the live set of the slot before it, minus
  its own workspace (``workspace * A``), so the row is written unconditionally.
* A recomputed node that allocates a storage also saved (a multi-output op recomputed for one
  output while another is saved) makes a copy (``_replay``'s ``dup``), live from that node to
  its last reader; its production and reads touch the copy (``A + y - 1``) instead of the
  saved storage (``A - y``).
* The forward order is fixed: a storage is live at forward step p between its first producer
  and last reader, and after that iff kept (``u_s - w_s``, or a forward output).
* The entry moment of the backward, the user outputs the caller holds during it unless saved
  (``1 - u_s``), held tangents and the accumulation moment (gradients + held + clone bytes)
  are added as ``evaluate`` adds them.
* Costs: ``JointEval.recompute_time`` is the sum over recomputed forward nodes (``r``), the
  swap time a constant per swapped storage; a non-recomputable node can never be needed.

Not modelled (:class:`NotImplementedError`): graphs with side-effect nodes (shape asserts, whose
extra backward nodes depend on S), forward nodes after the first tangent use, forward nodes
reading backward nodes; ``evaluate(..., schedule=True)`` and ``evaluate(..., sink=True)`` (the
memory-aware reorder, and the sinking of values that wait across a peak), which can only lower
the greedy plan's peak. The decision space is a ``candidates`` set of storages the
plan may keep (default: eager's saved set, the greedy planner's space).

Every solution is checked with ``model.evaluate``. A plan the simulator finds over the target
(HiGHS's feasibility tolerance is relative: a byte or two over with MB-sized tensors; or
``_replay`` counting more than this model, see below) is excluded by a no-good cut on its
(r, u, w) pattern, which fixes its memory and time, and the MILP solved again: the returned plan
is the optimum of the decision space *as evaluate prices it*. ``MilpResult.exact`` says whether
the MILP's overhead and read set agree with the simulator's.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from scipy.optimize import Bounds, LinearConstraint, OptimizeResult, milp
from scipy.sparse import coo_array

from memcompile.analysis.joint_model import _FW, _PRIMAL, _TANGENT, JointEval, JointModel

log = logging.getLogger(__name__)

__all__ = ["MilpResult", "linear_peak", "min_peak", "solve_saved_set"]

# The objective is in nanoseconds: HiGHS stops at an absolute gap of 1e-6, which in seconds
# would swallow whole recomputations (~5 us each).
_NS = 1e9
_ONE = -1  # key of the constant term in a linear expression

Lin = dict[int, float]


@dataclass(frozen=True)
class MilpResult:
    """The MILP's plan and how it was solved.

    Attributes:
        saved: storages the plan keeps for the backward (those it reads, as ``JointEval.saved``).
        swapped: (storage, tier) of the saved storages swapped out between the passes.
        objective: predicted seconds the plan adds (recompute + swap), per the MILP; ``inf``
            without a plan.
        bound: HiGHS's lower bound on the optimal overhead, seconds (== objective when optimal).
        status: ``optimal``, ``infeasible``, ``time_limit`` (maybe with a plan) or ``error``.
        optimal: the plan is proven optimal.
        evaluation: ``model.evaluate(saved, swapped)`` of the plan, or ``None`` without one.
        exact: the evaluation agrees with the MILP (same overhead, peak within the target).
        seconds: wall time of the solve.
        cuts: plans the simulator found over the target (by HiGHS's tolerance) and excluded.
    """

    saved: frozenset[int]
    swapped: tuple[tuple[int, str], ...]
    objective: float
    bound: float
    status: str
    optimal: bool
    evaluation: JointEval | None
    exact: bool
    seconds: float
    cuts: int = 0


def _add(out: Lin, terms: Lin, scale: float = 1.0) -> Lin:
    for j, v in terms.items():
        out[j] = out.get(j, 0.0) + scale * v
    return out


def _lin(*parts: tuple[Lin, float]) -> Lin:
    """sum of scale * expression."""
    out: Lin = {}
    for terms, scale in parts:
        _add(out, terms, scale)
    return out


class _Formulation:
    """The MILP of one joint model; the target and fixed decisions come with each solve."""

    def __init__(
        self,
        model: JointModel,
        *,
        candidates: Collection[int] | None = None,
        recompute: bool = True,
        swap_tier: str | None = None,
    ) -> None:
        self.model = m = model
        self.swap_tier = swap_tier
        self.lb: list[float] = []
        self.ub: list[float] = []
        self.integer: list[int] = []
        self.names: list[str] = []
        self.obj: list[float] = []
        self._ri: list[int] = []
        self._rj: list[int] = []
        self._rv: list[float] = []
        self.row_lo: list[float] = []
        self.row_hi: list[float] = []

        self._check_supported()
        must = m.must_save() - m.persistent
        if candidates is None:
            candidates = m.default_saved() | m.must_save()
        free = frozenset(candidates) - m.persistent - must
        fw = [i for i, k in enumerate(m.kind) if k == _FW]
        self.fw = fw
        fw_set = set(fw)

        # -- the fixed backward: B, its tangents and its groups --------------------------------
        bset: set[int] = set()
        tangents: set[int] = set()
        stack = list(m.bw_outputs)
        while stack:
            i = stack.pop()
            if i in bset or i in fw_set:
                continue
            if m.kind[i] in (_PRIMAL, _TANGENT):  # placeholders are always available
                if m.kind[i] == _TANGENT:
                    tangents.add(i)
                continue
            bset.add(i)
            stack.extend(m.inputs[i])
        self.bset = bset
        groups = self.model.backward_groups(bset)
        group_of = {i: g for g, members in enumerate(groups) for i in members}

        # -- availability and recomputability of forward nodes ---------------------------------
        # avail: True / False / the free storages whose AND it is.
        avail: dict[int, bool | tuple[int, ...]] = {}
        for i in fw:
            sids = m.storages[i]
            if m.is_sym[i]:
                avail[i] = True
            elif m.is_tuple[i] or not sids:
                avail[i] = False
            else:
                open_ = tuple(s for s in sids if s not in m.persistent and s not in must)
                if not open_:
                    avail[i] = True
                elif any(s not in free for s in open_):
                    avail[i] = False
                else:
                    avail[i] = open_
        # evaluate() marks a plan infeasible if it recomputes a non-recomputable node that
        # owns a tracked storage.
        allowed = {
            i: m.recomputable[i] or all(s in m.persistent for s in m.storages[i]) for i in fw
        }
        # Groups a forward node could be recomputed in: those of the B nodes it reaches through
        # forward nodes that could be recomputed (consumers come later in joint order).
        # Views (``JointModel.free_views``) are never the backward's inputs: it makes them
        # again from their source whenever it needs them, available or not, at no cost.
        views = m.free_views
        cand: dict[int, list[int]] = {}
        rcap: set[int] = set()
        for i in reversed(fw):
            reach: set[int] = set()
            for c in m.users[i]:
                if c in bset:
                    reach.add(group_of[c])
                elif c in rcap:
                    reach.update(cand[c])
            cand[i] = sorted(reach)
            if (avail[i] is not True or i in views) and allowed[i] and reach:
                rcap.add(i)
        self.rcap = rcap
        for i in fw:
            if m.nodes[i].target is torch.ops.aten.copy_.default and i in rcap:
                raise NotImplementedError(f"a recomputable copy_ ({m.nodes[i].name}) is a root")

        # -- decision variables ----------------------------------------------------------------
        self.k = {s: self._var(f"k{s}", integer=True, lb=0.0 if recompute else 1.0) for s in free}
        self.a: dict[int, int] = {}
        for i in fw:
            if isinstance(avail[i], tuple):
                self.a[i] = self._var(f"a{i}")
        self.r = {
            i: self._var(f"r{i}", obj=0.0 if i in views else m.cost[i] * _NS) for i in sorted(rcap)
        }

        def a_expr(i: int) -> Lin:
            v = avail[i]
            if v is True:
                return {_ONE: 1.0}
            if v is False:
                return {}
            return {self.a[i]: 1.0}

        def need(c: int) -> Lin:
            if c in bset:
                return {_ONE: 1.0}
            if c in self.r:
                return {self.r[c]: 1.0}
            return {}

        for i, v in avail.items():
            if isinstance(v, tuple):  # a_i = AND k_s
                for s in v:
                    self._row({self.a[i]: 1.0, self.k[s]: -1.0}, hi=0.0)
                self._row(_lin(({self.a[i]: 1.0}, 1.0), *(({self.k[s]: 1.0}, -1.0) for s in v)),
                          lo=1.0 - len(v))  # fmt: skip
        self.x: dict[int, int] = {}
        for i in fw:
            needs = [need(c) for c in m.users[i]]
            needs = [n for n in needs if n]
            if avail[i] is not True and i not in rcap:
                # Never recomputed: no consumer may need it unless it is available.
                for n in needs:
                    self._row(_lin((n, 1.0), (a_expr(i), -1.0)), hi=0.0)
            if i in views and i in rcap:  # r_i = OR need_c
                ri = {self.r[i]: 1.0}
                if not any(_ONE in n for n in needs):
                    self._row(_lin((ri, 1.0), *((n, -1.0) for n in needs)), hi=0.0)
                for n in needs:
                    self._row(_lin((ri, 1.0), (n, -1.0)), lo=0.0)
                continue
            if i in rcap:  # r_i = (1 - a_i) AND OR need_c
                ri = {self.r[i]: 1.0}
                self._row(_lin((ri, 1.0), (a_expr(i), 1.0)), hi=1.0)
                if not any(_ONE in n for n in needs):
                    self._row(_lin((ri, 1.0), *((n, -1.0) for n in needs)), hi=0.0)
                for n in needs:
                    self._row(_lin((ri, 1.0), (n, -1.0), (a_expr(i), 1.0)), lo=0.0)
            if avail[i] is not False and needs:  # x_i = a_i AND OR need_c
                self.x[i] = xi = self._var(f"x{i}")
                self._row(_lin(({xi: 1.0}, 1.0), (a_expr(i), -1.0)), hi=0.0)
                if not any(_ONE in n for n in needs):
                    self._row(_lin(({xi: 1.0}, 1.0), *((n, -1.0) for n in needs)), hi=0.0)
                for n in needs:
                    self._row(_lin(({xi: 1.0}, 1.0), (a_expr(i), -1.0), (n, -1.0)), lo=-1.0)

        # u_s = OR of its holders' x; w_s (swap) as JointModel.swappable.
        holders: dict[int, list[int]] = {}
        for i in fw:
            for s in m.storages[i]:
                if s not in m.persistent:
                    holders.setdefault(s, []).append(i)
        self.dyn = set(holders)  # storages the forward creates: their fate depends on S
        self.u: dict[int, int] = {}
        self.w: dict[int, int] = {}
        for s, hs in sorted(holders.items()):
            xs = [self.x[i] for i in hs if i in self.x]
            if not xs:
                continue
            self.u[s] = us = self._var(f"u{s}")
            for xi in xs:
                self._row({us: 1.0, xi: -1.0}, lo=0.0)
            self._row(_lin(({us: 1.0}, 1.0), *(({xi: 1.0}, -1.0) for xi in xs)), hi=0.0)
            covering = [
                self.x[i] for i in hs if i in self.x and m.covers_storage[i] and not m.is_tuple[i]
            ]
            if (
                swap_tier is None
                or not covering
                or s in m.held_outputs
                or s in m._fw_output_storages
            ):
                continue
            copy = 2 * (m.profile.launch_overhead + m.profile.copy_time(m.nbytes[s], swap_tier))
            self.w[s] = ws = self._var(f"w{s}", integer=True, obj=copy * _NS)
            self._row(_lin(({ws: 1.0}, 1.0), *(({xi: 1.0}, -1.0) for xi in covering)), hi=0.0)
            if len(xs) > 1:  # one holder only among the backward's inputs
                self._row(_lin(({ws: float(len(xs) - 1)}, 1.0), *(({xi: 1.0}, 1.0) for xi in xs)),
                          hi=float(len(xs)))  # fmt: skip

        def u_expr(s: int) -> Lin:
            return {self.u[s]: 1.0} if s in self.u else {}

        def kept(s: int) -> Lin:  # saved and on the device between the passes
            out = u_expr(s)
            if s in self.w:
                out = _lin((out, 1.0), ({self.w[s]: 1.0}, -1.0))
            return out

        # e_ig: recomputed by the end of group g (e at its last candidate group is r_i).
        self.e: dict[tuple[int, int], Lin] = {}
        for i in sorted(rcap):
            for g in cand[i][:-1]:
                self.e[i, g] = {self._var(f"e{i}_{g}"): 1.0}
            self.e[i, cand[i][-1]] = {self.r[i]: 1.0}

        def done_by(c: int, g: int) -> Lin:
            if c in bset:
                return {_ONE: 1.0} if group_of[c] <= g else {}
            if c in rcap:
                prior = [h for h in cand[c] if h <= g]
                return self.e[c, prior[-1]] if prior else {}
            return {}

        for i in sorted(rcap):
            ri = {self.r[i]: 1.0}
            for g in cand[i][:-1]:
                eig = self.e[i, g]
                self._row(_lin((eig, 1.0), (ri, -1.0)), hi=0.0)
                terms = [t for t in (done_by(c, g) for c in m.users[i]) if t]
                if not any(_ONE in t for t in terms):
                    self._row(_lin((eig, 1.0), *((t, -1.0) for t in terms)), hi=0.0)
                for t in terms:
                    self._row(_lin((eig, 1.0), (t, -1.0), (ri, -1.0)), lo=-1.0)

        # -- the peak ---------------------------------------------------------------------------
        self.peak = self._var("P", ub=math.inf)

        def at_most_peak(expr: Lin) -> None:
            self._row(_lin((expr, 1.0), ({self.peak: 1.0}, -1.0)), hi=0.0)

        # Forward: fixed order, storages live from first producer to last reader, then if kept.
        order = m.forward_order
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        for p, i in enumerate(order):
            for j in m.inputs[i]:
                for s in m.storages[j]:
                    last[s] = p
        for p, i in enumerate(order):
            for s in m.storages[i]:
                if s not in m.persistent and s not in first:
                    first[s] = p
                    last.setdefault(s, p)
        for p, i in enumerate(order):
            expr: Lin = {_ONE: float(m.workspace[i])}
            for s, f in first.items():
                if f > p:
                    continue
                if p <= last[s] or s in m._fw_output_storages:
                    expr[_ONE] += m.nbytes[s]
                else:
                    _add(expr, kept(s), m.nbytes[s])
            at_most_peak(expr)

        # Backward: slots in order; static storages (made by B) have a fixed liveness.
        slots: list[tuple[int, Lin]] = []  # (node, runs)
        for g, members in enumerate(groups):
            here = set(members) | {i for i in rcap if g in cand[i]}
            for i in sorted(here):
                if i in bset:
                    slots.append((i, {_ONE: 1.0}))
                else:
                    prev = [h for h in cand[i] if h < g]
                    runs = _lin(
                        (self.e[i, g], 1.0), (self.e[i, prev[-1]], -1.0) if prev else ({}, 0)
                    )
                    slots.append((i, runs))
        self.slots = slots
        n_slots = len(slots)

        # A recomputed node that allocates a storage the backward also has saved (one output of
        # a multi-output op whose other outputs were dropped) makes a fresh copy of it: the copy
        # lives until the node's last reader, the saved one until its own last use
        # (``JointModel._replay``). y[i, s] = r_i AND u_s: node i's output s is such a copy.
        self.y: dict[tuple[int, int], int] = {}
        for i in sorted(rcap):
            made = {sid for j in m.inputs[i] for sid in m.storages[j]}
            for sid in m.storages[i]:
                if sid in self.u and sid not in made and sid not in m.persistent:
                    self.y[i, sid] = y = self._var(f"y{i}_{sid}")
                    self._row({y: 1.0, self.r[i]: -1.0}, hi=0.0)
                    self._row({y: 1.0, self.u[sid]: -1.0}, hi=0.0)
                    self._row({y: 1.0, self.r[i]: -1.0, self.u[sid]: -1.0}, lo=-1.0)

        # Touches of each storage (or copy, keyed (node, storage)): (slot, lower bound of the
        # indicator "this slot runs and touches it"), from producing it or reading a holder.
        Key = int | tuple[int, int]
        touches: dict[Key, list[tuple[int, Lin]]] = {}

        def touch(q: int, holder: int, sid: int, runs: Lin) -> None:
            y = self.y.get((holder, sid))
            if y is None:
                touches.setdefault(sid, []).append((q, runs))
                return
            touches.setdefault(sid, []).append((q, _lin((runs, 1.0), ({y: 1.0}, -1.0))))
            copy = _lin((runs, 1.0), ({y: 1.0, _ONE: -1.0}, 1.0))
            touches.setdefault((holder, sid), []).append((q, copy))

        for q, (i, runs) in enumerate(slots):
            for sid in m.storages[i]:
                if sid not in m.persistent:
                    touch(q, i, sid, runs)
            for j in dict.fromkeys(m.inputs[i]):
                for sid in m.storages[j]:
                    if sid not in m.persistent:
                        touch(q, j, sid, runs)
        tangent_storages = {s for i in tangents for s in m.storages[i]} - m.persistent
        bw_keep = {s for i in m.bw_outputs for s in m.storages[i]}
        static = [0.0] * n_slots
        end_bytes = 0.0  # live after the last slot
        for key, events in touches.items():
            if not isinstance(key, int) or key in self.dyn or key in tangent_storages:
                continue
            qs = [q for q, _ in events]  # slots of B nodes: they always run
            stop = n_slots - 1 if key in bw_keep else max(qs)
            for q in range(min(qs), stop + 1):
                static[q] += m.nbytes[key]
            if key in bw_keep:
                end_bytes += m.nbytes[key]
        held = {_ONE: float(sum(m.nbytes[s] for s in tangent_storages))}
        for s in m.held_outputs:  # the caller holds the loss unless the backward reads it
            _add(held, _lin(({_ONE: 1.0}, 1.0), (u_expr(s), -1.0)), m.nbytes[s])

        entry = dict(held)
        started_at_end: Lin = {}
        bw_rows: list[Lin] = [
            _lin((held, 1.0), ({_ONE: static[q]}, 1.0), (runs, float(m.workspace[i])))
            for q, (i, runs) in enumerate(slots)
        ]
        dynamic: list[Key] = [
            *sorted(self.dyn),
            *sorted(k for k in touches if not isinstance(k, int)),
        ]
        for key in dynamic:
            events = touches.get(key, [])
            s = key if isinstance(key, int) else key[1]
            kept_here = isinstance(key, int) and key in bw_keep
            ent = kept(s) if isinstance(key, int) else {}
            _add(entry, ent, m.nbytes[s])
            if not events and not ent:
                continue
            at: dict[int, list[Lin]] = {}
            for q, ev in events:
                at.setdefault(q, []).append(ev)
            lo = 0 if ent else min(at)
            hi = n_slots - 1 if kept_here else (max(at) if at else -1)
            f_prev: Lin = ent
            f_q: list[Lin] = []
            for q in range(lo, hi + 1):  # F: started by slot q (a running OR)
                fq = {self._var(f"F{key}_{q}"): 1.0}
                if f_prev:
                    self._row(_lin((fq, 1.0), (f_prev, -1.0)), lo=0.0)
                for ev in at.get(q, []):
                    self._row(_lin((fq, 1.0), (ev, -1.0)), lo=0.0)
                f_q.append(fq)
                f_prev = fq
            if kept_here:
                started_at_end = _add(started_at_end, f_prev, m.nbytes[s])
            l_next: Lin = {}
            for q in range(hi, lo - 1, -1):  # L: touched at or after slot q; live >= F + L - 1
                if kept_here:
                    lq: Lin = {_ONE: 1.0}
                else:
                    lq = {self._var(f"L{key}_{q}"): 1.0}
                    if l_next:
                        self._row(_lin((lq, 1.0), (l_next, -1.0)), lo=0.0)
                    for ev in at.get(q, []):
                        self._row(_lin((lq, 1.0), (ev, -1.0)), lo=0.0)
                live = self._var(f"live{key}_{q}")
                self._row(_lin(({live: 1.0}, 1.0), (f_q[q - lo], -1.0), (lq, -1.0)), lo=-1.0)
                _add(bw_rows[q], {live: float(m.nbytes[s])})
                l_next = lq
        at_most_peak(entry)
        for row in bw_rows:
            at_most_peak(row)
        at_most_peak(
            _lin((held, 1.0), ({_ONE: end_bytes + m.clone_bytes}, 1.0), (started_at_end, 1.0))
        )

    # -- construction helpers ------------------------------------------------------------------
    def _var(
        self,
        name: str,
        *,
        integer: bool = False,
        lb: float = 0.0,
        ub: float = 1.0,
        obj: float = 0.0,
    ) -> int:
        self.names.append(name)
        self.lb.append(lb)
        self.ub.append(ub)
        self.integer.append(int(integer))
        self.obj.append(obj)
        return len(self.names) - 1

    def _row(self, terms: Lin, *, lo: float = -math.inf, hi: float = math.inf) -> None:
        const = terms.get(_ONE, 0.0)
        r = len(self.row_lo)
        for j, v in terms.items():
            if j != _ONE and v != 0.0:
                self._ri.append(r)
                self._rj.append(j)
                self._rv.append(v)
        self.row_lo.append(lo - const)
        self.row_hi.append(hi - const)

    def _check_supported(self) -> None:
        m = self.model
        if any(m.impure):
            raise NotImplementedError("side-effect nodes: the backward's extra nodes depend on S")
        for i, k in enumerate(m.kind):
            if k != _FW:
                continue
            if i >= m.first_tangent_user:
                raise NotImplementedError(f"forward node {m.nodes[i].name} after the backward")
            if any(m.kind[j] not in (_FW, _PRIMAL) for j in m.inputs[i]):
                raise NotImplementedError(f"forward node {m.nodes[i].name} reads the backward")
        if any(m.kind[i] == _FW for i in m.bw_outputs):
            raise NotImplementedError("a gradient is a forward value")

    # -- solving -------------------------------------------------------------------------------
    def solve(
        self,
        *,
        target: float,
        objective: Literal["time", "peak"] = "time",
        fixed: Mapping[int, float] | None = None,
        time_limit: float = 60.0,
    ) -> OptimizeResult:
        """``scipy.optimize.milp`` with ``P <= target``, variables ``fixed`` (index -> value)."""
        n = len(self.names)
        lb = np.array(self.lb)
        ub = np.array(self.ub)
        ub[self.peak] = target
        for j, v in (fixed or {}).items():
            lb[j] = ub[j] = v
        if objective == "time":
            c = np.array(self.obj)
        else:
            c = np.zeros(n)
            c[self.peak] = 1.0
        a = coo_array((self._rv, (self._ri, self._rj)), shape=(len(self.row_lo), n)).tocsr()
        return milp(
            c,
            integrality=np.array(self.integer),
            bounds=Bounds(lb, ub),
            constraints=LinearConstraint(a, np.array(self.row_lo), np.array(self.row_hi)),
            options={"time_limit": time_limit, "mip_rel_gap": 1e-9, "presolve": True},
        )

    def exclude(self, x: np.ndarray) -> None:
        """A no-good cut: the next solution differs from ``x`` in what it recomputes, reads from
        the forward or swaps (which fix its memory and time)."""
        cols = [*self.r.values(), *self.u.values(), *self.w.values()]
        ones = [j for j in cols if x[j] > 0.5]
        zeros = [j for j in cols if x[j] <= 0.5]
        self._row({**{j: -1.0 for j in ones}, **{j: 1.0 for j in zeros}}, lo=1.0 - len(ones))

    def fix(self, saved: Collection[int], swapped: Collection[int] = ()) -> dict[int, float]:
        """Bounds that pin the decision variables to one plan."""
        out = {j: float(s in saved) for s, j in self.k.items()}
        out.update({j: float(s in swapped) for s, j in self.w.items()})
        return out


def linear_peak(
    model: JointModel,
    saved: Collection[int],
    swapped: Mapping[int, str] | None = None,
    *,
    candidates: Collection[int] | None = None,
) -> int | None:
    """The tracked peak the MILP's linear model gives one plan (tests: it must equal
    ``model.evaluate(saved, swapped).peak``); ``None`` where the model has no such plan (one
    that recomputes a node ``evaluate`` calls infeasible to recompute). ``candidates`` (default
    eager's saved set) and ``saved`` make the decision space."""
    pool = model.default_saved() | model.must_save() if candidates is None else candidates
    form = _Formulation(
        model,
        candidates=frozenset(pool) | frozenset(saved),
        swap_tier=next(iter((swapped or {}).values()), None),
    )
    res = form.solve(
        target=math.inf, objective="peak", fixed=form.fix(frozenset(saved), (swapped or {}).keys())
    )
    if res.status != 0:
        return None
    return round(float(res.x[form.peak]))


def min_peak(
    model: JointModel,
    *,
    recompute: bool = True,
    swap_tier: str | None = None,
    candidates: Collection[int] | None = None,
    time_limit: float = 60.0,
) -> int | None:
    """The smallest tracked peak any plan of the decision space reaches (``None``: none is
    feasible, or HiGHS ran out of time before proving it)."""
    form = _Formulation(model, candidates=candidates, recompute=recompute, swap_tier=swap_tier)
    res = form.solve(target=math.inf, objective="peak", time_limit=time_limit)
    if res.status != 0:
        return None
    return round(float(res.x[form.peak]))


def solve_saved_set(
    model: JointModel,
    target: int,
    *,
    recompute: bool = True,
    swap_tier: str | None = None,
    time_limit: float = 60.0,
    candidates: Collection[int] | None = None,
) -> MilpResult:
    """The saved set (and swaps) of least predicted overhead whose tracked peak is <= ``target``.

    Args:
        model: the fragment's joint model (small: tens to a few hundred nodes).
        target: tracked bytes, as ``search_saved_set``'s.
        recompute: storages may be dropped and recomputed (else the saved set is eager's).
        swap_tier: saved storages may be swapped to this tier (``host``/``disk``).
        time_limit: seconds HiGHS may spend; past it the best plan found is returned
            (``status="time_limit"``, ``optimal=False``).
        candidates: storages the plan may keep (default: eager's saved set and the must-save
            storages, the greedy planner's decision space).

    Raises:
        NotImplementedError: a graph outside the formulation (see the module docstring).
    """
    t0 = time.perf_counter()
    form = _Formulation(model, candidates=candidates, recompute=recompute, swap_tier=swap_tier)
    cuts = 0
    while True:
        left = time_limit - (time.perf_counter() - t0)
        res = form.solve(target=float(target), time_limit=max(left, 0.01))
        status_code = int(res.status)
        x = res.get("x")
        log.debug(
            "milp: %d variables, %d rows, status %d (%s)",
            len(form.names),
            len(form.row_lo),
            status_code,
            res.get("message", ""),
        )
        bound = res.get("mip_dual_bound")
        if status_code == 2 or x is None:
            status = {2: "infeasible", 1: "time_limit"}.get(status_code, "error")
            return MilpResult(
                saved=frozenset(),
                swapped=(),
                objective=math.inf,
                bound=math.inf if status_code == 2 else (bound or 0.0) / _NS,
                status=status,
                optimal=False,
                evaluation=None,
                exact=True,
                seconds=time.perf_counter() - t0,
                cuts=cuts,
            )
        keep = frozenset(s for s, j in form.k.items() if x[j] > 0.5) | model.must_save()
        swaps = {s: swap_tier for s, j in form.w.items() if x[j] > 0.5 and swap_tier is not None}
        evaluation = model.evaluate(keep, swaps)
        if evaluation.feasible and evaluation.peak <= target:
            break
        # HiGHS's feasibility tolerance is relative: with MB-sized tensors it accepts a plan a
        # byte or two over the target. The simulator has the last word: exclude that plan
        # (its recompute, read and swap pattern) and solve again.
        log.debug("milp: plan over the target by %d B; excluding it", evaluation.peak - target)
        form.exclude(x)
        cuts += 1
    objective = float(res.fun) / _NS
    used = frozenset(s for s, j in form.u.items() if x[j] > 0.5)
    exact = used == evaluation.saved and math.isclose(
        evaluation.time, objective, rel_tol=1e-6, abs_tol=1e-12
    )
    if not exact:
        log.warning(
            "milp: the simulator disagrees with the MILP: %.9f s vs %.9f s, reads %s vs %s",
            evaluation.time,
            objective,
            sorted(evaluation.saved),
            sorted(used),
        )
    return MilpResult(
        saved=evaluation.saved,
        swapped=evaluation.swapped,
        objective=objective,
        bound=min((bound if bound is not None else res.fun) / _NS, objective),
        status="optimal" if status_code == 0 else "time_limit",
        optimal=status_code == 0,
        evaluation=evaluation,
        exact=exact,
        seconds=time.perf_counter() - t0,
        cuts=cuts,
    )
