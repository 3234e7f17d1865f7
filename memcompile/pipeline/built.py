"""Rewrites of a plan's built graphs, kept only where the exact profile says they help.

The planner prices what a plan recomputes and swaps with its joint model; it does not see what
the late rewrites do to the built forward and backward graphs. So a plan over its target tries
them on the built graphs and keeps each only when a phase's exact peak drops::

    fw, bw = built(plan)                       exact peak P (profile_fragment, measured scratch)
    in place     (rewrites/inplace.py, built=True)    P' < P ? keep : drop
    row tiling   (rewrites/tiling/), 0 matmuls made again, then up to MAX_KEPT_MATMULS;
                 not built where a lower bound on the tiled peak is not below P
    rematerialize (rewrites/rematerialize.py), the backward only

Every profile here is exact: a rewritten node's kernel scratch is its original's (the same op on
the same metadata), probed once per graph.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx
from torch._functorch import partitioners as P

from memcompile.analysis.fragment_profile import (
    FragmentProfile,
    backward_profiler,
    profile_fragment,
)
from memcompile.analysis.graph import GraphProfile, StorageProfile
from memcompile.analysis.workspace import clone_workspace, probe_workspaces
from memcompile.errors import format_bytes
from memcompile.pipeline.env import FragmentSpec
from memcompile.pipeline.plan_cache import Step
from memcompile.planning.plan import FragmentPlan
from memcompile.rewrites.context import PassContext
from memcompile.rewrites.inplace import FORWARD_OPS, OPS, in_place_pass
from memcompile.rewrites.rematerialize import (
    Rematerialize,
    plan_rematerialize,
    rematerialize_pass,
)
from memcompile.rewrites.tiling.build import (
    InlineMemo,
    blocks_held,
    made_by_own_blocks,
    row_tile_pass,
    tiling_changes,
)
from memcompile.rewrites.tiling.find import (
    MAX_KEPT_MATMULS,
    RowTiling,
    find_row_tilings_each,
)

__all__ = [
    "ProfileMemo",
    "Split",
    "built_rewrite",
    "profile_args",
    "rematerialized",
    "replay",
    "tiled",
]

log = logging.getLogger(__name__)

#: AOT's split of a fragment's graphs, known before its metadata is: the static inputs, the
#: forward's leading outputs that are mutated inputs, and the user outputs after them.
Split = tuple[tuple[int, ...], int, int]
#: A rewrite of one built graph (``inplace``, ``tiling``).
Rewrite = Callable[[fx.GraphModule, PassContext], fx.GraphModule]


def aot_metadata() -> Any:
    """AOTAutograd's metadata of the graph being compiled (its input and output split), or
    ``None`` outside a compile."""
    ctx = torch._guards.TracingContext.try_get()
    return ctx.fw_metadata if ctx is not None else None


def profile_args(
    spec: FragmentSpec,
    gm: fx.GraphModule,
    bw: fx.GraphModule | None,
    *,
    split: Split | None = None,
) -> dict[str, Any]:
    """``profile_fragment``'s arguments for these graphs: AOT's input and output split (from its
    metadata, or ``split``) and the measured kernel workspaces."""
    meta = aot_metadata()
    static: tuple[int, ...]
    if split is not None:
        static, mutated, user = split
    elif meta is None:  # should not happen under Dynamo; profile without the output split
        log.warning(
            "memcompile: no AOT metadata for fragment F%d; profile is approximate", spec.index
        )
        static, mutated, user = (), 0, len(gm.graph.find_nodes(op="output")[0].args[0])
    else:
        static = tuple(meta.static_input_indices)
        mutated = meta.num_mutated_inp_runtime_indices
        user = meta.num_outputs + meta.num_intermediate_bases
    return dict(
        static_input_indices=static,
        num_mutated_inputs=mutated,
        num_user_outputs=user,
        forward_workspace=probe_workspaces(gm),
        backward_workspace=probe_workspaces(bw) if bw is not None else None,
        dropped_outputs=spec.dropped_outputs,
        released_tangents=spec.released_tangents,
    )


def joint_split(joint: fx.GraphModule, num_fwd_outputs: int, static: Sequence[int]) -> Split:
    """The :data:`Split` of graphs partitioned from ``joint`` (AOT's joint graph), before AOT's
    metadata of the forward exists (in the partitioner)."""
    _, _, descs, _ = P._extract_fwd_bwd_outputs(joint, num_fwd_outputs=num_fwd_outputs)
    mutated = sum(type(d).__name__ == "InputMutationAOTOutput" for d in descs)
    return tuple(static), mutated, num_fwd_outputs - mutated


_Workspaces = tuple[dict[str, Any], Callable[[str, fx.GraphModule], dict[str, int]]]


def _workspaces(
    spec: FragmentSpec, fw: fx.GraphModule, bw: fx.GraphModule, split: Split
) -> _Workspaces:
    """The profile arguments of the built graphs less their workspaces, and the workspace of a
    rewrite of either graph: each node's measured one, a copy's that of its original (the same
    op on the same metadata)."""
    args = profile_args(spec, fw, bw, split=split)
    measured = {
        graph: dict(args.pop(f"{graph}_workspace") or {}) for graph in ("forward", "backward")
    }

    def workspace(graph: str, g: fx.GraphModule) -> dict[str, int]:
        return {
            n.name: measured[graph].get(n.meta.get("memcompile_copy_of", n.name), 0)
            for n in g.graph.nodes
        }

    return args, workspace


def _profiler(
    workspaces: _Workspaces,
) -> Callable[[fx.GraphModule, fx.GraphModule], FragmentProfile]:
    """Exact profiles of rewrites of the built graphs, from :func:`_workspaces`' answer."""
    args, ws = workspaces

    def profile(f: fx.GraphModule, b: fx.GraphModule) -> FragmentProfile:
        return profile_fragment(
            f,
            b,
            clone_workspace=clone_workspace,
            forward_workspace=ws("forward", f),
            backward_workspace=ws("backward", b),
            **args,
        )

    return profile


class ProfileMemo:
    """The exact profile of each pair of built graphs one build profiles, kept by identity:
    each late rewrite profiles the pair it starts from, which the rewrite before it profiled as
    its result (in place, tiling with no matmul made again, with one, rematerializing: four
    profiles of one pair in a build that kept the first rewrite). A pair changed in place
    (``rematerialize_pass``) is :meth:`forget`-ten."""

    def __init__(self) -> None:
        # (Modules hash by identity.)
        self._found: dict[tuple[fx.GraphModule, fx.GraphModule], FragmentProfile] = {}
        self._workspaces: dict[tuple[fx.GraphModule, fx.GraphModule], _Workspaces] = {}

    def __call__(
        self, spec: FragmentSpec, fw: fx.GraphModule, bw: fx.GraphModule, split: Split
    ) -> FragmentProfile:
        found = self._found.get((fw, bw))
        if found is None:
            workspaces = self.workspaces(spec, fw, bw, split)
            found = self._found[(fw, bw)] = _profiler(workspaces)(fw, bw)
        return found

    def workspaces(
        self, spec: FragmentSpec, fw: fx.GraphModule, bw: fx.GraphModule, split: Split
    ) -> _Workspaces:
        """:func:`_workspaces` of the pair, found once (it keys every node's kernel by its
        metadata: ~0.1 s a pair on the GRU small; rematerializing asked again for the pair
        the profile had)."""
        found = self._workspaces.get((fw, bw))
        if found is None:
            found = self._workspaces[(fw, bw)] = _workspaces(spec, fw, bw, split)
        return found

    def forget(self, fw: fx.GraphModule, bw: fx.GraphModule) -> None:
        self._found.pop((fw, bw), None)
        self._workspaces.pop((fw, bw), None)


def built_backward_profiler(
    fw: fx.GraphModule, workspaces: _Workspaces
) -> Callable[[fx.GraphModule], GraphProfile]:
    """The backward's memory profile of rewrites of the built backward alone (``fw`` as built;
    ``workspaces``: :func:`_workspaces` of both): the forward profiled once
    (``fragment_profile.backward_profiler``), no node's FLOPs or bytes moved counted
    (rematerialization's trials compare peaks only)."""
    args, ws = workspaces
    profile = backward_profiler(
        fw,
        static_input_indices=args["static_input_indices"],
        num_mutated_inputs=args["num_mutated_inputs"],
        num_user_outputs=args["num_user_outputs"],
        forward_workspace=ws("forward", fw),
        released_tangents=args["released_tangents"],
        costs=False,
    )
    return lambda b: profile(b, ws("backward", b))


def _may_rewrite(plan: FragmentPlan) -> bool:
    """Whether the late rewrites may try to bring ``plan`` under its target: it has one, and
    holds no more than its saved-set cap."""
    if plan.target is None:
        return False
    return plan.saved_cap is None or plan.held_bytes <= plan.saved_cap


def built_rewrite(
    spec: FragmentSpec,
    fw: fx.GraphModule,
    bw: fx.GraphModule,
    plan: FragmentPlan,
    split: Split,
    rewrite: Rewrite,
    what: str,
    *,
    memo: ProfileMemo | None = None,
) -> tuple[fx.GraphModule, fx.GraphModule, FragmentPlan]:
    """``fw``, ``bw`` and ``plan`` (over its target) after ``rewrite`` of both built graphs,
    when that lowers a phase's exact peak (else as they were). The joint model the planner
    searched with does not see these rewrites, so only a plan over its target tries them (as
    :func:`rematerialized`): ``inplace.in_place_pass(built=True)`` writes elementwise results
    into the graphs' own dying values (a value the plan recomputes for the backward, rather than
    saves, is the graph's own in both graphs); ``row_tile_pass`` makes elementwise results a
    block of rows at a time. ``what`` names the rewrite in the log; ``memo``: the build's
    profiles so far."""
    target = plan.target
    if target is None or not _may_rewrite(plan):
        return fw, bw, plan
    fw2 = rewrite(fw, PassContext(spec.name, "forward"))
    bw2 = rewrite(bw, PassContext(spec.name, "backward"))
    if fw2 is fw and bw2 is bw:
        return fw, bw, plan
    memo = ProfileMemo() if memo is None else memo
    before = max(memo(spec, fw, bw, split).phase_peaks().values())
    # Probed as rewritten: an out= kernel may need a temporary its original did not.
    after = max(memo(spec, fw2, bw2, split).phase_peaks().values())
    if after >= before:
        return fw, bw, plan
    log.info(
        "F%d: %s: the step peaks at %s (%s without; budget %s)",
        spec.index,
        what,
        format_bytes(plan.resident_bytes + after),
        format_bytes(plan.resident_bytes + before),
        format_bytes(plan.resident_bytes + target),
    )
    plan = dataclasses.replace(
        plan,
        predicted_peak=min(plan.predicted_peak, plan.resident_bytes + after),
        feasible=after <= target,
    )
    return fw2, bw2, plan


class TilingSearch:
    """:func:`find_row_tilings` of the built graphs one fragment's search rewrites, each op of
    each graph searched once for both ``max_kept_matmuls`` the builds ask for: the search only
    decides, and the graphs do not change meanwhile (the rewrites make copies). Keyed by the
    graph object (by identity). ``inlined``: the fake values of the blocks the rewrites made
    (``tiling/build.InlineMemo``), for the next build that tiles the same op on the same
    values."""

    def __init__(self) -> None:
        # (graph, allowances) -> (the position of the first op searched, tilings by allowance)
        self._found: dict[
            tuple[fx.GraphModule, tuple[int, ...]], tuple[int, dict[int, tuple[RowTiling, ...]]]
        ] = {}
        self.inlined: InlineMemo = {}

    def __call__(self, gm: fx.GraphModule, kept: int, *, start: int = 0) -> tuple[RowTiling, ...]:
        """The tilings of ``gm``'s ops from position ``start`` on (and of earlier ones where
        they were searched already), with ``kept`` matmuls made again."""
        # Both allowances the builds ask for, in one search (find_row_tilings_each).
        allowances = tuple(sorted({0, MAX_KEPT_MATMULS, kept}))
        key = (gm, allowances)
        known = self._found.get(key)
        if known is None or known[0] > start:
            stop = None if known is None else known[0]
            found = find_row_tilings_each(gm, allowances, start=start, stop=stop)
            if known is not None:  # the ops searched before come after these
                found = {k: found[k] + known[1][k] for k in allowances}
            known = (start, found)
            self._found[key] = known
        return known[1][kept]


def _same_tilings(fw: fx.GraphModule, bw: fx.GraphModule, kept: int, search: TilingSearch) -> bool:
    """Whether both graphs tile alike with ``kept`` matmuls made again and with none (a graph
    the search fails on: not known to, ``tile_rows`` then says why)."""
    try:
        return all(search(g, kept) == search(g, 0) for g in (fw, bw))
    except Exception:  # the rewrite that follows reports it
        return False


def tile_rows(
    gm: fx.GraphModule,
    ctx: PassContext,
    *,
    max_kept_matmuls: int = MAX_KEPT_MATMULS,
    search: TilingSearch | None = None,
) -> fx.GraphModule:
    """``row_tile_pass``, then the in-place pass again where it tiled: a value the blocks now
    make again dies at its other reader, which may then write into it. ``search``: the
    decisions already made for ``gm``."""
    try:
        decided = None if search is None else search(gm, max_kept_matmuls)
        inlined = None if search is None else search.inlined
        tiled = row_tile_pass(
            gm, ctx, max_kept_matmuls=max_kept_matmuls, decided=decided, inlined=inlined
        )
    except Exception:  # a graph the pass does not know: the plan stands without it
        log.warning(
            "%s %s: row tiling failed; left as built", ctx.fragment, ctx.graph, exc_info=True
        )
        return gm
    return gm if tiled is gm else in_place_pass(tiled, ctx, built=True)


@dataclasses.dataclass(frozen=True)
class TiledBound:
    """Lower bounds on a graph's peak after :func:`tile_rows` with some tilings
    (:func:`_least_tiled_peak`).

    Attributes:
        least: whatever the pass makes of them (which ops it chooses, what the probe finds).
        blocks: op -> the bound where that op is made by its own blocks (``made_by_own_blocks``),
            for each op where that is higher than ``least``.
    """

    least: int
    blocks: dict[str, int]


def _least_tiled_peak(
    gm: fx.GraphModule, graph: GraphProfile, tilings: Sequence[RowTiling]
) -> TiledBound:
    """Lower bounds on the peak of ``gm`` (profiled as ``graph``) after :func:`tile_rows` with
    ``tilings`` (any of them):

    - each node the copy keeps holds what it held here less the bytes of the storages that may
      be held for less time now, while held up to their op (``tiling_changes``), and less its
      own new bytes and scratch where the in-place pass that follows the blocks may write it
      into a dying value of the same size (it lowers nothing else);
    - where an op is made by its own blocks (``blocks_held``), they start holding what is held
      across the op here (but those storages), every leaf they read, and the result's buffer
      (:attr:`TiledBound.blocks`); an op left whole is a node the copy keeps, so the lesser of
      the two counts in :attr:`TiledBound.least`.

    Nodes the blocks replace do not count otherwise, nor what the blocks make (lower bounds).
    On the LSTM (T=32, 0.25x) the blocks' result buffer is the peak where the op wrote into
    its dying operand before: a sum of three ``select_backward`` gradients (the bound whatever
    the pass does 2.25 MB, with those blocks 2.34 MB, the tiled backward's peak 3.09 MB; the
    untiled backward's 2.28 MB)."""
    replaced, until = tiling_changes(gm, tilings)
    index = {n.name: i for i, n in enumerate(graph.nodes)}
    # Each storage of those values: held for less time up to the latest op of its values.
    up_to: dict[int, int] = {}
    for name, op in until.items():
        i = index.get(name)
        if i is None:
            continue
        for sid in graph.nodes[i].storages:
            up_to[sid] = max(up_to.get(sid, -1), index[op])
    # Bytes that may go from each node's count, and bytes held across each node by storages
    # no tiling changes: difference arrays over the schedule.
    size = len(graph.nodes)
    diff, across = [0] * (size + 1), [0] * (size + 1)
    for st in graph.storages:
        free = _last(st, size)
        if st.id in up_to:
            last = min(free, up_to[st.id])
            first = max(0, st.alloc_index)
            if first <= last:
                diff[first] += st.nbytes
                diff[last + 1] -= st.nbytes
        elif st.alloc_index + 1 <= free:
            across[st.alloc_index + 1] += st.nbytes
            across[free + 1] -= st.nbytes
    by_name = {n.name: n for n in gm.graph.nodes}
    least, gone, held_across = 0, 0, 0
    kept: list[int] = []  # each node's count as kept
    after: list[int] = []  # each node's bytes held across it, allocated before
    for i, n in enumerate(graph.nodes):
        gone += diff[i]
        held_across += across[i]
        target = getattr(by_name.get(n.name), "target", None)
        # (Its out= kernel's scratch is probed anew: count the original's as possibly gone.)
        in_place = n.new_bytes + n.workspace_bytes if target in OPS or target in FORWARD_OPS else 0
        kept.append(n.live_bytes - gone - in_place)
        after.append(held_across)
        if n.name not in replaced:
            least = max(least, kept[-1])
    storages = {st.id: st for st in graph.storages}
    blocks: dict[str, int] = {}
    for op, (leaves, result) in blocks_held(gm, tilings).items():
        k = index.get(op)
        if k is None:
            continue
        # The leaves' storages that are not held across the op here (they died before it).
        extra = {
            sid
            for leaf in leaves
            if leaf in index
            for sid in graph.nodes[index[leaf]].storages
            if sid in storages and sid not in up_to
        }
        late = sum(
            storages[sid].nbytes
            for sid in extra
            if not storages[sid].alloc_index < k <= _last(storages[sid], size)
        )
        blocks[op] = after[k] + late + result
    least = max([least, *(min(kept[index[op]], b) for op, b in blocks.items())])
    return TiledBound(least, {op: b for op, b in blocks.items() if b > least})


def _last(st: StorageProfile, size: int) -> int:
    """The last node of a schedule of ``size`` nodes during which ``st`` is held."""
    return size - 1 if st.free_index is None else st.free_index


def _first_at_peak(gm: fx.GraphModule, graph: GraphProfile) -> int:
    """The position in ``gm`` of the first node that holds ``graph``'s peak (0: not known).
    Only tilings of ops from there on can lower such a node's count in
    :func:`_least_tiled_peak`: a tiling replaces nodes up to its op and shortens values up to
    its op (``tiling_changes``), and nodes below the peak stay below it."""
    at = next((n.name for n in graph.nodes if n.live_bytes >= graph.peak_bytes), None)
    return next((i for i, n in enumerate(gm.graph.nodes) if n.name == at), 0)


def _tiling_cannot_lower(
    profile: FragmentProfile,
    fw: fx.GraphModule,
    bw: fx.GraphModule,
    kept: int,
    search: TilingSearch,
) -> bool:
    """Whether row tiling (``kept`` matmuls made again) of the built graphs cannot lower their
    highest phase peak (``profile``: theirs), decided before building the blocks: a phase at
    that peak is the accumulation (the graphs' outputs and what they hold at the end: the
    same after), or its graph's tiled peak cannot be lower (:func:`_least_tiled_peak`).
    :func:`built_rewrite` would build, probe and profile the blocks only to reject them: on
    the GRU (small) each build's tiling took ~25 s, and none was kept."""
    peaks = profile.phase_peaks()
    top = max(peaks.values())
    for phase, value in peaks.items():
        if value != top:
            continue
        if phase == "accumulate":
            return True
        gm, graph = (fw, profile.forward) if phase == "forward" else (bw, profile.backward)
        assert graph is not None
        try:
            tilings = search(gm, kept, start=_first_at_peak(gm, graph))
        except Exception:  # the rewrite that follows reports it
            continue
        bound = _least_tiled_peak(gm, graph, tilings)
        if bound.least >= graph.peak_bytes:
            return True
        # An op whose blocks alone would reach the peak: where the pass makes it by its own
        # blocks (which ops it chooses needs every op's tilings).
        high = [op for op, b in bound.blocks.items() if b >= graph.peak_bytes]
        if high and any(made_by_own_blocks(gm, search(gm, kept), op) for op in high):
            return True
    return False


def tiled(
    spec: FragmentSpec,
    fw: fx.GraphModule,
    bw: fx.GraphModule,
    plan: FragmentPlan,
    split: Split,
    *,
    memo: ProfileMemo | None = None,
    search: TilingSearch | None = None,
) -> tuple[fx.GraphModule, fx.GraphModule, FragmentPlan, int | None]:
    """:func:`built_rewrite` with row tiling: first with no matmul made again by the blocks (a
    value kept whole for another reader is read whole instead), which costs no time; where that
    does not fit, also with them, and the lower peak is kept. The last item: the matmuls the
    kept rewrite may make again (``None``: the graphs as they were). ``memo``: the build's
    profiles so far; ``search``: the fragment search's tilings so far."""
    memo = ProfileMemo() if memo is None else memo
    best = None
    best_kept: int | None = None
    search = TilingSearch() if search is None else search
    for kept in sorted({0, MAX_KEPT_MATMULS}):
        # (Asked first: it searches the graph at the peak, from its first node there;
        # _same_tilings both graphs whole.)
        if _may_rewrite(plan) and _tiling_cannot_lower(
            memo(spec, fw, bw, split), fw, bw, kept, search
        ):
            # built_rewrite would build, probe and profile the blocks to reject them.
            log.debug(
                "F%d: row tiling (%d matmuls made again) cannot lower the peak", spec.index, kept
            )
            found = (fw, bw, plan)
        elif kept and _same_tilings(fw, bw, kept, search):
            break  # no op's blocks would make a matmul again: the same rewrite
        else:
            found = built_rewrite(
                spec,
                fw,
                bw,
                plan,
                split,
                functools.partial(tile_rows, max_kept_matmuls=kept, search=search),
                f"elementwise ops made by blocks of rows ({kept} matmuls made again)",
                memo=memo,
            )
        if best is None or found[2].predicted_peak < best[2].predicted_peak:
            best = found
            best_kept = None if found[0] is fw and found[1] is bw else kept
        if best[2].feasible:
            break
    assert best is not None
    return (*best, best_kept)


def rematerialized(
    spec: FragmentSpec,
    fw: fx.GraphModule,
    bw: fx.GraphModule,
    plan: FragmentPlan,
    split: Split,
    *,
    memo: ProfileMemo | None = None,
) -> tuple[FragmentPlan, tuple[Rematerialize, ...]]:
    """``plan`` (over its target) after making backward values again for their late readers
    where that lowers the backward's exact profile (``rematerialize.py``), and those made
    again; ``bw`` is rewritten in place. The plan fits afterwards if every phase meets the
    target. ``memo``: the build's profiles so far."""
    target = plan.target
    if target is None or not _may_rewrite(plan):
        return plan, ()
    memo = ProfileMemo() if memo is None else memo
    # The kernel scratch is probed once (it runs every kernel) for both profilers.
    workspaces = memo.workspaces(spec, fw, bw, split)
    built = _profiler(workspaces)

    def profile(g: fx.GraphModule) -> FragmentProfile:
        return built(fw, g)

    before = memo(spec, fw, bw, split)
    if before.backward is None or before.phase_peaks()["backward"] <= target:
        return plan, ()
    ctx = PassContext(fragment=spec.name, graph="backward")
    # Each trial profiles a rewrite of the backward only (the forward once, not per trial).
    backward = built_backward_profiler(fw, workspaces)
    splits = plan_rematerialize(
        bw, ctx, backward, target=target - before.held_output_bytes, start=before.backward
    )
    if not splits:
        return plan, ()
    rematerialize_pass(bw, ctx, splits=splits)
    memo.forget(fw, bw)  # (changed in place)
    after = max(profile(bw).phase_peaks().values())
    moved = sum(r.moved for r in splits)
    log.info(
        "F%d: %d backward values made again for their late readers, %d moved to them: the "
        "step peaks at %s (%s without; budget %s)",
        spec.index,
        len(splits) - moved,
        moved,
        format_bytes(plan.resident_bytes + after),
        format_bytes(plan.resident_bytes + max(before.phase_peaks().values())),
        format_bytes(plan.resident_bytes + target),
    )
    plan = dataclasses.replace(
        plan,
        predicted_peak=min(plan.predicted_peak, plan.resident_bytes + after),
        feasible=after <= target,
        rematerialized=tuple((r.node, r.before) for r in splits),
    )
    return plan, tuple(splits)


def replay(
    spec: FragmentSpec, fw: fx.GraphModule, bw: fx.GraphModule, late: Sequence[Step]
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """``fw`` and ``bw`` after the late rewrites ``late`` as a search recorded them
    (``search.build``): each applied as it was kept, nothing tried, nothing profiled."""
    for name, *args in late:
        if name == "in_place":
            fw = in_place_pass(fw, PassContext(spec.name, "forward"), built=True)
            bw = in_place_pass(bw, PassContext(spec.name, "backward"), built=True)
        elif name == "tiling":
            (kept,) = args
            fw = tile_rows(fw, PassContext(spec.name, "forward"), max_kept_matmuls=int(kept))
            bw = tile_rows(bw, PassContext(spec.name, "backward"), max_kept_matmuls=int(kept))
        elif name == "remat":
            (found,) = args
            splits = [
                Rematerialize(
                    node=str(r["node"]),
                    before=str(r["before"]),
                    moved=bool(r["moved"]),
                    inputs=tuple(str(i) for i in r["inputs"]),
                )
                for r in found
            ]
            rematerialize_pass(bw, PassContext(spec.name, "backward"), splits=splits)
        else:
            raise ValueError(f"unknown late rewrite {name!r}")
    return fw, bw
