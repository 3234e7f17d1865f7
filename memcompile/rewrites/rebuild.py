"""Pieces shared by the passes that copy a joint graph node by node with some nodes replaced
(``dropout.py``, ``losshead.py``, ``inplace.py``):

    new = fx.Graph(); env = {}
    for n in gm.graph.nodes: ... env[n] = new.node_copy(n, ...) or a replacement
        refresh_view(env[n], n, fake_mode)      # a view of a replaced value: its fake value anew
    return rebuilt_module(gm, new, "memcompile_<pass>", records)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import fx
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.multiprocessing.reductions import StorageWeakRef

from memcompile.analysis.graph import tensor_vals

__all__ = ["alias_nodes", "rebuilt_module", "refresh_view", "storage_refs"]


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
