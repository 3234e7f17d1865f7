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
    prefetch   a reload the plan issues early (``FragmentPlan.prefetch``), so its copy overlaps
    host_parameter  a parameter kept in the host tier (``FragmentPlan.host_params``), and the
               fetches that copy it to the device before each reader (``passes/params.py``)
    input      a graph input (parameters, buffers, the batch, incoming gradients)

The node where the fragment's step peak falls has a thick red border and ``PEAK`` in its label.
"""

from __future__ import annotations

import logging
from typing import Literal

import graphviz

from memcompile.errors import format_bytes
from memcompile.passes.params import FETCH_PREFIX
from memcompile.passes.plan import FragmentPlan
from memcompile.viz.snapshot import FragmentView, GraphView, Inspection, NodeView

log = logging.getLogger(__name__)

__all__ = ["ROLE_COLOURS", "DrawError", "Role", "node_roles", "plan_digraph", "render"]

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


def _add_graph(
    cluster: graphviz.Digraph,
    edges: list[tuple[str, str]],
    fragment: FragmentView,
    graph: GraphView,
    roles: dict[tuple[str, str], Role],
    forward_ids: dict[str, str],
) -> None:
    ids: dict[str, str] = {}
    for n in graph.nodes:
        if n.op == "output":
            continue
        if graph.kind == "backward" and n.op == "placeholder" and n.name in forward_ids:
            # A saved forward value: drawn once, so the saved set is the edges between the two
            # graphs. (Parameters the backward reads are drawn again inside it: edges from the
            # forward's inputs would cross the whole drawing.)
            ids[n.name] = forward_ids[n.name]
            continue
        node_id = f"{fragment.name}/{graph.kind}/{n.name}"
        ids[n.name] = node_id
        peak = graph.kind == fragment.peak_graph and n.name == fragment.peak_node
        role = roles[(graph.kind, n.name)]
        attrs = {"fillcolor": ROLE_COLOURS[role], "tooltip": f"{n.target} ({role})"}
        if n.op == "placeholder":
            attrs["shape"] = "ellipse"
        if peak:
            attrs.update(color="#e03131", penwidth="3", fontcolor="#c92a2a")
        # The peak label is absolute device bytes, as the budget and the timeline are.
        held = fragment.held_output_bytes if graph.kind == "backward" else 0
        absolute = fragment.base_bytes + held + n.live_bytes
        cluster.node(node_id, _label(n, absolute if peak else None), **attrs)
    for n in graph.nodes:
        if n.name in ids:
            edges.extend((ids[a], ids[n.name]) for a in n.inputs if a in ids)
    if graph.kind == "forward":
        forward_ids.update(
            (n.name, ids[n.name]) for n in graph.nodes if n.op != "placeholder" and n.name in ids
        )


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


def plan_digraph(insp: Inspection, *, legend: bool = True) -> graphviz.Digraph:
    """The drawing of every fragment of ``insp`` (see the module docstring)."""
    budget = "no budget" if insp.budget is None else f"budget {format_bytes(insp.budget)}"
    peak = "-" if insp.predicted_peak is None else format_bytes(insp.predicted_peak)
    dot = graphviz.Digraph(name="memcompile_plan")
    dot.attr(
        label=f"{insp.target}: {budget}, predicted step peak {peak}", labelloc="t", fontsize="18"
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
                    _add_graph(gc, edges, frag, graph, roles, forward_ids)
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
