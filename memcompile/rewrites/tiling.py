"""Row tiling: an elementwise result made a block of rows at a time, from operands that then
exist only a block at a time.

In a built backward, an elementwise op often reads values made just for it: a pre-activation
the plan recomputes, a gradient the graph broadcasts and scales. Branchy's branch backward at
bench size holds three 16 MiB tensors for one 16 MiB result (the recomputed pre-activation,
the dense scaled gradient, and the result written into it). Each row of the result depends on
the same row of those operands only, so they can be made a block of rows at a time:

    built backward before                               after
      g = div(expand(dy, [B, T, H]), H)                   out = empty([B*T, H])
      p = view(addmm(b, x, w_t), [B, T, H])               for each block r of rows (BLOCKS):
      gx = gelu_backward(g, p)                              g_r = div(view(expand(..))[r], H)
      ... = sum(view(gx, ..)); mm(t(view(gx)), x)           p_r = addmm(b, x[r], w_t)
                                                            gelu_backward.grad_input(
                                                                g_r, p_r, grad_input=out[r])
                                                          gx = view(out, [B, T, H])

The result is whole again for its readers (the weight gradient sums over every row: making it
by blocks would change the order of that sum), so only the operands' memory goes: the result
plus one block of each, instead of the result and every operand.

**What is tiled.** The *op* is an elementwise op with an ``out=`` form (``inplace.OPS`` and
``FORWARD_OPS``, or that form already, writing into an operand), a ``mean``/``sum`` over the
last dim only (branchy's forward: the mean of a GELU of a linear layer, whose 16 MiB GELU
output is then never whole), or ``_softmax``/``_softmax_backward_data`` over the last dim
(:data:`_ROW_OPS`), whose result is dense, with static sizes, and not a graph output.
Its *chain* is the values it reads, transitively, that are made row by row: ``view``/``reshape``
between ``[B, T, H]`` and ``[B*T, H]`` of such a value, pointwise ops (``torch.Tag.pointwise``;
an elementwise ``out=`` node that wrote into its operand counts as its functional op; ``detach``
and ``alias`` count as views), the row ops of :data:`_ROW_OPS`, ``mm``/``addmm`` whose row
operand is such a value or a leaf, and ``bmm`` of two leaves (blocks then hold whole batches:
``align`` rows). An op inside another's chain goes with that chain, unless the other keeps it
whole for earlier readers (then it is made by its own blocks too, where neither removes what
the other reads). Everything the chain reads from outside is a *leaf*, read whole: a leaf with
the op's rows is sliced per block (``view`` to ``[rows, k]`` first), a ``bmm``'s operands by
ranges of batches, one whose leading sizes are all 1 (a bias, a scalar) is read as it is, one
whose ``[P, k]`` rows repeat every ``P`` rows of its reader (a causal mask read by
``[B, H, T, T]`` scores) is repeated per block, a matmul's right operand always whole; any other
leaf leaves the op untiled. Values are handled as ``[rows, k]`` throughout. A chain value read
after the op is whole there anyway: it is read as a leaf instead, and the search runs again.

A chain value that other nodes read too is *kept*: it stays in the graph for them and the
blocks make it again (GPT's recomputed pre-activation, read by the GELU for the down
projection's weight gradient and then by the GELU's gradient: it now dies at the GELU, which
the in-place pass then writes into). Only when those readers all come before the op (else it
would be held whole at the op anyway), and with at most ``max_kept_matmuls`` matmuls made
again (:data:`MAX_KEPT_MATMULS`): a chain that would make more reads those matmuls whole, as
leaves, instead (no time; held whole up to the op). The compiler tries none first. The op is
tiled only where the values that go are at least half its result's bytes, and where nothing
between the chain's first node and the op writes into a leaf (the blocks read the leaves at
the op).

**Absorbed readers.** Where every other reader of a kept value is a ``bmm`` that reads it
through views nothing else reads (in its memory order, then transposes of later dims), whose
other operand is not made by the chain, and whose product nothing but views reads before the
op, the blocks make those products too, each block its own batches into the product's buffer
(``bmm.out``), and the value is not kept. Hand-written attention's value gradient reads the
recomputed probabilities before their gradient is made::

    before                                      after
      p = _softmax(scores)  # whole, 8 MiB        d_v = empty([B*H, T, D])
      d_v = bmm(transpose(view(p)), d_out)        for each block r of whole batches:
      d_s = _softmax_backward_data(d_p, p, ...)     p_r = _softmax(scores_r)
                                                    bmm.out(transpose(view(p_r)), d_out[r],
                                                            out=d_v[r])
                                                    _softmax_backward_data.out(d_p_r, p_r, ...)

so the probabilities are made once per step instead of twice (their own blocks for ``d_v``,
then the gradient's), and never whole. The product's views placed before the op move after
it; the probe compares the products too.

**Reloads by rows.** A leaf that is a swapped tensor's ``reload`` (or a view of it), read by
rows only, goes with its ``wait``: each block reloads its own rows from the host copy, on a GPU
the next block's copy issued before this block computes, so that it overlaps (on a CPU the copy
runs on the computing thread: issued early it would only be held through this block)::

    before                                       after
      h = memcompile.reload(h_host, dev, s, 0)     for each block r of rows:
      memcompile.wait(h, s)                          h_r = memcompile.reload(
      gx = gelu_backward(g, view(h, [B, T, H]))          view(h_host, [B*T, H])[r], dev, s, 0)
                                                     memcompile.wait(h_r, s)
                                                     gelu_backward.grad_input(g_r, h_r, ...)

(branchy's host tier: a plan that swaps every pre-activation peaks as low as one that
recomputes them, without their matmuls). Likewise a reload read only as a batched matmul's
operand (directly, or through views and transposes of its later dims, ``v.transpose(1, 2)``):
each block reloads its own batches, the host copy's first dim, and makes the leaf's views of
them (hand-written attention's host tier: the values, reloaded whole for the probabilities'
gradient, 2 MiB a layer at the bench GPT's size, held beside the scores' blocks).

**Bit-identical, measured.** A block of rows of ``addmm`` is the same dot products as the whole,
and an elementwise kernel computes each element alike, but that is the kernels' business (a
BLAS may pick another path for fewer rows). So each distinct chain is run once, whole and by
blocks, on random values of its leaves' metadata, on the graph's device, and tiled only if the
results are bitwise equal (:func:`tiles_exactly`; cached per chain). A chain that differs is
left as it was and logged.

Decided by :func:`find_row_tilings`, rewritten by :func:`row_tile_pass`. The compiler tries the
pass on built graphs whose plan is over its target and keeps it only where the exact profile's
peak drops (``backends/compiler.py``), as for ``inplace.py``'s ``built=True``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch.utils._python_dispatch import _disable_current_modes

from memcompile.analysis.workspace import materialize
from memcompile.rewrites.context import PassContext
from memcompile.rewrites.inplace import FORWARD_OPS, OPS, owned_nodes
from memcompile.rewrites.rebuild import rebuilt_module, refresh_view, storage_refs
from memcompile.rewrites.rematerialize import written_between

log = logging.getLogger(__name__)

__all__ = ["BLOCKS", "RowTiling", "find_row_tilings", "row_tile_pass", "tiles_exactly"]

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
#: Name prefix of the nodes the pass creates.
PREFIX = "tiled"


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


def _reloaded(rowed: set[fx.Node], readers: set[fx.Node], *, batched: bool = False) -> set[fx.Node]:
    """The leaves of ``rowed`` (read only by rows; ``batched``: only by ranges of batches) whose
    reload can go: they and what makes them from the host copy (:func:`_reload_path`) are read
    by ``readers`` (the nodes the rewrite removes) only."""
    found = set()
    for leaf in rowed:
        made = _reload_path(leaf, batched=batched)
        if made is None:
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
    owned = owned_nodes(gm)
    nodes = list(gm.graph.nodes)
    order = {m: i for i, m in enumerate(nodes)}
    found = []
    for n in gm.graph.nodes:
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
        found_one = _tiling(n, form[0], rowed, owned, nodes, order, blocks, frozenset())
        if found_one is not None and len(found_one.kept_matmuls) > max_kept_matmuls:
            as_leaves = found_one.kept_matmuls
            found_one = _tiling(n, form[0], rowed, owned, nodes, order, blocks, as_leaves)
        if found_one is not None and len(found_one.kept_matmuls) <= max_kept_matmuls:
            found.append(found_one.tiling)
    return tuple(found)


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
    reloaded = _reloaded(search.rowed - search.whole - search.batched, readers)
    others = search.rowed | search.whole | search.periodic
    batches = _reloaded(search.batched - others, readers, batched=True)
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


#: Probe results by (graph code, leaf metadata, device).
_exact_cache: dict[tuple[object, ...], bool] = {}


def _leaf_key(v: torch.Tensor) -> tuple[object, ...]:
    return (tuple(v.shape), tuple(v.stride()), v.storage_offset(), v.dtype, str(v.device))


def tiles_exactly(whole: fx.Graph, tiled: fx.Graph, leaves: Sequence[torch.Tensor]) -> bool:
    """Whether ``tiled`` gives bitwise the result of ``whole`` on random values of ``leaves``'
    metadata (fake tensors), run on their device. Cached per code and metadata."""
    key = (whole.python_code("self").src, tiled.python_code("self").src, *map(_leaf_key, leaves))
    if key in _exact_cache:
        return _exact_cache[key]
    device = leaves[0].device if leaves else torch.device("cpu")
    devices = [device] if device.type == "cuda" else []
    with _disable_current_modes(), torch.random.fork_rng(devices=devices), torch.no_grad():
        results = []
        for graph in (whole, tiled):
            torch.manual_seed(0)  # the same leaf values for both (the op may write into one)
            inputs = materialize(list(leaves), device, {})
            module = fx.GraphModule(torch.nn.Module(), graph)
            out = module(*inputs)
            results.append((out,) if isinstance(out, torch.Tensor) else tuple(out))
        same = len(results[0]) == len(results[1]) and all(
            a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b)
            for a, b in zip(results[0], results[1], strict=True)
        )
    _exact_cache[key] = same
    return same


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


def _inline(
    new: fx.Graph, tiled: fx.Graph, leaves: Sequence[fx.Node], fake_mode: Any
) -> tuple[fx.Node, ...]:
    """Copy ``tiled`` into ``new`` at its end, its placeholders being ``leaves``; the nodes of
    its results. Each new node gets its fake value (a view of the buffer it writes into)."""
    local: dict[fx.Node, fx.Node] = dict(
        zip(tiled.find_nodes(op="placeholder"), leaves, strict=True)
    )
    result = None
    for m in tiled.nodes:
        if m.op == "placeholder":
            continue
        if m.op == "output":
            result = tuple(local[r] for r in m.args[0])  # type: ignore[union-attr]
            continue
        args, kwargs = fx.node.map_arg((m.args, m.kwargs), local.__getitem__)
        made = new.create_node(
            "call_function",
            m.target,
            args,  # type: ignore[arg-type]
            kwargs,  # type: ignore[arg-type]
            name=f"{PREFIX}_{m.name}",
        )
        vals = fx.node.map_arg((args, kwargs), lambda a: a.meta["val"])
        with fake_mode:
            made.meta["val"] = m.target(*vals[0], **vals[1])  # type: ignore[operator]
        local[m] = made
    assert result is not None
    return result


def row_tile_pass(
    gm: fx.GraphModule,
    ctx: PassContext,
    *,
    blocks: int = BLOCKS,
    max_kept_matmuls: int = MAX_KEPT_MATMULS,
    decided: tuple[RowTiling, ...] | None = None,
    ahead: bool | None = None,
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
    that computes, and hides nothing)."""
    if decided is None:
        decided = find_row_tilings(gm, blocks=blocks, max_kept_matmuls=max_kept_matmuls)
    # An op that another's chain makes by blocks goes with that chain (its own blocks would
    # read values the other removes); one the other keeps whole for earlier readers (the
    # probabilities the value gradient reads first) is made by its own blocks too, where
    # neither removes what the other reads.
    nodes = {n.name: n for n in gm.graph.nodes}
    inside = {c for t in decided for c in t.chain if c not in t.kept}
    chosen: list[RowTiling] = []
    for t in (t for t in decided if t.node not in inside):
        if all(
            not _removed(t, nodes) & set(o.leaves) and not _removed(o, nodes) & set(t.leaves)
            for o in chosen
        ):
            chosen.append(t)
    decided = tuple(chosen)
    if not decided:
        return gm
    graphs = {}
    for t in decided:
        # Probed with the reloaded leaves sliced (a reload copies their bits).
        whole, probe = _whole_graph(gm, t), _Blocks(gm, t, reload=False).build()
        leaves = [nodes[name].meta["val"] for name in t.leaves]
        if tiles_exactly(whole, probe, leaves):
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
    done: list[RowTiling] = []
    for n in gm.graph.nodes:
        if n.name in skipped or n.name in held:
            continue
        entry = graphs.get(n.name)
        if entry is None:
            env[n] = new.node_copy(n, lambda a: env[a])
            if n.op == "call_function" and storage_refs(n.meta.get("val")) & replaced:
                refresh_view(env[n], n, fake_mode)
            continue
        t, tiled, inputs = entry
        result, *products = _inline(new, tiled, [env[m] for m in inputs], fake_mode)
        for m, made in zip(
            (n, *(nodes[name] for name in t.absorbed)), (result, *products), strict=True
        ):
            replaced.update(storage_refs(m.meta.get("val")))
            env[m] = made
        for v in deferred[n.name]:
            env[v] = new.node_copy(v, lambda a: env[a])
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
