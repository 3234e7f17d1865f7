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
import re
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx

from memcompile.analysis.graph import target_name
from memcompile.records import FragmentIdentity

__all__ = ["fragment_identity"]

_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")
_DTYPES = {
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float64: "f64",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "b8",
}


def _fmt(x: Any, index: dict[fx.Node, int]) -> str:
    if isinstance(x, fx.Node):
        return f"%{index[x]}"
    if isinstance(x, (list, tuple)):
        inner = ", ".join(_fmt(a, index) for a in x)
        return f"[{inner}]" if isinstance(x, list) else f"({inner})"
    if isinstance(x, dict):
        return (
            "{"
            + ", ".join(
                f"{k}: {_fmt(v, index)}" for k, v in sorted(x.items(), key=lambda kv: str(kv[0]))
            )
            + "}"
        )
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return str(x)
    if callable(x) and not isinstance(x, type):
        return target_name(x)
    return _ADDRESS.sub("0x?", repr(x))


def _value_meta(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        dtype = _DTYPES.get(v.dtype, str(v.dtype).removeprefix("torch."))
        shape = ", ".join(str(s) for s in v.shape)
        stride = ", ".join(str(s) for s in v.stride())
        grad = " grad" if v.requires_grad else ""
        return f"{dtype}[{shape}]@{v.device.type} stride=({stride}){grad}"
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return f"{type(v).__name__}({v})"
    return type(v).__name__


def _source_name(node: fx.Node) -> str:
    grapharg = node.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    return source.name if source is not None else node.name


def fragment_identity(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> FragmentIdentity:
    """Structural identity of a Dynamo graph (see the module docstring)."""
    h = hashlib.sha256()
    index: dict[fx.Node, int] = {}
    sources: list[str] = []
    metas: list[str] = []
    placeholders = 0
    for i, n in enumerate(gm.graph.nodes):
        index[n] = i
        parts = [n.op, target_name(n.target), _fmt(n.args, index), _fmt(n.kwargs, index)]
        if n.op == "placeholder":
            val = n.meta.get("example_value", n.meta.get("val"))
            if val is None and placeholders < len(example_inputs):
                val = example_inputs[placeholders]
            placeholders += 1
            meta, src = _value_meta(val), _source_name(n)
            sources.append(src)
            metas.append(meta)
            parts += [meta, src]
        h.update("\x1f".join(parts).encode())
        h.update(b"\x1e")
    return FragmentIdentity(h.hexdigest()[:16], tuple(sources), tuple(metas))
