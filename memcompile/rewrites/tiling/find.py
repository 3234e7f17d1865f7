"""Row tiling's search: which elementwise ops of a built graph are made a block of rows at a
time, and from what (the rewrite and its pictures: the package docstring).

:func:`find_row_tilings` returns a frozen :class:`RowTiling` per op: its *chain* (the values it
reads, transitively, that are made row by row: :class:`_Chain`), the *leaves* the chain reads
whole, the chain values *kept* for earlier readers (made again by the blocks, at most
:data:`MAX_KEPT_MATMULS` matmuls), the reloads read by rows or by batches, and the batched
matmuls *absorbed*. Why: those operands then exist a block at a time, so their memory goes. An
op is picked only where what goes is at least half its result's bytes, and nothing writes into
a leaf between the chain's first node and the op (the blocks read the leaves at the op).
Nothing changes or runs here: ``build.py`` writes the blocks, ``probe.py`` checks their bits.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.utils._python_dispatch import _disable_current_modes

from memcompile.rewrites.inplace import FORWARD_OPS, OPS, owned_nodes
from memcompile.rewrites.rematerialize import written_between

__all__ = ["BLOCKS", "MAX_KEPT_MATMULS", "RowTiling", "find_row_tilings", "find_row_tilings_each"]

aten = torch.ops.aten

#: Blocks of rows a tiled op runs in: one block of each operand is held at a time.
BLOCKS = 8

#: Matmuls a tiled op's blocks may make again for themselves (values that stay whole for their
#: other readers): each is that matmul's time again.
MAX_KEPT_MATMULS = 1

#: Elementwise op -> (its out= overload, the out argument); and back.
_FORMS: dict[torch._ops.OpOverload, tuple[torch._ops.OpOverload, str]] = {**OPS, **FORWARD_OPS}
_FUNCTIONAL: dict[torch._ops.OpOverload, tuple[torch._ops.OpOverload, str]] = {
    out: (op, name) for op, (out, name) in _FORMS.items()
}
#: Reductions over the last dim -> their out= overload: a block of rows reduces each row as the
#: whole does (the probe checks it).
_REDUCTIONS: dict[torch._ops.OpOverload, torch._ops.OpOverload] = {
    aten.mean.dim: aten.mean.out,
    aten.sum.dim_IntList: aten.sum.IntList_out,
}
#: Ops over the last dim whose result has their first operand's shape -> (their out= overload,
#: its out argument, the position of the dim argument): a block of rows computes each row as the
#: whole does (the probe checks it).
_ROW_OPS: dict[torch._ops.OpOverload, tuple[torch._ops.OpOverload, str, int]] = {
    aten._softmax.default: (aten._softmax.out, "out", 1),
    aten._softmax_backward_data.default: (aten._softmax_backward_data.out, "grad_input", 2),
}
#: Same rows, same last size (a detach or alias is its input's rows as they are).
_VIEWS = (
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.detach.default,
    aten.alias.default,
)
_MATMULS = (aten.mm.default, aten.addmm.default)
_RELOAD = torch.ops.memcompile.reload.default
_WAIT = torch.ops.memcompile.wait.default
#: Searches of one op's chain at most, each reading the values the last found read after the
#: op as leaves.
_SEARCHES = 4
#: Values a chain reaches back from its op at most (nested reads): what is further is read as a
#: leaf. An unrolled recurrence (the zoo GRU, small) reaches back through every time step, and
#: the search recursed past Python's limit (``RecursionError``; blocks that make a whole
#: recurrence again would cost its time per block anyway).
_MAX_DEPTH = 48


@dataclass(frozen=True)
class RowTiling:
    """One elementwise op made a block of rows at a time.

    Attributes:
        node: the op's node in the graph given to the pass.
        op: the op (``aten.gelu_backward.default``).
        chain: the nodes now made a block at a time (graph order).
        kept: those of them that stay in the graph whole for their other readers, which all
            come before the op (the blocks make them again; they die at those readers now).
        leaves: the nodes the chain reads whole.
        reloaded: those of them that are the reload of a swapped tensor (or a view of it), read
            only by rows: the blocks reload their rows from the host copy instead, and the
            whole reload goes (with its views and ``wait``).
        rows: rows of the result (``B*T``).
        blocks: blocks of rows (at most).
        nbytes: bytes of the chain's values (and the reloads) no longer held whole.
        align: each block's rows are a multiple of it (a batched matmul's rows per batch).
        new: the node that holds the whole result now (``""`` before the rewrite).
        reloaded_batches: the leaves that are the reload of a swapped tensor (or a view or a
            transpose of its later dims), read only as a batched matmul's operand: the blocks
            reload their batches from the host copy instead, and the whole reload goes.
        absorbed: batched matmuls, earlier readers of a chain value, that the blocks make
            instead, each block its own batches (the chain value is then not kept whole).
    """

    node: str
    op: str
    chain: tuple[str, ...]
    kept: tuple[str, ...]
    leaves: tuple[str, ...]
    reloaded: tuple[str, ...]
    rows: int
    blocks: int
    nbytes: int
    align: int = 1
    new: str = ""
    reloaded_batches: tuple[str, ...] = ()
    absorbed: tuple[str, ...] = ()


def _static(shape: Sequence[Any]) -> tuple[int, ...] | None:
    return tuple(shape) if all(isinstance(s, int) for s in shape) else None  # type: ignore[arg-type]


def _val(n: object) -> torch.Tensor | None:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _functional(n: fx.Node) -> tuple[torch._ops.OpOverload, fx.Node | None] | None:
    """``(op, destination)`` of an elementwise node in either form (destination: the operand an
    ``out=`` form writes into, ``None`` for the functional form)."""
    if n.op != "call_function":
        return None
    if n.target in _FORMS:
        return n.target, None  # type: ignore[return-value]
    if n.target in _FUNCTIONAL:
        op, name = _FUNCTIONAL[n.target]  # type: ignore[index]
        dest = n.kwargs.get(name)
        if isinstance(dest, fx.Node) and dest in n.args:
            return op, dest
    return None


def _reduction(n: fx.Node) -> tuple[torch._ops.OpOverload, None] | None:
    """``(op, None)`` for a reduction over its input's last dim only (:data:`_REDUCTIONS`)."""
    if n.op != "call_function" or n.target not in _REDUCTIONS or not n.args:
        return None
    x, dims = n.args[0], n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
    xv = _val(x)
    if xv is None or not isinstance(dims, (list, tuple)) or len(dims) != 1:
        return None
    if dims[0] not in (-1, xv.ndim - 1):
        return None
    return n.target, None  # type: ignore[return-value]


def _row_op(n: fx.Node) -> tuple[torch._ops.OpOverload, None] | None:
    """``(op, None)`` for an op of :data:`_ROW_OPS` over its result's last dim."""
    if n.op != "call_function" or n.target not in _ROW_OPS:
        return None
    v, at = _val(n), _ROW_OPS[n.target][2]  # type: ignore[index]
    dim = n.args[at] if len(n.args) > at else None
    if v is None or dim not in (-1, v.ndim - 1):
        return None
    return n.target, None  # type: ignore[return-value]


def _shaped(op: object) -> bool:
    # The result has the rows and columns of the operands (else: a reduction of the last dim).
    return op in _FORMS or op in _ROW_OPS


def _rows_of(v: torch.Tensor) -> int:
    return v.numel() // v.shape[-1] if v.ndim and v.shape[-1] else 0


def _rowwise(v: torch.Tensor, consumer: torch.Tensor, rows: int, *, matmul: bool) -> bool:
    """Whether operand ``v`` has its reader's rows: a matmul's ``[rows, k]`` row operand, or a
    pointwise operand with the leading sizes of the reader's result ``consumer``."""
    if matmul:
        return v.ndim == 2 and v.shape[0] == rows
    return v.ndim == consumer.ndim and tuple(v.shape[:-1]) == tuple(consumer.shape[:-1])


def _period(v: torch.Tensor, consumer: torch.Tensor) -> int:
    """Rows after which operand ``v`` of a pointwise node with result ``consumer`` repeats its
    rows (``[T, k]`` or ``[1, 1, T, k]`` read by ``[B, H, T, k]``: ``T``); 0: it does not."""
    if v.ndim < 2 or consumer.ndim < 3 or v.ndim > consumer.ndim:
        return 0
    lead = [s for s in v.shape[:-2] if s != 1]
    if lead or v.shape[-1] != consumer.shape[-1] or v.shape[-2] != consumer.shape[-2]:
        return 0
    return int(v.shape[-2])


def _broadcast(v: torch.Tensor) -> bool:
    # Read alike by every row: a scalar, or leading sizes all 1.
    return v.ndim <= 1 or all(s == 1 for s in v.shape[:-1])


def _batch_dims(n: fx.Node) -> bool:
    """Whether ``n`` is a ``transpose`` of two dims after the first (a batch's own layout)."""
    if n.target is not aten.transpose.int:
        return False
    v, dims = _val(n), n.args[1:3]
    return v is not None and all(isinstance(d, int) and d % v.ndim >= 1 for d in dims)


def _reload_path(leaf: fx.Node, *, batched: bool = False) -> tuple[list[fx.Node], fx.Node] | None:
    """``(nodes, reload)`` when ``leaf`` is the value of a swapped tensor's ``reload`` (or a
    view of it with the same last size): the nodes that make it from the host copy (the views
    on the way, the reload, its ``wait`` ops) and the reload; else ``None``. ``batched``: a
    batched matmul's operand, read by ranges of batches (its first dim): the views on the way
    may also be transposes of later dims (``k.transpose(1, 2)``), and every value on the way
    has the leaf's batches as its first size, so a range of batches of the leaf is that range
    of the reload's (contiguous) rows."""
    path, n = [leaf], leaf
    while (n.target in _VIEWS or (batched and _batch_dims(n))) and isinstance(n.args[0], fx.Node):
        n = n.args[0]
        path.append(n)
    if n.target is not _RELOAD or not isinstance(n.args[0], fx.Node):
        return None
    rv, lv = _val(n), _val(leaf)
    if rv is None or lv is None or not rv.is_contiguous():
        return None
    if batched:
        vals = [_val(m) for m in path]
        if lv.ndim < 2 or any(v is None or v.ndim < 2 or v.shape[0] != lv.shape[0] for v in vals):
            return None
    elif rv.shape[-1:] != lv.shape[-1:]:
        return None
    return [*path, *(u for u in n.users if u.target is _WAIT)], n


def _reloaded_by(leaf: fx.Node, *, batched: bool = False) -> tuple[list[fx.Node], fx.Node]:
    """:func:`_reload_path` of a leaf known to be reloaded."""
    made = _reload_path(leaf, batched=batched)
    assert made is not None, f"{leaf.name} is not a reload"
    return made


def _source(leaf: fx.Node, *, batched: bool = False) -> fx.Node:
    """The host copy a reloaded leaf is made from."""
    return _reloaded_by(leaf, batched=batched)[1].args[0]  # type: ignore[return-value]


def _reloaded(
    rowed: set[fx.Node],
    readers: set[fx.Node],
    leaves: Collection[fx.Node],
    *,
    batched: bool = False,
) -> set[fx.Node]:
    """The leaves of ``rowed`` (read only by rows; ``batched``: only by ranges of batches) whose
    reload can go: they and what makes them from the host copy (:func:`_reload_path`) are read
    by ``readers`` (the nodes the rewrite removes) only, and none of those is itself one of the
    chain's ``leaves`` (a softmax's output read whole, and by rows through the ``detach`` views
    its backward makes of it)."""
    found = set()
    for leaf in rowed:
        made = _reload_path(leaf, batched=batched)
        if made is None or any(m in leaves for m in made[0] if m is not leaf):
            continue
        inside = readers | set(made[0])
        if all(u in inside for m in made[0] for u in m.users):
            found.add(leaf)
    return found


@functools.lru_cache(maxsize=4096)
def _views_as(shape: tuple[int, ...], stride: tuple[int, ...], rows: int) -> bool:
    """Whether a tensor of ``shape`` and ``stride`` views as ``[rows, shape[-1]]``, by torch's
    own rule on a meta tensor. Cached: a chain asks it of every operand it reads, and an
    unrolled recurrence of a few layouts hundreds of times (GRU small: 166 s of fake-tensor
    views in one compile, before)."""
    try:
        with _disable_current_modes():  # a meta tensor, not the compile's fake one
            torch.empty_strided(shape, stride, device="meta").view(rows, shape[-1])
    except (RuntimeError, ValueError):
        return False
    return True


class _Chain:
    """The search from one op (see the module docstring)."""

    def __init__(
        self, op_node: fx.Node, owned: set[fx.Node], rows: int, as_leaves: frozenset[fx.Node]
    ) -> None:
        self.op_node = op_node
        self.owned = owned
        self.rows = rows
        self.as_leaves = as_leaves  # read whole, never made by the blocks
        self.chain: set[fx.Node] = set()
        self.leaves: set[fx.Node] = set()
        #: Leaves read a block of rows at a time, leaves read whole (a bias, a weight), and
        #: leaves read a range of batches at a time (a batched matmul's operands).
        self.rowed: set[fx.Node] = set()
        self.whole: set[fx.Node] = set()
        self.batched: set[fx.Node] = set()
        #: Leaves whose rows repeat every ``period`` rows of their reader (a causal mask
        #: ``[T, T]`` read by ``[B, H, T, T]`` scores): each block repeats them.
        self.periodic: set[fx.Node] = set()
        #: Blocks start at multiples of it (whole batches of a batched matmul, whole periods).
        self.align = 1
        #: Values that could not join the chain: not searched again from another reader (each
        #: reader searched them again, with all they read). Kept across give-backs.
        self.failed: set[fx.Node] = set()
        self.depth = 0

    def _state(self) -> tuple[Any, ...]:
        sets = (self.chain, self.leaves, self.rowed, self.whole, self.batched, self.periodic)
        return (*(set(x) for x in sets), self.align)

    def _restore(self, state: tuple[Any, ...]) -> None:
        (self.chain, self.leaves, self.rowed, self.whole, self.batched, self.periodic,
         self.align) = state  # fmt: skip

    def operand(self, a: fx.Node, consumer: torch.Tensor, *, matmul: bool = False) -> bool:
        """Take ``a`` (read by a pointwise node with result ``consumer``, or as a matmul's row
        operand) into the chain or as a leaf; ``False``: the op cannot be tiled."""
        v = _val(a)
        if v is None or _static(v.shape) is None or _static(v.stride()) is None:
            return False
        rowwise = _rowwise(v, consumer, self.rows, matmul=matmul)
        if rowwise:
            before = self._state()
            if self._made_by_rows(a, v):
                return True
            self._restore(before)  # what a failed search took, it gives back
        if not rowwise and not matmul and _broadcast(v):
            self.leaves.add(a)
            self.whole.add(a)
            return True
        if rowwise and self._viewable(v):
            self.leaves.add(a)
            self.rowed.add(a)
            return True
        period = _period(v, consumer)
        if not matmul and period:
            self.leaves.add(a)
            self.periodic.add(a)
            self.align = math.lcm(self.align, period)
            return True
        return False

    def _viewable(self, v: torch.Tensor) -> bool:
        shape, stride = _static(v.shape), _static(v.stride())
        return shape is not None and stride is not None and _views_as(shape, stride, self.rows)

    def _made_by_rows(self, n: fx.Node, v: torch.Tensor) -> bool:
        """Whether ``n`` joins the chain (with what it reads). What a failed search took stays
        until its caller, :meth:`operand`, gives it back."""
        if n in self.chain:
            return True
        if n in self.failed or self.depth >= _MAX_DEPTH:
            return False
        self.depth += 1
        try:
            joined = self._joins(n, v)
        finally:
            self.depth -= 1
        if not joined:
            # (A value that failed for what the chain held then may join another chain: a
            # missed tiling, never a wrong one.)
            self.failed.add(n)
        return joined

    def _joins(self, n: fx.Node, v: torch.Tensor) -> bool:
        """:meth:`_made_by_rows` for a value not searched yet."""
        if n not in self.owned or n.op != "call_function" or n is self.op_node:
            return False
        if n in self.as_leaves:
            return False
        if _static(v.shape) is None:
            return False
        if not v.is_contiguous() or _rows_of(v) != self.rows:
            return False
        target = n.target
        if target in _VIEWS:
            src = n.args[0]
            sv = _val(src)
            if sv is None or sv.shape[-1:] != v.shape[-1:] or not isinstance(src, fx.Node):
                return False
            # A view of a leaf is a leaf (the caller takes it): only what a view makes by
            # blocks joins the chain.
            if not self._made_by_rows(src, sv):
                return False
            self.chain.add(n)
            return True
        if target is aten.bmm.default:
            # A block of whole batches is the product of those batches of both operands
            # (leaves, read by ranges of batches).
            a, w = n.args[:2]
            if not isinstance(a, fx.Node) or not isinstance(w, fx.Node) or v.ndim != 3:
                return False
            if a in self.chain or w in self.chain or _val(a) is None or _val(w) is None:
                return False
            self.align = math.lcm(self.align, v.shape[1])
            self.chain.add(n)
            self.leaves |= {a, w}
            self.batched |= {a, w}
            return True
        if target in _MATMULS:
            a, w = (n.args[0], n.args[1]) if target is aten.mm.default else n.args[1:3]
            bias = n.args[0] if target is aten.addmm.default else None
            if not isinstance(a, fx.Node) or not isinstance(w, fx.Node):
                return False
            wv = _val(w)
            if wv is None or w in self.chain or wv.ndim != 2:
                return False
            self.chain.add(n)
            if not self.operand(a, v, matmul=True):
                return False
            if bias is not None and not (isinstance(bias, fx.Node) and self.operand(bias, v)):
                return False
            self.leaves.add(w)
            self.whole.add(w)
            return True
        if _row_op(n) is not None:  # a row's values from that row's alone
            self.chain.add(n)
            return all(self.operand(a, v) for a in n.args if isinstance(a, fx.Node))
        form = _functional(n)
        # An elementwise op the in-place pass wrote into an operand is, by blocks, its
        # functional op (the operand it wrote into dies there: nothing reads it after).
        in_place = form is not None and form[1] is not None
        pointwise = (
            isinstance(target, torch._ops.OpOverload)
            and torch.Tag.pointwise in target.tags
            and not any(isinstance(k, fx.Node) for k in n.kwargs.values())
        )
        if not (in_place or pointwise):
            return False
        if any(
            isinstance(a, (list, tuple)) and any(isinstance(x, fx.Node) for x in a) for a in n.args
        ):
            return False
        self.chain.add(n)
        return all(self.operand(a, v) for a in n.args if isinstance(a, fx.Node))

    def late(self, order: dict[fx.Node, int]) -> frozenset[fx.Node]:
        """The chain values read after the op, or graph outputs."""
        inside = self.chain | {self.op_node}
        return frozenset(
            c
            for c in self.chain
            if any(
                u not in inside and (u.op == "output" or order[u] > order[self.op_node])
                for u in c.users
            )
        )

    def shared(
        self, order: dict[fx.Node, int], absorbed: Collection[fx.Node] = ()
    ) -> set[fx.Node] | None:
        """The chain values that stay in the graph for other readers (the blocks make them
        again), with the chain values they read; ``None`` when a chain value has a reader
        after the op (holding it whole there too would gain nothing) or is a graph output,
        or a chain value is also a leaf. ``absorbed``: readers the blocks make too (with the
        views on their way), which keep nothing."""
        if self.chain & self.leaves:
            return None
        inside = self.chain | {self.op_node} | set(absorbed)
        kept: set[fx.Node] = set()
        for c in self.chain:
            outside = [u for u in c.users if u not in inside]
            if any(u.op == "output" or order[u] > order[self.op_node] for u in outside):
                return None
            if outside:
                kept.add(c)
        todo = list(kept)
        while todo:  # what a kept value reads must stay too
            for a in todo.pop().all_input_nodes:
                if a in self.chain and a not in kept:
                    kept.add(a)
                    todo.append(a)
        return kept


def find_row_tilings(
    gm: fx.GraphModule, *, blocks: int = BLOCKS, max_kept_matmuls: int = MAX_KEPT_MATMULS
) -> tuple[RowTiling, ...]:
    """The elementwise ops of the built graph ``gm`` that can be made a block of rows at a time
    (see the module docstring), in graph order. Decides only: ``gm`` is not changed, and the
    bit-identity probe has not run (:func:`row_tile_pass` runs it). ``max_kept_matmuls``:
    matmuls an op's blocks may make again; a chain that would make more reads them whole
    instead, as leaves (no time, but held whole up to the op)."""
    return find_row_tilings_each(gm, (max_kept_matmuls,), blocks=blocks)[max_kept_matmuls]


def find_row_tilings_each(
    gm: fx.GraphModule,
    allowances: Sequence[int],
    *,
    blocks: int = BLOCKS,
    start: int = 0,
    stop: int | None = None,
) -> dict[int, tuple[RowTiling, ...]]:
    """:func:`find_row_tilings` of ``gm`` with each of ``allowances`` as ``max_kept_matmuls``,
    in one search: each op's chain is searched once with no leaf given (the same search for
    every allowance), and once more with the matmuls it would make again read whole, where
    some allowance is below their count. ``start``, ``stop``: only the ops at those positions
    of ``gm``'s nodes (each op's tiling is its own: the tilings of a range of ops are those
    the whole search finds there)."""
    owned = owned_nodes(gm)
    nodes = list(gm.graph.nodes)
    order = {m: i for i, m in enumerate(nodes)}
    found: dict[int, list[RowTiling]] = {k: [] for k in allowances}
    for n in nodes[start:stop]:
        form = _functional(n) or _reduction(n) or _row_op(n)
        v = _val(n)
        if form is None or v is None or n not in owned:
            continue
        # What the blocks' rows are rows of: the result, or a reduction's input.
        rowed = v if _shaped(form[0]) else n.args[0].meta["val"]  # type: ignore[union-attr]
        if _static(v.shape) is None or _static(rowed.shape) is None:
            continue
        if rowed.ndim < 2 or not v.is_contiguous() or rowed.numel() == 0:
            continue
        if any(u.op == "output" for u in n.users):
            continue
        first = _tiling(n, form[0], rowed, owned, nodes, order, blocks, frozenset())
        again = None  # with the matmuls it would make again read whole, where one asks for it
        if first is not None and len(first.kept_matmuls) > min(allowances):
            as_leaves = first.kept_matmuls
            again = _tiling(n, form[0], rowed, owned, nodes, order, blocks, as_leaves)
        for k in allowances:
            found_one = first if first is None or len(first.kept_matmuls) <= k else again
            if found_one is not None and len(found_one.kept_matmuls) <= k:
                found[k].append(found_one.tiling)
    return {k: tuple(v) for k, v in found.items()}


@dataclass(frozen=True)
class _Found:
    tiling: RowTiling
    kept_matmuls: frozenset[fx.Node]


def _absorbed_path(bmm: fx.Node, chain: Collection[fx.Node]) -> tuple[int, list[fx.Node]] | None:
    """``(i, path)`` when operand ``i`` of batched matmul ``bmm`` is a value of ``chain`` seen
    through views of it that nothing else reads (in its memory order, then transposes of later
    dims): ``path`` is that value, then each view in order; ``None`` when neither operand is
    one."""
    for i, a in enumerate(bmm.args[:2]):
        views: list[fx.Node] = []
        while isinstance(a, fx.Node) and a not in chain:
            transposed = _batch_dims(a)
            # Walking back from the operand: transposes first, then views.
            if len(a.users) != 1 or not (transposed or _same_view(a)):
                break
            if transposed and views and not _batch_dims(views[0]):
                break
            views.insert(0, a)
            a = a.args[0]
        if isinstance(a, fx.Node) and a in chain and views:
            return i, [a, *views]
    return None


def _same_view(n: fx.Node) -> bool:
    """A view of its input in the same memory order (``_VIEWS``, an ``expand`` to its own
    shape)."""
    if n.target in _VIEWS:
        return True
    if n.target is not aten.expand.default or not isinstance(n.args[0], fx.Node):
        return False
    v, src = _val(n), _val(n.args[0])
    return v is not None and src is not None and v.shape == src.shape


def _absorbable(
    search: _Chain, kept: set[fx.Node], order: dict[fx.Node, int], rows: int
) -> dict[fx.Node, tuple[int, list[fx.Node]]]:
    """The readers of kept chain values the blocks can make instead, so that those values are
    not kept: for a kept value whose every reader outside the chain is, through views of
    it that nothing else reads, a batched matmul whose other operand is not a chain value,
    whose blocks are whole batches of the value's rows, and whose result nothing but views
    reads before the op. Matmul -> :func:`_absorbed_path`."""
    op = search.op_node
    found: dict[fx.Node, tuple[int, list[fx.Node]]] = {}
    for c in sorted(kept, key=order.__getitem__):
        outside = [u for u in c.users if u not in search.chain and u is not op]
        if not outside or c.target in _VIEWS:
            continue
        mine: dict[fx.Node, tuple[int, list[fx.Node]]] = {}
        for u in outside:
            bmm = u
            while bmm.target is not aten.bmm.default and len(bmm.users) == 1:
                bmm = next(iter(bmm.users))
            made = _absorbed_path(bmm, {c}) if bmm.target is aten.bmm.default else None
            if made is None or made[1][1] is not u or not _absorbs(bmm, made, order, op, rows):
                break
            other = bmm.args[1 - made[0]]
            if not isinstance(other, fx.Node) or other in search.chain:
                break
            mine[bmm] = made
        else:
            found.update(mine)
    return found


def _absorbs(
    bmm: fx.Node,
    made: tuple[int, list[fx.Node]],
    order: dict[fx.Node, int],
    op: fx.Node,
    rows: int,
) -> bool:
    # Static 3-d batches, whole batches per block of the chain value's rows, and every reader
    # of the product before the op a view (the views move after the blocks with it).
    v = _val(bmm)
    first = next((m for m in reversed(made[1]) if not _batch_dims(m)), made[1][0])
    fv = _val(first)
    if v is None or fv is None or v.ndim != 3 or _static(v.shape) is None:
        return False
    if fv.ndim != 3 or fv.shape[0] != v.shape[0] or rows % v.shape[0]:
        return False
    todo = list(bmm.users)
    while todo:
        u = todo.pop()
        if u.op == "output" or order[u] > order[op]:
            continue
        if u.target not in _VIEWS and not _batch_dims(u):
            return False
        todo += u.users
    return True


def _tiling(
    n: fx.Node,
    op: torch._ops.OpOverload,
    rowed: torch.Tensor,
    owned: set[fx.Node],
    nodes: list[fx.Node],
    order: dict[fx.Node, int],
    blocks: int,
    as_leaves: frozenset[fx.Node],
) -> _Found | None:
    """The tiling of op node ``n`` (rows of ``rowed``) with the nodes ``as_leaves`` read whole
    as leaves, and the matmuls its blocks make again; ``None``: not worth it, or not possible."""
    rows = _rows_of(rowed)
    operands = [a for a in (n.args if _shaped(op) else n.args[:1]) if isinstance(a, fx.Node)]
    for _ in range(_SEARCHES):
        search = _Chain(n, owned, rows, as_leaves)
        if not all(search.operand(a, rowed) for a in operands):
            return None
        # A value read after the op (a residual stream's gradient) is whole there anyway: it
        # is read whole, as a leaf, and the search runs again without it.
        late = search.late(order)
        if not late:
            break
        as_leaves |= late
    else:
        return None
    kept = search.shared(order)
    if kept is None:
        return None
    # An earlier reader of a kept value that is a batched matmul is made by the blocks too: the
    # value is then made by the blocks only (the probabilities, read whole by the value
    # gradient before their gradient is made).
    absorbed = _absorbable(search, kept, order, rows)
    if absorbed:
        extra = {m for bmm, (_, path) in absorbed.items() for m in (bmm, *path[1:])}
        again = search.shared(order, extra)
        if again is None:
            return None
        kept = again
        for bmm, (i, _) in absorbed.items():
            other = bmm.args[1 - i]
            assert isinstance(other, fx.Node)
            search.leaves.add(other)
            search.batched.add(other)
            search.align = math.lcm(search.align, rows // bmm.meta["val"].shape[0])
    # A swapped operand read by rows only is reloaded a block at a time from its host copy; one
    # read only by batched matmuls, a range of batches at a time.
    readers = (search.chain - kept) | {n} | set(absorbed)
    reloaded = _reloaded(search.rowed - search.whole - search.batched, readers, search.leaves)
    others = search.rowed | search.whole | search.periodic
    batches = _reloaded(search.batched - others, readers, search.leaves, batched=True)
    if not search.chain and not reloaded:
        return None
    chain = sorted(search.chain, key=order.__getitem__)
    sources = [
        _source(leaf, batched=leaf in batches) if leaf in reloaded | batches else leaf
        for leaf in search.leaves
    ]
    # The blocks read the leaves at the op, where the chain read them from its first node.
    start = order[chain[0]] if chain else order[n]
    if written_between(nodes, sources, start + 1, order[n]):
        return None
    gone = [c for c in chain if c.target not in _VIEWS and c not in kept]
    gone += [_reloaded_by(leaf)[1] for leaf in sorted(reloaded, key=order.__getitem__)]
    gone += [_reloaded_by(leaf, batched=True)[1] for leaf in sorted(batches, key=order.__getitem__)]
    nbytes = sum(c.meta["val"].untyped_storage().nbytes() for c in dict.fromkeys(gone))
    # Worth its kernel calls: operands of at least half the result's bytes go.
    if 2 * nbytes < n.meta["val"].untyped_storage().nbytes():
        return None
    tiling = RowTiling(
        node=n.name,
        op=str(op),
        chain=tuple(c.name for c in chain),
        kept=tuple(c.name for c in chain if c in kept),
        leaves=tuple(sorted(m.name for m in search.leaves)),
        reloaded=tuple(sorted(m.name for m in reloaded)),
        rows=rows,
        blocks=max(1, min(blocks, rows)),
        nbytes=nbytes,
        align=search.align,
        reloaded_batches=tuple(sorted(m.name for m in batches)),
        absorbed=tuple(m.name for m in sorted(absorbed, key=order.__getitem__)),
    )
    return _Found(
        tiling, frozenset(c for c in kept if c.target in _MATMULS or c.target is aten.bmm.default)
    )
