"""Pieces shared by the passes that copy a joint graph node by node with some nodes replaced
(``dropout.py``, ``losshead.py``, ``inplace.py``, row tiling, ...):

    new = fx.Graph(); env = {}
    for n in gm.graph.nodes: ... env[n] = copy_node(new, n, ...) or a replacement
        refresh_view(env[n], n, fake_mode)      # a view of a replaced value: its fake value anew
    return rebuilt_module(gm, new, "memcompile_<pass>", records)

:func:`copy_node` is ``fx.Graph.node_copy`` without torch 2.13's check of every node's
arguments for raw symbolic values (a pytree walk, ~60 % of ``create_node``'s time under
cProfile): a search copies its graphs node by node many times over (hand-written-attention GPT
(tiny) under an infeasible budget: 130,000 nodes made; its first step 4 % faster without the
walk, side by side).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

from torch import fx
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.multiprocessing.reductions import StorageWeakRef

from memcompile.analysis.graph import tensor_vals

__all__ = [
    "alias_nodes",
    "copy_graph",
    "copy_node",
    "make_node",
    "rebuilt_module",
    "refresh_view",
    "storage_refs",
]


def copy_node(graph: fx.Graph, node: fx.Node, arg_transform: Callable[[fx.Node], Any]) -> fx.Node:
    """``graph.node_copy(node, arg_transform)``: the node made bare, then given its arguments
    (the same ``Node._update_args_kwargs`` its constructor runs), so that ``create_node`` does
    not walk them for raw symbolic values (memcompile's graphs are AOT's and its own copies,
    whose symbolic sizes are nodes); ``meta`` shallow-copied, as ``node_copy`` does."""
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), arg_transform)
    made = make_node(graph, node.op, node.target, args, kwargs, node.name, node.type)
    made.meta = copy.copy(node.meta)
    return made


def make_node(
    graph: fx.Graph,
    op: str,
    target: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    name: str | None = None,
    type_expr: Any = None,
) -> fx.Node:
    """``graph.create_node(op, target, args, kwargs, name, type_expr)`` without the walk of its
    arguments for raw symbolic values (see :func:`copy_node`)."""
    made = graph.create_node(op, target, (), {}, name, type_expr)
    if args or kwargs:
        made.args = args
        made.kwargs = kwargs
    return made


def copy_graph(graph: fx.Graph) -> fx.Graph:
    """A copy of ``graph`` as ``copy.deepcopy`` makes it (nodes by :func:`copy_node`, each
    sharing its original's ``meta`` values; the output node's type and ``meta``; the code
    generator deep-copied), names registered afresh."""
    new = fx.Graph(tracer_cls=graph._tracer_cls)
    env: dict[fx.Node, fx.Node] = {}
    for n in graph.nodes:
        if n.op == "output":
            out = new.output(fx.node.map_arg(n.args[0], env.__getitem__), type_expr=n.type)
            out.meta = copy.copy(n.meta)
            continue
        env[n] = copy_node(new, n, env.__getitem__)
    new._codegen = copy.deepcopy(graph._codegen)
    return new


def storage_refs(val: object) -> set[StorageWeakRef]:
    """The storages of the tensors in a node's ``meta['val']``."""
    return {StorageWeakRef(t.untyped_storage()) for t in tensor_vals(val)}


def alias_nodes(gm: fx.GraphModule, node: fx.Node) -> list[fx.Node]:
    """The nodes of ``gm`` whose values share a storage with ``node``'s (``node`` included)."""
    mine = storage_refs(node.meta.get("val"))
    return [n for n in gm.graph.nodes if mine & storage_refs(n.meta.get("val"))]


def refresh_view(copy: fx.Node, original: fx.Node, fake_mode: Any) -> None:
    """``copy`` (of ``original``) reads a replaced value: run its op again on the new fake
    values, so its ``meta['val']`` views the replacement's storage (for the analysis)."""
    args, kwargs = fx.node.map_arg((copy.args, copy.kwargs), lambda a: a.meta["val"])
    with fake_mode:
        copy.meta["val"] = original.target(*args, **kwargs)  # type: ignore[operator]


def rebuilt_module(
    gm: fx.GraphModule, new: fx.Graph, key: str, records: Sequence[object]
) -> fx.GraphModule:
    """The module of ``new`` (``gm``'s attributes and meta), with the pass's ``records`` as a
    tuple in ``meta[key]``; linted. Its Python code is generated when something first runs or
    reads it (torch's ``_LazyGraphModule``, as Inductor's passes use): most rewrites a search
    makes are only profiled, then dropped (gpt_manual small under an infeasible budget:
    generating their code was 12 % of the first step)."""
    out = _LazyGraphModule(gm, new)
    out.meta = dict(getattr(gm, "meta", {}))
    out.meta[key] = tuple(records)
    out.graph.lint()
    return out
