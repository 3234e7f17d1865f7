"""One fragment's AOTAutograd hooks: its partitioner and its forward, backward and inference
compilers, sharing the fragment's state (the backward compiles lazily, at the first backward)::

    partition      the pipeline decides (pipeline/fragment.py); then, and only then, what was
                   decided is applied: an infeasible plan raises (or warns), the pilot's reserve
                   is registered, parameters move to the host tier
                   (with inner="inductor": the pair compiled and run once, what Inductor's code
                   peaks beside the eager run measured, the plan made again while that puts it
                   over the budget: inner_peak.py; inner="auto" with no plan of Inductor's
                   within it: the fragment traced and planned again for eager kernels)
    fw compiler    where the pilot predicts (pipeline/finish.py), the exact profile of the
                   forward and backward (with Inductor's measured difference), reloads
                   hoisted, the budget checked, the inner compiler
    bw compiler    the inner compiler
    each graph     wrapped (call_wrapper.py): counted, watched, its block keys recorded

A build reaches its compiler only through the :class:`BuildEnv` it is handed.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import warnings
from collections.abc import Callable, Sequence
from types import CodeType
from typing import Any

import sympy
import torch
from torch import fx
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import default_partition
from torch._logging._internal import trace_structured_artifact
from torch.utils._python_dispatch import _disable_current_modes

from memcompile.analysis.fragment_profile import FragmentProfile, profile_fragment
from memcompile.analysis.graph import bound_sizes
from memcompile.analysis.workspace import clone_workspace
from memcompile.backends import advice
from memcompile.backends.build_env import BuildEnv
from memcompile.backends.call_wrapper import wrap, wrap_plain
from memcompile.backends.fallbacks import code_label
from memcompile.backends.inner import BoxedCallable, GraphRole, compile_inner, decompositions
from memcompile.backends.inner_peak import InnerPeaks, measure_inner, unmeasurable
from memcompile.config import resolve_inner
from memcompile.errors import InnerCompilerWarning, format_bytes
from memcompile.pipeline import features
from memcompile.pipeline.built import Split, aot_metadata, joint_split, profile_args
from memcompile.pipeline.env import FragmentSpec
from memcompile.pipeline.finish import early_reloads, pilot_op
from memcompile.pipeline.fragment import BelowBound, Decided, plan_partition
from memcompile.planning.plan import FragmentPlan
from memcompile.records import FragmentIdentity, FragmentRecord, FragmentStats, SizeKey
from memcompile.rewrites.context import PassContext
from memcompile.rewrites.params import find_inference_fetches, param_fetch_pass
from memcompile.runtime.measure import storage_sizes
from memcompile.runtime.store import is_host_placed

__all__ = ["FragmentBuild", "device_of"]

log = logging.getLogger(__name__)


class _EagerRetry(Exception):
    """The partitioner's word to :meth:`FragmentBuild.compile`: trace the fragment again for
    eager kernels (``FragmentBuild._eager_may_fit``); ``smallest``: the peak of Inductor's
    smallest plan, bytes."""

    def __init__(self, smallest: int) -> None:
        super().__init__(f"no plan of Inductor's fits (smallest {smallest} bytes)")
        self.smallest = smallest


def _first_plan_missed(budget: int | None, spec: FragmentSpec, decided: Decided) -> bool:
    """A fragment's first plan (not a re-plan's) misses ``budget``, and the search ran to its
    end (a quick "no" is far below every plan)."""
    return (
        budget is not None
        and not decided.plan.feasible
        and not decided.quick_no
        and spec.replan_resident is None
        and not spec.host_replan
    )


#: Profiles kept per fragment for the sizes its calls had (dynamic shapes).
MAX_SIZE_PROFILES = 256
#: Plans made again for what the inner compiler's code was measured to need (inner_peak.py).
MAX_INNER_REPLANS = 2


def device_of(values: Sequence[Any]) -> torch.device | None:
    """The device of a fragment's inputs: the first one not on the CPU (host-placed parameters
    of a CUDA model are CPU tensors), else the CPU; ``None``: no tensors."""
    devices = [t.device for t in values if isinstance(t, torch.Tensor)]
    return next((d for d in devices if d.type != "cpu"), devices[0] if devices else None)


def _size_slots(gm: fx.GraphModule) -> tuple[tuple[int, int, Any], ...]:
    """Where each size symbol of ``gm``'s inputs can be read from a call's arguments."""
    slots: list[tuple[int, int, Any]] = []
    seen: set[Any] = set()
    for pos, p in enumerate(gm.graph.find_nodes(op="placeholder")):
        val = p.meta.get("val")
        dims: list[tuple[int, Any]]
        if isinstance(val, torch.SymInt):
            dims = [(-1, val)]
        elif isinstance(val, torch.Tensor):
            dims = [(d, n) for d, n in enumerate(val.shape) if isinstance(n, torch.SymInt)]
        else:
            continue
        for dim, n in dims:
            expr = n.node.expr
            if isinstance(expr, sympy.Symbol) and expr not in seen:
                seen.add(expr)
                slots.append((pos, dim, expr))
    return tuple(slots)


def _frame_location(frame: Any) -> str:
    return f"{frame.name} ({frame.filename}:{frame.lineno})" if frame is not None else "<unknown>"


def _code_location(code: CodeType | None) -> str:
    return "<unknown>" if code is None else code_label(code)


def code_location(gm: fx.GraphModule) -> str:
    """Where the frame Dynamo cut ``gm`` from begins, ``function (file:line)``. Dynamo gives no
    user stack for some graphs (a return at the top level of a resume function): the code object
    it compiles still says where it is."""
    why = getattr(gm, "compile_subgraph_reason", None)
    stack = list(getattr(why, "user_stack", None) or [])
    return _frame_location(stack[0]) if stack else _code_location(compiling_code())


def compiling_code() -> CodeType | None:
    """The code object Dynamo is compiling (``None`` outside a Dynamo compile)."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    try:
        return InstructionTranslator.current_tx().f_code
    except AttributeError:  # no translator on this thread: the backend was called directly
        return None


class FragmentBuild:
    """Closure state shared by one fragment's partition_fn and compilers (see the module
    docstring)."""

    def __init__(self, env: BuildEnv, index: int, example_inputs: Sequence[Any]) -> None:
        self.env = env
        self.index = index
        self.example_inputs = list(example_inputs)
        #: The fragment's device, read before any of its parameters moves to the host tier.
        self.device = device_of(example_inputs)
        #: Its inner compiler (``inner="auto"`` resolved for its device; falls back to eager
        #: kernels, with a warning, where Inductor fails to compile under "auto").
        self.inner = resolve_inner(
            env.pipeline.config.inner, self.device.type if self.device is not None else None
        )
        self.stats = FragmentStats()
        self.profile: FragmentProfile | None = None
        self.plan: FragmentPlan | None = None
        self.fw_gm: fx.GraphModule | None = None
        self.bw_gm: fx.GraphModule | None = None
        self.static_inputs: tuple[int, ...] = ()
        #: (input position, dim or -1 for a SymInt input, sympy symbol) of each size symbol of
        #: the forward graph's inputs: a call's values of them are its size key.
        self.size_slots: tuple[tuple[int, int, Any], ...] = ()
        self._profile_args: dict[str, Any] = {}
        self._sized_profiles: dict[SizeKey, FragmentProfile] = {}
        # Inputs the graphs fetch from the host tier (host-placed parameters and their aliases).
        self.hosted_inputs: tuple[int, ...] = ()
        #: Position of each input that is an alias of another input -> that input's position
        #: (one placeholder per read, rewrites/input_uses.py).
        self.alias_sources: dict[int, int] = {}
        #: Positions of inputs whose several contributions the backward graph sums (parameters
        #: not split, several-edge reads): ``step/checks.py`` watches them.
        self.summed_inputs: tuple[int, ...] = ()
        # block key -> parameter storages (address -> bytes) of the calls with that key
        self.blocks: dict[int, dict[int, int]] = {}
        # block key -> storage address of each parameter/buffer input, by position
        self.block_inputs: dict[int, dict[int, int]] = {}
        # Bytes this fragment's plan leaves to the pilot's prefetch cache (dynamic/prefetch.py).
        self.prefetch_reserve = 0
        #: How the pipeline plans it besides its inputs (a re-plan, what steps showed):
        #: ``FragmentSpec``'s fields of those names.
        self.replan_resident: int | None = None
        self.replan_saved_cap: int | None = None
        self.host_replan = False
        self.dropped_outputs: frozenset[int] = frozenset()
        self.replan_start: tuple[str, ...] = ()
        self.released_tangents: frozenset[str] = frozenset()
        #: Where its frame begins (``code_location``): recompiles of one code replace each other.
        self.code = ""
        #: The plan cache's key when its plan was replayed from an earlier run's search.
        self.plan_cached: str | None = None
        #: What the inner compiler's code peaks beside the eager run of the planned graphs
        #: (``None``: not measured; ``inner_unmeasured`` says why when it could not be).
        self.inner_peaks: InnerPeaks | None = None
        self.inner_unmeasured = ""
        #: Bytes the plan was made around for the inner compiler (``FragmentSpec``'s field).
        self.inner_excess = 0
        #: Bytes the inner compiler's code was measured to need past the budget with the
        #: smallest plan found (the plan is then infeasible), else 0.
        self.inner_over = 0
        #: Why the fragment runs on eager kernels where ``inner="auto"`` chose Inductor
        #: (``""``: it does not).
        self.inner_fallback = ""
        #: Its plan does not fit, and the step decides (:meth:`_step_decides`).
        self.step_decides = False

    def spec(self) -> FragmentSpec:
        """This fragment as the pipeline plans it."""
        return FragmentSpec(
            index=self.index,
            example_inputs=tuple(self.example_inputs),
            alias_sources=dict(self.alias_sources),
            device=self.device,
            dropped_outputs=self.dropped_outputs,
            released_tangents=self.released_tangents,
            replan_resident=self.replan_resident,
            replan_saved_cap=self.replan_saved_cap,
            replan_start=self.replan_start,
            host_replan=self.host_replan,
            code=self.code,
            inner_excess=self.inner_excess,
            inner=self.inner,
        )

    # -- compiling ---------------------------------------------------------------------------
    def compile(
        self, gm: fx.GraphModule, example_inputs: Sequence[Any], identity: FragmentIdentity
    ) -> tuple[Callable[..., Any], FragmentRecord]:
        """``gm`` compiled through AOTAutograd with this build's hooks, and its record."""
        why = getattr(gm, "compile_subgraph_reason", None)
        stack = list(getattr(why, "user_stack", None) or [])
        reason = (getattr(why, "reason", "") or "").strip().splitlines()
        compile_id = torch._guards.CompileContext.current_compile_id()
        has_ops = any(
            n.op in ("call_function", "call_method", "call_module") for n in gm.graph.nodes
        )
        if has_ops:
            try:
                compiled = self._aot(gm, example_inputs)
            except _EagerRetry as retry:
                self._eager_to_fit(retry.smallest)
                compiled = self._aot(gm, example_inputs)
        else:
            # Nothing to plan or run through AOTAutograd (an empty resume graph).
            compiled = wrap_plain(self.env.monitor, self, gm)
        inputs = self.example_inputs
        statics = [inputs[i] for i in self.static_inputs if i < len(inputs)]
        may_host = self.env.pipeline.resident.may_host
        record = FragmentRecord(
            index=self.index,
            identity=identity,
            code=self.code,
            reason=reason[0] if reason else "",
            break_at=_frame_location(stack[-1] if stack else None),
            compile_id=str(compile_id) if compile_id is not None else "",
            static_inputs=self.static_inputs,
            static_storages=tuple(storage_sizes(statics).items()),
            profile=self.profile,
            plan=self.plan,
            inner=self.inner,
            stats=self.stats,
            blocks=self.blocks,
            block_inputs=self.block_inputs,
            profile_at=self.profile_at if self.size_slots else None,
            summed_inputs=self.summed_inputs,
            hostable=frozenset(storage_sizes(t for t in statics if may_host(t))),
            plan_cached=self.plan_cached,
            inner_unmeasured=self.inner_unmeasured,
            inner_fallback=self.inner_fallback,
            step_decides=self.step_decides,
        )
        return compiled, record

    # -- AOTAutograd hooks -------------------------------------------------------------------
    def partition(
        self,
        joint: fx.GraphModule,
        joint_inputs: Any,
        *,
        num_fwd_outputs: int,
        static_lifetime_input_indices: list[int] | None = None,
        **kwargs: Any,
    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        config = self.env.pipeline.config
        placed = any(
            i not in self.alias_sources and isinstance(t, torch.Tensor) and is_host_placed(t)
            for i, t in enumerate(self.example_inputs)
        )
        if (
            config.budget is None
            and not config.reorder
            and config.offload_params is not True
            and not placed
        ):
            fw, bw = default_partition(
                joint,
                joint_inputs,
                num_fwd_outputs=num_fwd_outputs,
                static_lifetime_input_indices=static_lifetime_input_indices,
                **kwargs,
            )
        else:
            spec = self.spec()
            static = static_lifetime_input_indices or []
            try:
                decided = plan_partition(joint, num_fwd_outputs, static, spec, self.env.pipeline)
                decided, spec = self._inner_fitted(joint, num_fwd_outputs, static, spec, decided)
            except BelowBound as below:
                resident = self.env.pipeline.resident
                advice.below_bound(
                    config,
                    spec,
                    below,
                    device_other=resident.device_other_bytes,
                    untaken=resident.untaken_bytes(self.example_inputs),
                )
            deferred = self._step_decides(spec, decided)
            if not deferred and self._eager_may_fit(spec, decided):
                raise _EagerRetry(decided.plan.predicted_peak)
            self._apply(spec, decided, deferred=deferred)
            fw, bw = decided.fw, decided.bw
        self.bw_gm = bw
        return fw, bw

    def _inner_fitted(
        self,
        joint: fx.GraphModule,
        num_fwd_outputs: int,
        static: Sequence[int],
        spec: FragmentSpec,
        decided: Decided,
    ) -> tuple[Decided, FragmentSpec]:
        """With an inner compiler other than eager: what its code peaks beside the planned
        graphs, measured (inner_peak.py); while that puts the fragment over its budget, the plan
        made again with the code's excess over the graphs' profile counted as resident (at most
        ``MAX_INNER_REPLANS`` times); when no plan fits, the plan kept is marked infeasible
        with its measured peak (``_apply`` raises or warns, as for any plan that misses). A
        plan the graphs' profile says misses the budget but whose code is measured within it
        fits."""
        config = self.env.pipeline.config
        if self.inner == "eager" or decided.bw is None or not features.current().inner_measure:
            return decided, spec
        device = self.device or torch.device("cpu")
        if device.type == "cpu" and torch.autograd.profiler._is_profiler_enabled:
            # The CPU measurement needs its own profiler session; nested ones corrupt the outer.
            self.inner_unmeasured = "a profiler session was active"
            log.info("F%d: %s's code not measured: %s", self.index, self.inner, "a profiler ran")
            return decided, spec
        split = joint_split(joint, num_fwd_outputs, static)
        for round_ in range(MAX_INNER_REPLANS + 1):
            why = unmeasurable(decided.fw, decided.bw)
            if why is not None:
                self.inner_unmeasured = why
                log.info("F%d: %s's code not measured: %s", self.index, self.inner, why)
                return decided, spec
            bw = self._hoisted(spec, decided, split)
            try:
                peaks = measure_inner(
                    self.inner,
                    decided.fw,
                    bw,
                    static_input_indices=static,
                    device=device,
                    real_inputs=self.example_inputs,
                )
            except Exception as e:  # Inductor could not compile or run the graphs
                if config.inner == "auto":
                    self._eager_instead(e)
                else:  # asked for: the compile proper raises if Inductor cannot compile them
                    self.inner_unmeasured = f"measuring failed ({type(e).__name__}: {e})"[:200]
                    log.warning(
                        "memcompile: F%d: %s's code %s",
                        self.index,
                        self.inner,
                        self.inner_unmeasured,
                    )
                return decided, spec
            self.inner_peaks = peaks
            if config.budget is None:
                break
            args = profile_args(spec, decided.fw, bw, split=split)
            profile = profile_fragment(decided.fw, bw, clone_workspace=clone_workspace, **args)
            planned = max(profile.phase_peaks().values())
            measured = max(peaks.applied(profile).phase_peaks().values())
            peak = decided.plan.resident_bytes - spec.inner_excess + measured
            over = peak - config.budget
            if not decided.plan.feasible:
                # The smallest plan of these graphs' profile misses the budget; the code that
                # runs them may not (Inductor fuses what the profile counts): then it fits.
                if over <= 0:
                    log.info(
                        "F%d: no plan of the graphs' profile fits budget=%s, but %s's code of "
                        "the smallest is measured at %s: it fits",
                        self.index,
                        format_bytes(config.budget),
                        self.inner,
                        format_bytes(peak),
                    )
                    plan = dataclasses.replace(decided.plan, feasible=True)
                    return dataclasses.replace(decided, plan=plan), spec
                # Its error names what the code of the smallest plan was measured to peak at
                # (a moment of the code's own, not the one the planner saw).
                plan = dataclasses.replace(decided.plan, predicted_peak=peak)
                return dataclasses.replace(decided, plan=plan, fixed_peak=False), spec
            if over <= 0:
                break
            # Plan again with the code's excess over these graphs' profile counted as resident
            # (more, if an earlier round's was not enough: the next plan's code may differ).
            excess = max(measured - planned, spec.inner_excess + over)
            again = None
            if round_ < MAX_INNER_REPLANS:
                log.info(
                    "F%d: %s's code is measured to peak %s over budget=%s: planning again with "
                    "that much less",
                    self.index,
                    self.inner,
                    format_bytes(over),
                    format_bytes(config.budget),
                )
                tighter = dataclasses.replace(spec, inner_excess=excess)
                try:
                    again = plan_partition(
                        joint, num_fwd_outputs, static, tighter, self.env.pipeline
                    )
                except BelowBound:
                    again = None
            if again is None or not again.plan.feasible:
                # No plan fits what the inner compiler's code needs: infeasible, with the
                # measured peak of the one kept as the smallest found.
                self.inner_over = over
                plan = dataclasses.replace(decided.plan, feasible=False, predicted_peak=peak)
                return dataclasses.replace(decided, plan=plan, fixed_peak=False), spec
            decided, spec = again, tighter
            self.inner_excess = tighter.inner_excess
        return decided, spec

    def _hoisted(self, spec: FragmentSpec, decided: Decided, split: Split) -> fx.GraphModule:
        """A copy of ``decided``'s backward with its reloads moved up as the forward compiler
        will move them (``early_reloads``): what the inner compiler is then given."""
        bw = copy.deepcopy(decided.bw)
        if decided.plan.swapped:
            args = profile_args(spec, decided.fw, bw, split=split)
            profile = profile_fragment(decided.fw, bw, clone_workspace=clone_workspace, **args)
            inputs = [p.meta.get("val") for p in decided.fw.graph.find_nodes(op="placeholder")]
            cost = self.env.pipeline.cost_profile(inputs)
            early_reloads(bw, decided.plan, profile, cost, spec)
        return bw

    def _step_decides(self, spec: FragmentSpec, decided: Decided) -> bool:
        """No plan of this fragment fits, but it misses the budget by no more than the rest
        of the step may still give way (``ResidentSet.movable_bytes``: the other fragments'
        saved sets, counted at their most, their parameters the host tier may take, the loop's
        optimizer state): then the step decides, not the fragment. Its smallest plan runs, the
        step's check re-plans the step as a whole (planning/replan.py) and warns if that does
        not fit (``advice.step_over``). A naturally written MoE whose head compiled last
        missed half the unplanned iteration's peak by its bound, 21.33 against 15.69 MiB;
        re-planned as a step it measured 11.81 MiB."""
        config = self.env.pipeline.config
        plan = decided.plan
        if not _first_plan_missed(config.budget, spec, decided):
            return False
        assert config.budget is not None
        movable = self.env.pipeline.resident.movable_bytes(spec, host=decided.hosted)
        if plan.predicted_peak - movable > config.budget:
            return False
        log.info(
            "F%d: its smallest plan peaks at %s, over budget=%s by no more than the rest of the "
            "step may give way (%s): running it; the step's check plans the step as a whole",
            self.index,
            format_bytes(plan.predicted_peak),
            format_bytes(config.budget),
            format_bytes(movable),
        )
        return True

    def _apply(self, spec: FragmentSpec, decided: Decided, *, deferred: bool = False) -> None:
        """What the pipeline decided, applied: only now, so an infeasible plan raises with the
        parameters untouched (``deferred``: it does not fit only by what the rest of the step
        holds now; the step decides: :meth:`_step_decides`)."""
        env, plan = self.env, decided.plan
        resident, config = env.pipeline.resident, env.pipeline.config
        self.prefetch_reserve = decided.prefetch_reserve
        self.plan_cached = decided.cached
        self.step_decides = deferred
        if not plan.feasible and not deferred:
            advice.infeasible(
                config,
                spec,
                plan,
                prefetch_reserve=self.prefetch_reserve,
                hosted=bool(decided.hosted),
                host_peak=decided.host_peak,
                held_outputs=decided.held_outputs,
                sharded=env.fsdp.sharded is not None,
                device_other=resident.device_other_bytes,
                untaken=resident.untaken_bytes(self.example_inputs),
                inner_over=(self.inner, self.inner_over) if self.inner_over else None,
                quick_no=decided.quick_no,
                fixed_peak=decided.fixed_peak,
                inner_fallback=self.inner_fallback,
                inner=self.inner,
            )
        self.hosted_inputs = decided.hosted + decided.placed
        env.budget.compiled(self.index, None, reserve=self.prefetch_reserve)
        resident.note_fetched(self.example_inputs, self.hosted_inputs)
        if env.prefetcher is not None:
            env.prefetcher.add_reserve(self.prefetch_reserve)
        if decided.hosted:  # only now: an infeasible plan raised above, parameters untouched
            own = spec.own_inputs(decided.hosted)
            with _disable_current_modes():  # partitioning runs under the fake mode
                resident.host_params_pinned |= self.device is not None and (
                    self.device.type == "cuda"
                )
                moved = sum(resident.move_to_host(self.example_inputs[i]) for i in own)
                # Point the example aliases of the parameters just moved at their host storage:
                # the old ones would keep the device copies alive.
                for j, i in self.alias_sources.items():
                    if i in decided.hosted:
                        self.example_inputs[j] = torch.ops.aten.alias.default(
                            self.example_inputs[i]
                        )
            resident.host_param_bytes += moved
            log.info(
                "F%d: %d parameters (%s) moved to the host tier",
                self.index,
                len(own),
                format_bytes(moved),
            )
        self.plan = plan
        log.info(
            "F%d planned: recompute %d, swap %d of %d saved tensors, predicted peak %s (budget "
            "%s), holds %s for the backward%s%s",
            self.index,
            len(plan.recomputed),
            len(plan.swapped),
            len(plan.decisions),
            format_bytes(plan.predicted_peak),
            "none" if config.budget is None else format_bytes(config.budget),
            format_bytes(plan.held_bytes),
            "" if plan.saved_cap is None else f" (cap {format_bytes(plan.saved_cap)})",
            f", loss heads by blocks ({', '.join(plan.linear_ce)})" if plan.linear_ce else "",
        )

    def forward_compiler(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> BoxedCallable:
        self.fw_gm = gm
        env = self.env
        if env.prefetcher is not None:
            cost = env.pipeline.cost_profile(example_inputs)
            decided = pilot_op(
                gm,
                self.spec(),
                env.pipeline,
                cost,
                prefetch_reserve=self.prefetch_reserve,
                hook=env.prefetcher.key,
            )
            env.prefetcher.place(self.index, decided, cost)
        self._profile(gm, self.bw_gm)
        if self.plan is not None and self.plan.swapped:
            cost = env.pipeline.cost_profile(example_inputs)
            self.plan, moved = early_reloads(self.bw_gm, self.plan, self.profile, cost, self.spec())
            if moved:
                self._profile(gm, self.bw_gm)
        if self.plan is not None:
            # The final plan (with its prefetches) for tlparse; a no-op unless TORCH_TRACE is set.
            final = self.plan
            trace_structured_artifact(
                f"memcompile_plan_F{self.index}", "json", lambda: json.dumps(final.to_dict())
            )
        advice.check_budget(
            env.pipeline.config,
            self.index,
            self.plan,
            self.profile,
            counted=self.inner_excess,
            inner=self.inner if self.inner_peaks is not None else None,
        )
        fn = self._compile(gm, example_inputs, "forward", self.static_inputs)
        return wrap(self, fn, "forward")

    def backward_compiler(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> BoxedCallable:
        if gm is not self.bw_gm:
            # AOT changed the graph after partitioning; the profile describes the partitioned one.
            log.debug("F%d: backward graph differs from the partitioned one", self.index)
        fn = self._compile(gm, example_inputs, "backward", ())
        return wrap(self, fn, "backward")

    def inference_compiler(
        self, gm: fx.GraphModule, example_inputs: Sequence[Any]
    ) -> BoxedCallable:
        # No partition, so no plan: the parameters in the host tier now are fetched before
        # each reader, as the training graphs fetch them (rewrites/params.py).
        meta = aot_metadata()
        static = tuple(meta.static_input_indices) if meta is not None else ()
        fetched = find_inference_fetches(self.example_inputs, static)
        if fetched:
            outputs = gm.graph.output_node().args[0]
            gm = param_fetch_pass(
                gm,
                PassContext(fragment=f"F{self.index}", graph="inference"),
                primals=fetched,
                num_fwd_outputs=len(outputs) if isinstance(outputs, (list, tuple)) else 1,
                device=self.device or torch.device("cpu"),
                store=self.env.pipeline.store_key,
            )
            self.hosted_inputs = fetched
            log.info(
                "F%d: its inference graph fetches %d host-placed inputs", self.index, len(fetched)
            )
        self._profile(gm, None)
        fn = self._compile(gm, example_inputs, "inference", self.static_inputs)
        return wrap(self, fn, "inference")

    def _compile(
        self,
        gm: fx.GraphModule,
        example_inputs: Sequence[Any],
        role: GraphRole,
        static: Sequence[int],
    ) -> BoxedCallable:
        """``gm`` compiled by this fragment's inner compiler; under ``inner="auto"`` a failed
        Inductor compile is a warning and eager kernels."""
        if self.inner == "inductor" and self.env.pipeline.config.inner == "auto":
            try:
                return compile_inner(
                    "inductor", gm, example_inputs, role=role, static_input_indices=static
                )
            except Exception as e:
                self._eager_instead(e)
        return compile_inner(self.inner, gm, example_inputs, role=role, static_input_indices=static)

    def _aot(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        """``gm`` through AOTAutograd with this build's partitioner and compilers."""
        return aot_autograd(
            fw_compiler=self.forward_compiler,
            bw_compiler=self.backward_compiler,
            inference_compiler=self.inference_compiler,
            partition_fn=self.partition,
            decompositions=decompositions(self.inner),
            keep_inference_input_mutations=True,
        )(gm, example_inputs)

    def _eager_may_fit(self, spec: FragmentSpec, decided: Decided) -> bool:
        """``inner="auto"`` chose Inductor, and no plan of its graphs fits the budget: eager
        kernels may (their graphs keep eager's decompositions and get the rewrites that rely
        on eager's kernels: in place, row tiling). Only a fragment's first plan, searched to
        its end (a quick "no" is far below either)."""
        config = self.env.pipeline.config
        return (
            config.inner == "auto"
            and self.inner != "eager"
            and _first_plan_missed(config.budget, spec, decided)
        )

    def _eager_to_fit(self, smallest: int) -> None:
        """``inner="auto"``: no plan of Inductor's fits this fragment's budget (its smallest
        peaks at ``smallest``); it is traced, planned and run with eager kernels from now on
        (exact, at eager's speed). Nothing was applied yet: the partitioner raises before."""
        budget = self.env.pipeline.config.budget
        assert budget is not None
        self.inner_fallback = (
            f"no plan of Inductor's fits budget={format_bytes(budget)}: its smallest peaks at "
            f"{format_bytes(smallest)}"
        )
        self.inner = "eager"
        self.inner_peaks = None
        self.inner_unmeasured = ""
        self.inner_excess = self.inner_over = 0
        self.plan_cached = None
        warnings.warn(
            f"memcompile: F{self.index}: {self.inner_fallback}; inner='auto' plans and runs it "
            "on eager kernels instead, whose plans reach further (eager's decompositions, "
            "elementwise ops in place, row tiling; exact, but slower than Inductor's code; "
            "inner='inductor' raises instead)",
            InnerCompilerWarning,
            stacklevel=2,
        )

    def _eager_instead(self, error: Exception) -> None:
        """``inner="auto"``: Inductor failed on this fragment; its graphs run on eager kernels
        from now on (correct, at eager's speed; the graphs keep Inductor's decompositions)."""
        self.inner = "eager"
        self.inner_peaks = None
        self.inner_fallback = f"Inductor failed ({type(error).__name__})"
        warnings.warn(
            f"memcompile: Inductor failed on F{self.index} ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}); inner='auto' runs its graphs "
            "on eager kernels instead (inner='inductor' raises the error)",
            InnerCompilerWarning,
            stacklevel=2,
        )

    # -- profiles ----------------------------------------------------------------------------
    def _profile(self, gm: fx.GraphModule, bw: fx.GraphModule | None) -> None:
        self._profile_args = profile_args(self.spec(), gm, bw)
        self.static_inputs = self._profile_args["static_input_indices"]
        profile = profile_fragment(gm, bw, clone_workspace=clone_workspace, **self._profile_args)
        if self.inner_peaks is not None:
            profile = self.inner_peaks.applied(profile)
        self.profile = profile
        self.size_slots = _size_slots(gm)
        self._sized_profiles.clear()

    def size_key(self, args: Sequence[Any]) -> SizeKey:
        """The values of the forward graph's size symbols in a call with ``args``."""
        return tuple(
            int(args[pos]) if dim < 0 else int(args[pos].shape[dim])
            for pos, dim, _ in self.size_slots
        )

    def profile_at(self, sizes: SizeKey) -> FragmentProfile | None:
        """The profile of the built graphs at a call's sizes (:meth:`size_key`), exact where the
        example's sizes (the profile's hints) are not; cached."""
        profile, fw = self.profile, self.fw_gm
        if not sizes or profile is None or fw is None or len(sizes) != len(self.size_slots):
            return profile
        found = self._sized_profiles.get(sizes)
        if found is None:
            bindings = {sym: v for (_, _, sym), v in zip(self.size_slots, sizes, strict=True)}
            with bound_sizes(bindings):
                found = profile_fragment(fw, self.bw_gm, **self._profile_args)
            # Gradient copies are of parameters, whose sizes are static: the example's figure.
            found = dataclasses.replace(found, clone_bytes=profile.clone_bytes)
            if len(self._sized_profiles) < MAX_SIZE_PROFILES:
                self._sized_profiles[sizes] = found
        return found
