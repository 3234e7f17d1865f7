"""Materialize a backward value a second time for its late readers, so it is not held across
the peak in between.

A value the backward recomputes or reloads for an early reader (a recomputation chain) that is
read again only after the peak is held across it. Where budgets are tight that is the binding
moment (bench GPT, host tier, 0.05 budget: each attention backward holds its layer's reloaded
input and the recomputed layer norm output, 2 MiB each, for the weight gradient and the layer
norm's backward that come after it). Making it again right before the late readers frees it
in between, at the cost of one more copy or kernel:

    before                                        after
      x = reload(x_host)                            x = reload(x_host)
      ln = native_layer_norm(x, ...)                ln = native_layer_norm(x, ...)
      qkv = addmm(b, ln, w)     # recomputation     qkv = addmm(b, ln, w)
      ... attention backward: the peak,             ... attention backward: the peak,
          x and ln live ...                             x and ln dead ...
      dw = mm(t(ln), dqkv)                          ln2 = native_layer_norm(x2 := reload(x_host))
      dx = native_layer_norm_backward(.., x, ..)    dw = mm(t(ln2), dqkv)
                                                    dx = native_layer_norm_backward(.., x2, ..)

A value that *no* reader needs before the peak is moved instead, at no cost: its op runs right
before its first reader and the original goes. Where a rewrite after the planner's search (row
tiling) moves the peak, the joint model's ordering (``schedule.sink``) never looked there (bench
GPT, recompute only, at its floor: the LM head's input gradient made before the recomputed
layer norm and the weight gradient, which meet the 16 MiB log-softmax):

    before                                        after
      dh = mm(dlogits, w)        # waits            ln = native_layer_norm(x, ...)
      ln = native_layer_norm(x, ...)                dw = mm(t(dlogits), ln)      # the peak
      dw = mm(t(dlogits), ln)    # the peak         dh = mm(dlogits, w)
      dx = native_layer_norm_backward(dh, ...)      dx = native_layer_norm_backward(dh, ...)

Only values whose second computation gives the same bits are candidates: reloads (the host copy
stays in the store until the backward ends) and deterministic ops with no effects whose inputs
nothing writes in between (``in_place.py`` writes into dying gradients). Views of the value are
made again with it, and so are the values it reads that nothing reads from the peak on (up to
three steps back, as ``x2 := reload(x_host)`` above): a copy reading the originals would hold
them across the peak instead (bench GPT's host tier: the layer norm's reloaded input, 2 MiB
per attention backward). Their time is not priced: the pass runs only for a plan over its
target. Reloads are not moved: where a reload is issued is ``prefetch.py``'s decision (early
enough to hide the copy). Readers that write into a copy or view it (row
tiling's ``out=`` buffers) get values of the copy's storage, for the analysis.

:func:`plan_rematerialize` decides, from exact profiles of trial rewrites (a split is kept
when the backward's peak drops, or stays and the old peak position drops: every layer of a
model peaks alike, so one split alone rarely lowers the maximum);
:func:`rematerialize_pass` applies the decisions.
"""

from __future__ import annotations

import copy
import logging
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.multiprocessing.reductions import StorageWeakRef

from memcompile.analysis.graph import GraphProfile, has_effect, tensor_vals
from memcompile.rewrites.context import PassContext
from memcompile.rewrites.rebuild import copy_graph, refresh_view

log = logging.getLogger(__name__)

__all__ = ["Rematerialize", "plan_rematerialize", "rematerialize_pass", "written_between"]

_RELOAD = torch.ops.memcompile.reload.default
_WAIT = torch.ops.memcompile.wait.default
# Trial profiles plan_rematerialize may run (each is linear in the graph).
_MAX_TRIALS = 96
# How many steps back a made-again value's inputs are made again with it (_chain).
_CHAIN_DEPTH = 3


@dataclass(frozen=True)
class Rematerialize:
    """Make ``node`` (and its views the late readers read) again right before ``before``; the
    readers from ``before`` on read the new value. ``moved``: no reader comes before
    ``before``, so the original goes (a move, no second computation). ``inputs``: nodes
    ``node`` reads (directly or through each other), in graph order, made again with it, so
    the copy reads their copies: each would otherwise die before the peak, and the copy reading
    it would hold it across (the reload a recomputed layer norm reads)."""

    node: str
    before: str
    moved: bool = False
    inputs: tuple[str, ...] = ()


def _mutates(n: fx.Node) -> bool:
    target = n.target
    return isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable


def _repeatable(n: fx.Node) -> bool:
    """Running ``n`` again on the same inputs gives the same bits and changes nothing else."""
    if n.op != "call_function":
        return False
    if n.target is _RELOAD:
        return True  # the tier keeps its copy for the whole backward
    return isinstance(n.target, torch._ops.OpOverload) and not has_effect(n) and not _mutates(n)


def _ref(t: torch.Tensor) -> StorageWeakRef:
    return StorageWeakRef(t.untyped_storage())


def _is_view_of(n: fx.Node, storage: StorageWeakRef) -> bool:
    """``n`` makes no storage besides ``storage``: a view of it, or the getitem of a
    multi-output op that is ``storage`` (the caller checks that ``n`` reads its family)."""
    if n.op != "call_function" or _mutates(n) or n.target is _WAIT:
        return False
    vals = tensor_vals(n.meta.get("val"))
    target = n.target
    aliasing = target is operator.getitem or (
        isinstance(target, torch._ops.OpOverload) and target.is_view
    )
    return bool(vals) and aliasing and all(_ref(t) == storage for t in vals)


def _family(
    head: fx.Node, position: Mapping[fx.Node, int], storage: StorageWeakRef
) -> list[fx.Node]:
    """``head`` and the nodes that view ``storage`` through it, in graph order (``position``:
    each node's). Found through the readers of each member (a scan of every later node per
    candidate was ~8 % of the LSTM's budgeted first step)."""
    members = [head]
    todo = [head]
    inside = {head}
    while todo:
        for u in todo.pop().users:
            if u not in inside and _is_view_of(u, storage):
                inside.add(u)
                members.append(u)
                todo.append(u)
    return sorted(members, key=position.__getitem__)


def written_between(nodes: Sequence[fx.Node], inputs: Sequence[fx.Node], lo: int, hi: int) -> bool:
    """A node in ``nodes[lo:hi]`` writes a storage one of ``inputs`` reads (``wait`` writes
    nothing: it is declared to mutate the reload it waits for only so that no compiler moves a
    reader above it; the readers after it, it still precedes)."""
    storages = {_ref(t) for a in inputs for t in tensor_vals(a.meta.get("val"))}
    for n in nodes[lo:hi]:
        if (
            _mutates(n)
            and n.target is not _WAIT
            and any(
                _ref(t) in storages
                for a in n.all_input_nodes
                for t in tensor_vals(a.meta.get("val"))
            )
        ):
            return True
    return False


def _chain(
    head: fx.Node, nodes: Sequence[fx.Node], position: dict[fx.Node, int], at: int
) -> list[fx.Node]:
    """The nodes ``head`` reads, directly or through each other (at most
    :data:`_CHAIN_DEPTH` steps back), to make again with it, in graph order: repeatable, read
    by nothing from the peak position ``at`` on, so each is dead at the peak unless a copy of
    ``head`` reads it, and written by nothing before it (through any view: a row tiling's
    ``out=`` buffer made again would be an empty one)."""
    chain: set[fx.Node] = set()
    frontier = [head]
    for _ in range(_CHAIN_DEPTH):
        found = []
        for m in frontier:
            for a in m.all_input_nodes:
                if a in chain or not _repeatable(a):
                    continue
                if any(position[u] >= at or u.op == "output" for u in a.users):
                    continue
                if written_between(nodes, [a], position[a] + 1, at):
                    continue
                chain.add(a)
                found.append(a)
        frontier = found
    return sorted(chain, key=position.__getitem__)


def _candidates(gm: fx.GraphModule, profile: GraphProfile) -> list[Rematerialize]:
    """Splits worth a trial at ``profile``'s peak: values live there and not read there; read
    only after it (moves), or before and after it; largest first. (Moves are not tried first:
    on bench branchy's host tier, 56 moves that each lowered one branch's peak left the 66
    splits that lower the step's peak by 2 MiB unfound.)"""
    nodes = list(gm.graph.nodes)
    by_name = {n.name: n for n in nodes}
    position = {n: p for p, n in enumerate(nodes)}
    peak_node = by_name.get(profile.nodes[profile.peak_index].name)
    if peak_node is None:
        return []
    at = position[peak_node]
    i = profile.peak_index
    live = [
        s
        for s in profile.storages
        if s.alloc_index <= i and (s.free_index is None or s.free_index > i)
    ]
    out = []
    for s in sorted(live, key=lambda s: (-s.nbytes, s.alloc_index)):
        head = by_name.get(s.producer)
        if head is None or not _repeatable(head):
            continue
        vals = [t for t in tensor_vals(head.meta.get("val")) if t.untyped_storage().nbytes()]
        storage = next((_ref(t) for t in vals if t.untyped_storage().nbytes() == s.nbytes), None)
        if storage is None:
            continue
        members = _family(head, position, storage)
        inside = set(members)
        readers = [u for m in members for u in m.users if u not in inside and u.target is not _WAIT]
        late = [u for u in readers if position[u] > at]
        if not late or peak_node in inside:
            continue
        # A move: no reader of any of the op's outputs (a layer norm's mean and rstd too)
        # before the peak, so the original goes. A reload's placement is prefetch.py's.
        every = dict.fromkeys(
            m for r in dict.fromkeys(map(_ref, vals)) for m in _family(head, position, r)
        )
        all_readers = [u for m in every for u in m.users if u not in every]
        # (Not to the output: a value only the graph returns waits for nothing.)
        moved = head.target is not _RELOAD and all(
            position[u] > at and u.op != "output" for u in all_readers
        )
        if len(late) == len(readers) and not moved:
            continue
        if any(_mutates(u) for u in readers if position[u] <= at):
            continue  # an early reader writes into the value: a second copy would miss it
        first = min(all_readers if moved else late, key=position.__getitem__)
        # What the copy reads that would die before the peak is made again with it (a
        # recomputed layer norm's reloaded input: bench GPT's host tier, 2 MiB per attention
        # backward), unless two copies would be named alike.
        chain = [] if moved else _chain(head, nodes, position, at)
        if len({_base(n.name) for n in (*chain, *every)}) < len(chain) + len(every):
            chain = []
        copied = set(chain)
        if any(
            c.target is not _RELOAD
            and written_between(
                nodes,
                [a for a in c.all_input_nodes if a not in copied],
                position[c],
                position[first],
            )
            for c in (*chain, head)
        ):
            continue
        out.append(Rematerialize(head.name, first.name, moved, tuple(n.name for n in chain)))
    return out


def _base(name: str) -> str:
    """``name`` without the ``_r<k>`` an earlier split's copy got (a value moved again)."""
    return re.sub(r"_r\d+$", "", name)


def _apply(gm: fx.GraphModule, ctx: PassContext, split: Rematerialize, ordinal: int) -> None:
    nodes = list(gm.graph.nodes)
    by_name = {n.name: n for n in nodes}
    missing = [n for n in (split.node, split.before, *split.inputs) if n not in by_name]
    if missing:
        raise ValueError(f"{ctx.fragment}: no node {', '.join(map(repr, missing))}")
    head, before = by_name[split.node], by_name[split.before]
    chain = [by_name[name] for name in split.inputs]
    position = {n: p for p, n in enumerate(nodes)}
    vals = tensor_vals(head.meta.get("val"))
    members = [head]
    for storage in dict.fromkeys(_ref(t) for t in vals):
        members += [m for m in _family(head, position, storage) if m not in members]
    members.sort(key=position.__getitem__)
    late = {
        u
        for m in members
        for u in m.users
        if u not in members and position[u] >= position[before] and u.target is not _WAIT
    }
    needed = set()
    for m in reversed(members):  # the copies a late reader reads, and what they read
        if m is head or any(u in late or u in needed for u in m.users):
            needed.add(m)
    env: dict[fx.Node, fx.Node] = {}

    def swap(a: fx.Node) -> fx.Node:
        return env.get(a, a)

    fake_mode = detect_fake_mode(vals)
    assert fake_mode is not None, "AOT graphs carry fake tensors"
    with gm.graph.inserting_before(before):
        for m in [*chain, *members]:
            if m not in needed and m not in chain:
                continue
            # Named for the split's place in the sequence, not by FX's namespace: a graph's
            # namespace keeps the names of erased nodes and its deepcopy's does not, so a
            # copy named in a trial (on a deepcopy) could be named otherwise when the splits
            # are applied to the graph itself, and a later split naming it would not find it
            # (the GRU's backward: "no node 'mm_35' or 'in_place_add_71'").
            args, kwargs = fx.node.map_arg((m.args, m.kwargs), swap)
            new = gm.graph.create_node(
                m.op, m.target, args, kwargs, name=f"{_base(m.name)}_r{ordinal}", type_expr=m.type
            )
            new.meta = copy.copy(m.meta)
            # A fresh value: the analysis must see a new storage, not the first one again.
            refresh_view(new, new, fake_mode)
            new.meta["memcompile_copy_of"] = m.meta.get("memcompile_copy_of", m.name)
            env[m] = new
            if m.target is _RELOAD:
                done = gm.graph.call_function(_WAIT, (new, m.args[2]))
                done.meta["val"] = None
    stale = {_ref(t) for m in env for t in tensor_vals(m.meta.get("val"))}
    fresh = set(env.values())
    for u in sorted(late, key=position.__getitem__):
        u.args = fx.node.map_arg(u.args, swap)
        u.kwargs = fx.node.map_arg(u.kwargs, swap)
    # A reader that writes into a copy (an ``out=`` buffer, an in-place op) or views it still
    # carries a value of the original's storage: the analysis would count that storage again,
    # as a new allocation (a moved row tiling buffer, 3 KiB over the allocator's peak). Its
    # value is run again on the copies' values, and so on down the chain.
    for u in nodes[position[before] :]:
        if (
            u.op == "call_function"
            and any(a in fresh for a in u.all_input_nodes)
            and any(_ref(t) in stale for t in tensor_vals(u.meta.get("val")))
        ):
            refresh_view(u, u, fake_mode)
            fresh.add(u)
    if split.moved and any(u not in members for m in members for u in m.users):
        raise ValueError(f"{ctx.fragment}: {split.node} is read before {split.before}: not a move")
    # Views and getitems of the original that only late readers read go (last first): a
    # getitem left behind would hold the op's whole output tuple (a layer norm's output with
    # its mean) until it runs. A move's original goes too.
    for m in reversed(members):
        if not m.users:
            gm.graph.erase_node(m)


def rematerialize_pass(
    gm: fx.GraphModule,
    ctx: PassContext,
    *,
    splits: Sequence[Rematerialize],
    first: int = 0,
    lint: bool = True,
) -> fx.GraphModule:
    """Apply ``splits`` to ``gm`` in place (and return it), in order: each node, and those of
    its views a reader from ``before`` on reads, is copied right before ``before``; readers
    from there on read the copies. A reload's copy gets its own ``wait``. The copies of the
    ``k``-th split are named ``<node>_r<first + k>`` (``<node>`` without an earlier split's
    ``_r<j>``): a trial of a split that follows ``first`` kept ones names its copies as the
    whole sequence will. ``lint``: check the graph after (a trial, only profiled, is not:
    its splits are checked when applied to the graph itself).

    Raises:
        ValueError: a split names a node ``gm`` does not have (at its turn).
    """
    for k, split in enumerate(splits):
        _apply(gm, ctx, split, first + k)
    if lint:
        gm.graph.lint()
    gm.recompile()
    if splits:
        log.debug(
            "%s: %d values made again or moved for their late readers", ctx.fragment, len(splits)
        )
    return gm


def _trial_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm``'s graph for a trial, sharing its attributes, whose Python code is
    generated only if something reads it (torch's ``_LazyGraphModule``, as Inductor's passes
    use): a trial is only profiled, and generating the code twice per trial (the copy, then
    the pass) was about 40 % of the trials' time on the GRU small's 3,000-node backward. The
    graph is copied as ``copy.deepcopy`` copies it, without torch's check of each node's
    arguments (``rebuild.copy_graph``)."""
    return _LazyGraphModule(gm, copy_graph(gm.graph))


def plan_rematerialize(
    gm: fx.GraphModule,
    ctx: PassContext,
    evaluate: Callable[[fx.GraphModule], GraphProfile],
    *,
    target: int | None = None,
    max_trials: int = _MAX_TRIALS,
    start: GraphProfile | None = None,
) -> tuple[Rematerialize, ...]:
    """The splits that lower ``gm``'s peak, found by trial: at the peak, each candidate (see
    :func:`_candidates`) is applied to a copy and profiled by ``evaluate``; the first that
    lowers the peak (or keeps it and lowers the old peak position) is kept, then the search
    goes on from the new profile. It stops at ``target`` bytes (when given), when no
    candidate helps, or after ``max_trials`` profiles. ``gm`` itself is not changed; ``start``
    is ``evaluate(gm)`` where the caller has it."""
    profile = start if start is not None else evaluate(gm)
    # Each trial is applied to ``working`` in place; ``settled`` has the splits kept so far
    # (each kept one applied to it too, as to ``working``: the same nodes and names), and a
    # copy of it replaces ``working`` after a trial that is not kept. Most trials are kept (83
    # of 121 on the LSTM, T=48, 0.25x), and a copy per trial was 15 % of its first step.
    working, settled = _trial_copy(gm), _trial_copy(gm)
    kept: list[Rematerialize] = []
    trials = 0
    while trials < max_trials and (target is None or profile.peak_bytes > target):
        at = profile.nodes[profile.peak_index].name
        improved = False
        for split in _candidates(working, profile):
            rematerialize_pass(working, ctx, splits=(split,), first=len(kept), lint=False)
            new = evaluate(working)
            log.debug(
                "trial %s: peak %d at %s", split, new.peak_bytes, new.nodes[new.peak_index].name
            )
            trials += 1
            there = next(
                (n.live_bytes for n in new.nodes if n.name == at),
                new.peak_bytes,
            )
            if new.peak_bytes < profile.peak_bytes or (
                new.peak_bytes == profile.peak_bytes and there < profile.peak_bytes
            ):
                rematerialize_pass(settled, ctx, splits=(split,), first=len(kept), lint=False)
                profile, improved = new, True
                kept.append(split)
                break
            working = _trial_copy(settled)
            if trials >= max_trials:
                break
        if not improved:
            break
    moved = sum(r.moved for r in kept)
    log.info(
        "%s: %d values made again for late readers, %d moved to them (%d trial profiles); "
        "backward peak %d bytes",
        ctx.fragment,
        len(kept) - moved,
        moved,
        trials,
        profile.peak_bytes,
    )
    return tuple(kept)
