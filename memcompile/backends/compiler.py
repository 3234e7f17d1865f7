"""``MemCompiler``: the backend object behind one ``torch.compile(..., backend="memcompile")`` call.

For each fragment Dynamo hands it:

    record identity (structural hash, sources, reason)     backends/identity.py
    one placeholder per read of a multiply-read input      rewrites/input_uses.py
    aot_autograd(partition_fn, fw/bw/inference compilers)  backends/fragment_build.py
        partition_fn   the pipeline decides the plan and the graphs   pipeline/
        fw compiler    finish, profile, compile with the inner compiler
        bw compiler    (lazy, first backward) the inner compiler
    wrap each compiled graph: count calls, watch the step            backends/call_wrapper.py

Between compiles it watches the steps (``step/``: the monitor records each call, the budget
replays the step and re-plans, the checks run at its end) and the frames Dynamo runs eagerly
(``backends/fallbacks.py``). Everything the report, the CLI and the notebooks show is read from
``MemCompiler.fragments`` and the observed step; nothing is recomputed later.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from types import CodeType, FrameType
from typing import Any

import torch
import torch._dynamo
from torch import fx
from torch._C._dynamo.eval_frame import set_code_exec_strategy
from torch._dynamo.eval_frame import innermost_backend
from torch._dynamo.types import FrameAction, FrameExecStrategy

from memcompile.analysis.costmodel import DeviceProfile, device_profile, resolve_profile_name
from memcompile.analysis.optimizer_cost import OptimizerCost
from memcompile.analysis.step_model import CallStorages, StepPrediction
from memcompile.backends import advice
from memcompile.backends.build_env import BuildEnv
from memcompile.backends.dynamo_hooks import (
    COMPILER_ATTR,
    ENTRY_ATTR,
    HOOK_ATTR,
    calling_compiled_module,
    calling_dynamo_context,
    hookless,
    install_call_hook,
)
from memcompile.backends.fakes import real_inputs
from memcompile.backends.fallbacks import (
    EagerFallbackWarning,
    Fallback,
    FunctionSpan,
    code_label,
    dispatch_mode_fallback,
    module_functions,
)
from memcompile.backends.fallbacks import monitor as fallback_monitor
from memcompile.backends.fragment_build import (
    FragmentBuild,
    code_location,
    compiling_code,
    device_of,
)
from memcompile.backends.identity import fragment_identity
from memcompile.backends.progress import slow_compile_notice
from memcompile.backends.regions import RegionSet, eager_readers, find_regions, install_regions
from memcompile.backends.sharded import RankCheck, ShardedModel
from memcompile.backends.unplanned import UnplannedWatch
from memcompile.config import OPTIONS_ENV, MemConfig, env_options
from memcompile.dynamic.prefetch import Prefetcher
from memcompile.dynamic.trace import TraceRecorder
from memcompile.errors import MemoryBudgetWarning, format_bytes
from memcompile.pipeline import features
from memcompile.pipeline.env import FragmentEnv
from memcompile.records import FragmentIdentity, FragmentRecord, StepEvent
from memcompile.rewrites.context import PassContext
from memcompile.rewrites.input_uses import InputSplit, split_inputs_pass
from memcompile.runtime import copy_engine, scalar_reads
from memcompile.runtime.after_backward import after_backward
from memcompile.runtime.after_backward import cancel as cancel_after_backward
from memcompile.runtime.compile_callbacks import ensure_compile_callbacks
from memcompile.runtime.glue import GlueOffload, pause
from memcompile.runtime.peakwatch import PeakWatch
from memcompile.runtime.pinned import install_hooks as install_pinned_hooks
from memcompile.runtime.store import (
    HOSTABLE_DEVICES,
    TieredStore,
    is_off_device,
    register_store,
)
from memcompile.step.budget import StepBudget, reset_codes
from memcompile.step.checks import StepChecks
from memcompile.step.fraction import BudgetFraction
from memcompile.step.iteration import IterationWatch, grad_bytes
from memcompile.step.monitor import BlockObserver, OutputsFound, StepMonitor
from memcompile.step.resident import ResidentSet

log = logging.getLogger(__name__)

__all__ = ["BlockObserver", "MemCompiler", "StepEvent"]

_all_compilers: weakref.WeakSet[MemCompiler] = weakref.WeakSet()

#: Dynamo's recompile limit for a model memcompile sees is dynamic (when the limit is still
#: torch's default): MoE expert graphs, early exits and trees recompile for new shapes/paths.
DYNAMIC_RECOMPILE_LIMIT = 64
#: Distinct graphs of one module ``forward`` after which it runs eagerly with its ``torch.nn``
#: modules compiled as regions (Dynamo's default recompile limit).
REGIONAL_AFTER = 8


def _apply_dynamo_settings() -> None:
    # An empty resume graph otherwise makes Dynamo skip a *shared* resume frame for good, running
    # every later call eagerly (research/04, "no ops traced"); empty graphs cost nothing here.
    if not torch._dynamo.config.allow_empty_graphs:
        log.debug("setting torch._dynamo.config.allow_empty_graphs = True")
        torch._dynamo.config.allow_empty_graphs = True


class MemCompiler:
    """Dynamo backend object; one per ``torch.compile`` call.

    Args:
        options: a dict of memcompile options (validated into :class:`MemConfig`) or a config.

    Attributes:
        config: the validated options.
        fragments: one :class:`FragmentRecord` per fragment compiled, in compile order.
        fallbacks: frames Dynamo ran eagerly while this compiler's model ran.
        step_monitor: every fragment call of the steps (``step/monitor.py``).
        resident: the device's resident bytes and the host tier (``step/resident.py``).
        budget: the step against the budget, and its re-plans (``step/budget.py``).
        checks: the end-of-step checks (``step/checks.py``).
        iteration: the optimizers that step the model, and the loop's micro-batches
            (``step/iteration.py``).
        fraction: ``budget="60%"``: the unplanned iteration measured, then the budget
            (``step/fraction.py``); ``None`` for a budget in bytes or none. Once resolved,
            ``config.budget`` holds its bytes.
        fsdp: the model's FSDP2 units (``backends/sharded.py``).
        prefetcher: the pilot: predicts the next blocks and prefetches their host-placed
            parameters (dynamic/prefetch.py); ``None`` with ``pilot="off"``.
        dynamic: why the model counts as dynamic ("" until seen): a fragment with symbolic
            shapes, a recompiled frame, or one graph serving several parameter sets.
        recompile_limit_raised: (old, new) when memcompile raised Dynamo's recompile limit.
        model: the compiled module, when known (memcompile.compile): its parameters are
            resident.
        regional: the modules called from the model's frames that Dynamo runs eagerly, each
            compiled as a fragment of its own (``backends/regions.py``); ``None`` until the
            call hook is attached.
    """

    iteration: IterationWatch

    def __init__(self, options: Mapping[str, Any] | MemConfig | None = None) -> None:
        if options is None or isinstance(options, Mapping):
            # A torch.compile call's options (memcompile.compile passes a MemConfig): what
            # MEMCOMPILE_OPTIONS gives, under the call's own.
            env = env_options()
            if env:
                options = {**env, **(options or {})}
                log.info("memcompile: options from %s: %s", OPTIONS_ENV, env)
        self.config = config = MemConfig.from_options(options)
        self.fragments: list[FragmentRecord] = []
        self.fallbacks: list[Fallback] = []
        self._lock = threading.Lock()
        self._hooked = False
        #: Monitor position when the hook was attached in the middle of a model call, until
        #: the rest of that call's fallbacks are claimed (:meth:`claim_late`).
        self._late_cursor: int | None = None
        self.model: weakref.ref[torch.nn.Module] | None = None
        self.regional: RegionSet | None = None
        # Frames gone regional after REGIONAL_AFTER compiles, and those to skip at the next
        # call (_regional_after_recompiles).
        self._regional_codes: list[CodeType] = []
        self._skip_pending: list[CodeType] = []
        # Code object -> identities of the graphs compiled from it.
        self._graphs_per_code: dict[CodeType, set[str]] = {}
        self.dynamic = ""
        self.recompile_limit_raised: tuple[int, int] | None = None
        self.store = TieredStore(config.disk_path)
        self.store_key = register_store(self.store)
        #: The eager glue's saved tensors, sent to the host tier when a measured step with
        #: eager frames is over the budget (runtime/glue.py).
        self.glue = GlueOffload(
            self.store, lambda: self._device, lambda: self.resident.model_tensors()
        )
        self._glue_params_seen = -1  # fallbacks when the glue's parameters were looked at
        self._skipped_looked_at = False  # _claim_skipped ran
        self.fsdp = ShardedModel(check_ranks=config.check_ranks)
        # The compute device (the first fragment's) and the parameters fragments took.
        self._device: torch.device | None = None
        self._params: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
        # The model's parameters as the step in progress found them (with the step's number),
        # kept to the step's end: a step's first call and its optimizers' steps read them
        # without walking the module tree again (_loop_params).
        self._step_params: tuple[int, list[torch.Tensor]] | None = None
        #: ``budget="60%"``: the unplanned iteration measured, then the budget (step/fraction.py).
        self.fraction = (
            BudgetFraction(config.budget_fraction)
            if config.budget is None and config.budget_fraction is not None
            else None
        )
        observers: list[BlockObserver] = []
        if config.trace_path is not None:
            observers.append(
                TraceRecorder(config.trace_path, records=self.records, model=self._model)
            )
        self._components(config, observers)
        _apply_dynamo_settings()
        install_pinned_hooks()  # before this model's first trace (pinned.py)
        install_start_hook()
        _all_compilers.add(self)

    def _components(self, config: MemConfig, observers: Sequence[BlockObserver]) -> None:
        """The step's watchers and the fragments' build environment under ``config`` (again
        when a fractional budget is resolved: :meth:`_rebudget`)."""
        self.resident = ResidentSet(
            config,
            self.records,
            self._model,
            self.fsdp.is_sharded,
            loop=lambda: (self.iteration.state_bytes, self.iteration.grads_at_start),
        )
        self.step_monitor = StepMonitor(
            budgeted=config.budget is not None or self.fraction is not None,
            records=self.records,
            listener=self,
            present_grads=self._present_grads,
        )
        if hasattr(self, "iteration"):  # its optimizer hooks may be running: kept
            self.iteration.reset(self.step_monitor)
        else:
            self.iteration = IterationWatch(
                self._loop_params,
                self._compute_device,
                self.step_monitor,
                self._optimizer_stepped,
                offload=config.offload_optimizer,
                store=self.store,
                tier=config.offload_to,
                first_step_over=lambda new, transient: self.budget.first_step_over(new, transient),
                paused=lambda: self.unplanned.direct,
            )
        self.budget = StepBudget(
            config, self.records, self.step_monitor, self.resident, self.iteration
        )
        self.checks = StepChecks(
            config,
            self.records,
            self.step_monitor,
            self.budget,
            lambda: len(self.fallbacks),
            glue=self.glue.turn_on if config.swap else None,
        )
        self.prefetcher: Prefetcher | None = None
        # No budget, the step seen: model calls run in the direct mode (backends/unplanned.py).
        self.unplanned = UnplannedWatch()
        #: fragment compiles so far (first compiles and re-plans): a pilot trial's step with one
        #: is not timed
        self.compiles = 0
        if config.pilot != "off":
            self.prefetcher = Prefetcher(
                config.pilot,
                config.prefetch_depth,
                records=self.records,
                model=self._model,
                gate=self._pilot_gate if config.pilot == "auto" else None,
                compiles=lambda: self.compiles,
                iterations=lambda: self.iteration.iterations,
            )
            self.store.prefetched = self.prefetcher.cache
        self.step_monitor.observers.extend(observers)
        self._env = BuildEnv(
            pipeline=FragmentEnv(
                config,
                self.cost_profile,
                self.resident,
                self.store_key,
                auto_pilot=self._auto_pilot_plans,
            ),
            store=self.store,
            monitor=self.step_monitor,
            unplanned=self.unplanned,
            budget=self.budget,
            prefetcher=self.prefetcher,
            fsdp=self.fsdp,
            note_dynamic=self.note_dynamic,
        )

    def _model(self) -> torch.nn.Module | None:
        return self.model() if self.model is not None else None

    def _loop_params(self) -> list[torch.Tensor]:
        """The parameters a training loop steps: the model's when known, else those the
        fragments took as inputs."""
        model = self._model()
        if model is None:
            return list(self._params.values())
        step = self.step_monitor.steps_started
        if self._step_params is not None and self._step_params[0] == step:
            return self._step_params[1]
        # During a module's forward its glue-read parameters are fetched copies: the real ones.
        params = self.glue.params.real(model.parameters())
        self._step_params = (step, params)
        return params

    def _compute_device(self) -> torch.device:
        return self._device or torch.device("cpu")

    def _present_grads(self, args: Sequence[Any]) -> dict[int, int]:
        # At a step's first call: the gradients it begins with (a later micro-batch); an
        # iteration's first step may be sampled (CPU: step/checks.py).
        params = self._loop_params()
        present = grad_bytes(params, self._compute_device())
        self.iteration.step_began(sum(present.values()))
        if self.iteration.begins_iteration:
            self.checks.iteration_began(self._roots(args), self.iteration.micro_batches)
        elif present or self.iteration.optimizers:
            self.checks.step_began()
        # Else a loop without an optimizer begins an iteration: sampled from the call's start
        # where the call hook is (_between_calls, which ends it too), not from here, after this
        # call's compiles and the eager code before its first fragment.
        if self.fraction is not None:
            self._measure_fraction(args, begins=not present and not self.iteration.optimizers)
        return present

    def _roots(self, args: Sequence[Any]) -> tuple[Any, ...]:
        """What an iteration's resident bytes are reachable from: the model (else its
        parameters), its optimizers, the call's arguments."""
        model = self._model()
        owner = model if model is not None else self._loop_params()
        return (owner, list(self.iteration.optimizers), args)

    def _measure_fraction(self, args: Sequence[Any], *, begins: bool) -> None:
        """``budget="60%"``, a step begins: an iteration after the first (which compiles) is
        measured; ``begins``: a loop without an optimizer begins an iteration (no gradients)."""
        fraction = self.fraction
        assert fraction is not None
        if fraction.resolved is not None or fraction.gave_up:
            return
        if not (self.iteration.begins_iteration or begins):
            fraction.step_began()
        elif fraction.measuring:
            # No optimizer and no call hook: nowhere to start over between model calls.
            fraction.give_up("nor between two calls of a compiled module")
        elif self.step_monitor.steps_observed >= 1:  # the first iteration compiles
            fraction.iteration_began(self._roots(args), self._compute_device())

    def _rebudget(self) -> None:
        """Start over with the measured budget, once it is: forget the fragments and the steps,
        and drop every frame compiled so far, which Dynamo then compiles again. Between two
        model calls (no compiled frame runs, and no optimizer hook, which must not register
        more while they run), or where re-plans apply without a call hook."""
        resolved = self.fraction.resolved if self.fraction is not None else None
        if resolved is None or self.config.budget is not None:
            return
        dropped = self.budget.drop_compiled()  # no frame runs here
        self.checks.reset()
        observers = list(self.step_monitor.observers)
        for observer in observers:
            observer.reset()
        with self._lock:
            self.fragments.clear()
        self.config = dataclasses.replace(self.config, budget=resolved.budget)
        self._components(self.config, observers)
        log.warning(
            "memcompile: budget %s; the model is compiled again under it (%d frame(s) dropped)",
            resolved.describe(),
            dropped,
        )

    def __repr__(self) -> str:
        return f"MemCompiler({len(self.fragments)} fragments, inner={self.config.inner!r})"

    # -- Dynamo backend protocol ---------------------------------------------------------------
    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        device = device_of(example_inputs)
        if self.config.pilot in ("markov", "lightgbm") and device is not None:
            if device.type not in HOSTABLE_DEVICES:
                raise NotImplementedError(
                    f"memcompile option pilot={self.config.pilot!r} prefetches host-placed "
                    "parameters, which is only implemented for the CPU and CUDA devices; on "
                    f"{device.type} parameters cannot be host-placed (use pilot='off' or 'auto')"
                )
        ctx = calling_dynamo_context()
        if ctx is not None:
            self.attach_in_call(ctx, sys._getframe(1))
        self.checks.compiling(device)
        if self.fraction is not None:
            self.fraction.compiling()
        if self._device is None and device is not None:
            self._device = device
        identity = fragment_identity(gm, example_inputs)
        self._regional_after_recompiles(identity.id)
        old, resident, saved_cap = self.budget.take_awaiting(identity.id)
        # Dynamo compiles under its own global lock, so the next index cannot be taken meanwhile.
        # A re-planned fragment keeps its index (and call counts): it replaces its record.
        index = old.index if old is not None else self._next_index()
        # The graphs are planned and built with one placeholder per read of an input that
        # several ops read (its gradient then adds up in eager's order; rewrites/input_uses.py).
        gm = split_inputs_pass(
            gm,
            PassContext(fragment=f"F{index}", graph="dynamo"),
            example_inputs=example_inputs,
            params=self.config.split_param_reads,
        )
        split = gm.meta.get("memcompile_input_split", InputSplit())
        compile_inputs = split.compile_inputs(example_inputs)
        # DDP's graph splitter compiles each piece with fake parameters: plan with the real ones.
        real, unfound = real_inputs(example_inputs)
        if unfound and self.config.offload_params is True:
            warnings.warn(
                f"memcompile: F{index}: {unfound} parameters reached the backend as fake tensors "
                "(DDP's graph splitting) with no real parameter found behind them, so they stay "
                "on the device (offload_params=True)",
                MemoryBudgetWarning,
                stacklevel=2,
            )
        self.fsdp.note(
            self._model(),
            index=index,
            first_compile=not self.fragments,
            offload_params=self.config.offload_params,
            budget=self.config.budget,
            peak_watched=self.checks.peak_watch is not None,
            dynamic=self.dynamic,
        )
        for t in real:
            if isinstance(t, torch.nn.Parameter):
                self._params[id(t)] = t
        build = self._build(index, split, real, identity, old, resident, saved_cap)
        build.code = code_location(gm)
        self.note_dynamic_fragment(build.index, gm)
        # Planning runs graphs; in a call whose glue goes to the host tier, not through its hooks.
        with (
            pause(),
            slow_compile_notice(f"F{index}", nodes=len(gm.graph.nodes), budget=self.config.budget),
        ):
            compiled, record = build.compile(gm, compile_inputs, identity)
        compiled = self.glue.paused(split.wrap(compiled))
        self.unplanned.compiled(self.step_monitor.steps_observed)
        self.budget.compiled(record.index, compiling_code())
        with self._lock:
            # A re-planned fragment's record is replaced where its index is (the record it was
            # queued with may have been replaced since: a re-plan of a re-plan).
            at = (
                next((i for i, r in enumerate(self.fragments) if r.index == old.index), None)
                if old is not None
                else None
            )
            if at is not None:
                self.fragments[at] = record
            else:
                self.fragments.append(record)
            self.compiles += 1
        log.info(
            "%s %s %s (%s): %s, %d inputs",
            "re-planned" if old is not None else "compiled",
            record.name,
            record.id,
            record.code,
            record.reason,
            len(record.identity.sources),
        )
        return compiled

    def _build(
        self,
        index: int,
        split: InputSplit,
        real: Sequence[Any],
        identity: FragmentIdentity,
        old: FragmentRecord | None,
        resident: int | None,
        saved_cap: int | None,
    ) -> FragmentBuild:
        """The build of F{index}: its inputs, and what it plans with besides them (a re-plan's
        figures, what steps showed of its outputs and incoming gradients)."""
        build = FragmentBuild(self._env, index, split.expand(real))
        build.alias_sources = split.aliases(len(real))
        build.summed_inputs = split.summed
        build.dropped_outputs = self.budget.dropped_outputs(identity.id)
        build.released_tangents = self.budget.released_tangents(identity.id)
        if (
            old is not None
            and old.plan is not None
            and (build.dropped_outputs or build.released_tangents)
        ):
            build.replan_start = tuple(
                d.tensor for d in old.plan.decisions if d.action != "recompute"
            )
        if old is not None:
            build.stats = old.stats
            build.replan_resident = resident
            build.replan_saved_cap = saved_cap
            build.host_replan = self.budget.host_replan(index)
        return build

    def _next_index(self) -> int:
        return max((r.index for r in self.fragments), default=-1) + 1

    def reset(self) -> None:
        """Forget fragments and steps (``torch._dynamo.reset()`` calls this: code is dropped)."""
        with self._lock:
            self.fragments.clear()
            self.fallbacks.clear()
            self.step_monitor.reset()
            self.budget.reset()
            self.checks.reset()
            self.resident.reset()
            self.iteration.reset()
            self.glue.reset()
            self.unplanned.reset()
            self._step_params = None
            # Dynamo forgot the frames' code and strategies: they compile (and count) anew.
            self._graphs_per_code.clear()
            self._regional_codes.clear()
            self._skip_pending.clear()
        for observer in self.step_monitor.observers:
            observer.reset()
        if self.prefetcher is not None:
            self.prefetcher.reset()
        # The CPU's copy thread finishes what it was given and stops; the next copy starts it.
        copy_engine.shutdown()

    def records(self) -> list[FragmentRecord]:
        """A snapshot of the compiled fragments, in compile order."""
        with self._lock:
            return list(self.fragments)

    def cost_profile(self, example: Sequence[Any]) -> DeviceProfile:
        """The cost model for graphs whose tensors look like ``example``."""
        device = device_of(example) or torch.device("cpu")
        return device_profile(resolve_profile_name(self.config.device_profile, device))

    # -- dynamic models and the pilot ------------------------------------------------------------
    def _pilot_gate(self) -> bool:
        # pilot="auto": the pilot where its prefetches pay, once the model is dynamic and has
        # parameters on the host; a trial then times it against fetching on demand
        # (dynamic/trial.py). On the CPU device with its copies on the computing thread (the
        # copy thread off, runtime/copy_engine.py) a prefetch can hide nothing, so no trial:
        # it would only cost its steps with the pilot and the cache's reserve.
        if not self.dynamic or not self.resident.host_param_bytes:
            return False
        if self._pilot_can_overlap():
            return True
        if self.prefetcher is not None and self.prefetcher.blocked is None:
            self.prefetcher.blocked = advice.CPU_AUTO_PILOT_OFF
            log.info("memcompile pilot: %s", advice.CPU_AUTO_PILOT_OFF)
        return False

    def _pilot_can_overlap(self) -> bool:
        # A prefetch can overlap compute: a CUDA device (copies on a side stream), or the CPU
        # device with its copy thread on.
        return self._compute_device().type == "cuda" or copy_engine.active()

    def _auto_pilot_plans(self) -> bool:
        # pilot="auto": plans leave the cache its reserve (and forward graphs a prediction op)
        # once the model is dynamic, where a trial may run: it needs them; a static model, or
        # one on the CPU with its copies on the computing thread, pays nothing.
        return bool(self.dynamic) and self._pilot_can_overlap()

    def note_dynamic(self, reason: str) -> None:
        """The model is dynamic (first reason kept). Dynamo's recompile limit is raised for it,
        deliberately and once, unless the user changed it: a dynamic model recompiles more
        often, and a frame over the limit runs eagerly (reported as a fallback)."""
        if self.dynamic:
            return
        self.dynamic = reason
        log.info("memcompile: the model is dynamic (%s)", reason)
        self.fsdp.warn_paths(reason)
        config = torch._dynamo.config
        limit = config.recompile_limit
        default = config._config["recompile_limit"].default  # type: ignore[attr-defined]
        if limit == default and limit < DYNAMIC_RECOMPILE_LIMIT:
            config.recompile_limit = DYNAMIC_RECOMPILE_LIMIT
            self.recompile_limit_raised = (limit, DYNAMIC_RECOMPILE_LIMIT)
            log.info(
                "memcompile: raised torch._dynamo.config.recompile_limit from %d to %d for this "
                "dynamic model",
                limit,
                DYNAMIC_RECOMPILE_LIMIT,
            )

    def note_dynamic_fragment(self, index: int, gm: fx.GraphModule) -> None:
        """A fragment with symbolic input shapes, or a frame recompiled for training, makes the
        model dynamic."""
        for p in gm.graph.find_nodes(op="placeholder"):
            v = p.meta.get("example_value", p.meta.get("val"))
            if isinstance(v, torch.SymInt) or (
                isinstance(v, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in v.shape)
            ):
                self.note_dynamic(f"F{index} has symbolic shapes")
                break
        compile_id = torch._guards.CompileContext.current_compile_id()
        # A frame compiled again for inference (an evaluation under torch.no_grad between
        # training steps: Dynamo guards on grad mode) is not a dynamic model.
        if (
            compile_id is not None
            and getattr(compile_id, "frame_compile_id", None)
            and torch.is_grad_enabled()
        ):
            self.note_dynamic(f"F{index} recompiles a frame")

    # -- what the step monitor tells (StepListener) ----------------------------------------------
    def step_ended(self, *, in_call: bool) -> None:
        """A step ended: its checks, then (in a call, with no call hook) the re-plans' code is
        dropped now: this frame keeps running."""
        self._step_params = None  # not kept between steps (the model may go)
        self.checks.measured_peak()
        over = self.budget.check()
        if over is not None:
            records = {r.index: r for r in self.records()}
            advice.step_over(
                over,
                self.config,
                hostable_bytes=sum(
                    self.resident.hostable_on_device(set(over.used), records).values()
                ),
                host_param_bytes=self.resident.host_param_bytes,
                sharded=self.fsdp.sharded is not None,
            )
        self.checks.grad_order()
        if in_call and not self._hooked:
            self._rebudget()
            self.budget.apply_replans()

    def _optimizer_stepped(self, cost: OptimizerCost) -> None:
        """An optimizer stepped the model's parameters: the iteration's last micro-batch is over
        (its check now counts the optimizer's state), then the optimizer step's own peak; the
        re-plans apply before the model's next call."""
        self.step_monitor.end_step_if_done()
        if self.iteration.iteration_done:
            if self.fraction is not None and self.fraction.measuring:
                self.fraction.iteration_ended()  # applies at the model's next call
            self.checks.iteration_ended(self.iteration.micro_batches, cost.kind)
        over = self.budget.optimizer_step()
        self.budget.apply_replans()
        if over is not None:
            advice.optimizer_over(over, self.config, sharded=self.fsdp.sharded is not None)

    def first_backward(
        self, index: int, outputs: OutputsFound | None, held: frozenset[int]
    ) -> None:
        """The step's first backward call returned: re-plan what it showed assumed wrongly."""
        self.budget.first_backward(index, outputs, held)

    def _sampled_backward_ended(self) -> bool:
        """A backward pass returned (runtime/after_backward.py) while the sample of a call
        without an optimizer waited for it: read the sample when the pass was the call's (it
        ran the fragments' backward; returns True: done waiting)."""
        if not self.checks.awaiting_backward:
            return True
        if self.step_monitor.last_kind != "backward":  # another graph's backward
            return False
        # The step's check first (as an optimizer step does), so that the sample is held
        # against this step's prediction.
        self.step_monitor.end_step_if_done()
        self.checks.backward_ended()
        return True

    # -- eager fallbacks and the call hook -------------------------------------------------------
    def attach(self, ctx: Any) -> bool:
        """Claim the eager fallbacks of every call of the model compiled through ``ctx`` (a
        ``torch._dynamo`` context) when the call ends; see dynamo_hooks.py. Returns whether the hook
        was installed now (False: it already was)."""

        if self.regional is None:
            self.regional = RegionSet(hookless(ctx), self.unplanned)
        regional = self.regional

        def enter() -> Callable[[], None]:
            self._between_calls()
            self.claim_late()
            # Under a dispatch mode Dynamo runs the call eagerly, compiled code or not, and
            # says so nowhere the monitor reads.
            self._dispatch_mode_call()
            cursor = fallback_monitor.cursor()
            regional.enter()
            self.glue.enter()
            # The numbers the model's Python reads from tensors (an expert's index, an exit's
            # confidence) for the pilot and the trace; the tensor methods are wrapped only while
            # such a call runs.
            reads = self._wants_reads()
            sink = scalar_reads.start(self._on_read) if reads else None

            def leave() -> None:
                if reads:
                    scalar_reads.stop(sink)
                self.glue.leave()
                regional.leave()
                if self.checks.sampling and not self.iteration.optimizers:
                    # A loop without an optimizer: its sample, begun at this call's start
                    # (_between_calls), ends with it, or with its backward when it trained
                    # (_sampled_backward_ended, once autograd's pass returns).
                    self.checks.call_ended(
                        trains=self.step_monitor.step_trains and torch.is_grad_enabled()
                    )
                    if self.checks.awaiting_backward:
                        after_backward(self._sampled_backward_ended)
                claimed = fallback_monitor.claim_since(cursor)
                self._claim(claimed)
                if not (claimed or self.fragments or self.fallbacks or self._skipped_looked_at):
                    self._claim_skipped()
                if sys.exc_info()[0] is not None:  # Dynamo runs this in a `finally`
                    self._call_failed()

            return leave

        self._hooked = True
        return install_call_hook(ctx, enter)

    def attach_in_call(self, ctx: Any, frame: FrameType | None) -> None:
        """Attach to ``ctx`` from inside a call of its model (``torch.compile(backend=
        "memcompile")``: the first fragment's compile, or the first frame Dynamo starts to
        compile, see :func:`_on_compile_start`); no-op when attached already. The hook watches
        the later calls only: the frames Dynamo gave up on so far in this call are still running
        (they call ``frame``), or were called by one of them; those after this point are claimed
        when the next call starts (or by report())."""
        if not self.attach(ctx):
            return
        self._claim(fallback_monitor.claim_running(frame))
        self._late_cursor = fallback_monitor.cursor()
        if self.model is None:
            # Its parameters count against the budget, those only eager frames read too
            # (no fragment takes them as inputs; step/resident.py).
            model = calling_compiled_module(ctx)
            if model is not None:
                self.model = weakref.ref(model)
                self._install_regions(self.fallbacks)

    def _wants_reads(self) -> bool:
        prefetcher = self.prefetcher
        return self.step_monitor.wants_reads() or (
            prefetcher is not None and prefetcher.takes_reads()
        )

    def _on_read(self, values: tuple[int | float, ...]) -> None:
        # A number the model's Python read from a tensor during its call (runtime/scalar_reads.py).
        self.step_monitor.on_reads(values)
        if self.prefetcher is not None:
            self.prefetcher.read(values)

    def _call_failed(self) -> None:
        """A model call raised: the iteration it was part of will not end as measured, so a
        profiler sample of it stops now (a loop that ends here must not leave the CPU profiler
        running)."""
        self.checks.cancel_sample()
        cancel_after_backward(self._sampled_backward_ended)
        if self.fraction is not None:
            self.fraction.cancel()

    def _between_calls(self) -> None:
        # A model call starts and none of its frames runs: the place to end a step whose backward
        # is done (so its check runs now, not in the next step's first fragment) and to drop the
        # code of the fragments to re-plan, which Dynamo then compiles again in this call.
        self.step_monitor.end_step_if_done()
        if self.checks.awaiting_backward:  # a sampled call whose backward never came: dropped
            cancel_after_backward(self._sampled_backward_ended)
            self.checks.no_backward()
        if (
            self.fraction is not None
            and self.fraction.measuring
            and not self.iteration.optimizers
            and not grad_bytes(self._loop_params(), self._compute_device())
        ):
            # A loop without an optimizer: the measured iteration ended with its step.
            self.fraction.iteration_ended()
        if (
            self.checks.wants_sample
            and not self.iteration.optimizers
            and not grad_bytes(self._loop_params(), self._compute_device())
        ):
            # A loop without an optimizer: a call that begins without gradients is sampled
            # from its start (before the eager code ahead of its first fragment: a fallen-back
            # frame's glue) to its end, or the end of its backward when it trained, so that
            # no profiler runs in the user's code after it. The call's arguments are not known
            # here: not in the peak.
            # (With an optimizer, the iteration is sampled from its first fragment call to its
            # optimizer step: _present_grads.)
            self.checks.iteration_began(self._roots(()), 1)
        self._rebudget()
        self.budget.apply_replans()
        self._skip_recompiling()
        self._host_glue_params()
        self.unplanned.call_starts(self._nothing_to_plan(), self.step_monitor.steps_observed)

    def _nothing_to_plan(self) -> bool:
        """No budget (nor a fraction to measure), no parameters or optimizer state in the host
        tier, no pilot asked for and no trace: what the calls tell the monitor changes nothing
        (backends/unplanned.py)."""
        config = self.config
        return (
            features.current().direct_unplanned
            and config.budget is None
            and self.fraction is None
            and config.offload_params is not True
            and config.offload_optimizer is not True
            and not self.resident.host_param_bytes
            and not self.iteration.offloading
            and config.pilot in ("auto", "off")
            and config.trace_path is None
        )

    def _host_glue_params(self) -> None:
        """Once parameters go to the host tier (``offload_params=True``, or ``"auto"``
        having moved some to fit the budget) and a step was seen (its fragments compiled),
        move the model's parameters no fragment takes — those only eager code reads, an HF
        MoE's eager experts — there too, fetched around their modules' forward
        (runtime/glue_params.py). Again as more frames fall back."""
        offload = self.config.offload_params
        if self._glue_params_seen == len(self.fallbacks) or not (
            offload is True
            or (
                offload == "auto"
                and (self.resident.host_step or self.resident.host_param_bytes > 0)
            )
        ):
            return
        model, device = self._model(), self._device
        if model is None or device is None or self.step_monitor.steps_observed < 1:
            return
        # Looked at again when Dynamo gives up on more frames (a model's first calls claim
        # theirs as they end).
        self._glue_params_seen = len(self.fallbacks)
        if device.type not in HOSTABLE_DEVICES or self.fsdp.sharded is not None:
            return
        # The parameters held directly by modules whose own forward runs eagerly, that no
        # fragment takes (not a region's: those are fragments' once they run).
        taken = {a for r in self.records() for a, _ in r.static_storages}
        modules = dict(model.named_modules())
        names = [
            f"{path}.{name}" if path else name
            for path in eager_readers(model, self.fallbacks)
            for name, p in modules[path]._parameters.items()
            if p is not None
            and p.device == device
            and not is_off_device(p)
            and p.untyped_storage().data_ptr() not in taken
            and self.resident.may_host(p)
        ]
        if not names:
            return
        freed = self.glue.params.install(model, names, device, self.resident.move_to_host)
        self.resident.host_param_bytes += freed
        # What the step holds changed: the CPU measures the next iteration (through its
        # backward), and the glue's saved tensors go to the host tier too if it passes the
        # budget. CUDA measures each step, but only once it is over: there they go now.
        self.checks.sample_again()
        if self.config.swap and device.type == "cuda":
            self.glue.turn_on(
                f"{len(names)} parameter(s) only eager code reads went to the host tier "
                f"({format_bytes(freed)}) with the others"
            )

    def _dispatch_mode_call(self) -> None:
        fallback = dispatch_mode_fallback()
        if fallback is None:
            return
        with self._lock:
            first = fallback not in self.fallbacks
            if first:
                self.fallbacks.append(fallback)
        if first:
            warnings.warn(fallback.message(), EagerFallbackWarning, stacklevel=4)

    def _claim(self, fallbacks: list[Fallback]) -> None:
        if fallbacks:
            with self._lock:
                self.fallbacks.extend(fallbacks)
            self._install_regions(fallbacks)

    def _regional_after_recompiles(self, identity: str) -> None:
        """A module's ``forward`` compiled into its ``REGIONAL_AFTER``-th distinct graph (a
        new graph for each input's Python structure: a tree network's recursion over a new tree
        every step) runs eagerly from the model's next call, with the ``torch.nn`` modules it
        calls as fragments (backends/regions.py), rather than compiling a graph per structure
        up to Dynamo's recompile limit. Only where it calls such modules. Graphs are counted by
        identity: a re-plan compiles the same graph again."""
        code = compiling_code()
        if code is None or code in self._regional_codes:
            return
        seen = self._graphs_per_code.setdefault(code, set())
        seen.add(identity)
        model = self._model()
        if (
            len(seen) < REGIONAL_AFTER
            or model is None
            or self.regional is None
            or not features.current().regional
        ):
            return
        fallback = Fallback(
            code=code_label(code),
            kind="recompiling",
            reason=f"compiled {len(seen)} times (a new graph for each input's structure)",
            compile_id=str(torch._guards.CompileContext.current_compile_id()),
            hint="memcompile runs it eagerly and compiles the torch.nn modules it calls",
        )
        # A decorator's wrapper is one code object for every module it wraps: skipping it would
        # run them all eagerly. Only a forward of one module type goes regional.
        owners = {
            type(m) for m in model.modules() if getattr(type(m).forward, "__code__", None) is code
        }
        if len(owners) != 1 or not find_regions(model, [fallback]):
            return
        self._regional_codes.append(code)
        self._skip_pending.append(code)
        self._claim([fallback])

    def _skip_recompiling(self) -> None:
        """Between two model calls: the frames :meth:`_regional_after_recompiles` chose run
        eagerly from now on, their nested frames too (the regions' own Dynamo context compiles
        the modules)."""
        codes, self._skip_pending = self._skip_pending, []
        reset_codes(codes)
        for code in codes:
            set_code_exec_strategy(code, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))

    def _install_regions(self, fallbacks: Collection[Fallback]) -> None:
        """Compile the ``torch.nn`` modules that frames Dynamo gave up on call, as fragments of
        their own from the model's next call (backends/regions.py)."""
        model = self._model()
        if self.regional is None or model is None or not features.current().regional:
            return
        regions = find_regions(model, fallbacks)
        if install_regions(model, regions, self.regional):
            for caller in dict.fromkeys(r.caller for r in regions):
                paths = [r.path for r in regions if r.caller == caller]
                log.warning(
                    "memcompile: Dynamo runs %s eagerly; the %d torch.nn module(s) it calls "
                    "(%s) are compiled as fragments of their own from the model's next call; the "
                    "tensor operations between them stay eager",
                    caller,
                    len(paths),
                    ", ".join(paths),
                )

    def claim_late(self) -> None:
        """Claim what Dynamo gave up on in the rest of the call that attached the hook (its
        cleanup never ran: the hook was not there when the call started)."""
        cursor, self._late_cursor = self._late_cursor, None
        if cursor is not None:
            self._claim(fallback_monitor.claim_since(cursor))

    def _claim_skipped(self) -> None:
        """A call that compiled nothing and gave up on nothing: a frame of the model's own
        class that Dynamo gave up on earlier in the process (under another backend: the same
        code object) is skipped from then on, with no record in this call. Its earlier record
        is the model's (and its modules become regions)."""
        model = self._model()
        if model is not None:
            # Once: the class's methods are walked (a model that compiles nothing: every call).
            self._skipped_looked_at = True
            self._claim(fallback_monitor.claim_functions(module_functions(model)))

    def claim_fallbacks_of(self, functions: Collection[FunctionSpan]) -> None:
        """Claim unclaimed fallbacks of frames of these functions (for hooks attached late, after
        the model's first call)."""
        self._claim(fallback_monitor.claim_functions(functions))

    # -- what the report and the tools read ------------------------------------------------------
    def predict_step(
        self, extra_resident: Iterable[torch.Tensor] = ()
    ) -> tuple[StepPrediction | None, tuple[StepEvent, ...], int]:
        """(prediction, replayed calls, resident bytes) of the most recent step.

        Resident: the parameters and buffers of every block that ran, of the compiled module when
        known, and ``extra_resident``."""
        return self.budget.predict(extra_resident)[:3]

    def current_step(self) -> tuple[StepEvent, ...]:
        """The most recent step (``StepMonitor.current_step``)."""
        return self.step_monitor.current_step()

    def step_sequence(self) -> tuple[StepEvent, ...]:
        """The calls step predictions replay (``StepMonitor.step_sequence``)."""
        return self.step_monitor.step_sequence()

    @property
    def block_observers(self) -> list[BlockObserver]:
        """Told of every fragment call, in order (dynamic/: the trace recorder, the pilot)."""
        return self.step_monitor.observers

    @property
    def last_step(self) -> tuple[StepEvent, ...]:
        """Fragment calls of the last complete training step observed."""
        return self.step_monitor.last_step

    @property
    def last_step_storages(self) -> tuple[CallStorages, ...]:
        """Each call's :class:`CallStorages`, parallel to :attr:`last_step`."""
        return self.step_monitor.last_step_storages

    @property
    def steps_observed(self) -> int:
        return self.step_monitor.steps_observed

    @property
    def peak_watch(self) -> PeakWatch | None:
        """CUDA with a budget: each step's measured peak against it (runtime/peakwatch.py)."""
        return self.checks.peak_watch

    @peak_watch.setter
    def peak_watch(self, watch: PeakWatch | None) -> None:
        self.checks.peak_watch = watch

    @property
    def host_params_pinned(self) -> bool:
        """Whether host-placed parameters are a CUDA model's pinned ones (runtime/pinned.py)."""
        return self.resident.host_params_pinned

    @host_params_pinned.setter
    def host_params_pinned(self, pinned: bool) -> None:
        self.resident.host_params_pinned = pinned

    @property
    def device_other_bytes(self) -> int | None:
        """CUDA: device bytes others had allocated at the first plan (``None``: not measured)."""
        return self.resident.device_other_bytes

    @property
    def rank_check(self) -> RankCheck | None:
        """``check_ranks=True`` on an FSDP2 model: the ranks compare units."""
        return self.fsdp.rank_check


def _on_compile_start(args: Any) -> None:
    """Dynamo starts compiling a frame: if it runs under ``torch.compile(backend="memcompile")``,
    attach that model's compiler now. A model whose first frame falls back and whose modules are
    all ``torch.nn`` ones compiles no fragment, so the backend would never be called: without
    this its fallbacks were found only by ``report()``, and the modules were never compiled as
    regions (backends/regions.py)."""
    ctx = calling_dynamo_context()
    if ctx is None or getattr(ctx, HOOK_ATTR, None) is not None:
        return  # not a compiled model's call, or already hooked (or a region's context)
    callback = ctx.callback
    if not callable(callback):
        return
    wrapper = innermost_backend(callback)
    if not getattr(getattr(wrapper, "compiler_fn", None), ENTRY_ATTR, False):
        return
    compiler = getattr(wrapper, COMPILER_ATTR, None)
    if compiler is None:
        try:
            compiler = MemCompiler(getattr(wrapper, "kwargs", {}).get("options"))
        except (TypeError, ValueError):
            return  # bad options: the backend's first call raises them to the user
        setattr(wrapper, COMPILER_ATTR, compiler)
    compiler.attach_in_call(ctx, sys._getframe(1))


def install_start_hook() -> None:
    """Register :func:`_on_compile_start` with Dynamo (idempotent; kept across
    ``torch._dynamo.reset()``, runtime/compile_callbacks.py)."""
    ensure_compile_callbacks(_on_compile_start)


install_start_hook()


def reset_all() -> None:
    """Reset every live compiler (used by the entry-point backend's ``reset``)."""
    for c in list(_all_compilers):
        c.reset()
