"""Joint-graph memory model: a training step's memory for a choice of saved storages.

AOTAutograd hands the partitioner one joint graph (forward, then backward). What memcompile's
recompute planning changes is the set ``S`` of storages the forward keeps for the backward; the
rest follows:

    forward    every forward node runs in joint order; a storage in S lives past the end of the
               forward, every other one dies after its last forward use
    backward   walk back from the gradients to what is available (tangents, parameters and
               inputs, S); forward nodes met on the way are recomputed
    order      as torch's ``reordering_to_mimic_autograd_engine``: backward nodes in joint order,
               each preceded by the not-yet-computed nodes it needs, so recomputation sits next
               to its consumer, layer by layer; for the planner's search, values that wait
               across the peak are then computed right before their first reader where that
               lowers it (``schedule.sink``)

:meth:`JointModel.evaluate` replays liveness over both orders with the memory model of
``analysis.profile_graph`` (per storage, freed after last use, measured kernel workspace) in
O(nodes), which is what lets the planner try many sets. The plan it picks is built with torch's
partitioner (``partition.py``) and profiled again exactly.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import logging
import operator
from collections import OrderedDict
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import fx
from torch._functorch import partitioners as P

from memcompile.analysis.costmodel import DeviceProfile
from memcompile.analysis.graph import (
    StorageIds,
    covers_storage,
    draws_random,
    has_effect,
    is_host_value,
    node_cost,
    tensor_vals,
)
from memcompile.analysis.liveness import Liveness, Replayed
from memcompile.analysis.schedule import SinkMemo
from memcompile.analysis.schedule import schedule as schedule_nodes
from memcompile.analysis.schedule import sink as sink_order

log = logging.getLogger(__name__)

__all__ = ["JointEval", "JointModel"]

_PRIMAL, _TANGENT, _FW, _BW, _OTHER = range(5)
_RELOAD = torch.ops.memcompile.reload.default
# The memory-aware orders ``evaluate(..., schedule=True)`` tries besides torch's, as (window,
# lookahead) of ``schedule.schedule``: the free list schedule (finishes parallel branches one by
# one), without and with lookahead (neither wins everywhere: on the bench GPT's forward without a
# budget the lookahead order peaks 2 MB higher), and a local reordering of torch's order (moves a
# recomputation and its consumer ahead of a neighbour allocating a long-lived gradient).
_SCHEDULES: tuple[tuple[int | None, int], ...] = ((None, 1), (None, 3), (16, 3))
# Saved sets whose backward ``JointModel._backward_of`` remembers.
_RECENT = 4
# ``JointModel._backward_of``'s answer.
_Backward = tuple[
    list[int], set[int], frozenset[int], frozenset[int], frozenset[int], tuple[int, ...]
]


@dataclass(frozen=True)
class JointEval:
    """The step under one saved set (all bytes tracked: persistent inputs excluded).

    Attributes:
        saved: storages kept from forward to backward (those the backward actually reads).
        forward_peak, backward_peak: peak of each graph; the backward's includes the user
            outputs the caller holds (the loss) during it.
        accumulate_peak: after the backward, while AccumulateGrad copies mis-laid gradients.
        peak: the largest of the three.
        peak_phase: ``forward``, ``backward`` or ``accumulate``.
        live_at_peak: storages live at the peak moment.
        recompute: joint-graph indices of forward nodes the backward recomputes.
        recompute_time: their predicted time, seconds.
        swapped: storages swapped out after their last forward use and back in before their
            first backward use, with their tier (``host``/``disk``).
        swap_time: predicted seconds of those copies (out and back), not overlapped.
        swappable: saved storages that could be swapped (see :meth:`JointModel.swappable`).
        backward_order: joint indices of the backward graph's nodes, in execution order.
        forward_order: joint indices of the forward graph's nodes, in execution order.
        infeasible: storages that must be saved (not recomputable) but are not in the set.
        saved_inputs: activation inputs (graph inputs that are not parameters or buffers,
            each its whole storage) the backward reads: autograd holds them from forward to
            backward as it holds the saved set (``FragmentProfile.saved_input_bytes``).
    """

    saved: frozenset[int]
    forward_peak: int
    backward_peak: int
    accumulate_peak: int
    peak: int
    peak_phase: str
    live_at_peak: frozenset[int]
    recompute: tuple[int, ...]
    recompute_time: float
    backward_order: tuple[int, ...]
    infeasible: frozenset[int]
    swapped: tuple[tuple[int, str], ...] = ()
    swap_time: float = 0.0
    swappable: frozenset[int] = frozenset()
    forward_order: tuple[int, ...] = ()
    saved_inputs: frozenset[int] = frozenset()

    @property
    def time(self) -> float:
        """Predicted seconds the plan adds to a step (recompute and copies)."""
        return self.recompute_time + self.swap_time

    @property
    def feasible(self) -> bool:
        return not self.infeasible


def _is_view(target: object) -> bool:
    """An aten op whose outputs alias its first input (``detach``, ``split``, ``permute``)."""
    return isinstance(target, torch._ops.OpOverload) and target.is_view


class JointModel:
    """Analysis of one joint graph; :meth:`evaluate` prices a saved set.

    Args:
        joint: the AOT joint graph (forward + backward, ``meta['val']`` on nodes).
        num_fwd_outputs: how many joint outputs belong to the forward.
        static_input_indices: positions of parameters and buffers among the primals.
        profile: the device profile that prices each node (roofline of FLOPs and bytes).
        workspace: measured kernel scratch per node name (``workspace.probe_workspaces``).
        clone_bytes: transient of AccumulateGrad's gradient copies (``FragmentProfile``'s).
        dropped_outputs: positions among the forward's outputs of user outputs the caller
            drops before the backward (seen in a step: a loop keeping only the loss); the
            others are held from the forward's end through the backward.
        released_tangents: names of incoming gradients (``tangents_k``) no one else holds
            through the backward (a step showed it: AOTAutograd's zeros for an output that got
            no gradient): freed after their last reader, the others held to the end.
        remake_views: the backward makes the forward's views again from the values that cover
            their storages instead of taking them as inputs (:attr:`free_views`). Off for
            Inductor's graphs: on the hand-written-attention GPT at 0.6x and 0.5x (CPU), the
            plans it allowed fitted as modelled but Inductor's code peaked 6-25 KiB over them.
    """

    def __init__(
        self,
        joint: fx.GraphModule,
        *,
        num_fwd_outputs: int,
        static_input_indices: Sequence[int],
        profile: DeviceProfile,
        workspace: Mapping[str, int] | None = None,
        clone_bytes: int = 0,
        dropped_outputs: Collection[int] = (),
        released_tangents: Collection[str] = (),
        remake_views: bool = True,
    ) -> None:
        self.joint = joint
        self.remake_views = remake_views
        self.num_fwd_outputs = num_fwd_outputs
        self.static_input_indices = list(static_input_indices)
        nodes = [n for n in joint.graph.nodes if n.op != "output"]
        self.nodes = nodes
        self.index = {n: i for i, n in enumerate(nodes)}
        self._by_name = {n.name: i for i, n in enumerate(nodes)}
        info = P.classify_nodes(joint, self.static_input_indices, num_fwd_outputs)
        self.node_info = info
        ids = StorageIds()
        self.ids = ids
        fw_outs, bw_outs, fw_descs, _ = P._extract_fwd_bwd_outputs(
            joint, num_fwd_outputs=num_fwd_outputs
        )
        # As torch's default partitioner: the forward is every node that does not depend on a
        # tangent, up to the last forward output (values only the backward reads, such as SDPA's
        # logsumexp, included).
        last_fw = max((self.index[o] for o in fw_outs if isinstance(o, fx.Node)), default=-1)
        kinds: list[int] = []
        for i, n in enumerate(nodes):
            if n.op == "placeholder":
                kinds.append(_TANGENT if P._is_tangent(n) else _PRIMAL)
            elif n in info.tangents_closure or n in info.required_bw_nodes:
                kinds.append(_BW)
            elif i <= last_fw or (
                # The rest of a tuple the forward made (a dropout's mask after its output, the
                # last forward output): made with it, so forward, and saved as it is.
                n.target is operator.getitem
                and isinstance(n.args[0], fx.Node)
                and kinds[self.index[n.args[0]]] == _FW
            ):
                kinds.append(_FW)
            else:
                kinds.append(_OTHER)
        self.kind = kinds
        self.inputs = [tuple(self.index[a] for a in n.all_input_nodes) for n in nodes]
        self.storages = [ids.ids_of(n.meta.get("val")) for n in nodes]
        self.nbytes = [ids.nbytes(s) for s in range(len(ids._nbytes))]
        # Parameters, buffers, user inputs and module constants: held by the caller, untracked;
        # so are copies sent to the host (a host-placed parameter's gradient, rewrites/params.py,
        # and a loss head's log-softmax, rewrites/linearce.py).
        self.persistent: frozenset[int] = frozenset(
            s
            for i, n in enumerate(nodes)
            if (n.op in ("placeholder", "get_attr") and kinds[i] != _TANGENT) or is_host_value(n)
            for s in self.storages[i]
        )
        # SymInts (sizes, also as graph inputs) are saved for the backward separately, for free.
        self.is_sym = [
            isinstance(n.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool, int, float))
            for n in nodes
        ]
        # Multi-output ops are never saved themselves (autograd saves their getitems).
        self.is_tuple = [isinstance(n.meta.get("val"), (tuple, list)) for n in nodes]
        self.recomputable = [self._recomputable(n) for n in nodes]
        # Side-effect nodes (shape asserts) torch's extraction keeps wherever they can run.
        self.impure = [n.op == "call_function" and n.is_impure(impure_random=False) for n in nodes]
        self.forward_only = [P._must_be_in_forward(n) for n in nodes]
        # Outputs of random, impure or forward-only ops: saved whenever the backward needs them
        # (recomputing dropout would draw new random numbers).
        self._must_save = frozenset(
            s
            for i, k in enumerate(kinds)
            if k == _FW and not self.recomputable[i]
            for s in self.storages[i]
            if s not in self.persistent
        )
        # Activation inputs (the primals that are not parameters or buffers), whole storages
        # only, as FragmentProfile counts them: the backward reading one makes autograd hold it.
        primals = [i for i, n in enumerate(nodes) if n.op == "placeholder" and kinds[i] != _TANGENT]
        static = set(self.static_input_indices)
        self.activation_inputs: frozenset[int] = frozenset(
            s
            for pos, i in enumerate(primals)
            if pos not in static and covers_storage(nodes[i].meta.get("val"))
            for s in self.storages[i]
        )
        self.profile = profile
        self.cost = [self._op_time(n, profile) for n in nodes]
        # Swapping copies a whole storage: only tensors that are exactly their storage qualify.
        self.covers_storage = [covers_storage(n.meta.get("val")) for n in nodes]
        workspace = workspace or {}
        self.workspace = [workspace.get(n.name, 0) for n in nodes]
        self.clone_bytes = clone_bytes
        self.fw_outputs = [self.index[o] for o in fw_outs if isinstance(o, fx.Node)]
        self.bw_outputs = [self.index[o] for o in bw_outs if isinstance(o, fx.Node)]
        # User-visible outputs (not new values of mutated inputs) are held by the caller, but
        # for those a step showed dropped before the backward (``dropped_outputs``).
        dropped = set(dropped_outputs)
        self.released_tangents = frozenset(released_tangents)
        self.held_outputs = (
            frozenset(
                s
                for j, (o, d) in enumerate(zip(fw_outs, fw_descs, strict=True))
                if isinstance(o, fx.Node)
                and type(d).__name__ != "InputMutationAOTOutput"
                and j not in dropped
                for s in self.storages[self.index[o]]
            )
            - self.persistent
        )
        # Forward outputs that are new values of mutated inputs (AOT puts them first).
        self.num_mutated_outputs = sum(
            type(d).__name__ == "InputMutationAOTOutput" for d in fw_descs
        )
        self._fw_output_storages = (
            frozenset(s for i in self.fw_outputs for s in self.storages[i]) - self.persistent
        )
        self.forward_order = [
            i for i, k in enumerate(kinds) if k in (_PRIMAL, _FW) and nodes[i].op != "placeholder"
        ]
        users: list[list[int]] = [[] for _ in nodes]
        for i, ins in enumerate(self.inputs):
            for j in ins:
                users[j].append(i)
        self.users = users
        # Storage -> nodes holding it (its producer, views, out= writers), in joint order
        # (``nodes_holding``), and the forward ones among them: the planner prices and swaps
        # storages through these without scanning the graph.
        holding: dict[int, list[int]] = {}
        for i, sids in enumerate(self.storages):
            for s in sids:
                holding.setdefault(s, []).append(i)
        self._holding = {s: tuple(v) for s, v in holding.items()}
        self.holders: dict[int, tuple[int, ...]] = {
            s: fw for s, v in holding.items() if (fw := tuple(i for i in v if kinds[i] == _FW))
        }
        self._names: dict[int, str] | None = None
        self._recent: OrderedDict[frozenset[int], _Backward] = OrderedDict()
        # For the scheduler, which asks these at every step of every schedule.
        self.input_storages: list[frozenset[int]] = [
            frozenset(s for j in ins for s in self.storages[j]) for ins in self.inputs
        ]
        self.has_effect: list[bool] = [has_effect(n) for n in nodes]
        self.effect_nodes = tuple(i for i, e in enumerate(self.has_effect) if e)
        self.sink_memo = SinkMemo()
        self.liveness = Liveness(
            self.storages,
            self.inputs,
            [k == _FW for k in kinds],
            self.persistent,
            self.nbytes,
            self.workspace,
        )
        self.first_tangent_user = min(
            (u for i, k in enumerate(kinds) if k == _TANGENT for u in users[i]), default=len(nodes)
        )
        # For ``backward_nodes`` and ``backward_groups``, which every evaluation runs: the
        # nodes the backward may compute from its inputs alone (call_function, not
        # forward-only), the side-effect ones among them, and the copy_ nodes ahead of the
        # first backward node.
        self._side_effect_candidate = [
            n.op == "call_function" and not self.forward_only[i] for i, n in enumerate(nodes)
        ]
        self._side_effects = [
            i for i, c in enumerate(self._side_effect_candidate) if c and self.impure[i]
        ]
        self._early_copies = [
            i
            for i, n in enumerate(nodes)
            if i < self.first_tangent_user and n.target is torch.ops.aten.copy_.default
        ]
        # Each node's inputs before the first tangent user (``_backward_walk``).
        self._low_inputs: list[tuple[int, ...]] = [
            tuple(j for j in ins if j < self.first_tangent_user) for ins in self.inputs
        ]

    def _op_time(self, n: fx.Node, profile: DeviceProfile) -> float:
        if n.op != "call_function":
            return 0.0
        flops, moved, _ = node_cost(n, self.ids)
        outs = tensor_vals(n.meta.get("val"))
        return profile.op_time(flops, moved, outs[0].dtype if outs else "float32")

    def _recomputable(self, n: fx.Node) -> bool:
        if n.op != "call_function" or P._must_be_in_forward(n) or draws_random(n):
            return False
        if n.is_impure(impure_random=False):
            return False
        val = n.meta.get("val")
        # Sizes that only exist at run time (unbacked symbols) cannot be recreated reliably.
        return not any(
            isinstance(s, torch.SymInt) and s.node.hint is None and not s.node.has_hint()
            for t in tensor_vals(val)
            for s in t.shape
        )

    # -- the default saved set ------------------------------------------------------------------
    def default_saved(self) -> frozenset[int]:
        """Storages eager autograd would keep: every forward value the backward reads."""
        out: set[int] = set()
        for i, k in enumerate(self.kind):
            if k == _FW and any(self.kind[u] != _FW for u in self.users[i]):
                out.update(s for s in self.storages[i] if s not in self.persistent)
        return frozenset(out)

    def eager_saved(self) -> frozenset[int]:
        """Storages eager autograd would keep running the user's code: :meth:`default_saved`,
        less what the user's ``torch.utils.checkpoint`` makes again in the backward
        (:meth:`checkpointed`), plus the checkpointed regions' inputs it makes them from."""
        recomputed, inputs = self._checkpoint
        return (self.default_saved() - recomputed) | inputs

    def checkpointed(self) -> frozenset[int]:
        """Storages the backward reads that the user's activation checkpointing recomputes:
        forward values in a checkpointed region (``node.meta["recompute"]`` MUST_RECOMPUTE or
        PREFER_RECOMPUTE, as torch's partitioners read the tags
        ``torch.utils.checkpoint(use_reentrant=False)`` leaves under Dynamo), but a region's
        last value a later region reads (saved between them, as torch's
        ``cleanup_recompute_tags`` does). Every plan recomputes them, as eager does: the user
        asked for it, and the planner's moves only recompute or swap more."""
        return self._checkpoint[0]

    @functools.cached_property
    def _checkpoint(self) -> tuple[frozenset[int], frozenset[int]]:
        """(:meth:`checkpointed`, the regions' inputs they are made from again)."""
        nodes, kind = self.nodes, self.kind
        tagged = [False] * len(nodes)
        for i, n in enumerate(nodes):
            if kind[i] != _FW or not P.must_recompute(n):
                continue
            region = n.meta.get("ac_graph_id")
            tagged[i] = region is None or not any(
                P.must_recompute(u) and u.meta.get("ac_graph_id", region) > region for u in n.users
            )
        if not any(tagged):
            return frozenset(), frozenset()
        read = [
            i for i, k in enumerate(kind) if k == _FW and any(kind[u] != _FW for u in self.users[i])
        ]
        # From the tagged values the backward reads, back through their region to its inputs.
        stack = [i for i in read if tagged[i]]
        seen = set(stack)
        inputs: set[int] = set()
        while stack:
            for a in self.inputs[stack.pop()]:
                if a in seen or kind[a] != _FW:
                    continue
                seen.add(a)
                if tagged[a]:
                    stack.append(a)
                else:
                    inputs.update(self.storages[a])
        kept = {s for i in read if not tagged[i] for s in self.storages[i]}
        recomputed = {s for i in read if tagged[i] for s in self.storages[i]} - kept - inputs
        return (
            frozenset(recomputed - self.persistent),
            frozenset(inputs - self.persistent),
        )

    def fetched_copies(self) -> frozenset[int]:
        """Storages of device copies of host-placed parameters (``rewrites/params.py``'s fetches
        of a graph input): fetched again for the backward by default, as ZeRO-Offload does,
        rather than kept from the forward (a recurrent cell would keep one per time step)."""
        return frozenset(
            s
            for i, n in enumerate(self.nodes)
            if self.kind[i] == _FW
            and n.target is _RELOAD
            and isinstance(n.args[0], fx.Node)
            and n.args[0].op == "placeholder"
            for s in self.storages[i]
        )

    def must_save(self) -> frozenset[int]:
        """Storages of forward values that cannot be recomputed (random, mutating, impure); every
        saved set implicitly contains those the backward needs."""
        return self._must_save

    @functools.cached_property
    def _availability(self) -> list[bool | None]:
        """Whether each node is available to the backward as far as that does not depend on
        the saved set: ``True`` (a primal, a tangent, a SymInt: saved for free), ``False``
        (not a forward value, a multi-output op, no storage), ``None`` (when all its storages
        are saved, persistent or must be saved)."""
        out: list[bool | None] = []
        for i, k in enumerate(self.kind):
            if k in (_PRIMAL, _TANGENT):
                out.append(True)
            elif k != _FW:
                out.append(False)
            elif self.is_sym[i]:
                out.append(True)
            elif self.is_tuple[i] or not self.storages[i]:
                out.append(False)
            else:
                out.append(None)
        return out

    @functools.cached_property
    def _saved_free(self) -> tuple[frozenset[int], frozenset[int], tuple[int, ...]]:
        """The part of :meth:`backward_nodes`' walk from the gradients that no saved set
        changes: (the nodes it always needs: not forward values, not primals or tangents; the
        primals and tangents it reaches; the forward values it reaches first, where the walk
        that depends on the saved set starts). A forward value reads only forward values and
        primals, so that walk never comes back. (Every evaluation of the planner walked the
        whole backward: a fifth of it on the GRU small.)"""
        always: set[int] = set()
        given: set[int] = set()
        frontier: set[int] = set()
        stack = list(self.bw_outputs)
        while stack:
            i = stack.pop()
            if i in always or i in given or i in frontier:
                continue
            if self.kind[i] == _FW:
                frontier.add(i)
            elif self._availability[i] is True:
                given.add(i)
            else:
                always.add(i)
                stack.extend(self.inputs[i])
        return frozenset(always), frozenset(given), tuple(sorted(frontier))

    @functools.cached_property
    def free_views(self) -> frozenset[int]:
        """Forward views the backward makes again from their source rather than take as
        inputs (see ``_view_base``); making one runs no kernel, so a plan's recompute time
        does not count them."""
        return frozenset(i for i, j in enumerate(self._view_base) if j >= 0)

    @functools.cached_property
    def _view_base(self) -> list[int]:
        """Per node, when it is a forward view (an aten view op, or an element of a view op's
        tuple: ``split``'s, ``chunk``'s) of a forward value or primal whose storages hold all of
        its own, that value's index; else -1. The backward makes such a view again rather than
        take it as an input: autograd saves a ``sigmoid``'s output through a ``detach`` of it,
        and a GRU's gates as ``split`` pieces of one matmul, and with the view as a second
        input (or as the only one, a piece of the storage) no swap could copy the storage
        (``swappable``: 384 of the GRU small's 582 saved storages were not)."""
        out = [-1] * len(self.nodes)
        if not self.remake_views:
            return out
        for i, n in enumerate(self.nodes):
            if self.kind[i] != _FW or n.op != "call_function" or self.is_sym[i]:
                continue
            source = n.args[0] if n.args else None
            if n.target is operator.getitem:
                view = isinstance(source, fx.Node) and _is_view(source.target)
            else:
                view = _is_view(n.target)
            if not view or not isinstance(source, fx.Node) or not self.storages[i]:
                continue
            j = self.index.get(source)
            if j is None or self.kind[j] not in (_FW, _PRIMAL):
                continue
            if set(self.storages[i]) <= set(self.storages[j]) and self._recomputable(n):
                out[i] = j
        return out

    def _available(self, i: int, saved: Collection[int]) -> bool:
        known = self._availability[i]
        if known is not None:
            return known
        return all(
            s in saved or s in self.persistent or s in self._must_save for s in self.storages[i]
        )

    # -- evaluation -----------------------------------------------------------------------------
    def backward_nodes(self, saved: Collection[int]) -> tuple[set[int], list[int], set[int]]:
        """(nodes the backward runs, forward nodes among them it recomputes but views, which
        run no kernel (:attr:`free_views`), its inputs).

        As torch's extraction: what the gradients need, walking back to available values, plus
        side-effect nodes (shape asserts) computable from those inputs."""
        # What the walk from the gradients finds whatever is saved, once (``_saved_free``):
        # only the forward values it reaches are walked here.
        always, given, frontier = self._saved_free
        needed: set[int] = set(always)
        inputs: set[int] = set(given)

        node_inputs = self.inputs
        # _available, inlined (the planner walks the backward for every saved set it prices).
        by_kind, storages = self._availability, self.storages
        persistent, must_save = self.persistent, self._must_save
        view_base = self._view_base

        def walk(roots: Iterable[int]) -> None:
            stack = list(roots)
            while stack:
                i = stack.pop()
                if i in needed or i in inputs:
                    continue
                a = by_kind[i]
                # A view of another forward value (view_base) is made again, whether its
                # storage is saved or not: the backward takes the value that covers the
                # storage, one per storage, which a swap can copy whole. (A view runs no
                # kernel: not priced as a recomputation.)
                view = view_base[i] >= 0
                if a is True or (
                    a is None
                    and not view
                    and all(s in saved or s in persistent or s in must_save for s in storages[i])
                ):
                    inputs.add(i)
                    continue
                needed.add(i)
                stack.extend(node_inputs[i])

        walk(frontier)
        # Side-effect nodes the gradients do not need, computable from the inputs alone
        # (every node on the way a candidate): decided for those only, over their ancestors.
        roots = [i for i in self._side_effects if i not in needed]
        if roots:
            state: dict[int, bool] = {}
            candidate = self._side_effect_candidate
            for root in roots:
                stack = [root]
                while stack:
                    i = stack[-1]
                    if i in state:
                        stack.pop()
                    elif i in inputs or not candidate[i]:
                        state[i] = i in inputs
                        stack.pop()
                    else:
                        pending = [j for j in node_inputs[i] if j not in state]
                        if pending:
                            stack.extend(pending)
                        else:
                            state[i] = all(state[j] for j in node_inputs[i])
                            stack.pop()
            walk([i for i in roots if state[i]])
        recompute = sorted(needed.intersection(self._recomputations))
        return needed, recompute, inputs

    @functools.cached_property
    def _recomputations(self) -> frozenset[int]:
        """Forward nodes that run a kernel when the backward needs them (not :attr:`free_views`)."""
        free = self.free_views
        return frozenset(i for i, k in enumerate(self.kind) if k == _FW and i not in free)

    def backward_groups(self, needed: set[int]) -> list[list[int]]:
        """torch's reordering_to_mimic_autograd_engine over the needed nodes (joint indices), as
        its groups: each insert of a root emits the not-yet-placed nodes it needs, sorted."""
        order, starts = self._backward_walk(needed, groups=True)
        return [order[a:b] for a, b in itertools.pairwise([*starts, len(order)])]

    def backward_order(self, needed: set[int]) -> list[int]:
        """:meth:`backward_groups`, flattened: the backward's execution order."""
        return self._backward_walk(needed, groups=False)[0]

    def _backward_walk(self, needed: set[int], *, groups: bool) -> tuple[list[int], list[int]]:
        """(:meth:`backward_order`, where each of :meth:`backward_groups` starts in it; with
        ``groups=False`` those starts are not kept).

        The roots from the first tangent user on are taken in index order, and a node's inputs
        come before it: when one is taken, every needed node after that user and before it is
        placed already, so only its inputs before that user (``_low_inputs``) are looked at,
        and it is never reached from a later root. Most have none, or none left to place: each
        is a group of its own, and runs of them are copied as slices of the sorted nodes. (Half
        the planner's evaluation on a recurrent net was this walk, node by node.)"""
        done: set[int] = set()
        out: list[int] = []
        starts: list[int] = []
        node_inputs = self.inputs
        tangent_user = self.first_tangent_user

        def place(root: int, todo: list[int]) -> None:
            # ``root`` and the not-yet-placed needed nodes it reads (``todo``: its inputs).
            seen = [root]
            while todo:
                i = todo.pop()
                if i in done or i not in needed:
                    continue
                done.add(i)
                seen.append(i)
                todo.extend(node_inputs[i])
            if groups:
                starts.append(len(out))
            out.extend(sorted(seen) if len(seen) > 1 else seen)

        def insert(root: int) -> None:  # a root before the first tangent user
            if root in done or root not in needed:
                return
            done.add(root)
            place(root, [j for j in node_inputs[root] if j not in done and j in needed])

        def singletons(run: list[int]) -> None:
            if groups:
                starts.extend(range(len(out), len(out) + len(run)))
            out.extend(run)

        ordered = sorted(needed)
        for i in self._early_copies:  # copy_ nodes ahead of the first backward node run first
            if i in needed and i not in done:  # (as torch's)
                insert(i)
        first = bisect.bisect_left(ordered, tangent_user)
        main = ordered[first:]
        low = self._low_inputs
        run = 0  # main[run:] not emitted yet
        # (The nodes with any input before that user: an empty tuple selects none.)
        for k in itertools.compress(range(len(main)), map(low.__getitem__, main)):
            i = main[k]
            todo = [j for j in low[i] if j not in done and j in needed]
            if todo:
                singletons(main[run:k])
                place(i, todo)
                run = k + 1
        singletons(main[run:])
        # The rest: roots before the first tangent user (those after it are placed).
        for i in self.bw_outputs:  # outputs that do not depend on the tangents at all
            if i < tangent_user and i not in done:
                insert(i)
        for i in ordered[:first]:  # side-effect nodes before the first backward node
            if i not in done:
                insert(i)
        return out, starts

    def _replay(
        self,
        order: Sequence[int],
        live_on_entry: Iterable[int],
        keep: Collection[int],
        held_nodes: Collection[int] = (),
        late: Collection[int] = (),
    ) -> Replayed:
        """Liveness over ``order``: (peak, end, peak position, storages live at the peak).

        ``late`` storages (swapped in) become live right before their first use. A forward node
        in ``order`` after the entry (a recomputation in the backward) that also produces a
        storage which arrives saved (or swapped in) makes a new copy of it: the copy lives as
        long as the recomputed node's value (until its last reader here), the saved one until
        its own last use. Copies get keys past the storages' (never a planner's storage).
        ``keep`` and the storages of ``held_nodes`` live to the end. The planner's search
        replays thousands of times, in array operations (``liveness.py``)."""
        ends = set(keep)
        ends.update(s for i in held_nodes for s in self.storages[i])
        return self.liveness.replay(order, live_on_entry, ends, late)

    def nodes_holding(self, storage: int) -> tuple[int, ...]:
        """Every node whose value holds ``storage`` (its producer, views, ``out=`` writers),
        in joint order."""
        return self._holding.get(storage, ())

    def swappable(self, storage: int, bw_inputs: Collection[int]) -> bool:
        """``storage`` can be swapped: one dense backward input covers it exactly, and the
        caller does not hold it (a user output)."""
        holders = [i for i in self.holders.get(storage, ()) if i in bw_inputs]
        return (
            len(holders) == 1
            and self.covers_storage[holders[0]]
            and not self.is_tuple[holders[0]]
            and storage not in self.held_outputs
            and storage not in self._fw_output_storages
        )

    def evaluate(
        self,
        saved: Collection[int],
        swapped: Mapping[int, str] | None = None,
        *,
        schedule: bool = False,
        sink: bool = False,
    ) -> JointEval:
        """The step with ``saved`` kept from forward to backward, of which ``swapped``
        (storage -> tier) leave the device in between, in torch's orders. With ``schedule``,
        each graph also tries the memory-aware orders (``schedule.py``) and keeps whichever
        peaks lower; with ``schedule`` or ``sink``, the order kept then has the values that
        wait across its peak computed later where that lowers it (``schedule.sink``: a few
        linear replays, cheap enough for every evaluation of the planner's search)."""
        saved = frozenset(saved) - self.persistent
        recompute, bw_inputs, infeasible, used_saved, eligible, torch_order = self._backward_of(
            saved
        )
        order: Sequence[int] = torch_order
        swaps = {s: t for s, t in (swapped or {}).items() if s in eligible}
        fw_keep = (used_saved - swaps.keys()) | self._fw_output_storages
        fw_order = self.forward_order
        fw_result = self._replay(fw_order, (), fw_keep)
        if schedule:
            for window, lookahead in _SCHEDULES:
                alt = schedule_nodes(
                    self, fw_order, keep=fw_keep, window=window, lookahead=lookahead
                )
                alt_result = self._replay(alt, (), fw_keep)
                if alt_result[0] < fw_result[0]:
                    fw_order, fw_result = alt, alt_result
        if schedule or sink:
            fw_order, fw_result = sink_order(
                self, fw_order, lambda o: self._replay(o, (), fw_keep), fw_result
            )
        fw_peak, _, _, fw_live = fw_result
        entering = [i for i in bw_inputs if self.kind[i] == _TANGENT]
        # Held to the end: all but those no one else holds (they die after their last reader).
        tangents = [i for i in entering if self.nodes[i].name not in self.released_tangents]
        held = self.held_outputs - used_saved
        held_bytes = sum(self.nbytes[s] for s in held)
        bw_entry = [s for s in used_saved if s not in swaps]
        bw_entry += [s for i in entering for s in self.storages[i]]
        bw_keep = {s for i in self.bw_outputs for s in self.storages[i]}
        bw_result = self._replay(order, bw_entry, bw_keep, held_nodes=tangents, late=swaps.keys())
        if schedule:
            held_storages = {s for i in tangents for s in self.storages[i]}
            for window, lookahead in _SCHEDULES:
                alt = schedule_nodes(
                    self,
                    torch_order,
                    entry=bw_entry,
                    keep=bw_keep | held_storages,
                    late=swaps.keys(),
                    window=window,
                    lookahead=lookahead,
                )
                alt_result = self._replay(
                    alt, bw_entry, bw_keep, held_nodes=tangents, late=swaps.keys()
                )
                if alt_result[0] < bw_result[0]:
                    order, bw_result = alt, alt_result
        if schedule or sink:
            order, bw_result = sink_order(
                self,
                order,
                lambda o: self._replay(
                    o, bw_entry, bw_keep, held_nodes=tangents, late=swaps.keys()
                ),
                bw_result,
            )
        bw_peak, bw_end, _, bw_live = bw_result
        phases = {
            "forward": (fw_peak, fw_live),
            "backward": (held_bytes + bw_peak, bw_live | held),
            "accumulate": (held_bytes + bw_end + self.clone_bytes, frozenset()),
        }
        phase = max(phases, key=lambda k: phases[k][0])
        return JointEval(
            saved=used_saved,
            forward_peak=fw_peak,
            backward_peak=held_bytes + bw_peak,
            accumulate_peak=phases["accumulate"][0],
            peak=phases[phase][0],
            peak_phase=phase,
            live_at_peak=phases[phase][1],
            recompute=tuple(recompute),
            recompute_time=sum(self.cost[i] for i in recompute),
            backward_order=tuple(order),
            infeasible=infeasible,
            swapped=tuple(sorted(swaps.items())),
            swappable=eligible,
            forward_order=tuple(fw_order),
            saved_inputs=frozenset(
                s for i in bw_inputs for s in self.storages[i] if s in self.activation_inputs
            ),
            swap_time=sum(
                2 * (self.profile.launch_overhead + self.profile.copy_time(self.nbytes[s], t))
                for s, t in swaps.items()
            ),
        )

    def _backward_of(self, saved: frozenset[int]) -> _Backward:
        """What the backward is under ``saved``, whatever is swapped: (forward nodes it
        recomputes, its inputs, storages of those that cannot be recomputed, the saved
        storages it reads, those it may swap, torch's order). The last few saved sets are
        remembered: a search prices a swap, and takes one back, at its current saved set."""
        found = self._recent.get(saved)
        if found is not None:
            self._recent.move_to_end(saved)
            return found
        needed, recompute, bw_inputs = self.backward_nodes(saved)
        infeasible = frozenset(
            s
            for i in recompute
            if not self.recomputable[i]
            for s in self.storages[i]
            if s not in self.persistent
        )
        used_saved = frozenset(
            s
            for i in bw_inputs
            if self.kind[i] == _FW
            for s in self.storages[i]
            if s not in self.persistent
        )
        eligible = frozenset(s for s in used_saved if self.swappable(s, bw_inputs))
        order = tuple(self.backward_order(needed))
        found = (recompute, bw_inputs, infeasible, used_saved, eligible, order)
        self._recent[saved] = found
        if len(self._recent) > _RECENT:
            self._recent.popitem(last=False)
        return found

    def decided_at_peak(self, e: JointEval) -> int:
        """Bytes live at ``e``'s peak moment that its saved set put there: storages saved for
        the backward (kept, or reloaded after a swap) and values the backward recomputes.

        0: the moment holds only what every saved set has there (the backward's own values,
        incoming gradients, the outputs the caller holds; the accumulation after the backward
        holds nothing saved, as row tiling's skip counts it too). Another saved set drops none of
        those and only adds its own saved or recomputed values: no plan of this graph lowers
        that moment but by ordering the backward otherwise (the GRU small's plans under
        14.2 MiB all peak at one such moment, 18.87 MB of gradients, recomputing or swapping
        alike)."""
        recomputed = {s for i in e.recompute for s in self.storages[i]}
        return sum(self.nbytes[s] for s in e.live_at_peak if s in e.saved or s in recomputed)

    def held_bytes(self, e: JointEval) -> int:
        """Device bytes ``e`` holds from the forward to the backward: its saved storages that
        stay on the device (not swapped) and the activation inputs its backward reads (what a
        multi-fragment step keeps of this graph while other fragments run)."""
        swapped = dict(e.swapped)
        kept = [s for s in e.saved if s not in swapped]
        return sum(self.nbytes[s] for s in (*kept, *e.saved_inputs))

    def recompute_walk(
        self,
        storage: int | Collection[int],
        saved: Collection[int],
        *,
        bw_inputs: Collection[int] | None = None,
        recomputed: Collection[int] = (),
    ) -> tuple[float, frozenset[int]]:
        """(seconds, storages read) of the recomputation ``storage`` leaving ``saved`` adds.

        Every forward node holding a dropped storage becomes unavailable: the walk starts at
        those the backward reads (``bw_inputs``, its inputs under ``saved``; the producer when
        not given), views included, and stops at what stays available (whose storages it
        reads) or is already among the ``recomputed`` nodes (paid for). Infinite seconds: a
        node on the way cannot be recomputed."""
        dropped = {storage} if isinstance(storage, int) else set(storage)
        rest = frozenset(saved) - dropped
        stack = [
            i
            for s in sorted(dropped)
            for i in self.holders.get(s, ())
            if bw_inputs is None or i in bw_inputs
        ]
        if bw_inputs is None:
            stack = stack[:1] if len(dropped) == 1 else stack
        done = set(recomputed)
        seen: set[int] = set()
        reads: set[int] = set()
        cost = 0.0
        while stack:
            i = stack.pop()
            if i in seen or i in done:
                continue
            if self._available(i, rest):
                reads.update(self.storages[i])
                continue
            if not self.recomputable[i]:
                return float("inf"), frozenset()
            seen.add(i)
            cost += self.cost[i]
            stack.extend(self.inputs[i])
        return cost, frozenset(reads - self.persistent)

    def swap_holders(self, saved: Collection[int], swapped: Collection[int]) -> dict[int, str]:
        """Storage -> name of the saved node holding it (a swap copies that node's value)."""
        _, _, inputs = self.backward_nodes(frozenset(saved) - self.persistent)
        out: dict[int, str] = {}
        for s in swapped:
            (holder,) = [i for i in inputs if s in self.storages[i]]
            out[s] = self.nodes[holder].name
        return out

    def saved_nodes(self, saved: Collection[int]) -> tuple[list[fx.Node], list[fx.Node]]:
        """(tensor nodes, SymInt nodes) to pass to torch's extraction for this saved set."""
        _, _, inputs = self.backward_nodes(frozenset(saved) - self.persistent)
        tensors = [
            self.nodes[i]
            for i in sorted(inputs)
            if self.kind[i] in (_PRIMAL, _FW) and not self.is_sym[i]
        ]
        syms = [self.nodes[i] for i in sorted(inputs) if self.is_sym[i]]
        return tensors, syms

    def describe(self, storage: int) -> str:
        """The first single-output node holding ``storage`` (a multi-output op's ``getitem``,
        not the op): plans name storages this way, :meth:`storage_named` reads it back."""
        if self._names is None:  # built once: a plan names hundreds of storages
            self._names = {}
            for i, sids in enumerate(self.storages):
                if len(sids) == 1 and not self.is_tuple[i]:
                    self._names.setdefault(sids[0], self.nodes[i].name)
        try:
            return self._names[storage]
        except KeyError:
            raise KeyError(f"no single-output node holds storage {storage}") from None

    def storage_named(self, name: str) -> int:
        """The storage a plan's tensor name refers to (see :meth:`describe`)."""
        (storage,) = self.storages[self._by_name[name]]
        return storage

    def __repr__(self) -> str:
        return f"JointModel({len(self.nodes)} nodes, {len(self.forward_order)} forward)"
