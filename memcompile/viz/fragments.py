"""The block transition graph of an observed step (networkx), drawn with graphviz.

    from memcompile.viz.fragments import transition_graph
    g = transition_graph(insp)               # networkx.DiGraph
    g.nodes["F0.fw"]["calls"], g.edges["F0.fw", "F0.bw"]["count"]
    show_fragments(insp).save("blocks.svg")  # memcompile.viz.show_fragments

A node is a block, one fragment call kind with one parameter set (``F1.fw#2``: the third expert
that fragment F1's graph ran for); an edge counts how often one block ran right after another in
the step. For a static model it is a chain (``F0.fw -> F0.bw``); for a dynamic one the branching
is what the pilot predicts.
"""

from __future__ import annotations

import logging

import graphviz
import networkx as nx

from memcompile.viz.draw import render
from memcompile.viz.snapshot import Inspection

log = logging.getLogger(__name__)

__all__ = ["transition_digraph", "transition_graph"]

_KIND_COLOURS = {"forward": "#d0ebff", "backward": "#ffe8cc", "inference": "#e9ecef"}


def transition_graph(insp: Inspection) -> nx.DiGraph:
    """Blocks of ``insp.step`` and the transitions between consecutive calls."""
    g = nx.DiGraph()
    previous = None
    for call in insp.step:
        label = call.label
        if label not in g:
            g.add_node(label, fragment=call.fragment, kind=call.kind, block=call.block, calls=0)
        g.nodes[label]["calls"] += 1
        if previous is not None:
            if g.has_edge(previous, label):
                g.edges[previous, label]["count"] += 1
            else:
                g.add_edge(previous, label, count=1)
        previous = label
    return g


def transition_digraph(g: nx.DiGraph, *, title: str = "") -> graphviz.Digraph:
    """``g`` (from :func:`transition_graph`) as a graphviz drawing."""
    dot = graphviz.Digraph(name="memcompile_blocks")
    dot.attr(rankdir="LR", label=title, labelloc="t")
    dot.attr("node", shape="box", style="filled,rounded", fontname="Helvetica")
    for name, data in g.nodes(data=True):  # insertion order: first-seen, deterministic
        calls = data["calls"]
        dot.node(
            name,
            f"{name}\\n{calls} call{'s' if calls != 1 else ''}",
            fillcolor=_KIND_COLOURS.get(data["kind"], "#ffffff"),
        )
    for a, b, data in g.edges(data=True):
        dot.edge(a, b, label=str(data["count"]) if data["count"] > 1 else "")
    return dot


def render_transitions(insp: Inspection, fmt: str = "svg") -> bytes:
    """The transition graph of ``insp`` rendered (see :func:`memcompile.viz.draw.render`)."""
    return render(transition_digraph(transition_graph(insp), title=f"{insp.target}: blocks"), fmt)
