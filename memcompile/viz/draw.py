"""Graphviz drawings of planned fragments: every node coloured by what the plan does with it.

    from memcompile.viz.draw import plan_digraph, render
    dot = plan_digraph(insp)                 # a graphviz.Digraph (source: dot.source)
    svg = render(dot, "svg")                 # bytes; needs graphviz's `dot` program
    show_plan(insp).save("plan.svg")         # memcompile.viz.show_plan: inline in notebooks

Each fragment is a cluster holding its forward and backward graphs (as built, after the plan).
A backward input that is a saved forward value is drawn as that forward node, so the saved
tensors are the edges between the two. Colours (:data:`ROLE_COLOURS`):

    keep       a saved tensor the plan keeps on the device
    recompute  a saved tensor the plan recomputes, and the backward's copies that recompute it
    swap       a tensor swapped to the host or disk tier, and the offload/reload/wait nodes
    prefetch   a reload the plan issues early (``FragmentPlan.prefetch``), so its copy overlaps,
               and the pilot's in-graph prediction and prefetch (``memcompile::pilot_prefetch``)
    host_parameter  a parameter kept in the host tier (``FragmentPlan.host_params``), and the
               fetches that copy it to the device before each reader (``rewrites/params.py``)
    input      a graph input (parameters, buffers, the batch, incoming gradients)

The node where the fragment's step peak falls has a thick red border and ``PEAK`` in its label.

**Compact mode** (``plan_digraph(insp, compact=True)``; automatic above :data:`COMPACT_ABOVE`
nodes, ``memcompile draw --compact/--full``): a drawing of a few hundred nodes takes graphviz
seconds and is read by zooming. Compact mode draws each graph's schedule as runs instead of nodes:
a run is a maximal stretch of consecutive nodes (schedule order) whose decided nodes all share one
role (plain ops join the run they are in; a run of plain ops only is white). A run of one node is
drawn as that node; a longer one is one box, coloured by its role, labelled with its length,
its first and last node, the decided tensors it holds (``3 keep: mm, gelu, addmm``) and the bytes
it allocates. The run holding the peak node is marked as the peak node would be, and its label
names the node (``PEAK 1.4 MiB at mm_4``). Edges join runs (duplicates merged).
"""

from __future__ import annotations

import logging
from typing import Literal

import graphviz

from memcompile.errors import format_bytes
from memcompile.planning.plan import FragmentPlan
from memcompile.rewrites.params import FETCH_PREFIX
from memcompile.viz.snapshot import FragmentView, GraphView, Inspection, NodeView

log = logging.getLogger(__name__)

__all__ = [
    "COMPACT_ABOVE",
    "ROLE_COLOURS",
    "DrawError",
    "Role",
    "node_count",
    "node_roles",
    "plan_digraph",
    "render",
    "runs",
]

#: ``plan_digraph(compact=None)`` draws compactly above this many graph nodes in all.
COMPACT_ABOVE = 150

Role = Literal["keep", "recompute", "swap", "prefetch", "host_parameter", "input", "op"]

#: Fill colour of each role (the legend shows them in this order).
ROLE_COLOURS: dict[str, str] = {
    "keep": "#b2f2bb",
    "recompute": "#ffd8a8",
    "swap": "#a5d8ff",
    "prefetch": "#d0bfff",
    "host_parameter": "#ffc9c9",
    "input": "#e9ecef",
    "op": "#ffffff",
}

_SWAP_OPS = ("memcompile.offload.default", "memcompile.reload.default", "memcompile.wait.default")
_RELOAD = "memcompile.reload.default"
_PILOT = "memcompile.pilot_prefetch.default"


class DrawError(RuntimeError):
    """Rendering failed (e.g. graphviz's ``dot`` program is missing); one-line message."""


def node_roles(fragment: FragmentView, plan: FragmentPlan | None) -> dict[tuple[str, str], Role]:
    """``(graph kind, node name) -> role`` for every node of the fragment's built graphs."""
    actions = {d.tensor: d.action for d in plan.decisions} if plan is not None else {}
    prefetched = {reload for reload, _ in plan.prefetch} if plan is not None else set()
    hosted = set(plan.host_params) if plan is not None else set()
    forward_ops = {
        n.name
        for n in (fragment.forward.nodes if fragment.forward else ())
        if n.op != "placeholder"
    }
    roles: dict[tuple[str, str], Role] = {}
    for graph in (fragment.forward, fragment.backward):
        if graph is None:
            continue
        for n in graph.nodes:
            role: Role = "op"
            if n.op == "placeholder":
                role = "host_parameter" if n.name in hosted else "input"
            elif n.name.startswith(FETCH_PREFIX) and n.target == _RELOAD:
                role = "host_parameter"
            elif n.target == _PILOT:
                role = "prefetch"
            elif n.target in _SWAP_OPS:
                role = "prefetch" if n.target == _RELOAD and n.name in prefetched else "swap"
            elif graph.kind != "backward" and n.name in actions:
                action = actions[n.name]
                role = (
                    "keep" if action == "keep" else "recompute" if action == "recompute" else "swap"
                )
            elif graph.kind == "backward" and n.name in forward_ops:
                role = "recompute"  # a forward node copied into the backward
            roles[(graph.kind, n.name)] = role
    return roles


def _label(n: NodeView, peak: int | None) -> str:
    op = n.target.rsplit(".", 2)[-2] if n.op == "call_function" and "." in n.target else n.op
    # "mm_3\nmm" says nothing twice: show the op only when the name does not start with it
    short = n.name.lstrip("_").startswith(op.lstrip("_")) or n.op == "placeholder"
    text = n.name if short else f"{n.name}\\n{op}"
    if n.new_bytes:
        text += f"\\n{format_bytes(n.new_bytes)}"
    return f"PEAK {format_bytes(peak)}\\n{text}" if peak is not None else text


def runs(graph: GraphView, roles: dict[tuple[str, str], Role]) -> list[list[NodeView]]:
    """``graph``'s nodes (``output`` left out) cut into the runs of compact mode: consecutive
    nodes whose roles other than ``"op"`` are all the same (see the module docstring)."""
    out: list[list[NodeView]] = []
    current: list[NodeView] = []
    current_role: Role | None = None
    for n in graph.nodes:
        if n.op == "output":
            continue
        role = roles[(graph.kind, n.name)]
        if role != "op" and current_role is not None and role != current_role:
            out.append(current)
            current, current_role = [], None
        current.append(n)
        if role != "op":
            current_role = role
    if current:
        out.append(current)
    return out


def _run_label(
    run: list[NodeView], graph: GraphView, roles: dict[tuple[str, str], Role], peak: str | None
) -> str:
    decided = [n.name for n in run if roles[(graph.kind, n.name)] != "op"]
    placeholders = sum(1 for n in run if n.op == "placeholder")
    what = "inputs" if placeholders == len(run) else "nodes"
    lines = [f"{len(run)} {what}: {run[0].name} … {run[-1].name}"]
    if decided and what == "nodes":
        role = roles[(graph.kind, decided[0])].replace("_", " ")
        names = ", ".join(decided[:3]) + (", …" if len(decided) > 3 else "")
        lines.append(f"{len(decided)} {role}: {names}")
    new = sum(n.new_bytes for n in run)
    if new:
        lines.append(f"allocates {format_bytes(new)}")
    if peak is not None:
        lines.insert(0, peak)
    return "\\n".join(lines)


def _add_graph(
    cluster: graphviz.Digraph,
    edges: list[tuple[str, str]],
    fragment: FragmentView,
    graph: GraphView,
    roles: dict[tuple[str, str], Role],
    forward_ids: dict[str, str],
    *,
    compact: bool = False,
) -> None:
    ids: dict[str, str] = {}
    groups = runs(graph, roles) if compact else [[n] for n in graph.nodes if n.op != "output"]
    held = fragment.held_output_bytes if graph.kind == "backward" else 0
    for group in groups:
        drawn = [
            n
            for n in group
            if not (graph.kind == "backward" and n.op == "placeholder" and n.name in forward_ids)
        ]
        drawn_names = {n.name for n in drawn}
        for n in group:
            if n.name not in drawn_names:
                # A saved forward value: drawn once, so the saved set is the edges between the
                # two graphs. (Parameters the backward reads are drawn again inside it: edges from
                # the forward's inputs would cross the whole drawing.)
                ids[n.name] = forward_ids[n.name]
        if not drawn:
            continue
        first = drawn[0]
        node_id = f"{fragment.name}/{graph.kind}/{first.name}"
        for n in drawn:
            ids[n.name] = node_id
        peak_node = next(
            (
                n
                for n in drawn
                if graph.kind == fragment.peak_graph and n.name == fragment.peak_node
            ),
            None,
        )
        role: Role = next(
            (roles[(graph.kind, n.name)] for n in drawn if roles[(graph.kind, n.name)] != "op"),
            "op",
        )
        names = ", ".join(n.name for n in drawn)
        attrs = {"fillcolor": ROLE_COLOURS[role], "tooltip": f"{first.target} ({role})"}
        if all(n.op == "placeholder" for n in drawn):
            attrs["shape"] = "ellipse"
        # The peak label is absolute device bytes, as the budget and the timeline are.
        absolute = None if peak_node is None else fragment.base_bytes + held + peak_node.live_bytes
        if peak_node is not None:
            attrs.update(color="#e03131", penwidth="3", fontcolor="#c92a2a")
        if len(drawn) == 1:
            label = _label(first, absolute)
        else:
            attrs["tooltip"] = f"{role}: {names}"
            peak = (
                None
                if peak_node is None or absolute is None
                else f"PEAK {format_bytes(absolute)} at {peak_node.name}"
            )
            label = _run_label(drawn, graph, roles, peak)
            attrs["style"] = "filled,bold"
        cluster.node(node_id, label, **attrs)
    seen: set[tuple[str, str]] = set()
    for n in graph.nodes:
        if n.name not in ids:
            continue
        for a in n.inputs:
            if a in ids:
                edge = (ids[a], ids[n.name])
                if edge[0] != edge[1] and edge not in seen:
                    seen.add(edge)
                    edges.append(edge)
    if graph.kind == "forward":
        forward_ids.update(
            (n.name, ids[n.name]) for n in graph.nodes if n.op != "placeholder" and n.name in ids
        )


def node_count(insp: Inspection) -> int:
    """Nodes of every built graph of ``insp`` (what a full drawing draws, give or take)."""
    return sum(len(g.nodes) for f in insp.fragments for g in (f.forward, f.backward) if g)


def _legend(dot: graphviz.Digraph) -> None:
    with dot.subgraph(name="cluster_legend") as legend:
        legend.attr(label="legend", style="rounded", color="#adb5bd")
        previous = None
        for role, colour in ROLE_COLOURS.items():
            node_id = f"legend/{role}"
            legend.node(node_id, role.replace("_", " "), fillcolor=colour)
            if previous is not None:
                legend.edge(previous, node_id, style="invis")
            previous = node_id
        legend.node("legend/peak", "PEAK", color="#e03131", penwidth="3", fillcolor="#ffffff")
        legend.edge(previous or "legend/peak", "legend/peak", style="invis")


def plan_digraph(
    insp: Inspection, *, legend: bool = True, compact: bool | None = None
) -> graphviz.Digraph:
    """The drawing of every fragment of ``insp`` (see the module docstring).

    Args:
        compact: draw runs of nodes instead of nodes; ``None``: when ``insp`` has more than
            :data:`COMPACT_ABOVE` nodes.
    """
    if compact is None:
        compact = node_count(insp) > COMPACT_ABOVE
    log.info("drawing %s: %d nodes, compact=%s", insp.target, node_count(insp), compact)
    budget = "no budget" if insp.budget is None else f"budget {format_bytes(insp.budget)}"
    peak = "-" if insp.predicted_peak is None else format_bytes(insp.predicted_peak)
    dot = graphviz.Digraph(name="memcompile_plan")
    mode = " (compact: runs of nodes)" if compact else ""
    dot.attr(
        label=f"{insp.target}: {budget}, predicted step peak {peak}{mode}",
        labelloc="t",
        fontsize="18",
    )
    dot.attr("node", shape="box", style="filled", fontname="Helvetica", fontsize="10")
    dot.attr("edge", color="#868e96", arrowsize="0.5")
    edges: list[tuple[str, str]] = []
    for frag in insp.fragments:
        plan = insp.plan_of(frag)
        roles = node_roles(frag, plan)
        title = f"{frag.name} {frag.id} {frag.short_code}"
        if plan is not None:
            title += (
                f"\\nrecompute {len(plan.recomputed)}, swap {len(plan.swapped)} of "
                f"{len(plan.decisions)} saved; plan peak {format_bytes(plan.predicted_peak)}"
            )
        with dot.subgraph(name=f"cluster_{frag.name}") as fc:
            fc.attr(label=title, style="rounded", color="#495057")
            forward_ids: dict[str, str] = {}
            for graph in (frag.forward, frag.backward):
                if graph is None:
                    continue
                with fc.subgraph(name=f"cluster_{frag.name}_{graph.kind}") as gc:
                    gc.attr(label=graph.kind, style="dashed", color="#adb5bd")
                    _add_graph(gc, edges, frag, graph, roles, forward_ids, compact=compact)
    for a, b in edges:
        dot.edge(a, b)
    if legend:
        _legend(dot)
    return dot


def render(dot: graphviz.Digraph, fmt: str = "svg") -> bytes:
    """``dot`` rendered by graphviz (``fmt``: svg, png, pdf; ``"dot"`` gives the source).

    Raises:
        DrawError: graphviz's ``dot`` program is missing or failed.
    """
    if fmt == "dot":
        return dot.source.encode()
    try:
        return dot.pipe(format=fmt)
    except graphviz.ExecutableNotFound:
        raise DrawError(
            "graphviz's `dot` program is not installed (Debian/Ubuntu: apt-get install graphviz)"
        ) from None
    except (graphviz.CalledProcessError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DrawError(f"graphviz could not render {fmt}: {first}") from None
