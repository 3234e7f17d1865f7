"""Row tiling's rewrite: the ops :func:`~memcompile.rewrites.tiling.find.find_row_tilings` picked,
made a block of rows at a time (the before/after pictures: the package docstring,
``tiling/__init__.py``).

For each :class:`RowTiling`, :class:`_Blocks` writes a graph over the op's leaves: the result's
buffer (``empty``, or the leaf an in-place op writes into) and each absorbed matmul's, then for
each block of rows (:data:`BLOCKS` of them; whole batches or periods where ``align`` asks) the
chain on that block's rows (slices of the leaves, or a reloaded leaf's block copied from its
host copy, on a GPU the next block's copy issued first), the absorbed matmuls' batches
(``bmm.out``) and the op's ``out=`` form writing into the buffer's rows, then the result in the
op's shape. :func:`row_tile_pass` has each probed against the op as it was (``probe.py``),
copies the graph node by node with the blocks in the op's place and the nodes they make
unneeded left out, and records the rewrites in ``meta['memcompile_row_tiles']``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx
from torch._guards import detect_fake_mode

from memcompile.rewrites.context import PassContext
from memcompile.rewrites.rebuild import (
    copy_node,
    make_node,
    rebuilt_module,
    refresh_view,
    storage_refs,
)
from memcompile.rewrites.tiling.find import (
    _FORMS,
    _REDUCTIONS,
    _RELOAD,
    _ROW_OPS,
    _VIEWS,
    _WAIT,
    BLOCKS,
    MAX_KEPT_MATMULS,
    RowTiling,
    _absorbed_path,
    _batch_dims,
    _functional,
    _period,
    _reloaded_by,
    _rowwise,
    find_row_tilings,
)
from memcompile.rewrites.tiling.probe import code_key, tiles_exactly

log = logging.getLogger(__name__)

__all__ = [
    "PREFIX",
    "InlineMemo",
    "blocks_held",
    "made_by_own_blocks",
    "row_tile_pass",
    "tiling_changes",
]

aten = torch.ops.aten

#: Name prefix of the nodes the pass creates.
PREFIX = "tiled"

#: The fake values :func:`_inline` gave the nodes of one op's blocks: (their code, the ids of
#: the leaves' values) -> (those leaf values, kept alive so that no id is reused; the values).
#: A search builds many candidates that tile the same op on the same leaf values (the graphs
#: each build partitions share their nodes' values): the second gets the first's values
#: instead of a fake dispatch per node (half the blocks' nodes on the GRU small's builds).
InlineMemo = dict[tuple[Any, ...], tuple[tuple[Any, ...], tuple[Any, ...]]]


def _absorbed_paths(
    t: RowTiling, nodes: dict[str, fx.Node]
) -> dict[fx.Node, tuple[int, list[fx.Node]]]:
    """``t``'s absorbed matmuls -> :func:`_absorbed_path` of each, in ``t.absorbed`` order."""
    paths: dict[fx.Node, tuple[int, list[fx.Node]]] = {}
    if not t.absorbed:
        return paths
    chain = {nodes[c] for c in t.chain}
    for name in t.absorbed:
        found = _absorbed_path(nodes[name], chain)
        assert found is not None, f"{name} reads no chain value"
        paths[nodes[name]] = found
    return paths


def _bounds(rows: int, blocks: int, align: int = 1) -> list[tuple[int, int]]:
    step = math.ceil(math.ceil(rows / blocks) / align) * align
    return [(r, min(r + step, rows)) for r in range(0, rows, step)]


class _Blocks:
    """Writes the op by blocks of rows into a graph whose placeholders are its leaves (a
    reloaded leaf's: its host copy, see :attr:`inputs`). With ``reload=False`` the reloaded
    leaves are sliced like the others (the probe's graph: a reload copies bits). ``ahead``:
    each block also issues the next block's reloads (see :func:`row_tile_pass`)."""

    def __init__(
        self, gm: fx.GraphModule, t: RowTiling, *, reload: bool = True, ahead: bool = True
    ) -> None:
        nodes = {n.name: n for n in gm.graph.nodes}
        self.t = t
        self.ahead = ahead
        self.op_node = nodes[t.node]
        self.chain = [nodes[c] for c in t.chain]
        self.leaves = [nodes[name] for name in t.leaves]
        #: Reloaded leaves -> their reload (read by rows, or by batches, from its host copy).
        self.sources: dict[fx.Node, fx.Node] = {}
        for name in t.reloaded if reload else ():
            self.sources[nodes[name]] = _reloaded_by(nodes[name])[1]
        #: Leaves reloaded by batches -> the views from the reload to the leaf, in that order.
        self.by_batches: dict[fx.Node, list[fx.Node]] = {}
        for name in t.reloaded_batches if reload else ():
            leaf = nodes[name]
            path, self.sources[leaf] = _reloaded_by(leaf, batched=True)
            views = [m for m in path if m.target is not _WAIT and m is not self.sources[leaf]]
            self.by_batches[leaf] = views[::-1]
        #: Batched matmuls the blocks make too -> (the chain value's operand, the path to it).
        self.absorbed = _absorbed_paths(t, nodes)
        self.products: dict[fx.Node, fx.Node] = {}  # their whole results (buffers)
        #: The nodes the placeholders stand for, in order.
        self.inputs: list[fx.Node] = [
            self.sources[n].args[0] if n in self.sources else n  # type: ignore[misc]
            for n in self.leaves
        ]
        self.graph = fx.Graph()
        self.ph = {leaf: self.graph.placeholder(f"leaf{i}") for i, leaf in enumerate(self.leaves)}
        self.flat: dict[fx.Node, fx.Node] = {}  # leaves with rows, as [rows, k]
        self.loaded: dict[tuple[fx.Node, tuple[int, int]], fx.Node] = {}  # reloaded blocks

    def rows_view(self, leaf: fx.Node) -> fx.Node:
        """``leaf`` viewed as ``[rows, k]`` (one node, made on first use)."""
        if leaf not in self.flat:
            # A reloaded leaf's placeholder is its host copy, in the reload's shape.
            lv = (self.sources[leaf] if leaf in self.sources else leaf).meta["val"]
            self.flat[leaf] = (
                self.ph[leaf]
                if lv.ndim == 2
                else self.graph.call_function(
                    aten.view.default, (self.ph[leaf], [self.t.rows, lv.shape[-1]])
                )
            )
        return self.flat[leaf]

    def leaf_rows(self, leaf: fx.Node, rows: tuple[int, int]) -> fx.Node:
        """Block ``rows`` of ``leaf``: a slice, or for a reloaded leaf the block's reload."""
        if leaf in self.sources:
            return self.loaded[(leaf, rows)]
        return self.graph.call_function(aten.slice.Tensor, (self.rows_view(leaf), 0, *rows))

    def batches(self, value: fx.Node, rows: tuple[int, int]) -> tuple[int, int]:
        """The batches (first dim) of a batched matmul's operand or product ``value`` that block
        ``rows`` of the result reads or makes (blocks hold whole batches)."""
        n = value.meta["val"].shape[0]
        return rows[0] * n // self.t.rows, rows[1] * n // self.t.rows

    def leaf_batches(self, leaf: fx.Node, rows: tuple[int, int]) -> fx.Node:
        """The batches of ``leaf`` that block ``rows`` reads: a slice, or for a leaf reloaded
        by batches the block's reload seen through the leaf's views."""
        first, last = self.batches(leaf, rows)
        if leaf not in self.by_batches:
            return self.graph.call_function(aten.slice.Tensor, (self.ph[leaf], 0, first, last))
        made = self.loaded[(leaf, rows)]
        for view in self.by_batches[leaf]:  # the leaf's own views, on the block's batches
            if view.target is aten.transpose.int:
                made = self.graph.call_function(aten.transpose.int, (made, *view.args[1:3]))
            elif view.target in (aten.detach.default, aten.alias.default):
                continue
            else:
                shape = [last - first, *view.meta["val"].shape[1:]]
                made = self.graph.call_function(aten.view.default, (made, shape))
        return made

    def reload(self, rows: tuple[int, int], ahead: tuple[int, int] | None) -> None:
        """Reload block ``rows`` of each reloaded leaf (where not yet issued) and the next
        block's (``ahead``: its copy overlaps this block's compute on a GPU), then wait for
        this block's."""
        for leaf, src in self.sources.items():
            for r in (rows, ahead):
                if r is not None and (leaf, r) not in self.loaded:
                    if leaf in self.by_batches:  # its host copy's batches, in the reload's shape
                        part = self.graph.call_function(
                            aten.slice.Tensor, (self.ph[leaf], 0, *self.batches(leaf, r))
                        )
                    else:
                        part = self.graph.call_function(
                            aten.slice.Tensor, (self.rows_view(leaf), 0, *r)
                        )
                    self.loaded[(leaf, r)] = self.graph.call_function(
                        _RELOAD, (part, *src.args[1:]), dict(src.kwargs)
                    )
        for leaf, src in self.sources.items():
            self.graph.call_function(_WAIT, (self.loaded[(leaf, rows)], src.args[2]))

    def arg(
        self,
        a: Any,
        consumer: torch.Tensor | None,
        block: dict[fx.Node, fx.Node],
        rows: tuple[int, int],
        *,
        matmul: bool = False,
    ) -> Any:
        """Argument ``a`` of a node with result ``consumer`` (``None``: read whole, a matmul's
        weight) in block ``rows``; ``matmul``: a matmul's row operand."""
        if not isinstance(a, fx.Node):
            return a
        if a in block:
            return block[a]
        av = a.meta["val"]
        if consumer is None:
            return self.ph[a]
        if _rowwise(av, consumer, self.t.rows, matmul=matmul):
            return self.leaf_rows(a, rows)
        period = _period(av, consumer)
        if period and not matmul:  # its [period, k] rows, once per period of the block
            flat = self.graph.call_function(
                aten.reshape.default, (self.ph[a], [period, av.shape[-1]])
            )
            return self.graph.call_function(
                aten.repeat.default, (flat, [(rows[1] - rows[0]) // period, 1])
            )
        if av.ndim > 1:  # a bias: every row reads it whole, as its last size
            return self.graph.call_function(aten.view.default, (self.ph[a], [av.shape[-1]]))
        return self.ph[a]

    def block(self, buffer: fx.Node, rows: tuple[int, int], ahead: tuple[int, int] | None) -> None:
        """The chain and the op for one block of rows, the op writing into ``buffer``
        (``ahead``: the next block's rows)."""
        g = self.graph
        self.reload(rows, ahead)
        block: dict[fx.Node, fx.Node] = {}
        for c in self.chain:
            cv = c.meta["val"]
            if c.target in _VIEWS:  # [B, T, H] and [B*T, H] are the same blocks of rows
                src = c.args[0]
                assert isinstance(src, fx.Node)
                block[c] = block[src] if src in block else self.leaf_rows(src, rows)
            elif c.target is aten.bmm.default:
                # The block is whole batches of both operands (leaves).
                a, w = (self.leaf_batches(x, rows) for x in c.args[:2])  # type: ignore[arg-type]
                product = g.call_function(aten.bmm.default, (a, w))
                block[c] = g.call_function(
                    aten.view.default, (product, [rows[1] - rows[0], cv.shape[-1]])
                )
            elif c.target is aten.mm.default:
                a, w = c.args[:2]
                block[c] = g.call_function(
                    aten.mm.default,
                    (self.arg(a, cv, block, rows, matmul=True), self.arg(w, None, block, rows)),
                )
            elif c.target is aten.addmm.default:
                bias, a, w = c.args[:3]
                block[c] = g.call_function(
                    aten.addmm.default,
                    (
                        self.arg(bias, cv, block, rows),
                        self.arg(a, cv, block, rows, matmul=True),
                        self.arg(w, None, block, rows),
                        *c.args[3:],
                    ),
                    dict(c.kwargs),
                )
            else:
                args = tuple(self.arg(a, cv, block, rows) for a in c.args)
                if c.target in _ROW_OPS:  # over the last dim of the block's [rows, k]
                    at = _ROW_OPS[c.target][2]  # type: ignore[index]
                    args = (*args[:at], -1, *args[at + 1 :])
                target, kwargs = c.target, dict(c.kwargs)
                form = _functional(c)
                if form is not None and form[1] is not None:  # its functional op, by blocks
                    target = form[0]
                    kwargs.pop(_FORMS[form[0]][1])
                block[c] = g.call_function(target, args, kwargs)  # type: ignore[arg-type]
        for bmm, (i, path) in self.absorbed.items():
            self.absorbed_block(bmm, i, path, block, rows)
        op_node = self.op_node
        out = g.call_function(aten.slice.Tensor, (buffer, 0, *rows))
        v = op_node.meta["val"]
        if op_node.target in _ROW_OPS:  # over the last dim of the block's [rows, k]
            out_op, out_name, at = _ROW_OPS[op_node.target]  # type: ignore[index]
            row_args = [self.arg(a, v, block, rows) for a in op_node.args]
            row_args[at] = -1
            g.call_function(out_op, tuple(row_args), {**op_node.kwargs, out_name: out})
            return
        form = _functional(op_node)
        if form is None:  # a reduction over the last dim: of the block's rows
            x, kwargs = op_node.args[0], dict(op_node.kwargs)
            kwargs.pop("dim", None)
            keepdim = op_node.args[2] if len(op_node.args) > 2 else kwargs.pop("keepdim", False)
            xs = self.arg(x, x.meta["val"], block, rows)  # type: ignore[union-attr]
            g.call_function(
                _REDUCTIONS[op_node.target],  # type: ignore[index]
                (xs, [-1], keepdim),
                {**kwargs, "out": out},
            )
            return
        out_op, out_name = _FORMS[form[0]]
        kwargs = {k: a for k, a in op_node.kwargs.items() if k != out_name}
        args = tuple(self.arg(a, v, block, rows) for a in op_node.args)
        g.call_function(out_op, args, {**kwargs, out_name: out})

    def absorbed_block(
        self,
        bmm: fx.Node,
        i: int,
        path: list[fx.Node],
        block: dict[fx.Node, fx.Node],
        rows: tuple[int, int],
    ) -> None:
        """Batched matmul ``bmm``'s batches for block ``rows``, into its buffer: operand ``i``
        is the chain value ``path[0]`` seen through ``path[1:]``, the other a leaf."""
        g = self.graph
        first, last = self.batches(bmm, rows)
        # The views in the value's memory order are one view of the block's rows; then the
        # transposes.
        shaped = next((m for m in reversed(path) if not _batch_dims(m)), path[0])
        made = g.call_function(
            aten.view.default, (block[path[0]], [last - first, *shaped.meta["val"].shape[1:]])
        )
        for m in path[path.index(shaped) + 1 :]:
            made = g.call_function(aten.transpose.int, (made, *m.args[1:3]))
        other = bmm.args[1 - i]
        assert isinstance(other, fx.Node)
        operands = [made, self.leaf_batches(other, rows)]
        if i:
            operands.reverse()
        out = g.call_function(aten.slice.Tensor, (self.products[bmm], 0, first, last))
        g.call_function(aten.bmm.out, tuple(operands), {"out": out})

    def build(self) -> fx.Graph:
        """The graph: the result's buffer (or the leaf the op writes into), each block, the
        result in the op's shape (and each absorbed matmul's whole result after it)."""
        g, t, v = self.graph, self.t, self.op_node.meta["val"]
        for bmm in self.absorbed:
            bv = bmm.meta["val"]
            self.products[bmm] = g.call_function(
                aten.empty.memory_format,
                (list(bv.shape),),
                {
                    "dtype": bv.dtype,
                    "layout": torch.strided,
                    "device": bv.device,
                    "pin_memory": False,
                },
            )
        form = _functional(self.op_node)
        dest = form[1] if form is not None else None
        if dest is not None and dest in self.ph:
            buffer, result = self.rows_view(dest), self.ph[dest]
        else:
            # An elementwise result as [rows, H]; a reduction's as [rows], or [rows, 1] kept.
            keep = v.numel() == t.rows and v.ndim > 0 and v.shape[-1] == 1
            shaped = form is not None or self.op_node.target in _ROW_OPS
            shape = [t.rows, v.shape[-1]] if shaped else [t.rows, 1] if keep else [t.rows]
            buffer = g.call_function(
                aten.empty.memory_format,
                (shape,),
                {
                    "dtype": v.dtype,
                    "layout": torch.strided,
                    "device": v.device,
                    "pin_memory": False,
                },
            )
            result = (
                buffer
                if list(v.shape) == shape
                else g.call_function(aten.view.default, (buffer, list(v.shape)))
            )
        bounds = _bounds(t.rows, t.blocks, t.align)
        for i, rows in enumerate(bounds):
            ahead = bounds[i + 1] if self.ahead and i + 1 < len(bounds) else None
            self.block(buffer, rows, ahead)
        g.output((result, *self.products.values()))
        return g


def _whole_graph(gm: fx.GraphModule, t: RowTiling) -> fx.Graph:
    """The op as it was, over ``t``'s leaves (placeholders, in ``t.leaves`` order). Nodes are
    named afresh, so equal chains give equal code (the probe's cache key)."""
    nodes = {n.name: n for n in gm.graph.nodes}
    whole = fx.Graph()
    env = {nodes[name]: whole.placeholder(f"leaf{i}") for i, name in enumerate(t.leaves)}
    absorbed = _absorbed_paths(t, nodes)
    made = [nodes[name] for name in (*t.chain, t.node)]
    if absorbed:  # with the views between each and the chain value, in graph order
        made += [m for bmm, (_, path) in absorbed.items() for m in (*path[1:], bmm)]
        order = {m: i for i, m in enumerate(gm.graph.nodes)}
        made.sort(key=order.__getitem__)
    for c in made:
        args, kwargs = fx.node.map_arg((c.args, c.kwargs), env.__getitem__)
        env[c] = whole.call_function(c.target, args, kwargs)  # type: ignore[arg-type]
    whole.output((env[nodes[t.node]], *(env[bmm] for bmm in absorbed)))
    return whole


def _removed(t: RowTiling, nodes: dict[str, fx.Node]) -> set[str]:
    """Names of the nodes ``t``'s rewrite removes: its chain but what it keeps, each
    reloaded leaf's whole reload (with its views and ``wait``), and the absorbed matmuls with
    the views they read the chain value through (the blocks make them)."""
    gone = set(t.chain) - set(t.kept)
    for bmm, (_, path) in _absorbed_paths(t, nodes).items():
        gone.update(m.name for m in (*path[1:], bmm))
    gone.update(m.name for name in t.reloaded for m in _reloaded_by(nodes[name])[0])
    gone.update(
        m.name for name in t.reloaded_batches for m in _reloaded_by(nodes[name], batched=True)[0]
    )
    return gone


def tiling_changes(
    gm: fx.GraphModule, tilings: Sequence[RowTiling]
) -> tuple[frozenset[str], dict[str, str]]:
    """What :func:`row_tile_pass` with ``tilings`` (any of them) changes in ``gm``: the nodes it
    replaces (each op, which its blocks make, and :func:`_removed`'s), and the nodes whose values
    may be held for less time, each with the op up to which (the latest of the tilings that
    touch it): the removed ones and the chain values kept for their earlier readers. Every other
    value of ``gm`` is made by the same node and held at least as long (a leaf is read by the
    blocks at the op at the latest; a removed or kept value has no reader after the op,
    ``_Chain.shared``, and an absorbed matmul's product is whole again from the op on), so a
    node the copy keeps holds at least what it held, less those values' bytes while they were
    held before their op. ``built.tiled`` bounds the copy's peak so before building the
    blocks."""
    nodes = {n.name: n for n in gm.graph.nodes}
    order = {name: i for i, name in enumerate(nodes)}
    replaced: set[str] = set()
    until: dict[str, str] = {}
    for t in tilings:
        gone = _removed(t, nodes)
        replaced |= gone | {t.node}
        for name in gone | set(t.kept):
            if name not in until or order[until[name]] < order[t.node]:
                until[name] = t.node
    return frozenset(replaced), until


def blocks_held(
    gm: fx.GraphModule, tilings: Sequence[RowTiling]
) -> dict[str, tuple[tuple[str, ...], int]]:
    """What the blocks of each of ``tilings`` hold as the first starts, where
    :func:`row_tile_pass` with ``tilings`` (any of them) would make that op by its own blocks
    (no other tiling's chain makes it): op name -> (the leaves the blocks read whole, every one
    but the reloaded, which each block reloads by rows; the bytes of the result's buffer, 0
    where the blocks write into a leaf). The blocks read every leaf at the op, and the result's
    buffer is allocated whole before the first block (:meth:`_Blocks.build`)."""
    nodes = {n.name: n for n in gm.graph.nodes}
    gone: set[str] = set()
    for t in tilings:
        gone |= _removed(t, nodes)
    held: dict[str, tuple[tuple[str, ...], int]] = {}
    for t in tilings:
        if t.node in gone:
            continue
        reloaded = set(t.reloaded) | set(t.reloaded_batches)
        form = _functional(nodes[t.node])
        dest = form[1] if form is not None else None
        v = nodes[t.node].meta["val"]
        result = 0 if dest is not None and dest.name in t.leaves else v.numel() * v.element_size()
        held[t.node] = (tuple(n for n in t.leaves if n not in reloaded), int(result))
    return held


@functools.cache
def _out_argument(target: Any) -> str | None:
    """The name of ``target``'s one ``out=`` argument where it returns just that argument
    (``aten.mul.out``'s ``out``, ``aten.gelu_backward.grad_input``'s ``grad_input``)."""
    schema = getattr(target, "_schema", None)
    if schema is None:
        return None
    outs = [a for a in schema.arguments if a.is_out]
    returns = schema.returns
    if len(outs) != 1 or len(returns) != 1 or returns[0].alias_info is None:
        return None
    if returns[0].alias_info.before_set != outs[0].alias_info.before_set:  # type: ignore[union-attr]
        return None
    return outs[0].name


def _inline(
    new: fx.Graph,
    tiled: fx.Graph,
    leaves: Sequence[fx.Node],
    fake_mode: Any,
    memo: InlineMemo | None = None,
    used: set[tuple[Any, ...]] | None = None,
) -> tuple[fx.Node, ...]:
    """Copy ``tiled`` into ``new`` at its end, its placeholders being ``leaves``; the nodes of
    its results. Each new node gets its fake value (a view of the buffer it writes into):
    ``memo``'s where it has those of the same code on the same leaf values, else new ones,
    then remembered. ``used``: the keys of ``memo`` this graph has taken values of already (two
    nodes of one graph never share a value: the profile would count one buffer)."""
    local: dict[fx.Node, fx.Node] = dict(
        zip(tiled.find_nodes(op="placeholder"), leaves, strict=True)
    )
    key: tuple[Any, ...] = ()
    known = None
    if memo is not None:
        inputs = tuple(leaf.meta["val"] for leaf in leaves)
        key = (code_key(tiled), tuple(map(id, inputs)))
        if used is not None and key in used:
            memo = None  # (the same op twice in one graph: a recomputed copy)
        elif key in memo:
            known = iter(memo[key][1])
        if used is not None:
            used.add(key)
    made_vals = []
    result = None
    for m in tiled.nodes:
        if m.op == "placeholder":
            continue
        if m.op == "output":
            result = tuple(local[r] for r in m.args[0])  # type: ignore[union-attr]
            continue
        args, kwargs = fx.node.map_arg((m.args, m.kwargs), local.__getitem__)
        made = make_node(new, "call_function", m.target, args, kwargs, f"{PREFIX}_{m.name}")
        out = _out_argument(m.target)
        if known is not None:
            made.meta["val"] = next(known)
        elif out is not None:
            # An ``out=`` kernel returns the view it writes into, and the probe ran these
            # blocks, so no block resizes it: the fake dispatch of an ``out=`` form (not in
            # FakeTensor's cache, ~1.3 ms each) would give back that same value.
            made.meta["val"] = kwargs[out].meta["val"]  # type: ignore[union-attr]
        else:
            vals = fx.node.map_arg((args, kwargs), lambda a: a.meta["val"])
            with fake_mode:
                made.meta["val"] = m.target(*vals[0], **vals[1])  # type: ignore[operator]
        made_vals.append(made.meta["val"])
        local[m] = made
    assert result is not None
    if memo is not None and known is None:
        memo[key] = (inputs, tuple(made_vals))
    return result


def _chosen(decided: Sequence[RowTiling], nodes: dict[str, fx.Node]) -> tuple[RowTiling, ...]:
    """The tilings of ``decided`` that :func:`row_tile_pass` makes by their own blocks, if the
    probe finds them bit-identical. An op that another's chain makes by blocks goes with that
    chain (its own blocks would read values the other removes); one the other keeps whole for
    earlier readers (the probabilities the value gradient reads first) is made by its own
    blocks too, where neither removes what the other reads."""
    inside = {c for t in decided for c in t.chain if c not in t.kept}
    chosen: list[RowTiling] = []
    for t in (t for t in decided if t.node not in inside):
        if all(
            not _removed(t, nodes) & set(o.leaves) and not _removed(o, nodes) & set(t.leaves)
            for o in chosen
        ):
            chosen.append(t)
    return tuple(chosen)


def _exact(gm: fx.GraphModule, t: RowTiling, nodes: dict[str, fx.Node]) -> bool:
    """Whether ``t``'s blocks give bitwise the op's result (:func:`tiles_exactly`; probed with
    the reloaded leaves sliced: a reload copies their bits)."""
    whole, probe = _whole_graph(gm, t), _Blocks(gm, t, reload=False).build()
    return tiles_exactly(whole, probe, [nodes[name].meta["val"] for name in t.leaves])


def made_by_own_blocks(gm: fx.GraphModule, decided: Sequence[RowTiling], op: str) -> bool:
    """Whether :func:`row_tile_pass` with ``decided`` makes ``op`` by its own blocks: it is
    chosen (:func:`_chosen`) and probed bit-identical (cached per code)."""
    nodes = {n.name: n for n in gm.graph.nodes}
    t = next((t for t in _chosen(decided, nodes) if t.node == op), None)
    return t is not None and _exact(gm, t, nodes)


def row_tile_pass(
    gm: fx.GraphModule,
    ctx: PassContext,
    *,
    blocks: int = BLOCKS,
    max_kept_matmuls: int = MAX_KEPT_MATMULS,
    decided: tuple[RowTiling, ...] | None = None,
    ahead: bool | None = None,
    inlined: InlineMemo | None = None,
) -> fx.GraphModule:
    """A copy of the built graph ``gm`` with the ops :func:`find_row_tilings` picks made a block
    of rows at a time, where the probe finds the blocks bit-identical (:func:`tiles_exactly`);
    ``gm`` itself when there is none. ``gm`` is not changed; the copy shares the fake values of
    every node it keeps. The rewrites are in ``meta['memcompile_row_tiles']`` (a tuple of
    :class:`RowTiling`, ``new`` filled in). ``decided``: what :func:`find_row_tilings` returns
    for ``gm`` with the same ``blocks`` and ``max_kept_matmuls``, when the caller has it.
    ``ahead``: each block issues the next block's reloads before it computes, so that their
    copy overlaps its compute; that block of each reloaded leaf is then held through this
    block's peak. ``None``: where the op's device is a GPU (on a CPU a copy runs on the thread
    that computes, and hides nothing). ``inlined``: the blocks' fake values made by earlier
    calls (:data:`InlineMemo`), shared by the caller's calls."""
    if decided is None:
        decided = find_row_tilings(gm, blocks=blocks, max_kept_matmuls=max_kept_matmuls)
    nodes = {n.name: n for n in gm.graph.nodes}
    decided = _chosen(decided, nodes)
    if not decided:
        return gm
    graphs = {}
    for t in decided:
        if _exact(gm, t, nodes):
            device = nodes[t.node].meta["val"].device
            maker = _Blocks(gm, t, ahead=device.type == "cuda" if ahead is None else ahead)
            graphs[t.node] = (t, maker.build(), maker.inputs)
        else:
            log.info(
                "%s %s: %s by blocks of rows differs in its bits here: left whole",
                ctx.fragment,
                ctx.graph,
                t.node,
            )
    if not graphs:
        return gm
    fake_mode = detect_fake_mode([n.meta.get("val") for n in gm.graph.nodes])
    assert fake_mode is not None, "built graphs carry fake tensors"
    skipped = {c for t, _, _ in graphs.values() for c in _removed(t, nodes)}
    # The views of an absorbed matmul's product before the op now follow the blocks that make
    # it (its other readers are after the op: _absorbs).
    order = {m: i for i, m in enumerate(gm.graph.nodes)}
    deferred: dict[str, list[fx.Node]] = {}
    for t, _, _ in graphs.values():
        views: dict[fx.Node, None] = {}
        todo = [nodes[name] for name in t.absorbed]
        while todo:
            for u in todo.pop().users:
                if order[u] < order[nodes[t.node]] and u not in views:
                    views[u] = None
                    todo.append(u)
        deferred[t.node] = sorted(views, key=order.__getitem__)
    held = {v.name for views in deferred.values() for v in views}

    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    replaced: set[Any] = set()
    used: set[tuple[Any, ...]] = set()  # the keys of ``inlined`` this graph took
    done: list[RowTiling] = []
    for n in gm.graph.nodes:
        if n.name in skipped or n.name in held:
            continue
        entry = graphs.get(n.name)
        if entry is None:
            env[n] = copy_node(new, n, lambda a: env[a])
            if n.op == "call_function" and storage_refs(n.meta.get("val")) & replaced:
                refresh_view(env[n], n, fake_mode)
            continue
        t, tiled, inputs = entry
        leaves_now = [env[m] for m in inputs]
        result, *products = _inline(new, tiled, leaves_now, fake_mode, inlined, used)
        for m, made in zip(
            (n, *(nodes[name] for name in t.absorbed)), (result, *products), strict=True
        ):
            replaced.update(storage_refs(m.meta.get("val")))
            env[m] = made
        for v in deferred[n.name]:
            env[v] = copy_node(new, v, lambda a: env[a])
            refresh_view(env[v], v, fake_mode)
        done.append(dataclasses.replace(t, new=result.name))
    # A value kept for readers that were themselves tiled away has none left.
    for n in reversed(list(gm.graph.nodes)):
        if any(n.name in t.kept for t in done) and n in env and not env[n].users:
            new.erase_node(env[n])
    out = rebuilt_module(gm, new, "memcompile_row_tiles", done)
    log.info(
        "%s: %d elementwise ops made by blocks of rows (%d bytes of operands not held whole)",
        ctx.fragment,
        len(done),
        sum(t.nbytes for t in done),
    )
    return out
