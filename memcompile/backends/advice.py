"""What memcompile tells a user whose budget is not met, and what would help.

    infeasible      no plan of a fragment fits: MemoryBudgetError (or a MemoryBudgetWarning
                    with on_infeasible="best_effort"), with the reasons and the options that help
    check_budget    a plan's built graphs profile over the budget it claimed to meet
    step_over       a step predicted over the budget that re-planning does not fit
    CPU_AUTO_PILOT_OFF  why pilot="auto" runs no trial on the CPU (the report's pilot line)

The texts are the contract with the user: they name the bytes that do not move and the option
that moves them.
"""

from __future__ import annotations

import logging
import warnings
from typing import NoReturn

from memcompile.analysis.fragment_profile import FragmentProfile
from memcompile.config import MemConfig
from memcompile.errors import MemoryBudgetError, MemoryBudgetWarning, format_bytes
from memcompile.pipeline.env import FragmentSpec
from memcompile.pipeline.fragment import LATE_CUT, QUICK_NO_SHARE, BelowBound
from memcompile.planning.plan import FragmentPlan
from memcompile.runtime.store import HOSTABLE_DEVICES
from memcompile.step.budget import OptimizerOver, StepOver

__all__ = [
    "CPU_AUTO_PILOT_OFF",
    "check_budget",
    "infeasible",
    "optimizer_over",
    "step_over",
]

log = logging.getLogger(__name__)


#: Why ``pilot="auto"`` runs no trial on the CPU device with its copies on the computing thread
#: (the report says it): a prefetched copy takes as long as the on-demand one it replaces, and
#: the predictions, the cache and the copies of mispredicted blocks are added time (the small
#: zoo MoE, benchmarks/results/dynamic_prefetch.md: 61.1 ms a step with the pilot in its graphs,
#: 46.9 ms fetching on demand), besides the budget its cache reserves.
CPU_AUTO_PILOT_OFF = (
    "on the CPU device with its copies on the computing thread a prefetch cannot hide a copy, "
    "so pilot='auto' fetches on demand without a trial (MEMCOMPILE_COPY_THREAD=1 puts the "
    "copies on a thread and lets a trial decide; pilot='markov' or 'lightgbm' runs it anyway, "
    "e.g. for its simulated GPU stall)"
)


def infeasible(
    config: MemConfig,
    spec: FragmentSpec,
    plan: FragmentPlan,
    *,
    prefetch_reserve: int,
    hosted: bool,
    host_peak: int | None,
    held_outputs: int,
    sharded: bool,
    device_other: int | None,
    untaken: int,
    inner_over: tuple[str, int] | None = None,
    quick_no: str = "",
    fixed_peak: bool = False,
    inner_fallback: str = "",
    inner: str = "eager",
) -> None:
    """No plan fits: raise MemoryBudgetError, or warn (``on_infeasible="best_effort"``); a
    re-plan only logs it (the next step's prediction tells whether the step fits).

    ``hosted``: the plan keeps this fragment's parameters on the host; ``host_peak``: the
    smallest peak found with them there, when that was tried and did not help;
    ``held_outputs``: bytes of the user outputs the plan counts as held by the caller through
    the backward; ``sharded``: FSDP2 manages the model's parameters; ``device_other``: bytes
    others had allocated on the device; ``untaken``: bytes of the model's parameters and
    buffers no fragment reads; ``inner_over``: the inner compiler and the bytes its code was
    measured to need past the budget with the smallest plan found; ``quick_no``: no other
    plan was searched (pipeline/fragment.py's quick no: ``"built"``, the plan is the first
    one built; ``"planned"``, as planned, before the rewrites of its built graphs);
    ``fixed_peak``: no saved or recomputed value is live at the plan's peak (only values the
    backward makes), so no plan of another saved set lowers it; ``inner_fallback``: why
    ``inner="auto"`` planned it for eager kernels instead of Inductor; ``inner``: the inner
    compiler it was planned for."""
    budget = config.budget
    assert budget is not None
    tips = []
    if quick_no == "built":
        tips.append(
            "that is the first plan's peak: the budget is under half of it, so no other plan "
            "was searched (on_infeasible='best_effort' searches them all and runs the "
            "smallest)"
        )
    elif quick_no == "planned":
        tips.append(
            "that is the first plan's peak as planned: the budget is under "
            f"{QUICK_NO_SHARE * (1 - LATE_CUT):.0%} of it, and the rewrites of a plan's built "
            f"graphs have taken off {LATE_CUT:.0%} at most, so neither they nor other plans "
            "were tried (on_infeasible='best_effort' tries them all and runs the smallest)"
        )
    if fixed_peak:
        tips.append(
            "no saved activation is live at that peak, only values the backward makes "
            "(gradients and their temporaries), so recomputing or offloading activations "
            "cannot lower it"
        )
    if inner_over is not None:
        inner, over = inner_over
        tips.append(
            f"{inner}'s code, measured at compile time, peaks {format_bytes(over)} above the "
            "budget with the smallest plan found (the eager model of the graphs fits it: "
            "inner='eager' runs them as planned)"
        )
    if inner == "inductor" and inner_over is None:
        # Inductor's graphs are traced with its decompositions and get none of the rewrites
        # that rely on eager's kernels (hand-written-attention GPT at 0.3x eager's
        # activations, before dropout stayed whole: Inductor's smallest plan 21.98 MiB, eager
        # kernels' 21.18 MiB).
        tips.append(
            "the plans were made for Inductor: inner='eager' plans for eager kernels (eager's "
            "decompositions, elementwise ops in place, row tiling), which can reach lower, and "
            "inner='auto' tries them where Inductor's plans miss"
        )
    if inner_fallback:
        tips.append(
            "that is the smallest plan for eager kernels: inner='auto' planned for them "
            f"because {inner_fallback}"
        )
    tips += _resident_tips(config, spec, plan, hosted=hosted, host_peak=host_peak, sharded=sharded)
    tips += _others_tips(device_other, untaken)
    if held_outputs >= plan.predicted_peak // 100 and not spec.dropped_outputs:
        # Step 1 cannot know what the caller keeps; the first backward shows it.
        tips.append(
            f"the plan counts F{spec.index}'s outputs ({format_bytes(held_outputs)}) as "
            "held by the caller through the backward, as a loop that keeps the logits "
            "does: if yours drops them before backward(), on_infeasible='best_effort' runs "
            "the smallest plan for the first step and plans again without them once its "
            "backward shows it"
        )
    if prefetch_reserve:
        tips.append(
            f"{format_bytes(prefetch_reserve)} of it is reserved for the pilot's "
            "prefetch cache (pilot='off', or a smaller prefetch_depth, frees it)"
        )
    hint = "; ".join(tips)
    if spec.replan_resident is not None or spec.host_replan:
        # A re-plan runs its smallest plan: the next step's prediction tells whether the
        # step fits with every re-planned fragment, and warns if not (step/budget.py).
        cap = plan.saved_cap
        log.info(
            "memcompile: re-planned F%d cannot meet its share of budget=%s (smallest peak "
            "%s%s); running its smallest plan: %s",
            spec.index,
            format_bytes(budget),
            format_bytes(plan.predicted_peak),
            ""
            if cap is None
            else f", holding {format_bytes(plan.held_bytes)} for the backward, cap "
            f"{format_bytes(cap)}",
            hint,
        )
        return
    if config.on_infeasible == "error":
        raise MemoryBudgetError(budget, plan.predicted_peak, hint)
    # The same reasons the error gives: a best-effort run is told why it does not fit too
    # (the GRU's longer buckets: they named the pilot's reserve, which then gave way).
    warnings.warn(
        f"memcompile: F{spec.index} does not fit budget={format_bytes(budget)}; running the "
        f"smallest plan found, predicted peak {format_bytes(plan.predicted_peak)} "
        f"(on_infeasible='best_effort'): {hint}",
        MemoryBudgetWarning,
        stacklevel=2,
    )


def _others_tips(device_other: int | None, untaken: int) -> list[str]:
    """What of the resident bytes is not this fragment's: others' device memory, and the
    model's parameters no fragment reads."""
    tips = []
    if device_other:
        tips.append(
            f"of which {format_bytes(device_other)} was already allocated on the "
            "device by others (other tensors, optimizer state, library workspaces)"
        )
    if untaken:
        tips.append(
            f"of which {format_bytes(untaken)} is the model's parameters and buffers that no "
            "fragment compiled so far reads (those of frames Dynamo runs eagerly stay on "
            "the device: see the EagerFallbackWarning)"
        )
    return tips


def below_bound(
    config: MemConfig,
    spec: FragmentSpec,
    below: BelowBound,
    *,
    device_other: int | None,
    untaken: int,
) -> NoReturn:
    """The budget is below every plan's lower bound (pipeline/fragment.py's fast no): raise
    ``MemoryBudgetError`` with the bound, before any search.

    Raises:
        MemoryBudgetError: always (``bound=True``).
    """
    budget = config.budget
    assert budget is not None
    what = (
        "buffers, inputs and other fragments' memory"
        if below.hostable
        else "parameters, buffers, inputs and other fragments' memory"
    )
    tips = [f"{format_bytes(below.resident)} of it is {what}, on the device whatever the plan"]
    tips += _others_tips(device_other, untaken)
    if below.largest:
        tips.append(
            f"{format_bytes(below.largest)} is {spec.name}'s largest parameter, fetched whole "
            "from the host for the op that reads it"
        )
    if config.offload_params is False:
        tips.append("offload_params=True (or 'auto') keeps parameters on the host")
    tips.append("on_infeasible='best_effort' searches anyway and runs the smallest plan found")
    raise MemoryBudgetError(budget, below.bound, "; ".join(tips), bound=True)


def _resident_tips(
    config: MemConfig,
    spec: FragmentSpec,
    plan: FragmentPlan,
    *,
    hosted: bool,
    host_peak: int | None,
    sharded: bool,
) -> list[str]:
    """What the options allowed could still do, and what of the peak stays resident and why."""
    tips = [f"enable {k}=True" for k in ("recompute", "swap") if not getattr(config, k)]
    device = spec.device
    resident = format_bytes(plan.resident_bytes)
    if hosted:
        tips.append(
            f"with the parameters on the host, {resident} of the peak is still buffers, "
            "inputs and other fragments' memory"
        )
    elif host_peak is not None:
        tips.append(
            f"{resident} of the peak is parameters, buffers and inputs; keeping the "
            f"parameters on the host does not help (smallest peak then "
            f"{format_bytes(host_peak)})"
        )
    elif device is not None and device.type not in HOSTABLE_DEVICES:
        tips.append(
            f"{resident} of the peak is parameters, buffers and inputs, which stay on the "
            "device (parameters on the host are only implemented for "
            f"{' and '.join(HOSTABLE_DEVICES)} devices in this version)"
        )
    elif sharded:
        tips.append(
            f"{resident} of the peak is parameters, buffers and inputs; FSDP2 manages the "
            "parameters (more ranks shard them thinner, and FSDP2's "
            "offload_policy=CPUOffloadPolicy() keeps them on the host)"
        )
    elif config.offload_params is False:
        tips.append(
            f"{resident} of the peak is parameters, buffers and inputs: offload_params=True "
            "(or 'auto') keeps parameters on the host"
        )
    else:
        tips.append(f"{resident} of the peak is buffers, inputs and other fragments' memory")
    return tips


def check_budget(
    config: MemConfig,
    index: int,
    plan: FragmentPlan | None,
    profile: FragmentProfile | None,
    *,
    counted: int = 0,
    inner: str | None = None,
) -> None:
    """Warn if F{index}'s built graphs' exact profile exceeds a budget its plan claimed to
    meet. ``counted``: bytes of ``plan.resident_bytes`` the profile counts already (what the
    inner compiler's code was measured to need, planned around); ``inner``: the inner
    compiler whose measured peaks the profile carries, named in the warning."""
    budget = config.budget
    if budget is None or plan is None or profile is None or not plan.feasible:
        return
    peak = plan.resident_bytes - counted + max(profile.phase_peaks().values())
    if peak > budget:
        measured = (
            f"; {inner}'s code was measured at compile time and planned around as far as a "
            "plan fits: a larger budget, or inner='eager', whose plans are exact, fits it"
            if inner is not None
            else ""
        )
        warnings.warn(
            f"memcompile: F{index}'s built graphs are predicted to peak at "
            f"{format_bytes(peak)}, over budget={format_bytes(budget)} (the planner expected "
            f"{format_bytes(plan.predicted_peak)}{measured})",
            MemoryBudgetWarning,
            stacklevel=2,
        )


def step_over(
    over: StepOver,
    config: MemConfig,
    *,
    hostable_bytes: int,
    host_param_bytes: int,
    sharded: bool,
) -> None:
    """Warn about a step predicted over the budget that re-planning does not fit, with what
    could fit it among what is not done already (``hostable_bytes``: the step's parameters the
    host tier may take that are still on the device)."""
    budget = config.budget or 0
    if not over.several:
        warnings.warn(
            f"memcompile: the step is predicted to peak at {format_bytes(over.peak)}, "
            f"over budget={format_bytes(budget)}, though its plan fit when it was made (the "
            "step's shapes or resident memory changed)",
            MemoryBudgetWarning,
            stacklevel=3,
        )
        return
    tips = []
    off = [name for name in ("recompute", "swap") if not getattr(config, name)]
    if off:
        tips.append("allow " + " and ".join(off))
    device = 0
    if sharded:
        tips.append("shard over more ranks or use FSDP2's CPUOffloadPolicy")
    elif config.offload_params is not True:
        device = hostable_bytes
        if device:
            tips.append(f"set offload_params=True ({format_bytes(device)} on the device)")
    tips.append("raise the budget")
    held = (
        f"With its parameters on the host ({format_bytes(host_param_bytes)}), its "
        "gradients and smallest saved sets"
        if host_param_bytes and not device and not sharded
        else "Its parameters, gradients and smallest saved sets"
    )
    if over.state_bytes or over.grad_bytes:  # the training loop's share of the step
        loop = []
        if over.state_bytes:
            loop.append(f"the optimizers' state ({format_bytes(over.state_bytes)})")
        if over.grad_bytes:
            loop.append(f"the gradients accumulated so far ({format_bytes(over.grad_bytes)})")
        held += ", with " + " and ".join(loop) + ","

    options = tips[0] if len(tips) == 1 else ", ".join(tips[:-1]) + ", or " + tips[-1]
    warnings.warn(
        f"memcompile: a {over.calls}-call step is predicted to peak at "
        f"{format_bytes(over.peak)}, over budget={format_bytes(budget)}: {over.why}. "
        f"{held} need more ({options}; see memcompile.report())",
        MemoryBudgetWarning,
        stacklevel=3,
    )


def optimizer_over(over: OptimizerOver, config: MemConfig, *, sharded: bool) -> None:
    """An optimizer step of the model is predicted over the budget: no plan of the forward and
    backward lowers it. Raise MemoryBudgetError (``on_infeasible="error"``; from the optimizer's
    ``step()``, after it) or warn."""
    budget = config.budget
    assert budget is not None
    what = ", ".join(over.optimizers) or "the optimizers' state"
    tips = ["raise the budget"]
    if config.offload_params is not True and not sharded:
        tips.append("set offload_params=True (parameters and gradients on the host)")
    tips.append("use an optimizer with less state")
    hint = (
        f"during the optimizer step the parameters and buffers "
        f"({format_bytes(over.resident)}), the gradients ({format_bytes(over.grads)}), "
        f"{what} and the step's temporaries ({format_bytes(over.transient)}) are on the "
        "device at once, which no plan of the forward and backward lowers: " + ", or ".join(tips)
    )
    if config.on_infeasible == "error":
        raise MemoryBudgetError(budget, over.peak, hint)
    warnings.warn(
        f"memcompile: the optimizer step is predicted to peak at {format_bytes(over.peak)}, over "
        f"budget={format_bytes(budget)} (on_infeasible='best_effort'): {hint}",
        MemoryBudgetWarning,
        stacklevel=5,
    )
