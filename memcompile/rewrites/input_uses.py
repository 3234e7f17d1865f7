"""One placeholder per read of a fragment input, so its gradient adds up in eager's order.

A fragment input ``h`` read by two ops of the fragment gets one gradient from AOTAutograd: its
backward graph adds the two contributions, and autograd then adds that sum to what the rest of
the step gave ``h`` (a later fragment, eager code). Eager adds the three one at a time, so the
association differs and so do the last bits of every gradient behind ``h`` (``torch.compile``'s
own ``aot_eager`` differs the same way). Here each read takes a placeholder of its own, fed an
alias of the same tensor, so each contribution reaches ``h`` by itself (Dynamo graph, before
AOTAutograd):

    F(w, h):                              F(w, h, h_0, h_1):
        y = linear(h, w) * h.sin()            y = linear(h_0, w) * h_1.sin()
    called F(w, h)                        called F(w, h, alias(h), alias(h))  # AliasBackward0

The order matches eager's. Eager's backward runs autograd nodes newest first and adds one
node's edges in order; each read's edges are found by running its op on fake tensors, a fresh
leaf per argument slot. The alias nodes run newest first too (autograd's ready queue), so they
are made in the reverse of the order eager adds the reads' contributions; every read gets one,
``h`` itself none. That also places what the rest of the step adds through a returned view of
``h`` (``h.view(-1, d)`` at the top of an MoE block whose experts run later): AOTAutograd makes
that view again outside its graph from the last input sharing ``h``'s storage
(``collect_metadata_analysis``: ``inp_storage_refs``), which is the newest alias, the one
whose node runs first, so those contributions are added first, as eager adds them. Appending
the new placeholders keeps every other input's position (host placement and the plans key on
them).

Parameters are split the same way when the ``split_param_reads`` option asks: a weight a
fragment reads more than once (tied, or with its transpose) then gets one ``AliasBackward0``
edge per read into its ``AccumulateGrad``. The aliases keep Dynamo's static-input marking (they
share the parameter's storage); when the parameter moves to the host tier its aliases are
fetched like it (``alias_sources`` in ``backends/fragment_build.py``), and only it moves.

Left alone, summed in-graph as before (bit-identical to eager unless the rest of the step adds
to the same gradient first; then as ``aot_eager``):

* parameters and Dynamo's static inputs, by default. A split returns one gradient per read at
  the end of the backward instead of a running sum: an unrolled recurrence reads its weight
  once per time step (the zoo GRU: its tiny step measured 791,016 B split against 328,424 B
  whole), a shared transformer layer once per layer. A split is needed only where the
  fragment's backward runs after something else added to the weight's gradient (the same
  fragment called again later in the step, or another fragment reading the weight), which is
  known once a step has run, not when the fragment compiles: the parameters left summed are
  ``InputSplit.summed``, and the compiler warns after a step where one of them got an earlier
  contribution (``StepChecks.grad_order``);
* inputs the fragment mutates (aliased mutated inputs take AOTAutograd's synthetic-base path).
  Nothing can add to such an input's gradient before the fragment's backward does: every op
  newer than the fragment reads the mutated value, whose gradient reaches the fragment's
  backward as an incoming gradient, and the version before the mutation is read only by older
  ops, whose backward runs later. The backward graph adds the fragment's own contributions in
  the order AOTAutograd's trace of autograd added them, eager's (tested with values whose sum
  shows the order);
* inputs one op reads through several autograd edges from one argument (``torch.rms_norm`` is
  ``x * rsqrt(x.pow(2).mean())``): no placeholder split reproduces eager's order there, and
  splitting the other reads would break what is exact today (nothing else adds first). They
  are in ``InputSplit.summed`` too, and warned about the same way.

Reads that add nothing (``h.size()``, ``h.detach()``) keep ``h``.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch._dynamo
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_leaves

from memcompile.rewrites.context import PassContext

log = logging.getLogger(__name__)

__all__ = ["InputSplit", "split_inputs_pass"]

_MUTATING = frozenset(
    {
        operator.setitem,
        operator.iadd,
        operator.isub,
        operator.imul,
        operator.itruediv,
        operator.ifloordiv,
        operator.ipow,
        operator.iand,
        operator.ior,
        operator.ixor,
    }
)


@dataclass(frozen=True)
class InputSplit:
    """The fragment's extra placeholders: ``sources[k]`` is the position of the input whose alias
    feeds placeholder ``n + k`` (``n`` = the Dynamo graph's inputs); ``summed``: positions of
    the inputs whose several contributions the backward graph sums: parameters several reads
    add a gradient to that were not split, and inputs an op reads through several autograd
    edges (``rms_norm``)."""

    sources: tuple[int, ...] = ()
    summed: tuple[int, ...] = ()

    def expand(self, args: Sequence[Any]) -> list[Any]:
        """``args`` and one alias per extra placeholder, made in order (see the module doc)."""
        alias = torch.ops.aten.alias.default
        return [*args, *(alias(args[i]) for i in self.sources)]

    def aliases(self, n: int) -> dict[int, int]:
        """Position of each extra placeholder -> position of the input it aliases, for a graph
        of ``n`` inputs before the split."""
        return {n + k: i for k, i in enumerate(self.sources)}

    def compile_inputs(self, args: Sequence[Any]) -> list[Any]:
        """The example inputs to compile the split graph for: each extra placeholder's is the
        original tensor itself. AOTAutograd traces a repeated input as a detached leaf of its
        own (it is not mutated), with the original's size symbols; a real alias would get
        fresh ones, without a source for Dynamo's guards."""
        return [*args, *(args[i] for i in self.sources)]

    def wrap(self, compiled: Callable[..., Any]) -> Callable[..., Any]:
        """``compiled`` (built for the split graph) called with the Dynamo graph's inputs."""
        if not self.sources:
            return compiled
        expand = self.expand

        def run(*args: Any) -> Any:
            return compiled(*expand(args))

        return torch._dynamo.disable(run, reason="memcompile: calls an AOT-compiled graph")


def _mutates(node: fx.Node) -> bool:
    """Whether ``node`` may write into its arguments (Dynamo graphs: ``x.add_(y)``, ``x[i] = v``,
    ``x += y``, ``out=``)."""
    if node.target in _MUTATING or "out" in node.kwargs:
        return True
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return name.endswith("_") and not name.startswith("_")


def _is_param(ph: fx.Node, example: object) -> bool:
    """A parameter or one of Dynamo's static inputs (held by the module, not the step)."""
    return isinstance(example, torch.nn.Parameter) or bool(
        (ph.meta.get("tensor_dict") or {}).get("_dynamo_static_input_type")
    )


class _Unknown(Exception):
    """A value the fake run cannot stand in for (an unbacked size, a module call)."""


class _SeveralEdges(_Unknown):
    """An op reads the input through several autograd edges from one argument slot: its
    contributions are summed in the backward graph, whatever the split."""


def _hint(v: object) -> object:
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        hint = v.node.hint
        if hint is None:
            raise _Unknown(f"unbacked {v}")
        return hint
    return v


def _fake_like(mode: FakeTensorMode, v: torch.Tensor) -> torch.Tensor:
    sizes = [_hint(s) for s in v.shape]
    strides = [_hint(s) for s in v.stride()]
    with mode:
        return torch.empty_strided(sizes, strides, dtype=v.dtype, device=v.device)  # type: ignore[arg-type]


def _stand_in(mode: FakeTensorMode, value: object) -> object:
    """A fresh fake of Dynamo's example value (no autograd history, concrete sizes)."""
    if isinstance(value, torch.Tensor):
        return _fake_like(mode, value)
    if isinstance(value, (list, tuple)):
        return type(value)(_stand_in(mode, v) for v in value)
    return _hint(value)


class _Run(NamedTuple):
    """What running one op on fake tensors showed: ``(sequence number, edge index, slot)`` of
    each autograd edge from its backward into the value read, and whether it returns that
    value itself (``"same"``: ``x.to(x.dtype)``) or a view of it (``"view"``)."""

    edges: list[tuple[int, int, int]]
    returns: str


def _edges(mode: FakeTensorMode, node: fx.Node, ph: fx.Node) -> _Run:
    """How ``node``'s backward adds into ``ph`` at the argument slots where it reads it:
    ``node`` run on fake tensors of the pass's own ``mode`` (Dynamo's shape environment stays
    untouched), a fresh leaf per slot. Each edge is one separate addition into ``ph``'s
    gradient in eager."""
    leaves: dict[int, int] = {}  # id(leaf) -> slot
    slot = -1

    def arg(a: fx.Node) -> Any:
        nonlocal slot
        slot += 1
        if "example_value" not in a.meta:
            raise _Unknown(f"{a.name} has no example value")
        value = _stand_in(mode, a.meta["example_value"])
        if a is ph:
            assert isinstance(value, torch.Tensor)
            value.requires_grad_()
            leaves[id(value)] = slot
        return value

    args, kwargs = fx.node.map_arg((node.args, node.kwargs), arg)
    with mode, torch.enable_grad():
        if node.op == "call_function":
            out = node.target(*args, **kwargs)  # type: ignore[operator]
        elif node.op == "call_method":
            out = getattr(args[0], node.target)(*args[1:], **kwargs)  # type: ignore[arg-type]
        else:
            raise _Unknown(f"{node.op} {node.target}")
    tensors = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    returns = ""
    if len(tensors) == 1 and len(leaves) == 1:
        (t,) = tensors
        returns = "same" if id(t) in leaves else "view" if id(t._base) in leaves else ""
    elif any(id(t) in leaves for t in tensors):
        raise _Unknown(f"{node.name} returns one of several reads of its input")
    found: list[tuple[int, int, int]] = []
    todo = [t.grad_fn for t in tensors if t.grad_fn is not None]
    seen = {id(fn) for fn in todo}
    while todo:
        fn = todo.pop()
        for index, (nxt, _) in enumerate(fn.next_functions):
            if nxt is None:
                continue
            variable = getattr(nxt, "variable", None)
            if variable is not None and id(variable) in leaves:
                found.append((fn._sequence_nr(), index, leaves[id(variable)]))
            elif id(nxt) not in seen:
                seen.add(id(nxt))
                todo.append(nxt)
    return _Run(found, returns)


#: One read of a placeholder: ``(op, argument slot)`` of each op on the way, the ops before the
#: last returning their input as it is (``h.to(torch.float32)`` on a float32 ``h``) or a view
#: of it that the graph returns (below).
Read = tuple[tuple[fx.Node, int], ...]


class _Facts(NamedTuple):
    """What every placeholder's analysis reads of the graph: node positions, the returned
    nodes, and the fake mode the reading ops run in."""

    order: dict[fx.Node, int]
    returned: set[fx.Node]
    mode: FakeTensorMode


def _arrivals(facts: _Facts, ph: fx.Node) -> tuple[list[Read] | None, bool]:
    """Each read of ``ph`` that adds to its gradient, in the order eager adds them (the newest
    autograd node first, one node's edges in order); ``None`` when an op reads ``ph`` through
    several edges from one slot (a composite op: ``rms_norm``), mutates it, or cannot be run on
    fake tensors, as then no split reproduces eager's order. The flag: it was several edges
    (the backward graph then sums them)."""
    order, returned = facts.order, facts.returned
    found: list[tuple[int, int, int, Read]] = []

    def visit(value: fx.Node, path: Read) -> None:
        for user in sorted(value.users, key=order.__getitem__):
            if user.op == "output":
                # AOTAutograd makes a returned alias of an input again outside its graph:
                # what the rest of the step adds through it arrives first, as in eager.
                continue
            if _mutates(user):
                raise _Unknown(f"{user.name} mutates it")
            run = _edges(facts.mode, user, value)
            # The same tensor: its readers read ph. A returned view that is value's only
            # reader (``h.view(-1, d)`` at the top of an MoE block): eager adds all its
            # readers' contributions in the view's buffer, starting with the rest of the
            # step's, so splitting its readers in this graph adds them in the same order.
            if run.returns == "same" or (
                run.returns == "view" and user in returned and len(value.users) == 1
            ):
                slots = [i for i, a in enumerate(_flat_args(user)) if a is value]
                visit(user, (*path, (user, slots[0])))
                continue
            edges = run.edges
            slots = [slot for _, _, slot in edges]
            if len(slots) != len(set(slots)):
                raise _SeveralEdges(f"{user.name} reads it through several edges")
            found.extend((order[user], seq, i, (*path, (user, slot))) for seq, i, slot in edges)

    try:
        visit(ph, ())
    except Exception as e:  # any op: a split is only ever an option
        log.debug("%s not split: %s", ph.name, e)
        return None, isinstance(e, _SeveralEdges)
    found.sort(key=lambda f: (-f[0], -f[1], f[2]))
    return [read for *_, read in found], False


def _flat_args(node: fx.Node) -> list[fx.Node]:
    flat: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), flat.append)
    return flat


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` anew: Dynamo reads its own graph's placeholders after the backend returns."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        env[node] = graph.node_copy(node, env.__getitem__)
        if hasattr(node, "_dynamo_source"):  # AOTAutograd reads it
            env[node]._dynamo_source = node._dynamo_source  # type: ignore[attr-defined]
    out = fx.GraphModule(gm, graph)
    out.meta = dict(gm.meta)
    if hasattr(gm, "_param_name_to_source"):
        out._param_name_to_source = gm._param_name_to_source
    return out


def _replace_slot(node: fx.Node, slot: int, new: fx.Node) -> None:
    """``node`` reads ``new`` at argument slot ``slot`` (slots as :func:`_edges` counts them)."""
    count = -1

    def swap(a: fx.Node) -> fx.Node:
        nonlocal count
        count += 1
        return new if count == slot else a

    node.args, node.kwargs = fx.node.map_arg((node.args, node.kwargs), swap)


def split_inputs_pass(
    gm: fx.GraphModule,
    ctx: PassContext,
    *,
    example_inputs: Sequence[Any],
    params: bool = False,
) -> fx.GraphModule:
    """A copy of Dynamo's graph ``gm`` with one placeholder per read of each input that several
    reads add a gradient to (module doc); the split is ``meta["memcompile_input_split"]``
    (:class:`InputSplit`). Parameters are split only with ``params``; without it those several
    reads add to are listed in ``InputSplit.summed``. ``gm`` itself is left as it is; with
    nothing to split it is returned (with the split in its ``meta`` when parameters are summed).
    """
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    facts = _Facts(
        order={n: i for i, n in enumerate(gm.graph.nodes)},
        returned=set(_flat_args(gm.graph.output_node())),
        mode=FakeTensorMode(),
    )
    plans: list[tuple[int, list[Read]]] = []
    summed: list[int] = []
    for pos, ph in enumerate(placeholders):
        example = example_inputs[pos] if pos < len(example_inputs) else None
        if not isinstance(example, torch.Tensor) or not example.requires_grad:
            continue
        arrival, several = _arrivals(facts, ph)
        if several:  # summed in the graph, split or not
            summed.append(pos)
        if arrival is None or len(arrival) < 2:
            continue
        if _is_param(ph, example) and not params:
            summed.append(pos)
        else:
            plans.append((pos, arrival))
    if not plans:
        if summed:
            gm.meta["memcompile_input_split"] = InputSplit(summed=tuple(summed))
        return gm
    out = _copy(gm)
    nodes = dict(zip(gm.graph.nodes, out.graph.nodes, strict=True))
    last = list(out.graph.find_nodes(op="placeholder"))[-1]
    sources: list[int] = []
    for pos, arrival in plans:
        ph = nodes[placeholders[pos]]
        for read in reversed(arrival):  # the last-arriving first: its alias node runs last
            with out.graph.inserting_after(last):
                new = out.graph.placeholder(f"{ph.name}_use{len(sources)}")
            # Not Dynamo's grapharg: that one belongs to the original input.
            new.meta = {k: v for k, v in ph.meta.items() if k != "grapharg"}
            new._dynamo_source = None  # type: ignore[attr-defined]
            last, value = new, new
            for op, slot in read[:-1]:  # ops returning their input: a copy per read
                with out.graph.inserting_after(nodes[op]):
                    copy = out.graph.node_copy(nodes[op])
                _replace_slot(copy, slot, value)
                value = copy
            op, slot = read[-1]
            _replace_slot(nodes[op], slot, value)
            sources.append(pos)
        log.debug("%s: input %s: %d reads add to its gradient", ctx.fragment, ph.name, len(arrival))
    out.meta["memcompile_input_split"] = InputSplit(tuple(sources), tuple(summed))
    out.graph.lint()
    out.recompile()
    return out
