"""The stable identity of a fragment Dynamo hands the backend.

A *fragment* is one ``fx.GraphModule`` given to the backend. Its identity must not depend on the
order in which frames were first seen (Dynamo's ``compile_id`` does), so :func:`fragment_identity`
hashes the graph's structure, the inputs' metadata and the parameter sources:

    for node in graph:  hash(op, qualified target, args with nodes as indices)
    for placeholder:    + shape / stride / dtype / device / requires_grad + Dynamo source name

Sizes that are symbolic print as their symbols (``s77``), which are stable for a given program.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from torch import fx

from memcompile.analysis.graph import format_arg, target_name, value_meta
from memcompile.records import FragmentIdentity

__all__ = ["fragment_identity"]


def _source_name(node: fx.Node) -> str:
    grapharg = node.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    return source.name if source is not None else node.name


def fragment_identity(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> FragmentIdentity:
    """Structural identity of a Dynamo graph (see the module docstring)."""
    h = hashlib.sha256()
    index: dict[fx.Node, int] = {}

    def at(node: fx.Node) -> str:
        return f"%{index[node]}"

    sources: list[str] = []
    metas: list[str] = []
    placeholders = 0
    for i, n in enumerate(gm.graph.nodes):
        index[n] = i
        parts = [
            n.op,
            target_name(n.target),
            format_arg(n.args, at),
            format_arg(n.kwargs, at),
        ]
        if n.op == "placeholder":
            val = n.meta.get("example_value", n.meta.get("val"))
            if val is None and placeholders < len(example_inputs):
                val = example_inputs[placeholders]
            placeholders += 1
            meta, src = value_meta(val), _source_name(n)
            sources.append(src)
            metas.append(meta)
            parts += [meta, src]
        h.update("\x1f".join(parts).encode())
        h.update(b"\x1e")
    return FragmentIdentity(h.hexdigest()[:16], tuple(sources), tuple(metas))
