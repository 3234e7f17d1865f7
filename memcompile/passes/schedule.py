"""Memory-aware ordering: linearize parallel work so values die as early as possible.

A greedy list scheduler over a set of nodes of the joint graph (the forward, or the backward the
planner built). Among the nodes whose inputs are ready it runs the one that adds the least memory
(bytes it allocates minus bytes whose last use it is); ties go to the node enabled most recently
(so a branch is finished before the next one starts), then to the original order:

    breadth-first code                          scheduled
      h1 = mm(x, w1); ...; h8 = mm(x, w8)         h1 = mm(x, w1); g1 = gelu(h1); s1 = sum(g1)
      g1 = gelu(h1);  ...; g8 = gelu(h8)          h2 = mm(x, w2); g2 = gelu(h2); s2 = sum(g2)
      s1 = sum(g1);   ...; s8 = sum(g8)           ...

It changes no op, only the order, so it costs no time. Random ops (dropout) and ops with side
effects keep their relative order: each draws from or changes state the next one sees, so
swapping two dropouts would swap their masks. The joint model replays both this order
and torch's, and keeps the lower peak (``JointModel.evaluate(..., schedule=True)``).
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Iterable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import fx

if TYPE_CHECKING:
    from memcompile.passes.joint import JointModel

__all__ = ["draws_random", "has_effect", "schedule"]


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


def schedule(
    model: JointModel,
    nodes: Sequence[int],
    *,
    entry: Iterable[int] = (),
    keep: Collection[int] = (),
    late: Collection[int] = (),
) -> list[int]:
    """A low-peak topological order of ``nodes`` (joint-graph indices, given in a valid order).

    Args:
        model: the joint model (inputs, storages and sizes of the nodes).
        nodes: the nodes to order; inputs outside this set are available from the start.
        entry: storages live before the first node (never counted as allocated by a node).
        keep: storages that survive the whole sequence (outputs, saved tensors).
        late: storages that come into being just before their first use (swapped in).
    """
    members = set(nodes)
    position = {i: p for p, i in enumerate(nodes)}
    live = set(entry) - model.persistent
    keep = set(keep)
    # Pending uses of each storage: a storage dies when the last node using it has run.
    pending: dict[int, int] = {}
    waiting: dict[int, int] = {}
    users: dict[int, list[int]] = {i: [] for i in nodes}
    previous_effect: int | None = None
    for i in nodes:
        deps = [j for j in model.inputs[i] if j in members]
        if model.has_effect[i]:
            if previous_effect is not None:
                deps.append(previous_effect)  # an ordering edge, not a data edge
            previous_effect = i
        waiting[i] = len(set(deps))
        for j in set(deps):
            users[j].append(i)
        for s in model.input_storages[i]:
            pending[s] = pending.get(s, 0) + 1

    inputs_storages = model.input_storages.__getitem__  # precomputed: called per step

    def delta(i: int) -> int:
        allocated = {s for s in model.storages[i] if s not in live and s not in model.persistent}
        allocated |= {s for s in inputs_storages(i) if s in late and s not in live}
        dying = {
            s
            for s in inputs_storages(i) | set(model.storages[i])
            if pending.get(s, 0) <= (1 if s in inputs_storages(i) else 0)
            and s not in keep
            and s not in model.persistent
        }
        return sum(model.nbytes[s] for s in allocated) - sum(model.nbytes[s] for s in dying)

    clock = 0
    ready: list[tuple[int, int, int, int]] = []  # (delta, -enabled at, position, node)
    enabled: dict[int, int] = {}
    for i in nodes:
        if waiting[i] == 0:
            enabled[i] = clock
            heapq.heappush(ready, (delta(i), 0, position[i], i))
    order: list[int] = []
    # Only storages a node touches can die when it runs; entry storages nobody reads go after
    # the first node (checking the whole live set at every step is quadratic on big graphs).
    unread_entry = [s for s in live if pending.get(s, 0) <= 0]
    while ready:
        _, neg_t, _, i = heapq.heappop(ready)
        # Scores go stale as memory changes: re-score once before committing to a node.
        fresh = (delta(i), neg_t, position[i], i)
        if ready and fresh > ready[0]:
            heapq.heappush(ready, fresh)
            continue
        order.append(i)
        clock += 1
        for s in inputs_storages(i):
            pending[s] -= 1
            if s in late:
                live.add(s)
        live.update(s for s in model.storages[i] if s not in model.persistent)
        for s in [*unread_entry, *inputs_storages(i), *model.storages[i]]:
            if pending.get(s, 0) <= 0 and s not in keep:
                live.discard(s)
        unread_entry = []
        for u in users[i]:
            waiting[u] -= 1
            if waiting[u] == 0:
                enabled[u] = clock
                heapq.heappush(ready, (delta(u), -clock, position[u], u))
    if len(order) != len(nodes):
        raise AssertionError("schedule: the nodes do not form a DAG closed under their inputs")
    return order
