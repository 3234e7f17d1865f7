"""``memcompile.report(compiled)``: what memcompile did, read from the backend's own records.

    r = memcompile.report(compiled)
    r.predicted_peak            # bytes: absolute device peak of one training step
    r.fragments[0].predicted_peak, r.fallbacks, r.to_dict()
    r.pilot.hit_rate            # dynamic networks: the pilot's accuracy, hits, wasted bytes
    print(r)                    # a table

The report never recompiles or re-profiles anything: it reads ``MemCompiler.fragments`` and the
last observed step, and predicts the step peak with
:func:`memcompile.analysis.step_model.simulate_step`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from torch._dynamo.eval_frame import innermost_backend

from memcompile.analysis.fragment_profile import FragmentProfile
from memcompile.backends.compiler import MemCompiler
from memcompile.backends.dynamo_hooks import COMPILER_ATTR, dynamo_context
from memcompile.backends.fallbacks import (
    Fallback,
    FunctionSpan,
    function_span,
    module_functions,
)
from memcompile.backends.regions import Region
from memcompile.config import MemConfig
from memcompile.errors import format_bytes
from memcompile.planning.plan import FragmentPlan, MemoryPlan
from memcompile.planning.replan import Replan
from memcompile.runtime.glue import GlueStats
from memcompile.runtime.glue_params import GlueParam
from memcompile.step.fraction import MeasuredBudget

if TYPE_CHECKING:  # the pilot imports LightGBM: only when a model uses it
    from memcompile.dynamic.prefetch import PilotReport

log = logging.getLogger(__name__)

__all__ = ["FragmentReport", "IterationReport", "MemReport", "find_compiler", "report"]

_SHORT = {"forward": "fw", "backward": "bw", "inference": "inf"}


@dataclass(frozen=True)
class FragmentReport:
    """One fragment as the report shows it (see ``memcompile.records.FragmentRecord``).

    ``predicted_peak`` is the predicted absolute device peak while this fragment's graphs run in
    the observed step (``None`` if it did not run in that step).
    """

    name: str
    id: str
    code: str
    reason: str
    break_at: str
    compile_id: str
    forward_calls: int
    backward_calls: int
    inference_calls: int
    predicted_peak: int | None
    training: bool
    approximate: bool
    profile: FragmentProfile | None
    plan: FragmentPlan | None = None
    #: The plan cache's key when the plan was replayed from an earlier run's search.
    plan_cached: str | None = None
    #: Why the inner compiler's code was not measured (``""``: measured, or eager).
    inner_unmeasured: str = ""
    #: The inner compiler its graphs ran on (``inner="auto"`` resolved for its device).
    inner: str = "eager"
    #: Why it ran on eager kernels where ``inner="auto"`` chose Inductor (``""``: it did not).
    inner_fallback: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "id": self.id,
            "code": self.code,
            "reason": self.reason,
            "break_at": self.break_at,
            "compile_id": self.compile_id,
            "forward_calls": self.forward_calls,
            "backward_calls": self.backward_calls,
            "inference_calls": self.inference_calls,
            "predicted_peak": self.predicted_peak,
            "training": self.training,
            "approximate": self.approximate,
            "profile": self.profile.to_dict() if self.profile is not None else None,
            "plan": self.plan.to_dict() if self.plan is not None else None,
            "plan_cached": self.plan_cached,
            "inner_adjust": list(self.profile.inner_adjust) if self.profile is not None else None,
            "inner_unmeasured": self.inner_unmeasured,
            "inner": self.inner,
            "inner_fallback": self.inner_fallback,
        }


@dataclass(frozen=True)
class IterationReport:
    """The training iteration as the loop showed it (``step/iteration.py``).

    Attributes:
        micro_batches: steps of the model between two optimizer steps (gradient accumulation).
        optimizers: each optimizer that steps the model, with its state
            (``"AdamW (for-loop) state 1.50 MiB"``).
        state_bytes: their state on the device.
        transient: the most one of their steps allocates and frees again (``exact``: priced for
            its kind; else estimated).
        grads_bytes: the model's gradients on the device when its last optimizer step began.
        peaks: the predicted peak of each phase seen: ``"first micro-batch"``, ``"later
            micro-batches"`` (begun with gradients present), ``"optimizer step"``.
    """

    micro_batches: int
    optimizers: tuple[str, ...]
    state_bytes: int
    transient: int
    exact: bool
    grads_bytes: int
    peaks: tuple[tuple[str, int], ...]

    @property
    def peak(self) -> int | None:
        """The iteration's predicted peak: its largest phase (``None``: none predicted)."""
        return max((p for _, p in self.peaks), default=None)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "peaks": dict(self.peaks), "peak": self.peak}


@dataclass(frozen=True)
class MemReport:
    """Fragments, predicted peak and eager fallbacks of one compiled model.

    Attributes:
        config: the options in force.
        fragments: one entry per compiled fragment, in compile order.
        predicted_peak: predicted absolute device peak of one training step that starts with
            gradients set to None (parameters, buffers, inputs, activations, gradients), bytes;
            ``None`` before anything was compiled. The budget covers the whole iteration:
            ``iteration`` adds the optimizers' state, accumulated gradients and the optimizer
            step.
        resident_bytes: parameters and buffers counted as resident for the whole step (on CUDA
            also device memory memcompile does not own, measured at the first plan).
        exact: the step is a single fragment run by the eager inner compiler, for which the
            prediction is exact; otherwise it is an estimate.
        step: the fragment calls of the step the prediction replays, e.g. ``("F0.fw", "F0.bw")``.
        steps_observed: complete training steps the backend has seen.
        fallbacks: frames Dynamo ran eagerly while this model ran.
        over_budget: a budget is set and the step is predicted to exceed it, or a step (CUDA) or
            a sampled iteration (CPU) was measured above it (memcompile warned).
        measured_peak: with a budget, the highest device peak measured: CUDA, a training step's,
            ``torch.cuda.max_memory_allocated`` read at step boundaries
            (``runtime/peakwatch.py``); CPU, a whole iteration's, with the profiler, sampled
            after each compile (``step/checks.py``); ``None`` before one was.
        latest_measured_peak: CPU, the latest sampled iteration's peak: what the step holds
            since the last change a sample followed (the glue's saved tensors to the host, a
            re-plan), where ``measured_peak`` keeps the highest; ``None`` on CUDA (its peak
            counter only grows) and before a sample.
        host_param_bytes: parameter bytes memcompile moved to the host tier (``offload_params``);
            they are not in ``resident_bytes``.
        pilot: the pilot's predictions and prefetches (``None`` with ``pilot="off"``); see
            :class:`memcompile.dynamic.prefetch.PilotReport`.
        dynamic: why the model counts as dynamic (``""``: not seen to be).
        recompile_limit_raised: ``(old, new)`` when memcompile raised Dynamo's recompile limit
            for this dynamic model (frames over the limit still run eagerly: ``fallbacks``).
        replans: re-planning rounds of steps predicted over budget, in order (see
            ``memcompile.planning.replan``); the last round of a step that still does not fit
            has ``fits == False``.
        summed_grads: ``"F{i}: source"`` of each input whose several contributions a
            fragment's backward graph sums (a parameter read several times; an input an op
            reads through several edges) after another call of the step added to its
            gradient: not eager's order (``GradientOrderWarning``; ``split_param_reads=True``
            splits the parameters).
        dropped_outputs: ``"F{i}: outputs [j, ...]"`` of each fragment whose plan counts those
            forward outputs as dropped by the caller before the backward, as steps showed (a
            loop that keeps only the loss); the rest of its outputs count as held.
        released_tangents: ``"F{i}: [tangents_k, ...]"`` of each fragment whose plan counts
            those incoming gradients as freed after their last reader, as steps showed (no one
            else holds them: AOTAutograd's zeros for an output that got no gradient).
        iteration: the training iteration, once an optimizer stepped the model's parameters
            (:class:`IterationReport`; ``None`` before).
        measured_budget: ``budget="60%"``: the iteration measured without a plan and the budget
            it gave (``None`` before it is measured, and for a budget in bytes).
        unseen_bytes: bytes a measured iteration (CPU samples) peaked above its prediction, which
            every later prediction counts (``StepBudget.unseen``): memory the plans do not see,
            such as the eager glue between regional fragments; 0 when none was measured.
        glue: the eager glue's saved tensors: whether they go to the host tier (turned on when
            a measured step with eager frames passed the budget), why, and the tensors and
            bytes the last model call sent there (``runtime/glue.py``).
        glue_measured: with a budget, the memory of the frames in ``fallbacks`` (the glue) is
            measured and counted in the predictions: CUDA measures every step; on the CPU an
            iteration through its backward was sampled (``unseen_bytes``). Their lines then
            read ``eager`` instead of ``EAGER`` (not for ``dispatch_mode`` calls).
        glue_params: the parameters no fragment takes (only eager code reads them) that went
            to the host tier with the others, fetched around their modules' forward
            (``runtime/glue_params.py``).
        direct_since_step: without a budget, the step count from which the regions call their
            modules directly and the fragments' calls and optimizer steps are not watched,
            once the steps since the last compile were seen (``backends/unplanned.py``): the
            prediction is of the last step seen; ``None`` while every step is watched.
        regions: the ``torch.nn`` modules called from frames in ``fallbacks`` that memcompile
            compiles as fragments of their own (``backends/regions.py``); the tensor operations
            between them in those frames stay eager.
        sharded_param_bytes: the model's parameters at their unsharded size (in the sharded
            parameters' dtype, as far as compiles saw them sharded) when FSDP2 (``fully_shard``)
            manages them, else 0. FSDP's all-gathered parameters, gradients before
            reduce-scatter and collective buffers are outside memcompile's graphs: the predicted
            peak does not count them (``backends/sharded.py``).
    """

    config: MemConfig
    fragments: tuple[FragmentReport, ...]
    predicted_peak: int | None
    resident_bytes: int
    exact: bool
    step: tuple[str, ...]
    steps_observed: int
    fallbacks: tuple[Fallback, ...]
    over_budget: bool = False
    host_param_bytes: int = 0
    pilot: PilotReport | None = None
    dynamic: str = ""
    recompile_limit_raised: tuple[int, int] | None = None
    replans: tuple[Replan, ...] = ()
    measured_peak: int | None = None
    latest_measured_peak: int | None = None
    summed_grads: tuple[str, ...] = ()
    dropped_outputs: tuple[str, ...] = ()
    released_tangents: tuple[str, ...] = ()
    sharded_param_bytes: int = 0
    iteration: IterationReport | None = None
    measured_budget: MeasuredBudget | None = None
    regions: tuple[Region, ...] = ()
    unseen_bytes: int = 0
    glue: GlueStats = field(default_factory=GlueStats)
    glue_params: tuple[GlueParam, ...] = ()
    glue_measured: bool = False
    direct_since_step: int | None = None

    @property
    def eager_frames(self) -> int:
        """Frames Dynamo ran eagerly (each listed in ``fallbacks``): memory there is unmanaged."""
        return len(self.fallbacks)

    @property
    def budget(self) -> int | None:
        return self.config.budget

    @property
    def plan(self) -> MemoryPlan:
        """The memory plans applied, one per planned fragment (empty without a budget)."""
        return MemoryPlan(
            budget=self.config.budget,
            device_profile=self.config.device_profile,
            fragments=tuple(
                replace(f.plan, fragment=f.id) for f in self.fragments if f.plan is not None
            ),
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return {
            "config": self.config.to_dict(),
            "over_budget": self.over_budget,
            "predicted_peak": self.predicted_peak,
            "measured_peak": self.measured_peak,
            "latest_measured_peak": self.latest_measured_peak,
            "resident_bytes": self.resident_bytes,
            "host_param_bytes": self.host_param_bytes,
            "exact": self.exact,
            "step": list(self.step),
            "steps_observed": self.steps_observed,
            "fragments": [f.to_dict() for f in self.fragments],
            "fallbacks": [f.to_dict() for f in self.fallbacks],
            "regions": [r.to_dict() for r in self.regions],
            "unseen_bytes": self.unseen_bytes,
            "glue": self.glue.to_dict(),
            "glue_params": [g.to_dict() for g in self.glue_params],
            "glue_measured": self.glue_measured,
            "direct_since_step": self.direct_since_step,
            "eager_frames": self.eager_frames,
            "dynamic": self.dynamic,
            "recompile_limit_raised": (
                list(self.recompile_limit_raised) if self.recompile_limit_raised else None
            ),
            "pilot": self.pilot.to_dict() if self.pilot is not None else None,
            "replans": [asdict(r) for r in self.replans],
            "summed_grads": list(self.summed_grads),
            "dropped_outputs": list(self.dropped_outputs),
            "released_tangents": list(self.released_tangents),
            "sharded_param_bytes": self.sharded_param_bytes,
            "iteration": self.iteration.to_dict() if self.iteration is not None else None,
            "measured_budget": (
                asdict(self.measured_budget) if self.measured_budget is not None else None
            ),
        }

    def __str__(self) -> str:
        peak = "n/a" if self.predicted_peak is None else format_bytes(self.predicted_peak)
        kind = "exact" if self.exact else "estimate"
        budget = ""
        if self.budget is not None:
            budget = f", budget {format_bytes(self.budget)}" + (
                " EXCEEDED" if self.over_budget else ""
            )
        elif self.config.budget_fraction is not None:
            budget = (
                f", budget {self.config.budget_fraction:.0%} (an iteration without a plan is "
                "measured first)"
            )
        latest = self.latest_measured_peak
        if latest is not None and latest != self.measured_peak:
            budget += (
                f", measured step peak {format_bytes(latest)} (latest sample; the highest "
                f"{format_bytes(self.measured_peak or 0)})"
            )
        elif self.measured_peak is not None:
            budget += f", measured step peak {format_bytes(self.measured_peak)}"
        measured = (
            " (their memory measured, in the budget)"
            if self.glue_measured and self.fallbacks
            else ""
        )
        lines = [
            f"memcompile report: {len(self.fragments)} fragment(s), predicted step peak {peak} "
            f"({kind}){budget}, {len(self.fallbacks)} eager fallback(s){measured}",
            f"  {'frag':<5} {'id':<16} {'fw':>5} {'bw':>5} {'inf':>5} {'pred. peak':>12}"
            "  code / reason",
        ]
        for f in self.fragments:
            p = "-" if f.predicted_peak is None else format_bytes(f.predicted_peak)
            lines.append(
                f"  {f.name:<5} {f.id:<16} {f.forward_calls:>5} {f.backward_calls:>5} "
                f"{f.inference_calls:>5} {p:>12}  {f.code}: {f.reason}"
            )
        if self.host_param_bytes:
            lines.append(f"  parameters on the host: {format_bytes(self.host_param_bytes)}")
        if self.measured_budget is not None:
            lines.append(f"  budget: {self.measured_budget.describe()}")
        if self.iteration is not None:
            lines.append(_iteration_line(self.iteration))
        lines.extend(_inner_lines(self.fragments))
        cached = [f.name for f in self.fragments if f.plan_cached]
        if cached:
            lines.append(
                f"  plans from the cache (searched by an earlier run): {', '.join(cached)} "
                "(MEMCOMPILE_PLAN_CACHE=0 searches again)"
            )
        for f in self.fragments:
            if f.plan is not None and f.plan.linear_ce:
                # It costs time (rewrites/linearce.py): the user is told where it was needed.
                hosted = [h.endswith("on the host") for h in f.plan.linear_ce]
                if all(hosted):
                    cost = "its log-softmax copied to the host and back"
                elif not any(hosted):
                    cost = "two more matmuls of its size a step"
                else:
                    cost = "host copies or two more matmuls of their size a step"
                lines.append(
                    f"  {f.name}: loss head made by blocks ({', '.join(f.plan.linear_ce)}), "
                    f"{cost}, to fit the budget"
                )
        if self.sharded_param_bytes:
            lines.append(
                f"  FSDP2 manages {format_bytes(self.sharded_param_bytes)} of parameters "
                "(unsharded): its all-gathers, gradient buffers and collectives are not in the "
                "predicted peak"
            )
        if self.dynamic:
            raised = ""
            if self.recompile_limit_raised:
                raised = ", Dynamo recompile limit raised {} -> {}".format(
                    *self.recompile_limit_raised
                )
            lines.append(f"  dynamic: {self.dynamic}{raised}")
        if self.pilot is not None:
            lines.append(_pilot_line(self.pilot))
        for r in self.replans:
            after = (
                "not run yet"
                if r.peak_after is None
                else f"{format_bytes(r.peak_after)}" + ("" if r.fits else ", still over budget")
            )
            # A fragment with a cap on what it holds for its backward shows it.
            caps = r.saved_cap or (None,) * len(r.fragments)
            names = ", ".join(
                f if c is None else f"{f} (saved <= {format_bytes(c)})"
                for f, c in zip(r.fragments, caps, strict=True)
            )
            host = ", parameters to the host" if r.host_params else ""
            lines.append(
                f"  re-planned {names} (round {r.round}{host}, {r.calls}-call step): "
                f"predicted {format_bytes(r.predicted_peak)} -> {after}"
            )
        for name in self.dropped_outputs:
            lines.append(f"  planned as dropped before the backward: {name}")
        for name in self.released_tangents:
            lines.append(f"  incoming gradients planned as freed early: {name}")
        for name in self.summed_grads:
            lines.append(f"  gradient summed out of eager's order: {name}")
        if self.unseen_bytes:
            lines.append(
                f"  measured beyond the plans: {format_bytes(self.unseen_bytes)} (counted in "
                "every prediction since)"
            )
        if self.glue.on:
            lines.append(
                f"  the eager glue's saved tensors to the host tier ({self.glue.why}): "
                f"{self.glue.tensors} tensors, {format_bytes(self.glue.bytes)} in the last call"
            )
        if self.glue_params:
            names = ", ".join(
                f"{g.module + '.' if g.module else ''}{g.name} ({format_bytes(g.nbytes)})"
                for g in self.glue_params[:6]
            )
            more = f", ... ({len(self.glue_params) - 6} more)" if len(self.glue_params) > 6 else ""
            lines.append(
                "  parameters only eager code reads, in the host tier (fetched around their "
                f"modules' forward): {names}{more}"
            )
        if self.direct_since_step is not None:
            lines.append(
                f"  no budget: since step {self.direct_since_step} regions call their modules "
                "directly and steps are not watched (nothing to plan; the prediction is of the "
                "last step seen)"
            )
        for fb in self.fallbacks:
            # A frame whose memory the budget measures and counts (the glue) is managed; one
            # run under a dispatch mode runs its compiled frames eagerly too: not.
            managed = self.glue_measured and fb.kind != "dispatch_mode"
            lines.append(
                f"  {'eager' if managed else 'EAGER'} {fb.code}: {fb.kind}: {fb.reason}"
                f"{_regions_note(self, fb)}"
                f"{'; its memory measured, in the budget' if managed else ''}"
            )
        return "\n".join(lines)


def _regions_note(report: MemReport, fallback: Fallback) -> str:
    paths = [r.path for r in report.regions if r.caller == fallback.code]
    if not paths:
        return ""
    shown = ", ".join(paths[:6]) + (f", ... ({len(paths) - 6} more)" if len(paths) > 6 else "")
    return f"; its {len(paths)} torch.nn module(s) run as fragments ({shown})"


def _iteration_line(it: IterationReport) -> str:
    peak = "n/a" if it.peak is None else format_bytes(it.peak)
    phases = ", ".join(f"{name} {format_bytes(p)}" for name, p in it.peaks)
    estimated = "" if it.exact else " (estimated)"
    return (
        f"  iteration: {it.micro_batches} micro-batch(es), {'; '.join(it.optimizers)}, "
        f"step transient {format_bytes(it.transient)}{estimated}: predicted peak {peak} "
        f"({phases})"
    )


def _pilot_line(p: PilotReport) -> str:
    if not p.enabled:
        return f"  pilot ({p.mode}): not running ({p.reason})"

    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{100 * x:.1f}%"

    us = "n/a" if p.predict_us_p50 is None else f"{p.predict_us_p50:.1f} us"
    if p.gpu_miss_us is None or p.gpu_wait_us is None:
        stall = f"stall {p.stall_us / 1000:.2f} ms (CPU)"
    else:  # CUDA: the host only queues the copies; the GPU's events say what they cost
        stall = (
            f"GPU stall {(p.gpu_miss_us + p.gpu_wait_us) / 1000:.2f} ms (on-demand copies "
            f"{p.gpu_miss_us / 1000:.2f} ms, late prefetches {p.gpu_wait_us / 1000:.2f} ms; "
            "measured)"
        )
    decided = f"\n  pilot trial: {p.decision}" if p.decision else ""
    return (
        f"  pilot ({p.mode}, active {p.active}): next-block accuracy {pct(p.accuracy)}, "
        f"{p.horizon}-ahead {pct(p.k_ahead_accuracy)}, hit rate {pct(p.hit_rate)} of "
        f"{format_bytes(p.needed_bytes)} fetched, wasted {format_bytes(p.wasted_bytes)}, "
        f"{stall}, predict p50 {us}, reserve "
        f"{format_bytes(p.reserve_bytes)}, {p.muted_predictions} predictions muted (wasteful)"
        + decided
        + _placement_line(p)
    )


def _placement_line(p: PilotReport) -> str:
    # Where the predictions were made (rewrites/pilot_prefetch.py) and the simulated stall.
    inside = [pl for pl in p.placements if pl.in_graph]
    if p.sim_stall_us is None:
        return ""
    late = p.sim_late_us or 0.0
    return (
        f"\n  pilot prefetch: {p.in_graph_predictions} predictions in-graph ({len(inside)} of "
        f"{len(p.placements)} forward graphs), {p.tail_predictions} at a tail, "
        f"{p.read_predictions} after a read; simulated stall "
        f"{p.sim_stall_us / 1000:.3f} ms ({late / 1000:.3f} ms waiting for late copies; "
        f"{p.sim_profile} profile estimate)"
    )


def _own_functions(compiled: Any, model: torch.nn.Module | None) -> set[FunctionSpan]:
    """The model's methods (or the compiled function) as ``(file, name, first, last line)``."""
    out = module_functions(model) if model is not None else set()
    f = getattr(compiled, "_torchdynamo_orig_callable", compiled)
    code = getattr(getattr(f, "__func__", f), "__code__", None)
    if code is not None:
        out.add(function_span(code))
    return out


def find_compiler(compiled: Any) -> tuple[MemCompiler, torch.nn.Module | None]:
    """The :class:`MemCompiler` behind ``compiled`` and the module it wraps, if any.

    ``compiled`` is what ``torch.compile(..., backend="memcompile")`` or ``memcompile.compile``
    returned (a module or a function), or a ``MemCompiler``. If the backend has not been called
    for it yet (nothing compiled, or every frame failed), the compiler is created now.

    Raises:
        TypeError: ``compiled`` was not produced by ``torch.compile`` with the memcompile backend.
    """
    if isinstance(compiled, MemCompiler):
        return compiled, None
    model = getattr(compiled, "_orig_mod", None)
    ctx = dynamo_context(compiled)
    callback = getattr(ctx, "callback", None)
    if not callable(callback):
        raise TypeError(
            "memcompile.report() needs the object returned by "
            "torch.compile(..., backend='memcompile') "
            f"or memcompile.compile(...); got {type(compiled).__name__}"
        )
    wrapper = innermost_backend(callback)
    backend = getattr(wrapper, "compiler_fn", wrapper)
    if isinstance(backend, MemCompiler):
        return backend, model
    from memcompile.backends.entry import memcompile_backend

    if backend is memcompile_backend:
        compiler = getattr(wrapper, COMPILER_ATTR, None)
        if compiler is None:
            compiler = MemCompiler(getattr(wrapper, "kwargs", {}).get("options"))
            setattr(wrapper, COMPILER_ATTR, compiler)
        compiler.attach(ctx)
        # Failed frames of the model's own methods are its, whenever the hook was attached:
        # now (no call watched yet), or in the middle of the first call (whose earlier
        # failures it claimed only if their frames were still running).
        compiler.claim_late()
        compiler.claim_fallbacks_of(_own_functions(compiled, model))
        return compiler, model
    name = getattr(wrapper, "compiler_name", type(backend).__name__)
    raise TypeError(f"this model was compiled with backend {name!r}, not memcompile")


def _inner_lines(fragments: Sequence[FragmentReport]) -> list[str]:
    """What the report says of the inner compiler's code (Inductor), measured at compile time
    or not."""
    measured, unmeasured = [], []
    inner = "inductor"
    for f in fragments:
        if f.inner == "eager" or f.profile is None or not f.profile.training:
            continue
        inner = f.inner
        if f.inner_unmeasured:
            unmeasured.append(f"{f.name} ({f.inner_unmeasured})")
        else:
            fw, bw = f.profile.inner_adjust
            measured.append(f"{f.name} (forward {_signed(fw)}, backward {_signed(bw)})")
    lines = [
        f"  eager kernels instead of Inductor (inner='auto'): {f.name} ({f.inner_fallback})"
        for f in fragments
        if f.inner_fallback
    ]
    if measured:
        lines.append(
            f"  {inner}'s code, measured at compile time beside the graphs' profile: "
            + ", ".join(measured)
        )
    if unmeasured:
        lines.append(
            f"  {inner}'s code not measured, predicted as the graphs' profile (approximate): "
            + ", ".join(unmeasured)
        )
    return lines


def _signed(n: int) -> str:
    return ("-" if n < 0 else "+") + format_bytes(abs(n))


def build_report(compiler: MemCompiler, model: torch.nn.Module | None = None) -> MemReport:
    """Report of ``compiler`` (``model``, when known, adds its unused parameters to the resident
    set)."""
    records = compiler.records()
    extra = [*model.parameters(), *model.buffers()] if model is not None else []
    prediction, seq, resident = compiler.predict_step(extra)
    per_fragment = prediction.fragment_peaks(seq) if prediction is not None else {}
    eager = all(r.inner == "eager" for r in records)
    budget, watch = compiler.budget, compiler.checks.peak_watch
    iteration = _iteration(compiler)

    fragments = tuple(
        FragmentReport(
            name=r.name,
            id=r.id,
            code=r.code,
            reason=r.reason,
            break_at=r.break_at,
            compile_id=r.compile_id,
            forward_calls=r.stats.forward_calls,
            backward_calls=r.stats.backward_calls,
            inference_calls=r.stats.inference_calls,
            predicted_peak=per_fragment.get(r.index),
            training=r.profile is not None and r.profile.training,
            approximate=r.profile is not None and r.profile.approximate,
            profile=r.profile,
            plan=r.plan,
            plan_cached=r.plan_cached,
            inner_unmeasured=r.inner_unmeasured,
            inner_fallback=r.inner_fallback,
            inner=r.inner,
        )
        for r in records
    )
    sharded = compiler.fsdp.sharded
    exact = bool(
        prediction is not None
        and prediction.exact
        and eager
        and sharded is None
        and not any(f.approximate for f in fragments)
    )
    return MemReport(
        config=compiler.config,
        fragments=fragments,
        predicted_peak=prediction.peak if prediction is not None else None,
        resident_bytes=resident,
        exact=exact,
        step=tuple(f"F{i}.{_SHORT[k]}" for i, k, _ in seq),
        steps_observed=compiler.steps_observed,
        fallbacks=tuple(compiler.fallbacks),
        regions=tuple(compiler.regional.regions) if compiler.regional is not None else (),
        unseen_bytes=compiler.budget.unseen,
        glue=compiler.glue.stats,
        glue_params=tuple(compiler.glue.params.params),
        glue_measured=compiler.config.budget is not None
        and (watch is not None or compiler.checks.samples > 0),
        direct_since_step=compiler.unplanned.since_step,
        host_param_bytes=compiler.resident.host_param_bytes,
        pilot=compiler.prefetcher.report() if compiler.prefetcher is not None else None,
        dynamic=compiler.dynamic,
        recompile_limit_raised=compiler.recompile_limit_raised,
        replans=tuple(compiler.budget.replans),
        measured_peak=watch.measured if watch is not None else compiler.checks.sampled_peak,
        latest_measured_peak=None if watch is not None else compiler.checks.last_sampled_peak,
        summed_grads=tuple(compiler.checks.summed_grads),
        sharded_param_bytes=compiler.fsdp.param_bytes,
        dropped_outputs=tuple(
            f"{r.name}: outputs {sorted(budget.dropped_outputs(r.id))}"
            for r in records
            if budget.dropped_outputs(r.id)
        ),
        released_tangents=tuple(
            f"{r.name}: {sorted(budget.released_tangents(r.id))}"
            for r in records
            if budget.released_tangents(r.id)
        ),
        iteration=iteration,
        measured_budget=compiler.fraction.resolved if compiler.fraction is not None else None,
        over_budget=budget.over_budget
        or (
            compiler.config.budget is not None
            and max(
                prediction.peak if prediction is not None else 0,
                (iteration.peak or 0) if iteration is not None else 0,
            )
            > compiler.config.budget
        ),
    )


def _iteration(compiler: MemCompiler) -> IterationReport | None:
    watch = compiler.iteration
    costs = list(watch.optimizers.values())
    if not costs:
        return None
    return IterationReport(
        micro_batches=watch.micro_batches,
        optimizers=tuple(sorted(c.describe() for c in costs)),
        state_bytes=watch.state_bytes,
        transient=watch.transient,
        exact=all(c.exact for c in costs),
        grads_bytes=watch.grads_at_step,
        peaks=tuple(compiler.budget.iteration_peaks.items()),
    )


def report(compiled: Any) -> MemReport:
    """Fragments, predicted step peak and eager fallbacks of a memcompile-compiled model.

    Args:
        compiled: what ``torch.compile(model, backend="memcompile")`` or ``memcompile.compile``
            returned.

    Raises:
        TypeError: ``compiled`` was not compiled with memcompile.
    """
    compiler, model = find_compiler(compiled)
    return build_report(compiler, model)
