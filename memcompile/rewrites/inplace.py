"""Elementwise backward ops in place: the result written into a gradient that dies there.

An elementwise op allocates its output although, in the backward, one of its inputs is often a
gradient read by nothing else, freed right after the op. GPT's MLP backward (bench size, 8 MiB
tensors) holds the reloaded up-projection output ``x``, the gradient ``g`` w.r.t. the GELU
output and a new 8 MiB for ``gelu_backward(g, x)``. The rewrite writes the result into ``g``
with the op's aten ``out=`` overload, the same structured kernel (bit-identical values, no
scratch):

    joint graph before                               after
      g = view(mm(grad_h, w2), [B, T, 4D])             g = view(mm(grad_h, w2), [B, T, 4D])
      gx = gelu_backward(g, x, approximate='tanh')     gx = gelu_backward.grad_input(
                                                            g, x, approximate='tanh', grad_input=g)
      ...                                              ...
      d = add(grad_a, grad_b)  # residual stream       d = add.out(grad_a, grad_b, out=grad_a)

Rewritten ops (:data:`OPS`): ``gelu_backward``, ``threshold_backward`` (ReLU), ``tanh_backward``,
``sigmoid_backward``, ``silu_backward``, ``mul.Tensor`` and ``add.Tensor``. The input written
over (the *destination*) must, conservatively:

* be a gradient: computed from a tangent, so it is new in every backward (a saved activation
  overwritten would be wrong for ``backward(retain_graph=True)``'s second backward), and never
  a graph input (tangents, parameters, user inputs: the caller holds those);
* die at the op: every node sharing its storage (views, the producer) is an ``aten`` node whose
  only readers are the op and other views of it, none a graph output, and the op reads that
  storage through no other argument;
* be laid out as the op's own result: same shape, strides, dtype and device (no broadcasting into
  it, no type promotion), dense and covering its whole storage (a slice written over would keep
  the rest of a bigger buffer alive as long as the result).

The op itself must not be a graph output (autograd's accumulation of a parameter's gradient
then sees the tensor it would otherwise own). The other arguments may broadcast or promote:
the kernel computes exactly as out of place.

**Built graphs** (``built=True``, after partitioning, for a plan over its budget): there a value
the graph computes itself is new in every call whether it comes from a tangent or not (a value
the plan recomputes for the backward, an activation the forward does not save), so any such
value may be the destination, and forward activations (:data:`FORWARD_OPS`: ``gelu``, ``tanh``,
``sigmoid``, ``silu``) are rewritten too:

    built backward before                           after
      h = addmm(b, x, w)        # recomputed          h = addmm(b, x, w)
      y = tanh(h)               # h dies here         y = tanh.out(h, out=h)

Graph inputs (saved values, tangents, parameters) and the memory of memcompile's own ops
(fetches, reloads, which a cache or the tier may share) are never written over. Whether a
rewrite pays is decided on the rewritten graphs' exact profile, with each in-place node probed
as it runs (``workspace.py``): oneDNN's ``gelu_backward`` needs a temporary when it writes into
its input beside a broadcast gradient.

The new node's fake value *is* the destination's, so the analysis (per storage) sees no new
allocation, and the ``out=`` schemas (``Tensor(a!)``) make it an impure node that the schedule
keeps in order with other effects; readers of the result through views get fake values
recomputed from the new node, as in ``losshead.py``. The pass is for the eager inner compiler:
Inductor reuses a dying buffer for a pointwise kernel itself, and a mutating ``out=`` node would
be a fallback kernel that blocks its fusion (``pipeline/search.py`` skips the pass there).
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Collection, Iterable
from dataclasses import dataclass

import torch
from torch import fx
from torch._functorch import partitioners as P
from torch._guards import detect_fake_mode
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.multiprocessing.reductions import StorageWeakRef

from memcompile.analysis.graph import covers_storage, sym_to_int
from memcompile.rewrites.context import PassContext
from memcompile.rewrites.rebuild import copy_node, rebuilt_module, refresh_view, storage_refs

log = logging.getLogger(__name__)

__all__ = ["FORWARD_OPS", "OPS", "InPlaceRewrite", "find_in_place", "in_place_pass", "owned_nodes"]

aten = torch.ops.aten

#: Rewritable op -> (its ``out=`` overload, that overload's out argument name).
OPS: dict[torch._ops.OpOverload, tuple[torch._ops.OpOverload, str]] = {
    aten.gelu_backward.default: (aten.gelu_backward.grad_input, "grad_input"),
    aten.threshold_backward.default: (aten.threshold_backward.grad_input, "grad_input"),
    aten.tanh_backward.default: (aten.tanh_backward.grad_input, "grad_input"),
    aten.sigmoid_backward.default: (aten.sigmoid_backward.grad_input, "grad_input"),
    aten.silu_backward.default: (aten.silu_backward.grad_input, "grad_input"),
    aten.mul.Tensor: (aten.mul.out, "out"),
    aten.add.Tensor: (aten.add.out, "out"),
}

#: Forward elementwise ops rewritten in built graphs only (``built=True``): their input dies
#: there when the plan recomputes it for the backward rather than saving it.
FORWARD_OPS: dict[torch._ops.OpOverload, tuple[torch._ops.OpOverload, str]] = {
    aten.gelu.default: (aten.gelu.out, "out"),
    aten.tanh.default: (aten.tanh.out, "out"),
    aten.sigmoid.default: (aten.sigmoid.out, "out"),
    aten.silu.default: (aten.silu.out, "out"),
}

#: Name prefix of the nodes the pass creates.
PREFIX = "in_place"


@dataclass(frozen=True)
class InPlaceRewrite:
    """One op computed in place.

    Attributes:
        node: the op's node in the graph given to the pass.
        op: the op (``aten.gelu_backward.default``).
        destination: the input node whose memory the result is written into.
        nbytes: bytes the op no longer allocates.
        new: the node that replaced ``node`` (``""`` before the rewrite).
    """

    node: str
    op: str
    destination: str
    nbytes: int
    new: str = ""


def _same(a: Iterable[object], b: Iterable[object]) -> bool:
    # Symbolic sizes are compared without adding guards.
    xs, ys = list(a), list(b)
    if len(xs) != len(ys):
        return False
    return all(statically_known_true(x == y) for x, y in zip(xs, ys, strict=True))  # type: ignore[arg-type]


def _from_tangents(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes computed from a tangent (the backward's own values)."""
    out: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if (n.op == "placeholder" and P._is_tangent(n)) or (
            n.op == "call_function" and any(a in out for a in n.all_input_nodes)
        ):
            out.add(n)
    return out


def owned_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes of a built forward or backward graph that make memory of the graph's own, new in
    every call: aten ops (not memcompile's fetches and reloads, whose memory a cache or the
    tier may share). Views of a graph input are among them, but its storage is not: the input
    shares it, and a destination must be one no input shares (``_dies_here``)."""
    return {
        n
        for n in gm.graph.nodes
        if n.op == "call_function"
        and (
            n.target is operator.getitem
            or (isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "aten")
        )
    }


def _dies_here(
    node: fx.Node, dest: fx.Node, aliases: list[fx.Node], gradients: Collection[fx.Node]
) -> bool:
    alias_set = set(aliases)
    for a in aliases:
        if a.op != "call_function" or a not in gradients:
            return False  # a graph input, or memory that is not the graph's own
        multi = isinstance(a.meta.get("val"), (tuple, list))
        for user in a.users:
            if user is node or user in alias_set:
                continue
            if multi and user.target is operator.getitem:
                continue  # another output of a multi-output op: another storage
            return False  # another reader, or a graph output
    # The op must read the destination's memory through ``dest`` alone.
    return not any(a is not dest and a in alias_set for a in node.all_input_nodes)


def _destination(
    node: fx.Node,
    gradients: Collection[fx.Node],
    holders: dict[StorageWeakRef, list[fx.Node]],
) -> fx.Node | None:
    out = node.meta.get("val")
    if not isinstance(out, torch.Tensor) or any(u.op == "output" for u in node.users):
        return None
    for arg in node.args:  # positional tensor arguments, first dying one wins
        if not isinstance(arg, fx.Node) or arg not in gradients:
            continue
        val = arg.meta.get("val")
        if not isinstance(val, torch.Tensor) or not covers_storage(val):
            continue
        if (val.dtype, val.device) != (out.dtype, out.device):
            continue
        if not (_same(val.shape, out.shape) and _same(val.stride(), out.stride())):
            continue
        aliases = holders[StorageWeakRef(val.untyped_storage())]
        if _dies_here(node, arg, aliases, gradients):
            return arg
    return None


def _forms(built: bool) -> dict[torch._ops.OpOverload, tuple[torch._ops.OpOverload, str]]:
    return {**OPS, **FORWARD_OPS} if built else OPS


def find_in_place(
    gm: fx.GraphModule,
    *,
    ops: Collection[torch._ops.OpOverload] | None = None,
    built: bool = False,
) -> tuple[InPlaceRewrite, ...]:
    """The ops of the joint graph ``gm`` that can write into a dying input (see the module
    docstring), in graph order; ``ops`` restricts the kinds (default: all of :data:`OPS`).
    ``built``: ``gm`` is a built forward or backward graph, where any value the graph makes
    itself may be written over (also :data:`FORWARD_OPS`), not only gradients. Decides only:
    ``gm`` is not changed."""
    forms = _forms(built)
    allowed = forms.keys() if ops is None else [o for o in ops if o in forms]
    unknown = [o for o in (ops or ()) if o not in forms]
    if unknown:
        raise ValueError(f"in_place_pass: no in-place form for {unknown}; known: {list(forms)}")
    gradients = owned_nodes(gm) if built else _from_tangents(gm)
    holders: dict[StorageWeakRef, list[fx.Node]] = {}  # storage -> nodes sharing it
    for n in gm.graph.nodes:
        for s in storage_refs(n.meta.get("val")):
            holders.setdefault(s, []).append(n)
    found = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target not in allowed or n not in gradients:
            continue
        dest = _destination(n, gradients, holders)
        if dest is None:
            continue
        val = n.meta["val"]
        found.append(
            InPlaceRewrite(
                node=n.name,
                op=str(n.target),
                destination=dest.name,
                nbytes=sym_to_int(val.untyped_storage().nbytes())[0],  # int() would guard
            )
        )
    return tuple(found)


def in_place_pass(
    gm: fx.GraphModule,
    ctx: PassContext,
    *,
    ops: Collection[torch._ops.OpOverload] | None = None,
    built: bool = False,
) -> fx.GraphModule:
    """A copy of the joint graph ``gm`` (with ``built``, a built forward or backward graph) with
    the ops :func:`find_in_place` picks computed into their dying input, or ``gm`` itself when
    there is none. ``gm`` is not changed; the copy shares the fake values of every node it
    keeps. The rewrites are in the result's ``meta['memcompile_in_place']`` (a tuple of
    :class:`InPlaceRewrite`, ``new`` filled in)."""
    decided = find_in_place(gm, ops=ops, built=built)
    forms = _forms(built)
    if not decided:
        return gm
    by_name = {r.node: r for r in decided}
    fake_mode = detect_fake_mode([n.meta.get("val") for n in gm.graph.nodes])
    assert fake_mode is not None, "AOT joint graphs carry fake tensors"
    nodes = {n.name: n for n in gm.graph.nodes}

    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    replaced: set[StorageWeakRef] = set()  # storages whose readers need new fake values
    done: list[InPlaceRewrite] = []
    for n in gm.graph.nodes:
        rw = by_name.get(n.name)
        if rw is not None:
            target, out_name = forms[n.target]  # type: ignore[index]
            dest = env[nodes[rw.destination]]
            args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: env[a])
            node = new.create_node(
                "call_function",
                target,
                args,  # type: ignore[arg-type]
                {**kwargs, out_name: dest},  # type: ignore[dict-item]
                name=f"{PREFIX}_{n.name}",
            )
            node.meta = {k: v for k, v in n.meta.items() if k not in ("val", "tensor_meta")}
            node.meta["val"] = dest.meta["val"]  # the result is the destination itself
            replaced.update(storage_refs(n.meta.get("val")))
            env[n] = node
            done.append(InPlaceRewrite(rw.node, rw.op, rw.destination, rw.nbytes, new=node.name))
            continue
        env[n] = copy_node(new, n, lambda a: env[a])
        if n.op == "call_function" and storage_refs(n.meta.get("val")) & replaced:
            # A view of a rewritten result: a view of the destination now, for the analysis.
            refresh_view(env[n], n, fake_mode)

    out = rebuilt_module(gm, new, "memcompile_in_place", done)
    log.info(
        "%s: %d elementwise ops in place (%d bytes not allocated)",
        ctx.fragment,
        len(done),
        sum(r.nbytes for r in done),
    )
    return out
