"""The block transition graph of an observed step or a block trace (networkx), drawn with graphviz.

    from memcompile.viz.fragments import transition_graph, trace_transition_graph
    g = transition_graph(insp)               # networkx.DiGraph
    g.nodes["F0.fw"]["calls"], g.edges["F0.fw", "F0.bw"]["count"], g.edges[...]["p"]
    g = trace_transition_graph(read_trace("moe.jsonl"))   # every step of a trace, forward only
    show_fragments(insp).save("blocks.svg")  # memcompile.viz.show_fragments (either source)

A node is a block, one fragment call kind with one parameter set (``F1.fw#2``: the third expert
that fragment F1's graph ran for); an edge counts how often one block ran right after another in
the step. For a static model it is a chain (``F0.fw -> F0.bw``); for a dynamic one the branching
is what the pilot predicts.

Every edge also carries ``p``, the transition probability ``count / (all transitions out of its
source)``: the observed ``P(next block | this block)``. Drawn on the edges (``p=0.50``, width
growing with ``p``), it shows where the next block is certain (one edge with ``p=1``) and where a
predictor must guess: a last-successor (Markov) predictor is right about as often as the largest
``p`` out of each block, and the pilot's other features (router sizes, position) are what can
do better.

From a trace (``trace_transition_graph``, :mod:`memcompile.dynamic.trace`), a block is named
``F<i>:<owner>``: ``F<i>`` numbers the trace's fragments in first-seen order, ``<owner>`` is the
module that owns the call's parameters (``F2:blocks.0.experts.3``; ``F0:root`` for the root
module). Transitions are counted within steps (the step's last block is not followed by the next
step's first).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import graphviz
import networkx as nx

from memcompile.viz.draw import render
from memcompile.viz.snapshot import Inspection

if TYPE_CHECKING:
    from memcompile.dynamic.trace import StepTrace

log = logging.getLogger(__name__)

__all__ = [
    "block_label",
    "render_trace_transitions",
    "render_transitions",
    "trace_transition_graph",
    "transition_digraph",
    "transition_graph",
    "transition_probabilities",
]

_KIND_COLOURS = {"forward": "#d0ebff", "backward": "#ffe8cc", "inference": "#e9ecef"}


def transition_graph(insp: Inspection) -> nx.DiGraph:
    """Blocks of ``insp.step`` and the transitions between consecutive calls."""
    g = nx.DiGraph()
    previous = None
    for call in insp.step:
        previous = _count_call(
            g, previous, call.label, fragment=call.fragment, kind=call.kind, block=call.block
        )
    return transition_probabilities(g)


def _count_call(g: nx.DiGraph, previous: str | None, label: str, **attrs: Any) -> str:
    """Count a call of block ``label`` (a node, made with ``attrs`` the first time) after
    ``previous`` (an edge); returns ``label``."""
    if label not in g:
        g.add_node(label, calls=0, **attrs)
    g.nodes[label]["calls"] += 1
    if previous is not None:
        if g.has_edge(previous, label):
            g.edges[previous, label]["count"] += 1
        else:
            g.add_edge(previous, label, count=1)
    return label


def transition_probabilities(g: nx.DiGraph) -> nx.DiGraph:
    """Set ``p`` on every edge of ``g``: its count over the counts of all edges out of its
    source. Returns ``g``."""
    for a in g.nodes:
        out = sum(d["count"] for _, _, d in g.out_edges(a, data=True))
        for _, _, d in g.out_edges(a, data=True):
            d["p"] = d["count"] / out
    return g


def block_label(block: str, fragments: dict[str, int]) -> str:
    """``F<i>:<owner>`` for a trace block id ``"<fragment id>/<owner>"``; ``fragments`` numbers
    fragment ids in first-seen order and is extended with new ones."""
    fragment, _, owner = block.partition("/")
    i = fragments.setdefault(fragment, len(fragments))
    return f"F{i}:{owner or 'root'}"


def trace_transition_graph(
    steps: Sequence[StepTrace], phases: Sequence[str] = ("forward", "inference")
) -> nx.DiGraph:
    """Blocks of every step of a trace (calls in ``phases``) and the transitions within steps.

    Raises:
        ValueError: the trace holds no call in ``phases``.
    """
    g = nx.DiGraph()
    fragments: dict[str, int] = {}
    for step in steps:
        previous = None
        for e in step.events:
            if e.phase not in phases:
                continue
            previous = _count_call(
                g,
                previous,
                block_label(e.block, fragments),
                fragment=e.fragment,
                kind=e.phase,
                block=e.block,
            )
    if g.number_of_nodes() == 0:
        raise ValueError(
            f"the trace ({len(steps)} steps) has no block calls in phases {', '.join(phases)}"
        )
    return transition_probabilities(g)


def transition_digraph(
    g: nx.DiGraph, *, title: str = "", probabilities: bool = True
) -> graphviz.Digraph:
    """``g`` (from :func:`transition_graph` or :func:`trace_transition_graph`) as a graphviz
    drawing; edges labelled with ``p`` (and the count when above 1), or the count only."""
    dot = graphviz.Digraph(name="memcompile_blocks")
    dot.attr(rankdir="LR", label=title, labelloc="t")
    dot.attr("node", shape="box", style="filled,rounded", fontname="Helvetica")
    # Node ids are indices: graphviz reads "F2:blocks.0" as node F2, port blocks.0.
    ids = {name: f"b{i}" for i, name in enumerate(g.nodes)}
    for name, data in g.nodes(data=True):  # insertion order: first-seen, deterministic
        calls = data["calls"]
        dot.node(
            ids[name],
            f"{name}\\n{calls} call{'s' if calls != 1 else ''}",
            fillcolor=_KIND_COLOURS.get(data["kind"], "#ffffff"),
            tooltip=name,
        )
    for a, b, data in g.edges(data=True):
        count = data["count"]
        if probabilities and "p" in data:
            p = data["p"]
            label = f"p={p:.2f}" + (f" ({count})" if count > 1 else "")
            dot.edge(ids[a], ids[b], label=label, penwidth=f"{0.5 + 2.5 * p:.2f}", fontsize="9")
        else:
            dot.edge(ids[a], ids[b], label=str(count) if count > 1 else "")
    return dot


def render_transitions(insp: Inspection, fmt: str = "svg", *, probabilities: bool = True) -> bytes:
    """The transition graph of ``insp`` rendered (see :func:`memcompile.viz.draw.render`)."""
    dot = transition_digraph(
        transition_graph(insp), title=f"{insp.target}: blocks", probabilities=probabilities
    )
    return render(dot, fmt)


def render_trace_transitions(
    steps: Sequence[StepTrace], fmt: str = "svg", *, probabilities: bool = True, title: str = ""
) -> bytes:
    """The transition graph of a block trace's forward calls rendered."""
    g = trace_transition_graph(steps)
    title = title or f"blocks of {len(steps)} steps (forward), transition probabilities"
    return render(transition_digraph(g, title=title, probabilities=probabilities), fmt)
