"""Graph analysis: what each node allocates, when it is freed, and the live-bytes curve.

Reads an AOT forward or backward ``fx.GraphModule`` (functional aten, ``meta['val']`` on every
node) and returns a frozen :class:`GraphProfile`; it never changes the graph.

The memory model is the one the eager inner compiler (FX with boxed codegen) executes:

    node i runs        live = (everything not yet freed) + (storages node i creates)
    after node i       every value whose last use was node i is dropped (``x = None``)

Bytes are counted per *storage*, taken from the fake tensors in ``meta['val']``: a view, a
``getitem`` or an op that returns an alias of its input creates nothing new, and a storage is
freed only after the last use of every node that aliases it. Storages that a caller holds (graph
inputs marked persistent, and anything aliasing them) are not tracked; graph outputs live past the
end. Measured against the CPU allocator the model is exact for the zoo's single-fragment workloads
(see tests/test_analysis.py and the closing notes); it does not see scratch space allocated and
freed inside one kernel.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import operator
import re
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import fx
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.flop_counter import flop_registry

from memcompile.runtime.ops import HOST_RESULTS  # (registers torch.ops.memcompile.*)

log = logging.getLogger(__name__)

__all__ = [
    "GraphProfile",
    "NodeProfile",
    "StorageIds",
    "StorageProfile",
    "bound_sizes",
    "covers_storage",
    "draws_random",
    "format_arg",
    "has_effect",
    "is_host_value",
    "node_cost",
    "profile_graph",
    "sym_to_int",
    "tensor_vals",
    "value_meta",
]

GraphKind = Literal["forward", "backward", "inference"]

_WAIT = torch.ops.memcompile.wait.default  # a stream wait: no kernel, no bytes

# Unbacked symbolic sizes (data-dependent, e.g. nonzero) have no hint; count them as this many
# elements and mark the profile approximate.
_UNBACKED_FALLBACK = 0


#: Values of size symbols that :func:`sym_to_int` uses instead of their hints (see
#: :func:`bound_sizes`): a graph compiled for dynamic sizes, profiled at one call's sizes.
_BINDINGS: contextvars.ContextVar[Mapping[Any, int] | None] = contextvars.ContextVar(
    "memcompile_size_bindings", default=None
)


@contextlib.contextmanager
def bound_sizes(bindings: Mapping[Any, int]) -> Iterator[None]:
    """Within the block, SymInts whose symbols are all in ``bindings`` (sympy symbol -> value)
    evaluate to those values, exactly; others to their hints, as outside it."""
    token = _BINDINGS.set(bindings)
    try:
        yield
    finally:
        _BINDINGS.reset(token)


def sym_to_int(x: int | torch.SymInt) -> tuple[int, bool]:
    """``(value, approximate)``: an int, or a SymInt evaluated at the bound sizes
    (:func:`bound_sizes`) or else by its hint (the example input)."""
    if isinstance(x, int):
        return x, False
    node = x.node
    bindings = _BINDINGS.get()
    if bindings:
        try:
            value = node.expr.xreplace(bindings)
        except Exception:  # not a sympy expression: use the hint
            value = None
        if value is not None and value.is_number:
            return int(value), False
    hint = node.hint
    if hint is None:
        try:
            hint = node.shape_env.size_hint(node.expr, allow_none=True)
        except Exception:  # an unbacked symbol: no example value exists
            hint = None
    return (int(hint) if hint is not None else _UNBACKED_FALLBACK), True


def covers_storage(val: Any) -> bool:
    """``val`` is a tensor that is exactly its storage: offset 0, dense, every byte of it (what
    a swap copies, and what a caller holding no other view can drop)."""
    if not isinstance(val, torch.Tensor):
        return False
    try:
        nbytes = val.numel() * val.element_size()
        return (
            val.storage_offset() == 0
            and is_non_overlapping_and_dense_or_false(val)
            and nbytes == val.untyped_storage().nbytes()
            and nbytes > 0
        )
    except Exception:  # symbolic sizes that cannot be compared
        return False


def tensor_vals(val: Any) -> list[torch.Tensor]:
    """The tensors in a node's ``meta['val']`` (a tensor, or a tuple/list of them)."""
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (list, tuple)):
        out: list[torch.Tensor] = []
        for v in val:
            out.extend(tensor_vals(v))
        return out
    return []


class StorageIds:
    """Small integer ids for the fake storages behind ``meta['val']`` tensors.

    One instance is shared by the forward and backward graphs of a fragment, so a tensor saved by
    the forward and read by the backward has one id in both. It keeps the tensors alive while in
    use so that weak storage references cannot be recycled.
    """

    def __init__(self) -> None:
        self._ids: dict[StorageWeakRef, int] = {}
        self._nbytes: list[int] = []
        self._approx: list[bool] = []
        self._keepalive: list[torch.Tensor] = []

    def id_of(self, t: torch.Tensor) -> int:
        """The id of ``t``'s storage (new ids are numbered in first-seen order)."""
        key = StorageWeakRef(t.untyped_storage())
        sid = self._ids.get(key)
        if sid is None:
            sid = len(self._nbytes)
            self._ids[key] = sid
            nbytes, approx = sym_to_int(t.untyped_storage().nbytes())
            self._nbytes.append(nbytes)
            self._approx.append(approx)
            self._keepalive.append(t)
        return sid

    def nbytes(self, sid: int) -> int:
        return self._nbytes[sid]

    def copy(self) -> StorageIds:
        """Another instance with the same ids, numbering new storages on from them alike."""
        other = StorageIds()
        other._ids = dict(self._ids)
        other._nbytes = list(self._nbytes)
        other._approx = list(self._approx)
        other._keepalive = list(self._keepalive)
        return other

    def fresh_copy(self, sid: int) -> int:
        """A new id for another storage the size of ``sid`` (a recomputed node's output)."""
        new = len(self._nbytes)
        self._nbytes.append(self._nbytes[sid])
        self._approx.append(self._approx[sid])
        return new

    def approximate(self, sid: int) -> bool:
        return self._approx[sid]

    def ids_of(self, val: Any) -> tuple[int, ...]:
        """Storage ids of every tensor in ``val``, deduplicated, in order."""
        seen: dict[int, None] = {}
        for t in tensor_vals(val):
            seen[self.id_of(t)] = None
        return tuple(seen)


@dataclass(frozen=True)
class StorageProfile:
    """One tracked storage: who allocates it and when it is freed.

    ``alloc_index`` is -1 for storages live on entry (freeable graph inputs); ``free_index`` is the
    index of the node after which it is dropped, or ``None`` if it survives the graph (an output).
    """

    id: int
    nbytes: int
    producer: str
    alloc_index: int
    free_index: int | None


@dataclass(frozen=True)
class NodeProfile:
    """One node of the schedule.

    Attributes:
        name, op, target: as in the FX graph (``target`` as a qualified string).
        storages: storage ids of the node's tensor outputs (aliases included).
        new_bytes: bytes of tracked storages this node allocates.
        workspace_bytes: scratch its kernel allocates and frees within the call (measured, see
            analysis/workspace.py).
        freed_bytes: bytes dropped right after it.
        live_bytes: tracked bytes live while it runs (inputs still held + its new outputs +
            its workspace).
        flops: from ``torch.utils.flop_counter`` (0 for ops it has no formula for).
        bytes_moved: bytes read plus written (logical sizes; 0 for views).
        inputs: names of the nodes it reads, in argument order (the graph's edges, kept so that
            drawings of a plan need no graph module).
    """

    name: str
    op: str
    target: str
    storages: tuple[int, ...]
    new_bytes: int
    workspace_bytes: int
    freed_bytes: int
    live_bytes: int
    flops: int
    bytes_moved: int
    inputs: tuple[str, ...] = ()


@dataclass(frozen=True)
class GraphProfile:
    """Memory and cost profile of one graph under its current schedule (node order).

    All byte counts are *tracked* bytes: storages the graph itself owns (created by its nodes,
    or freeable inputs such as saved activations in a backward graph), never persistent inputs.
    """

    kind: GraphKind
    nodes: tuple[NodeProfile, ...]
    storages: tuple[StorageProfile, ...]
    start_bytes: int
    end_bytes: int
    peak_bytes: int
    peak_index: int
    flops: int
    bytes_moved: int
    approximate: bool
    workspace_measured: bool = True
    persistent: frozenset[int] = field(default_factory=frozenset)

    @property
    def peak_node(self) -> str:
        """Name of the node during which the peak occurs."""
        return self.nodes[self.peak_index].name if self.nodes else ""

    @property
    def live_curve(self) -> tuple[int, ...]:
        """Live bytes while each node runs, in schedule order."""
        return tuple(n.live_bytes for n in self.nodes)

    def storage_bytes(self, ids: Iterable[int]) -> int:
        """Total bytes of the given tracked storage ids (unknown ids count 0)."""
        by_id = {s.id: s.nbytes for s in self.storages}
        return sum(by_id.get(i, 0) for i in dict.fromkeys(ids))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary (per-node rows included)."""
        return {
            "kind": self.kind,
            "start_bytes": self.start_bytes,
            "end_bytes": self.end_bytes,
            "peak_bytes": self.peak_bytes,
            "peak_node": self.peak_node,
            "flops": self.flops,
            "bytes_moved": self.bytes_moved,
            "approximate": self.approximate,
            "workspace_measured": self.workspace_measured,
            "nodes": [
                {
                    "name": n.name,
                    "op": n.op,
                    "target": n.target,
                    "new_bytes": n.new_bytes,
                    "workspace_bytes": n.workspace_bytes,
                    "freed_bytes": n.freed_bytes,
                    "live_bytes": n.live_bytes,
                    "flops": n.flops,
                    "bytes_moved": n.bytes_moved,
                    "inputs": list(n.inputs),
                }
                for n in self.nodes
            ],
        }


def target_name(target: Any) -> str:
    """A stable, qualified name for an FX node target."""
    if isinstance(target, str):
        return target
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    mod = getattr(target, "__module__", None) or ""
    qual = getattr(target, "__qualname__", None) or getattr(target, "__name__", None)
    if qual is None:
        return type(target).__name__
    return f"{mod}.{qual}" if mod else qual


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


def format_arg(x: Any, node: Callable[[fx.Node], str]) -> str:
    """A node's argument as stable text (fragment ids, plan cache keys): nodes as ``node``
    writes them, targets by :func:`target_name`, addresses in reprs as ``0x?``."""
    if isinstance(x, fx.Node):
        return node(x)
    if isinstance(x, (list, tuple)):
        inner = ", ".join(format_arg(a, node) for a in x)
        return f"[{inner}]" if isinstance(x, list) else f"({inner})"
    if isinstance(x, dict):
        return (
            "{"
            + ", ".join(
                f"{k}: {format_arg(v, node)}"
                for k, v in sorted(x.items(), key=lambda kv: str(kv[0]))
            )
            + "}"
        )
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return str(x)
    if callable(x) and not isinstance(x, type):
        return target_name(x)
    return _ADDRESS.sub("0x?", repr(x))


def value_meta(v: Any) -> str:
    """A value's metadata as stable text: a tensor's dtype, shape, device, stride and whether
    it requires grad; a symbolic size's expression; else the type's name."""
    if isinstance(v, torch.Tensor):
        dtype = _DTYPES.get(v.dtype, str(v.dtype).removeprefix("torch."))
        shape = ", ".join(str(s) for s in v.shape)
        stride = ", ".join(str(s) for s in v.stride())
        grad = " grad" if v.requires_grad else ""
        return f"{dtype}[{shape}]@{v.device.type} stride=({stride}){grad}"
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return f"{type(v).__name__}({v})"
    return type(v).__name__


def _flops(node: fx.Node) -> tuple[int, bool]:
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return 0, False
    fn = flop_registry.get(target._overloadpacket)
    if fn is None:
        return 0, False
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta.get("val"))
    try:
        count = fn(*args, **kwargs, out_val=node.meta.get("val"))
    except Exception as e:  # a formula that cannot read symbolic/None args: no estimate
        log.debug("flop formula for %s failed: %s", target, e)
        return 0, True
    return sym_to_int(count)


def _logical_bytes(vals: Iterable[torch.Tensor]) -> tuple[int, bool]:
    total, approx = 0, False
    for t in vals:
        n, a = sym_to_int(t.numel() * t.element_size())
        total += n
        approx |= a
    return total, approx


def _input_vals(node: fx.Node) -> Iterator[torch.Tensor]:
    for a in node.all_input_nodes:
        yield from tensor_vals(a.meta.get("val"))


@dataclass(frozen=True)
class _Lifetimes:
    node_sids: dict[fx.Node, tuple[int, ...]]
    first: dict[int, int]  # storage -> index of the node creating it (-1: live on entry)
    free_at: dict[int, int | None]  # storage -> index of the node after which it is dropped
    producer: dict[int, str]
    alloc_by_node: dict[int, list[int]]
    free_by_node: dict[int, list[int]]
    approximate: bool


def _lifetimes(
    nodes: list[fx.Node], ids: StorageIds, persistent: Collection[int], held: Collection[fx.Node]
) -> _Lifetimes:
    # FX drops a value right after its last user runs; a storage goes when every value that
    # aliases it is gone. Outputs and held inputs survive the graph.
    last_use: dict[fx.Node, int] = {}
    for i, n in enumerate(nodes):
        for a in n.all_input_nodes:
            last_use[a] = i
    outputs = {a for out in nodes if out.op == "output" for a in out.all_input_nodes}
    node_sids: dict[fx.Node, tuple[int, ...]] = {}
    first: dict[int, int] = {}
    free_at: dict[int, int | None] = {}
    producer: dict[int, str] = {}
    approx = False
    # A node copied from another graph (a forward node recomputed in the backward) carries the
    # original's meta['val']: its outputs would look like the storages the original made, which
    # may be live here (saved). An output storage seen before that is not one of the node's
    # inputs' storages (so not a view or an in-place result) is a new allocation: give it a
    # fresh id, and let the nodes reading this node (getitems, views) follow the renaming.
    copies: dict[int, int] = {}  # fresh id -> the id it copies
    for i, n in enumerate(nodes):
        if n.op == "output":
            continue
        sids = ids.ids_of(n.meta.get("val"))
        if n.op == "call_function":
            input_sids = {s for a in n.all_input_nodes for s in node_sids.get(a, ())}
            follow = {copies[s]: s for s in input_sids if s in copies}
            sids = tuple(follow.get(s, s) for s in sids)
            renamed = []
            for s in sids:
                if s in first and s not in input_sids and s not in persistent:
                    fresh = ids.fresh_copy(s)
                    copies[fresh] = s
                    s = fresh
                renamed.append(s)
            sids = tuple(renamed)
        node_sids[n] = sids
        end = None if n in outputs or n in held else last_use.get(n, i)
        for sid in sids:
            if sid in persistent:
                continue
            if sid not in first:
                first[sid] = -1 if n.op == "placeholder" else i
                producer[sid] = n.name
                free_at[sid] = end
            elif (prev := free_at[sid]) is not None:
                free_at[sid] = None if end is None else max(prev, end)
            approx |= ids.approximate(sid)
    alloc_by_node: dict[int, list[int]] = {}
    free_by_node: dict[int, list[int]] = {}
    for sid, i in first.items():
        alloc_by_node.setdefault(i, []).append(sid)
        if (end := free_at[sid]) is not None:
            free_by_node.setdefault(end, []).append(sid)
    return _Lifetimes(node_sids, first, free_at, producer, alloc_by_node, free_by_node, approx)


def is_host_value(n: fx.Node) -> bool:
    """Whether node ``n``'s value is host-tier memory a graph op made (``HOST_RESULTS``: a
    swapped-out copy, a loss head's log-softmax kept on the host), not the device's."""
    if n.op != "call_function":
        return False
    if n.target in HOST_RESULTS:
        return not isinstance(n.meta.get("val"), (tuple, list))
    producer = n.args[0] if n.target is operator.getitem and n.args else None
    return (
        isinstance(producer, fx.Node)
        and producer.op == "call_function"
        and n.args[1] in HOST_RESULTS.get(producer.target, ())
    )


#: Node meta key: (target, value, input values, :func:`node_cost`) of the node's last costing.
_COST_META = "memcompile_cost"


def node_cost(n: fx.Node, ids: StorageIds) -> tuple[int, int, bool]:
    """``(FLOPs, bytes moved, approximate)`` of one node; an op whose outputs all alias its
    inputs (a view) moves nothing. Kept in the node's ``meta`` with the values it was found
    for: a search profiles many graphs whose nodes are copies sharing those values (a node's
    copy gets its ``meta``), and a copy reading or making other values is costed again."""
    if n.target is _WAIT:
        return 0, 0, False
    val = n.meta.get("val")
    inputs = tuple(a.meta.get("val") for a in n.all_input_nodes)
    known = n.meta.get(_COST_META)
    if (
        known is not None
        and known[0] is n.target
        and known[1] is val
        and len(known[2]) == len(inputs)
        and all(a is b for a, b in zip(known[2], inputs, strict=True))
    ):
        return known[3]  # type: ignore[no-any-return]
    cost = _node_cost(n, ids)
    n.meta[_COST_META] = (n.target, val, inputs, cost)
    return cost


def _node_cost(n: fx.Node, ids: StorageIds) -> tuple[int, int, bool]:
    flops, approx = _flops(n)
    if n.op != "call_function":
        return flops, 0, approx
    outs = tensor_vals(n.meta.get("val"))
    ins = list(_input_vals(n))
    in_sids = {ids.id_of(t) for t in ins}
    if outs and all(ids.id_of(t) in in_sids for t in outs):
        return flops, 0, approx
    moved, m_approx = _logical_bytes([*ins, *outs])
    return flops, moved, approx or m_approx


def profile_graph(
    gm: fx.GraphModule,
    *,
    kind: GraphKind,
    persistent_inputs: Collection[int] = (),
    held_inputs: Collection[int] = (),
    persistent_storages: Collection[int] = (),
    ids: StorageIds | None = None,
    workspace: Mapping[str, int] | None = None,
    costs: bool = True,
) -> GraphProfile:
    """Profile ``gm`` as the eager inner compiler would run it.

    Args:
        gm: an AOT forward/backward/inference graph with ``meta['val']`` on its nodes.
        kind: which graph this is (recorded in the profile).
        persistent_inputs: positions of placeholders that the caller keeps alive (parameters,
            buffers, user inputs). Their storages, and anything aliasing them, are not tracked.
            Other placeholders are live on entry and freed after their last use (boxed calling
            convention), unless listed in ``held_inputs``.
        held_inputs: positions of placeholders the caller holds until the graph returns, though
            they are the graph's to count (a backward's incoming gradients: autograd holds them).
        persistent_storages: storage ids (from ``ids``) that are never tracked, e.g. the forward's
            persistent inputs when profiling the matching backward.
        ids: a shared :class:`StorageIds` to keep ids consistent across graphs.
        workspace: scratch bytes per node name (``analysis.workspace.probe_workspaces``), live
            only while that node runs; ``None``: not measured (the profile says so).
        costs: count each node's FLOPs and bytes moved; ``False``: memory only (every
            ``flops`` and ``bytes_moved`` 0), for a search that compares peaks (a third of
            a profile's time).
    """
    workspace_measured = workspace is not None
    workspace = workspace or {}
    ids = ids if ids is not None else StorageIds()
    nodes = list(gm.graph.nodes)
    persistent: dict[int, None] = dict.fromkeys(persistent_storages)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    held = {placeholders[pos] for pos in held_inputs}
    for pos in persistent_inputs:
        for sid in ids.ids_of(placeholders[pos].meta.get("val")):
            persistent[sid] = None
    for n in nodes:
        # Constants owned by the module, and host-tier values (swapped-out copies, the host
        # copy of a loss head's log-softmax; host or disk, not the device).
        if n.op == "get_attr" or is_host_value(n):
            for sid in ids.ids_of(n.meta.get("val")):
                persistent[sid] = None

    life = _lifetimes(nodes, ids, persistent, held)
    live = sum(ids.nbytes(s) for s in life.alloc_by_node.get(-1, []))
    start = live
    peak, peak_index = live, 0
    total_flops = total_moved = 0
    approx = life.approximate
    profiles: list[NodeProfile] = []
    for i, n in enumerate(nodes):
        new = sum(ids.nbytes(s) for s in life.alloc_by_node.get(i, []) if n.op != "placeholder")
        scratch = workspace.get(n.name, 0)
        live += new
        if live + scratch > peak:
            peak, peak_index = live + scratch, i
        freed = sum(ids.nbytes(s) for s in life.free_by_node.get(i, []))
        flops, moved, cost_approx = node_cost(n, ids) if costs else (0, 0, False)
        approx |= cost_approx
        total_flops += flops
        total_moved += moved
        profiles.append(
            NodeProfile(
                name=n.name,
                op=n.op,
                target=target_name(n.target),
                storages=life.node_sids.get(n, ()),
                new_bytes=new,
                workspace_bytes=scratch,
                freed_bytes=freed,
                live_bytes=live + scratch,
                flops=flops,
                bytes_moved=moved,
                inputs=tuple(a.name for a in n.all_input_nodes),
            )
        )
        live -= freed

    storages = tuple(
        StorageProfile(
            id=sid,
            nbytes=ids.nbytes(sid),
            producer=life.producer[sid],
            alloc_index=first,
            free_index=life.free_at[sid],
        )
        for sid, first in life.first.items()
    )
    profile = GraphProfile(
        kind=kind,
        nodes=tuple(profiles),
        storages=storages,
        start_bytes=start,
        end_bytes=live,
        peak_bytes=peak,
        peak_index=peak_index,
        flops=total_flops,
        bytes_moved=total_moved,
        approximate=approx,
        workspace_measured=workspace_measured,
        persistent=frozenset(persistent),
    )
    log.debug(
        "%s graph: %d nodes, start %d B, peak %d B at %s, end %d B, %d FLOPs%s",
        kind,
        len(nodes),
        start,
        peak,
        profile.peak_node,
        live,
        total_flops,
        " (approximate: symbolic sizes)" if approx else "",
    )
    return profile


def draws_random(node: fx.Node) -> bool:
    """The op draws from the random generator when it runs.

    Ops tagged ``nondeterministic_seeded`` do, except those whose only randomness is a
    ``dropout_p`` argument that is 0 here: the attention kernels
    (``_scaled_dot_product_flash_attention[_for_cpu]``, ``_efficient_attention``, ...) carry the
    tag for their optional dropout, and ``F.scaled_dot_product_attention`` without dropout
    passes ``dropout_p=0.0``. Such a call is as deterministic as a matmul, so it may be
    recomputed (what checkpointing does) and reordered.
    """
    target = node.target
    if not (
        isinstance(target, torch._ops.OpOverload)
        and torch.Tag.nondeterministic_seeded in target.tags
    ):
        return False
    for i, arg in enumerate(target._schema.arguments):
        if arg.name != "dropout_p":
            continue
        if arg.kwarg_only or i >= len(node.args):
            value = node.kwargs.get(arg.name, arg.default_value)
        else:
            value = node.args[i]
        # Only a literal 0 counts: a symbolic or traced probability may be non-zero.
        return not (isinstance(value, (int, float)) and value == 0)
    return True


def has_effect(node: fx.Node) -> bool:
    """Random (draws from the generator) or impure (mutates, communicates)."""
    if draws_random(node):
        return True
    return node.op == "call_function" and node.is_impure(impure_random=False)
