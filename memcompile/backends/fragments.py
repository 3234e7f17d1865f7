"""What memcompile remembers about each fragment Dynamo hands it.

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from memcompile.passes.analysis import target_name
from memcompile.passes.fragment import FragmentProfile
from memcompile.passes.plan import FragmentPlan

__all__ = [
    "FragmentIdentity",
    "FragmentRecord",
    "FragmentStats",
    "fragment_identity",
    "parameter_name",
]

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


@dataclass
class FragmentStats:
    """Runtime counters of one fragment (the only mutable part of a record)."""

    forward_calls: int = 0
    backward_calls: int = 0
    inference_calls: int = 0


@dataclass(frozen=True)
class FragmentIdentity:
    """Stable identity of a fragment.

    Attributes:
        id: 16 hex digits of the structural hash (graph + input metadata + sources).
        sources: Dynamo source of each input, e.g. ``L['self'].blocks[0].qkv.weight``.
        input_meta: one line per input: ``f32[8, 256]@cpu stride=(256, 1) grad``.
    """

    id: str
    sources: tuple[str, ...]
    input_meta: tuple[str, ...]


@dataclass(frozen=True)
class FragmentRecord:
    """One fragment: identity, where and why Dynamo cut it, its profile and call counts.

    Attributes:
        index: order in which this backend compiled it (``name`` is ``F{index}``); display only.
        identity: the stable :class:`FragmentIdentity`.
        code: the compiled frame, ``function (file:line)``.
        reason: why Dynamo ended the fragment (``return_value``, ``generic_jump …``, …).
        break_at: where that happened, ``function (file:line)``.
        compile_id: Dynamo's compile id (``frame/recompile``), for cross-referencing logs only.
        static_inputs: positions of parameters and buffers among the inputs.
        static_storages: ``(data_ptr, nbytes)`` of their storages at compile time, to count shared
            parameters once across fragments (no reference is kept).
        profile: forward/backward profile; ``None`` for a graph with no operations.
        plan: the memory plan applied (with a budget), else ``None``.
        inner: the inner compiler that runs the graphs.
        stats: call counters.
        blocks: parameter storages (address -> bytes) per block key seen at run time (one compiled
            graph serves many parameter sets, e.g. experts).
        block_inputs: per block key, the storage address of each parameter or buffer input (by
            position): which gradients the calls of different fragments share.
        profile_at: for a graph with dynamic sizes, its profile at one call's size-symbol values
            (``None`` when its sizes are static).
        summed_inputs: positions of the inputs whose several gradient contributions its
            backward graph sums: parameters read several times (not split), inputs an op
            reads through several autograd edges.
        hostable: addresses among ``static_storages`` of the parameters the host tier may take
            (``MemCompiler.may_host``): what a step that puts parameters on the host frees.
    """

    index: int
    identity: FragmentIdentity
    code: str
    reason: str
    break_at: str
    compile_id: str
    static_inputs: tuple[int, ...]
    static_storages: tuple[tuple[int, int], ...]
    profile: FragmentProfile | None
    plan: FragmentPlan | None
    inner: str
    stats: FragmentStats = field(default_factory=FragmentStats, compare=False)
    blocks: dict[int, dict[int, int]] = field(default_factory=dict, compare=False)
    block_inputs: dict[int, dict[int, int]] = field(default_factory=dict, compare=False)
    #: The profile at a call's size key (graphs compiled for dynamic sizes), else ``None``.
    profile_at: Callable[[tuple[int, ...]], FragmentProfile | None] | None = field(
        default=None, compare=False, repr=False
    )
    #: Positions of inputs whose several contributions its backward graph sums
    #: (``InputSplit.summed``, passes/input_uses.py).
    summed_inputs: tuple[int, ...] = ()
    hostable: frozenset[int] = frozenset()

    @property
    def name(self) -> str:
        return f"F{self.index}"

    @property
    def id(self) -> str:
        return self.identity.id


class RecordIndex:
    """Fragment records by index, looked up in ``records()`` again only for an index not seen
    yet (a fragment compiled since): per-call lookups on the hot path stay a dict access."""

    def __init__(self, records: Callable[[], Sequence[FragmentRecord]]) -> None:
        self._records = records
        self._by_index: dict[int, FragmentRecord] = {}

    def __call__(self, index: int) -> FragmentRecord | None:
        record = self._by_index.get(index)
        if record is None:
            self._by_index = {r.index: r for r in self._records()}
            record = self._by_index.get(index)
        return record

    def clear(self) -> None:
        self._by_index.clear()


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


def parameter_name(source: str) -> str:
    """A Dynamo source as the module's parameter name where it is one:
    ``L['self']._modules['w_hh']._parameters['weight']`` -> ``w_hh.weight``."""
    name = re.sub(r"\._(?:modules|parameters|buffers)\['([^']*)'\]", r".\1", source)
    name = re.sub(r"^L\['self'\]\.", "", name)
    return name or source


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
