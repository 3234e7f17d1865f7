"""Issue reloads early enough to hide their copies, late enough to keep the peak.

``swap.py`` puts each reload right before its ``wait``; on CUDA the copy then stalls the compute
stream for its whole time. This pass moves reloads up the backward graph:

    before                                    after
      a = op1(...)                              x = reload(x_host, ...)   # the copy starts here
      b = op2(a)                                a = op1(...)              # ... and overlaps
      x = reload(x_host, ...)                   b = op2(a)                #     op1 and op2
      wait(x)                                   wait(x)
      y = op3(x, b)                             y = op3(x, b)

Decide (:func:`plan_prefetch`), then rewrite (:func:`prefetch_pass`). Reloads are placed in the
order of their waits and keep that order (the copy stream is FIFO). Each goes to the latest
point from which, by the timeline's roofline times, its copy finishes before its wait, but never
to a point where the extra live bytes (the reloaded tensor, alive from the new point on) would
raise the graph's peak above what the budget allows (the plan's predicted peak plus the slack
its budget leaves): where memory stops it, it goes as early as memory allows. So a plan stays
within its budget, and only time can improve.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from torch import fx

from memcompile.analysis.costmodel import DeviceProfile
from memcompile.analysis.graph import GraphProfile, StorageIds
from memcompile.analysis.timeline import (
    RELOAD,
    WAIT,
    Timeline,
    copied_bytes,
    copy_seconds,
    node_seconds,
    simulate,
)
from memcompile.rewrites.context import PassContext

log = logging.getLogger(__name__)

__all__ = ["PrefetchPlan", "plan_prefetch", "prefetch_pass"]


@dataclass(frozen=True)
class PrefetchPlan:
    """Where each reload is issued.

    Attributes:
        issue_before: reload node name -> name of the node it is moved before (reloads that stay
            put are not listed).
        before: the timeline with every reload right before its wait.
        after: the predicted timeline once the plan is applied.
    """

    issue_before: tuple[tuple[str, str], ...]
    before: Timeline
    after: Timeline

    @property
    def hidden_seconds(self) -> float:
        """Stall time the plan removes."""
        return self.before.stall - self.after.stall


def _positions(
    nodes: Sequence[fx.Node],
    live: list[int],
    peak: int,
    start_s: list[float],
    profile: DeviceProfile,
) -> dict[fx.Node, int]:
    # Reloads in wait order, each moved to an index of ``nodes`` (insert before that node).
    index = {n: i for i, n in enumerate(nodes)}
    first_op = next((i for i, n in enumerate(nodes) if n.op != "placeholder"), len(nodes))
    waits = [n for n in nodes if n.target is WAIT]
    moved: dict[fx.Node, int] = {}
    floor = first_op  # FIFO: a reload is never issued before the previous one
    copy_free = 0.0
    for w in waits:
        rel = w.args[0]
        assert isinstance(rel, fx.Node) and rel.target is RELOAD
        p, need = index[rel], start_s[index[w]]
        seconds, size = copy_seconds(rel, profile), copied_bytes(rel)
        q = p
        # Never above what it reads (a block of rows of a host copy is sliced for it).
        lo = max([floor, *(index[a] + 1 for a in rel.all_input_nodes)])
        # Walk up while memory allows and the copy would still finish late.
        while q > lo and live[q - 1] + size <= peak:
            if max(start_s[q], copy_free) + seconds <= need:
                break
            q -= 1
        while q < p and nodes[q].target is RELOAD:  # anchor on a node that stays put
            q += 1
        for i in range(q, p):
            live[i] += size
        copy_free = max(start_s[q], copy_free) + seconds
        floor = q
        if q < p:
            moved[rel] = q
    return moved


def plan_prefetch(
    gm: fx.GraphModule, graph_profile: GraphProfile, profile: DeviceProfile, *, slack: int = 0
) -> PrefetchPlan:
    """Choose issue points for ``gm``'s reloads (see the module docstring).

    Args:
        gm: a backward graph after ``swap_pass`` (reload right before each wait).
        graph_profile: ``gm``'s exact profile (``profile_graph``), node for node.
        profile: the device's cost model (op and copy times).
        slack: bytes the graph's peak may rise by (what the budget leaves above the plan's
            predicted peak); 0 keeps the peak as it is.

    Raises:
        ValueError: ``slack`` is negative, or ``graph_profile`` is not ``gm``'s.
    """
    if slack < 0:
        raise ValueError(f"plan_prefetch: slack must be >= 0 bytes, got {slack}")
    nodes = list(gm.graph.nodes)
    before = simulate(gm, profile)
    if not any(n.target is WAIT for n in nodes):
        return PrefetchPlan((), before, before)
    if [p.name for p in graph_profile.nodes] != [n.name for n in nodes]:
        raise ValueError("plan_prefetch: the profile does not describe this graph")
    ids = StorageIds()
    start_s, clock = [], 0.0
    for n in nodes:
        start_s.append(clock)
        clock += node_seconds(n, profile, ids)
    live = list(graph_profile.live_curve)
    moved = _positions(nodes, live, graph_profile.peak_bytes + slack, start_s, profile)
    issue = tuple((rel.name, nodes[q].name) for rel, q in moved.items())
    order = [n for n in nodes if n not in moved]
    for rel, q in sorted(moved.items(), key=lambda kv: -kv[1]):
        order.insert(order.index(nodes[q]), rel)
    after = simulate(gm, profile, order=order) if issue else before
    log.debug(
        "prefetch: %d of %d reloads issued early; stall %.3g s -> %.3g s (%s model)",
        len(issue),
        sum(n.target is WAIT for n in nodes),
        before.stall,
        after.stall,
        profile.name,
    )
    return PrefetchPlan(issue, before, after)


def prefetch_pass(gm: fx.GraphModule, ctx: PassContext, *, plan: PrefetchPlan) -> fx.GraphModule:
    """Move each reload named in ``plan`` before its chosen node (in place; returns ``gm``)."""
    if plan.issue_before:
        by_name = {n.name: n for n in gm.graph.nodes}
        for rel_name, before_name in plan.issue_before:
            by_name[before_name].prepend(by_name[rel_name])
        gm.graph.lint()
        gm.recompile()
        log.info(
            "%s: %d reloads issued early, predicted stall %.3g s -> %.3g s",
            ctx.fragment,
            len(plan.issue_before),
            plan.before.stall,
            plan.after.stall,
        )
    return gm
