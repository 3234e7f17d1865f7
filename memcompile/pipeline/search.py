"""The plans one fragment tries, and the one rule that chooses among them.

A :class:`Candidate` is a joint graph, its memory model and the planner's plan for it; a
:class:`Built` is a candidate's forward and backward graphs as built (partitioned, swaps
inserted, the late rewrites of ``built.py`` applied), with the plan's peak as built. Variants of
a plan over its target are tried as data, as Inductor's ``reorder_for_peak_memory(methods=...)``
tries its orders::

    tried = [built plan]
          + recompute only, swap only            where the plan does both
          + the three searched for the smallest peak    while none fits
                  (neither where no saved or recomputed value is live at the built plan's
                   peak: another saved set cannot lower that moment)
          + the loss heads by blocks, and their alternatives   while none fits
    choose(tried): one that fits with the least predicted time, else the lowest peak

:class:`FragmentSearch` holds one partition's searches: the planner is called in the order the
stages ask (its greedy ends depend on the start), and each joint graph's memory model is built
once (the planner remembers its searches per model).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch
from torch import fx
from torch._functorch import partitioners as P

from memcompile.analysis.fragment_profile import accumulate_clone_bytes
from memcompile.analysis.joint_model import JointModel
from memcompile.analysis.workspace import clone_workspace, probe_workspaces
from memcompile.errors import format_bytes
from memcompile.pipeline import built as built_rewrites
from memcompile.pipeline import features, stage
from memcompile.pipeline.env import FragmentEnv, FragmentSpec
from memcompile.pipeline.plan_cache import LATE, Step, derived
from memcompile.planning.plan import FragmentPlan
from memcompile.planning.planner import SearchResult, plan_fragment
from memcompile.rewrites.context import PassContext
from memcompile.rewrites.inplace import in_place_pass
from memcompile.rewrites.losshead import loss_head_pass, min_block_bytes
from memcompile.rewrites.params import param_fetch_pass
from memcompile.rewrites.partition import partition_pass
from memcompile.rewrites.swap import swap_pass
from memcompile.runtime.store import is_host_placed

__all__ = ["Built", "Candidate", "FragmentSearch", "choose"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Candidate:
    """A plan of one joint graph, not built yet; ``peak_decided``: bytes live at its planned
    peak that its saved set put there (``JointModel.decided_at_peak``; ``None``: not known, a
    cached plan)."""

    joint: fx.GraphModule
    model: JointModel
    plan: FragmentPlan
    peak_decided: int | None = None


@dataclass(frozen=True)
class Built:
    """A candidate's graphs as built; ``plan``'s peak is the built graphs' where the late
    rewrites lowered it. ``peak_decided``: the candidate's, where the built graphs peak as
    planned (``None`` where the late rewrites moved the peak, or not known)."""

    joint: fx.GraphModule
    fw: fx.GraphModule
    bw: fx.GraphModule
    model: JointModel
    plan: FragmentPlan
    peak_decided: int | None = None


def choose(tried: Sequence[Built]) -> Built:
    """One that fits, the least predicted time (copies counted as not hidden); else the lowest
    peak. Ties go to the earlier (the list's order is the stages')."""
    return min(
        tried,
        key=lambda b: (
            not b.plan.feasible,
            b.plan.recompute_time + b.plan.swap_time if b.plan.feasible else 0.0,
            b.plan.predicted_peak,
        ),
    )


class FragmentSearch:
    """The plans of one fragment's partition (see the module docstring)."""

    def __init__(
        self,
        spec: FragmentSpec,
        env: FragmentEnv,
        num_fwd_outputs: int,
        static: Sequence[int],
    ) -> None:
        self.spec = spec
        self.env = env
        self.num_fwd_outputs = num_fwd_outputs
        self.static = static
        #: Bytes the plans leave to the pilot's prefetch cache (dynamic/prefetch.py).
        self.prefetch_reserve = 0
        self._models: dict[int, tuple[fx.GraphModule, JointModel]] = {}
        #: Planner calls and builds so far (what the slow-compile notice says, stage.py).
        self._plans = 0
        self._builds = 0
        #: Row tilings found and blocks made by this search's builds (each build tiles graphs
        #: that share most of their nodes' values with the builds before).
        self._tilings = built_rewrites.TilingSearch()

    # -- inputs on the host tier -------------------------------------------------------------
    def host_placed(self) -> list[int]:
        """Positions of inputs already in the host tier (placed by an earlier fragment), with
        their aliases."""
        spec = self.spec
        placed = [
            i
            for i, t in enumerate(spec.example_inputs)
            if i not in spec.alias_sources and isinstance(t, torch.Tensor) and is_host_placed(t)
        ]
        return spec.with_aliases(placed)

    def host_candidates(self) -> list[int]:
        """Parameters of this fragment that may move to the host tier (CPU or CUDA leaf
        parameters that cover their storage, see ``store.place_on_host``, not already there),
        with their aliases."""
        inputs, out = self.spec.example_inputs, []
        for i in self.static:
            t = inputs[i] if i < len(inputs) else None
            if isinstance(t, torch.Tensor) and self.env.resident.may_host(t):
                if not is_host_placed(t):
                    out.append(i)
        return self.spec.with_aliases(out)

    def lower_bound(self, placed: Sequence[int], *, hostable: bool) -> tuple[int, int, int]:
        """(bound, resident, largest): no plan of this fragment peaks below ``bound`` bytes, as
        the plans count it. ``resident``: what stays on the device whatever the plan (buffers,
        inputs, other fragments' memory; parameters too unless ``hostable``: they may move to
        the host tier); ``largest``: the largest parameter a plan fetches from the host
        (``placed`` ones, and with ``hostable`` every candidate), read whole on the device by
        its reader, so on it beside the resident bytes then. Any plan's resident count hosts
        at most these parameters, and keeps on the device any it does not host."""
        host = self.host_candidates() if hostable else []
        resident = self.env.resident.resident_bytes(self.spec, host=host)
        inputs = self.spec.example_inputs
        fetched = [inputs[i] for i in (*host, *placed) if isinstance(inputs[i], torch.Tensor)]
        largest = max((t.untyped_storage().nbytes() for t in fetched), default=0)
        return resident + largest, resident, largest

    def movable(self, host: Sequence[int] = ()) -> int:
        """Of the resident bytes a plan with the inputs at ``host`` on the host tier counts,
        what the step's own re-planning may still take off the device
        (``ResidentSet.movable_bytes``): a budget missed by no more is not a "no" yet
        (``fragment.py``'s fast and quick no; the backend's infeasible plan)."""
        return self.env.resident.movable_bytes(self.spec, host=host)

    def fetch(self, joint: fx.GraphModule, primals: Sequence[int]) -> fx.GraphModule:
        """``joint`` reading the inputs at ``primals`` from the host tier (rewrites/params.py)."""
        fetched = param_fetch_pass(
            joint,
            PassContext(fragment=self.spec.name, graph="joint"),
            primals=primals,
            num_fwd_outputs=self.num_fwd_outputs,
            device=self.spec.device or torch.device("cpu"),
            store=self.env.store_key,
        )
        return derived(joint, fetched, "fetch", tuple(primals))

    @property
    def eager_kernels(self) -> bool:
        """The fragment's graphs run on the eager inner compiler (``spec.inner``): the rewrites
        that rely on eager's kernels and order apply."""
        return self.spec.inner == "eager"

    def reserve(self, host: Sequence[int]) -> int:
        """The prefetch cache's share of the budget if this fragment fetches the inputs at
        ``host`` (and those already in the host tier); see dynamic/prefetch.py."""
        env, inputs = self.env, self.spec.example_inputs
        if not env.pilot_plans:
            return 0
        storages = {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for i in (*host, *self.host_placed())
            if isinstance(t := inputs[i], torch.Tensor)
        }
        own_bytes = sum(storages.values())
        depth = env.config.prefetch_depth
        return depth * max(env.resident.max_block_host_bytes, own_bytes)

    # -- planning ----------------------------------------------------------------------------
    def in_place(self, joint: fx.GraphModule) -> fx.GraphModule:
        """``joint`` with its loss heads and its dying gradients' elementwise ops computed in
        place (the same kernels: always)."""
        config, switches = self.env.config, features.current()
        ctx = PassContext(fragment=self.spec.name, graph="joint")
        original = joint
        if switches.loss_head_in_place:
            # Under a budget in 16 blocks of rows (least scratch); without one in blocks big
            # enough that their calls cost no time.
            min_block = (
                min_block_bytes(self.env.cost_profile(self.spec.example_inputs))
                if config.budget is None
                else 0
            )
            joint = loss_head_pass(joint, ctx, min_block_bytes=min_block)
        if switches.elementwise_in_place and self.eager_kernels:
            joint = in_place_pass(joint, ctx)  # the same kernels, writing into dying gradients
        return derived(original, joint, "in_place")

    def plan(
        self,
        joint: fx.GraphModule,
        *,
        host: Sequence[int] = (),
        start: Collection[str] = (),
        reserve: int | None = None,
        swap: bool = True,
        recompute: bool = True,
        floor: bool = False,
    ) -> Candidate:
        """The planner's plan of ``joint`` for this fragment's target, with the inputs at
        positions ``host`` counted as host-placed (not resident); ``start``: a saved set the
        search also starts from (``planner.search_saved_set``); ``reserve``: the prefetch
        cache's share of the budget (``None``: :meth:`reserve`'s); ``swap=False``: recompute
        only, whatever the ``swap`` option; ``recompute=False``: swap only, whatever the
        ``recompute`` option; ``floor``: searched for the smallest peak (a target of 0),
        feasible where that peak meets the budget."""
        config, spec = self.env.config, self.spec
        self._plans += 1
        what = [
            w
            for w, on in (
                ("parameters on the host", bool(host)),
                ("recomputing only", not swap),
                ("swapping only", not recompute),
                ("for the smallest peak", floor),
            )
            if on
        ]
        calling = f"the planner, call {self._plans}" + (f": {', '.join(what)}" if what else "")
        stage.say(calling)
        model = self._joint_model(joint)
        if reserve is None:
            reserve = self.reserve(host)
        resident = self.env.resident.resident_bytes(spec, host=host) + reserve
        target = None if config.budget is None else config.budget - resident
        searched: list[SearchResult] = []
        plan = plan_fragment(
            model,
            target=0 if floor and target is not None else target,
            resident_bytes=resident,
            recompute=config.recompute and recompute,
            swap_tier=config.offload_to if config.swap and swap else None,
            reorder=config.reorder,
            start=start,
            saved_cap=spec.replan_saved_cap,
            progress=lambda where: stage.say(f"{calling}; searching for {where}"),
            searched=searched.append,
        )
        decided = model.decided_at_peak(searched[0].final) if searched else None
        if floor and target is not None:
            plan = dataclasses.replace(
                plan,
                target=target,
                feasible=plan.predicted_peak - resident <= target
                and (plan.saved_cap is None or plan.held_bytes <= plan.saved_cap),
            )
        return Candidate(joint, model, plan, decided)

    def _joint_model(self, joint: fx.GraphModule) -> JointModel:
        """The joint model of ``joint``, built once per graph in a partition: one graph is
        planned several times (for the target, without the prefetch reserve, recomputing or
        swapping only, for the smallest peak), and the planner remembers its searches per
        model (``planner.py``)."""
        found = self._models.get(id(joint))
        if found is not None and found[0] is joint:
            return found[1]
        primals = [
            p.meta.get("val")
            for p in joint.graph.find_nodes(op="placeholder")
            if not P._is_tangent(p)
        ]
        _, bw_outs, _, _ = P._extract_fwd_bwd_outputs(joint, num_fwd_outputs=self.num_fwd_outputs)
        grads = [o.meta.get("val") if isinstance(o, fx.Node) else None for o in bw_outs]
        model = JointModel(
            joint,
            num_fwd_outputs=self.num_fwd_outputs,
            static_input_indices=self.static,
            profile=self.env.cost_profile(primals),
            workspace=probe_workspaces(joint),
            clone_bytes=accumulate_clone_bytes(grads, primals, set(self.static), clone_workspace),
            dropped_outputs=self.spec.dropped_outputs,
            released_tangents=self.spec.released_tangents,
            remake_views=self.eager_kernels,
        )
        self._models[id(joint)] = (joint, model)
        return model

    def room_without_reserve(
        self, fetched: fx.GraphModule, host: Sequence[int]
    ) -> tuple[int | None, Candidate]:
        """Bytes the plan of ``fetched`` (parameters at ``host`` on the host) leaves under the
        budget with no prefetch reserve (``None``: it does not fit even so), and that plan."""
        budget = self.env.config.budget
        bare = self.plan(fetched, host=host, reserve=0)
        if budget is None or not bare.plan.feasible:
            return None, bare
        return max(0, budget - bare.plan.predicted_peak), bare

    # -- building ----------------------------------------------------------------------------
    def build(self, cand: Candidate, *, late: Sequence[Step] | None = None) -> Built:
        """The forward and backward graphs of ``cand`` (partitioned, swaps inserted), and for a
        plan over its target the rewrites that may still bring it under (the plan with the
        peak they reach). Changes nothing outside the graphs. The late rewrites applied are
        recorded in the forward's ``meta`` (``plan_cache.LATE``); ``late``: apply those, as
        recorded, without trying any (a cached plan, ``plan_cache.py``)."""
        spec, model, plan = self.spec, cand.model, cand.plan
        self._builds += 1
        building = f"building plan {self._builds}"
        stage.say(building)
        ctx = PassContext(fragment=spec.name, graph="joint")
        fw, bw = partition_pass(cand.joint, ctx, model=model, plan=plan)
        if plan.swapped:
            saved = {
                model.storage_named(d.tensor) for d in plan.decisions if d.action != "recompute"
            }
            by_storage = {model.storage_named(n): tier for n, tier in plan.swapped.items()}
            holders = model.swap_holders(saved, by_storage)
            swaps = {holders[s]: tier for s, tier in by_storage.items()}
            fw, bw = swap_pass(fw, bw, ctx, swaps=swaps, store=self.env.store_key)
        if late is not None:
            fw, bw = built_rewrites.replay(spec, fw, bw, late)
            return Built(cand.joint, fw, bw, model, plan)
        applied: list[Step] = []
        memo = built_rewrites.ProfileMemo()
        # Not in a re-plan (planning/replan.py): its caps share the budget between fragments
        # by the joint model's figures, which do not price the splits.
        if not plan.feasible and spec.replan_resident is None:
            switches = features.current()
            split = (
                tuple(self.static),
                model.num_mutated_outputs,
                self.num_fwd_outputs - model.num_mutated_outputs,
            )
            if switches.built_in_place and self.eager_kernels:
                stage.say(f"{building}: elementwise ops in place")
                fw2, bw2, plan = built_rewrites.built_rewrite(
                    spec,
                    fw,
                    bw,
                    plan,
                    split,
                    lambda gm, ctx: in_place_pass(gm, ctx, built=True),
                    "elementwise results written into the graphs' own dying values",
                    memo=memo,
                )
                if fw2 is not fw or bw2 is not bw:
                    fw, bw = fw2, bw2
                    applied.append(("in_place",))
            if not plan.feasible and switches.row_tiling and self.eager_kernels:
                stage.say(f"{building}: row tiling")
                fw, bw, plan, kept = built_rewrites.tiled(
                    spec, fw, bw, plan, split, memo=memo, search=self._tilings
                )
                if kept is not None:
                    applied.append(("tiling", kept))
                row_tiled = tuple(
                    f"{graph}:{t.node}"
                    for graph, gm in (("forward", fw), ("backward", bw))
                    for t in gm.meta.get("memcompile_row_tiles", ())
                )
                plan = dataclasses.replace(plan, row_tiled=row_tiled)
            if not plan.feasible and switches.rematerialize:
                stage.say(f"{building}: backward values made again")
                plan, splits = built_rewrites.rematerialized(spec, fw, bw, plan, split, memo=memo)
                if splits:
                    applied.append(("remat", [dataclasses.asdict(r) for r in splits]))
        fw.meta[LATE] = tuple(applied)
        # Lowered by the late rewrites: the peak moved, to a moment the plan did not price.
        decided = cand.peak_decided if plan.predicted_peak >= cand.plan.predicted_peak else None
        return Built(cand.joint, fw, bw, model, plan, decided)

    # -- alternatives of a plan over its target -----------------------------------------------
    def with_alternatives(self, hosted: Sequence[int], first: Built) -> list[Built]:
        """``first`` (a plan built with the rewrites), and while it does not fit its
        :meth:`alternatives`, then those searched for the smallest peak; none where no saved
        or recomputed value is live at ``first``'s peak (``Built.peak_decided``: 0)."""
        tried = [first]
        if first.plan.feasible:
            return tried
        if first.peak_decided == 0 and features.current().fixed_peak:
            # Its peak moment holds only values every saved set has there: recomputing or
            # swapping otherwise cannot lower it (the GRU small under 14.2 MiB: its 4 other
            # plans, a minute of searching and building, all peaked at or above it).
            log.info(
                "F%d: the plan peaks at %s with no saved or recomputed value live there (the "
                "backward's own values): no other saved set lowers it, none searched",
                self.spec.index,
                format_bytes(first.plan.predicted_peak),
            )
            return tried
        tried += self.alternatives(first.joint, hosted, tried)
        # Also with no room at all (a target of 0 or less): the plan for such a target is
        # searched from other starts than the floor's searches (the dropouts' saved set), and
        # the rewrites take the two elsewhere (bench GPT, recompute only, a 1000 B budget:
        # 52.40 MiB as planned, 50.82 MiB searched for the smallest peak). A floor plan whose
        # decisions were tried already is not built again.
        if not any(t.plan.feasible for t in tried):
            tried += self.alternatives(first.joint, hosted, tried, floor=True)
        return tried

    def alternatives(
        self,
        joint: fx.GraphModule,
        hosted: Sequence[int],
        tried: Sequence[Built],
        *,
        floor: bool = False,
    ) -> list[Built]:
        """Other plans for a fragment whose plan (``tried[0]``) is over its target, built with
        the rewrites, where their decisions differ from those ``tried``: recomputing only
        where it swaps, swapping only where it recomputes. With ``floor``, the plan, recompute
        only and swap only, each searched for the smallest peak rather than for the target.

        The rewrites (in place, blocks of rows, reloads by rows) act on what a plan recomputes
        and what it swaps differently, which the planner does not price: a plan with one of
        the two only may end lower. And the planner's plan for a target it cannot meet
        depends on the target, and so does what the rewrites then reach: the smallest budget
        an error reports (``min_feasible``, found with no room) must fit when it is then the
        budget (tiny GPT, disk tier: planned for its own ``min_feasible`` of 451 KiB, the plan
        peaked at 482 KiB)."""
        config = self.env.config
        planned = tried[0].plan
        seen = {t.plan.decisions for t in tried}
        found: list[Built] = []
        for swap, recompute, what in (
            (True, True, "as configured"),
            (False, True, "recomputing instead of swapping"),
            (True, False, "swapping instead of recomputing"),
        ):
            if (not swap and not config.recompute) or (not recompute and not config.swap):
                continue
            if not floor and (
                (swap and recompute) or not (planned.recomputed if swap else planned.swapped)
            ):
                continue
            cand = self.plan(
                joint,
                host=hosted,
                reserve=self.prefetch_reserve,
                swap=swap,
                recompute=recompute,
                floor=floor,
            )
            if cand.plan.decisions in seen:
                continue
            seen.add(cand.plan.decisions)
            built = self.build(cand)
            log.info(
                "F%d: %s%s, the plan peaks at %s (%s as planned)",
                self.spec.index,
                what,
                " and searched for the smallest peak" if floor else "",
                format_bytes(built.plan.predicted_peak),
                format_bytes(planned.predicted_peak),
            )
            found.append(built)
        return found

    def build_blocks(
        self, joint: fx.GraphModule, hosted: Sequence[int], planned: FragmentPlan
    ) -> Built:
        """The plan of ``joint`` (its loss heads made by blocks, ``rewrites/linearce.py``) built
        with the rewrites; ``planned``: the plan without blocks, for the log."""
        built = self.build(self.plan(joint, host=hosted, reserve=self.prefetch_reserve))
        log.info(
            "F%d: with its loss heads made by blocks the built plan peaks at %s (%s without)",
            self.spec.index,
            format_bytes(built.plan.predicted_peak),
            format_bytes(planned.predicted_peak),
        )
        return built
