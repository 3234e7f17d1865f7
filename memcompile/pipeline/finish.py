"""Finishing a fragment's built graphs, once AOTAutograd hands them to the compilers.

forward    pilot_op:       where the pilot predicts the next blocks and copies their
                           parameters: inside the graph (rewrites/pilot_prefetch.py), or
                           at the fragment's tail
backward   early_reloads:  reloads moved up where their copies hide behind compute
                           without raising the profiled peak (rewrites/early_reloads.py)
"""

from __future__ import annotations

import dataclasses

from torch import fx

from memcompile.analysis.costmodel import DeviceProfile
from memcompile.analysis.fragment_profile import FragmentProfile
from memcompile.pipeline import features
from memcompile.pipeline.env import FragmentEnv, FragmentSpec
from memcompile.planning.plan import FragmentPlan
from memcompile.rewrites.context import PassContext
from memcompile.rewrites.early_reloads import plan_prefetch, prefetch_pass
from memcompile.rewrites.pilot_prefetch import (
    PilotPrefetchPlan,
    device_observed,
    observed_outputs,
    pilot_prefetch_pass,
    plan_pilot_prefetch,
)

__all__ = ["early_reloads", "pilot_op"]


def pilot_op(
    gm: fx.GraphModule,
    spec: FragmentSpec,
    env: FragmentEnv,
    cost: DeviceProfile,
    *,
    prefetch_reserve: int,
    hook: int,
) -> PilotPrefetchPlan:
    """Where the pilot predicts and copies the next blocks: inside this forward graph, where the
    copy overlaps the rest of it, once plans leave the cache a reserve; else (and for the
    simulated stall, always) the decision at the tail. ``hook``: the prefetcher's key in the
    graph's pilot op. Before profiling: the profile then describes the graph as built."""
    depth, resident = env.config.prefetch_depth, env.resident
    observed = observed_outputs(gm)
    decided = plan_pilot_prefetch(
        gm,
        cost,
        fragment=spec.name,
        copy_bytes=max(resident.max_block_host_bytes, prefetch_reserve // depth),
        copy_tensors=max(resident.max_block_host_tensors, 1),
        observed=observed,
    )
    # A CUDA router's counts are read at the tail: in the graph the host would wait there.
    if features.current().pilot_in_graph and env.pilot_plans and not device_observed(observed):
        ctx = PassContext(fragment=spec.name, graph="forward")
        pilot_prefetch_pass(gm, ctx, plan=decided, hook=hook, fragment=spec.index)
        return decided
    return decided.at_tail()


def early_reloads(
    bw: fx.GraphModule | None,
    plan: FragmentPlan | None,
    profile: FragmentProfile | None,
    cost: DeviceProfile,
    spec: FragmentSpec,
) -> tuple[FragmentPlan | None, bool]:
    """Move reloads up the backward where their copies can hide behind compute without raising
    the profiled peak past what the budget leaves above the plan's prediction (``bw`` is
    rewritten in place). Returns the plan naming them, and whether any moved (then profile
    again, exactly, with the new order)."""
    if bw is None or plan is None or not plan.swapped or profile is None:
        return plan, False
    assert profile.backward is not None
    slack = 0
    if plan.target is not None and plan.feasible:  # tracked bytes, as the phase peaks
        slack = max(0, plan.target - profile.phase_peaks()["backward"])
    decided = plan_prefetch(bw, profile.backward, cost, slack=slack)
    prefetch_pass(bw, PassContext(fragment=spec.name, graph="backward"), plan=decided)
    plan = dataclasses.replace(plan, prefetch=decided.issue_before, swap_stall=decided.after.stall)
    return plan, bool(decided.issue_before)
