"""Apply a recompute plan: build the forward and backward graphs, then order the backward.

    joint ──partition_pass(saved=keep tensors)──► forward, backward (recomputes the rest)
    backward ──reorder_pass(order=plan.backward_order)──► backward in the planned order

``partition_pass`` uses torch's own extraction (``_extract_fwd_bwd_modules``, what the default
and min-cut partitioners call), so every AOTAutograd convention (output order, saved SymInts,
tangents) is torch's; memcompile only chooses the saved set. ``reorder_pass`` replays the order
the planner priced, so the graph that runs is the one that was evaluated.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from torch import fx
from torch._functorch import partitioners as P
from torch.fx._lazy_graph_module import _LazyGraphModule

from memcompile.analysis.joint_model import JointModel
from memcompile.planning.plan import FragmentPlan
from memcompile.rewrites.context import PassContext
from memcompile.rewrites.rebuild import copy_node

log = logging.getLogger(__name__)

__all__ = ["partition_pass", "reorder_pass"]


def _has_side_effect(node: fx.Node) -> bool:
    return not P.is_not_collective(node) or node.is_impure(impure_random=False)


def reorder_pass(gm: fx.GraphModule, ctx: PassContext, *, order: Sequence[str]) -> fx.GraphModule:
    """Put ``gm``'s nodes in ``order`` (node names; placeholders stay first, output last).

    Raises:
        ValueError: ``order`` is not a topological order of ``gm``'s non-placeholder nodes.
    """
    nodes = {n.name: n for n in gm.graph.nodes}
    body = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    if sorted(order) != sorted(n.name for n in body):
        missing = {n.name for n in body} ^ set(order)
        raise ValueError(
            f"{ctx.fragment}: order does not match the graph's nodes: {sorted(missing)[:5]}"
        )
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.find_nodes(op="placeholder"):
        env[n] = copy_node(new, n, lambda x: env[x])
    for name in order:
        n = nodes[name]
        missing_inputs = [a.name for a in n.all_input_nodes if a not in env]
        if missing_inputs:
            raise ValueError(
                f"{ctx.fragment}: {name} is ordered before its inputs {missing_inputs}"
            )
        env[n] = copy_node(new, n, lambda x: env[x])
    for n in gm.graph.find_nodes(op="output"):
        env[n] = copy_node(new, n, lambda x: env[x])
    out = _LazyGraphModule(gm, new)  # (its code generated when first run or read)
    out.graph.lint()
    return out


def _complete_order(gm: fx.GraphModule, planned: Sequence[str]) -> list[str]:
    """``planned`` restricted to ``gm``'s nodes, plus the nodes the plan does not name.

    Extraction adds nodes the joint model never priced (e.g. ``copy_`` epilogues writing
    BatchNorm's running stats back into buffers). Each goes in as soon as its inputs are
    placed and every node before it in ``gm`` is placed, so side effects keep their order.
    """
    body = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    names = {n.name for n in body}
    listed = [p for p in planned if p in names]
    listed_set = set(listed)
    done = {n for n in gm.graph.nodes if n.op == "placeholder"}
    pos = {n: i for i, n in enumerate(body)}
    by_name = {n.name: n for n in body}
    pending = [n for n in body if n.name not in listed_set]
    out: list[str] = []
    prefix = 0  # body[:prefix] are all placed

    def place(n: fx.Node) -> None:
        nonlocal prefix
        done.add(n)
        out.append(n.name)
        while prefix < len(body) and body[prefix] in done:
            prefix += 1

    def flush() -> None:
        while pending:
            n = pending[0]  # in graph order: a later one never goes before an earlier one
            if pos[n] > prefix or not all(a in done for a in n.all_input_nodes):
                return
            pending.pop(0)
            place(n)

    flush()
    for name in listed:
        place(by_name[name])
        flush()
    out.extend(n.name for n in pending)  # only for a non-topological plan: reorder_pass names it
    return out


def partition_pass(
    joint: fx.GraphModule, ctx: PassContext, *, model: JointModel, plan: FragmentPlan
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Forward and backward graphs of ``joint`` saving the plan's kept and swapped tensors.

    (A partition returns two graphs, so this pass breaks the one-graph rule on purpose.)
    """
    # Swapped tensors are saved too: they spend the time in between on another tier.
    keep = {model.storage_named(d.tensor) for d in plan.decisions if d.action != "recompute"}
    tensors, syms = model.saved_nodes(keep)
    fw, bw = P._extract_fwd_bwd_modules(
        joint,
        tensors,
        saved_sym_nodes=syms,
        num_fwd_outputs=model.num_fwd_outputs,
        static_lifetime_input_nodes=model.node_info.static_lifetime_input_nodes,
    )
    # Dead nodes go, random ones included: torch's extraction keeps unused random ops when
    # random ops count as impure (outside a TracingContext), and one in the backward would both
    # waste memory and draw from the user's random stream. Side effects and collectives stay.
    for gm in (fw, bw):
        gm.graph.eliminate_dead_code(is_impure_node=_has_side_effect)
    fw = P.raise_getitems(fw)
    if plan.forward_order:
        fw = reorder_pass(fw, ctx, order=_complete_order(fw, plan.forward_order))
    in_bw = {x.name for x in bw.graph.nodes}
    bw = reorder_pass(bw, ctx, order=[n for n in plan.backward_order if n in in_bw])
    for gm in (fw, bw):
        gm.graph.lint()
        gm.recompile()
    log.debug(
        "%s: saved %d tensors, recomputing %d; backward %d nodes",
        ctx.fragment,
        len(tensors),
        len(plan.recomputed),
        len(bw.graph.nodes),
    )
    return fw, bw
