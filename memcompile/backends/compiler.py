"""``MemCompiler``: the backend object behind one ``torch.compile(..., backend="memcompile")`` call.

For each fragment Dynamo hands it:

    record identity (structural hash, sources, reason)          identity.fragment_identity
    one placeholder per read of a multiply-read input           rewrites.input_uses
    aot_autograd(partition_fn, fw/bw/inference compilers)
        partition_fn      torch's partitioner; keeps the backward graph for the forward compiler
        fw compiler       profile forward + backward together        analysis.fragment_profile
                          compile with the inner compiler             backends.inner
        bw compiler       (lazy, first backward) inner compiler
    wrap each compiled callable: count calls, track the step sequence, mark profiler ranges

Everything the report, the CLI and the notebooks show is read from ``MemCompiler.fragments`` and
the observed step; nothing is recomputed later.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from types import CodeType
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Protocol

import sympy
import torch
import torch._dynamo
from torch import fx
from torch._dynamo.backends.common import aot_autograd
from torch._functorch import partitioners as P
from torch._functorch.partitioners import default_partition
from torch._logging._internal import trace_structured_artifact
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import _disable_current_modes

from memcompile.analysis.costmodel import DeviceProfile, device_profile, resolve_profile_name
from memcompile.analysis.fragment_profile import (
    FragmentProfile,
    accumulate_clone_bytes,
    backward_profiler,
    profile_fragment,
)
from memcompile.analysis.graph import GraphProfile, bound_sizes
from memcompile.analysis.joint_model import JointModel
from memcompile.analysis.step_model import CacheUse, OutputLife, StepPrediction, simulate_step
from memcompile.analysis.workspace import clone_workspace, probe_workspaces
from memcompile.backends.dynamo_hooks import (
    calling_compiled_module,
    calling_dynamo_context,
    install_call_hook,
)
from memcompile.backends.fakes import real_inputs
from memcompile.backends.fallbacks import (
    EagerFallbackWarning,
    Fallback,
    FunctionSpan,
    dispatch_mode_fallback,
    monitor,
)
from memcompile.backends.identity import fragment_identity, parameter_name
from memcompile.backends.inner import BoxedCallable, compile_inner, decompositions
from memcompile.backends.progress import slow_compile_notice
from memcompile.backends.sharded import RankCheck, ShardedParams, sharded_params
from memcompile.config import MemConfig
from memcompile.errors import (
    GradientOrderWarning,
    MemoryBudgetError,
    MemoryBudgetWarning,
    format_bytes,
)
from memcompile.planning.plan import FragmentPlan
from memcompile.planning.planner import plan_fragment
from memcompile.planning.replan import MAX_REPLANS, MAX_ROUNDS, Replan, decide_replan
from memcompile.records import (
    FragmentIdentity,
    FragmentRecord,
    FragmentStats,
    SizeKey,
    StepEvent,
)
from memcompile.rewrites.context import PassContext
from memcompile.rewrites.dropout import dropout_pass, saved_after
from memcompile.rewrites.early_reloads import plan_prefetch, prefetch_pass
from memcompile.rewrites.inplace import in_place_pass
from memcompile.rewrites.input_uses import InputSplit, split_inputs_pass
from memcompile.rewrites.linearce import find_linear_ce, linear_ce_pass
from memcompile.rewrites.losshead import loss_head_pass, min_block_bytes
from memcompile.rewrites.params import param_fetch_pass
from memcompile.rewrites.partition import partition_pass
from memcompile.rewrites.pilot_prefetch import (
    device_observed,
    observed_outputs,
    pilot_prefetch_pass,
    plan_pilot_prefetch,
)
from memcompile.rewrites.rematerialize import plan_rematerialize, rematerialize_pass
from memcompile.rewrites.swap import swap_pass
from memcompile.rewrites.tiling import (
    MAX_KEPT_MATMULS,
    RowTiling,
    find_row_tilings,
    row_tile_pass,
)
from memcompile.runtime.measure import storage_sizes
from memcompile.runtime.peakwatch import PeakWatch
from memcompile.runtime.pinned import install_hooks as install_pinned_hooks
from memcompile.runtime.small_ints import small_int_outputs
from memcompile.runtime.store import (
    HOSTABLE_DEVICES,
    TieredStore,
    can_host_place,
    is_host_placed,
    place_on_host,
    register_store,
)

if TYPE_CHECKING:
    from memcompile.dynamic.prefetch import Prefetcher

log = logging.getLogger(__name__)

__all__ = ["BlockObserver", "MemCompiler", "StepEvent"]

#: Storages (address -> bytes) of the activation inputs a forward call's backward reads: those
#: it saves whole and those it reads through views (autograd keeps the storage alive either way).
ViewStorages = Mapping[int, int]


class CallStorages(NamedTuple):
    """Storages of one call that the step's replay counts by address
    (``analysis/step_model.py``), so that what several calls share is counted once.

    Attributes:
        kept: :data:`ViewStorages` of the inputs its backward reads (a forward call).
        outputs: its saved outputs that are also user outputs (address -> bytes), read after
            it returned.
        grad_inputs: its activation inputs whose gradients its backward makes (its profile's
            ``activation_grads``): input position -> storage address.
        cache: bytes the pilot's prefetch cache held after it (a forward call's tail).
        cache_use: what the cache held through it (a forward call with the pilot on): its
            copies taken by the graph, for later blocks, made by the graph's own prediction.
        held: bytes of its held user outputs (``FragmentProfile.held_output_positions``) the
            caller still held when the step's first backward began (the step's last forward
            call; ``None``: not measured).
        tangents: the step's first backward call: input positions of its incoming gradients
            still alive after it returned, held by someone else (the engine's root holds the
            loss's); ``None``: not measured.
        inputs: a forward call's activation input storages (address -> bytes); under a budget.
        lives: a forward call's held outputs and when each one's storage died
            (:class:`OutputLife`; ``died`` is set by a weak reference's callback); under a
            budget (without one the replay counts only the last forward's, ``held``).
        kept_at: of ``kept``, the whole storages its backward reads (``saved_input_reads``):
            address -> input position (the first that has it).
    """

    kept: ViewStorages
    outputs: ViewStorages
    grad_inputs: Mapping[int, int]
    cache: int = 0
    held: int | None = None
    cache_use: CacheUse | None = None
    tangents: frozenset[int] | None = None
    inputs: ViewStorages | None = None
    lives: tuple[OutputLife, ...] = ()
    kept_at: Mapping[int, int] = {}


_NO_STORAGES = CallStorages({}, {}, {})


class BlockObserver(Protocol):
    """Sees every fragment call (``MemCompiler.block_observers``), e.g. the trace recorder.

    ``on_block`` runs before the call with the step number, the :data:`StepEvent` fields and the
    call's arguments (read sizes only: a reference kept would keep activations alive)."""

    def on_block(
        self, step: int, index: int, kind: str, block: int, args: Sequence[Any]
    ) -> None: ...

    def reset(self) -> None: ...

    # Optional: ``on_block_end(step, index, kind, block, outputs, small_ints=...)`` runs after a
    # forward or inference call returned, with its outputs and their small integer values
    # (runtime/small_ints.py's ``small_int_outputs``, computed once per call and shared with
    # the prefetcher); called only on observers that define it, see ``MemCompiler._on_call_end``.


#: When a budgeted plan uses the dropout rewrite (rewrites/dropout.py): ``"auto"`` when the plan
#: without it misses the budget and the one with it fits or peaks lower, first with saved masks,
#: then (CPU) with masks replayed from the generator's state; ``"always"`` (saved masks),
#: ``"replay"`` and ``"never"`` are for tests and benchmarks (not a user option: "auto" is the
#: contract).
DROPOUT_REWRITE: Literal["auto", "always", "replay", "never"] = "auto"

#: Planned fragments compute cross-entropy heads in place (rewrites/losshead.py); ``False`` is for
#: tests and benchmarks that compare against the aten ops.
LOSS_HEAD_IN_PLACE = True

#: Planned fragments compute dying gradients' elementwise ops in place (rewrites/inplace.py), with
#: the eager inner compiler (Inductor reuses such buffers itself); ``False`` is for tests and
#: benchmarks that compare against the out-of-place ops.
ELEMENTWISE_IN_PLACE = True

#: A plan over its budget writes elementwise results into values of the built graphs' own that
#: die there (rewrites/inplace.py, ``built=True``) where that lowers the exact profile; ``False``
#: is for tests and benchmarks that compare.
BUILT_IN_PLACE = True

#: A plan still over its budget makes elementwise results a block of rows at a time from
#: operands that then exist a block at a time (rewrites/tiling.py) where that lowers the exact
#: profile and each distinct chain probes bit-identical; ``False`` is for tests and benchmarks
#: that compare.
ROW_TILING = True

#: A plan over its budget makes backward values again for their late readers where that lowers
#: the backward's exact profile (rewrites/rematerialize.py); ``False`` is for tests and benchmarks
#: that compare.
REMATERIALIZE = True

#: A fragment no plan fits makes its cross-entropy heads by blocks, the logits never whole
#: (rewrites/linearce.py), where the blocks probe bit-identical; it costs two more matmuls of the
#: head's size, so only then. ``False`` is for tests and benchmarks that compare.
LINEAR_CE_BLOCKS = True

#: The pilot predicts and prefetches inside each forward graph (rewrites/pilot_prefetch.py);
#: ``False`` leaves the prediction at the fragment's tail, for tests and benchmarks that compare.
PILOT_IN_GRAPH = True

#: Why ``pilot="auto"`` stays off for a CUDA model with parameters on the host (the report says
#: it). Measured on an H200 host (benchmarks/results/dynamic_prefetch_cuda.md): each prefetched
#: tensor costs the host ~65 us of CUDA calls (a synchronous copy ~24 us), so on the zoo MoE the
#: pilot hid most of the copies' GPU time yet made the step slower than fetching on demand.
CUDA_AUTO_PILOT_OFF = (
    "on CUDA the pilot prefetches only when asked for (pilot='markov' or 'lightgbm'): issuing "
    "its copies costs the host more than they hid on the measured MoE"
)
#: Why it stays off on the CPU device: there a copy runs on the thread that computes, so a
#: prefetched copy takes as long as the on-demand one it replaces and hides nothing, and the
#: predictions, the cache and the copies of mispredicted blocks are added time (the small zoo
#: MoE, benchmarks/results/dynamic_prefetch.md: 61.1 ms a step with the pilot in its graphs,
#: 46.9 ms fetching on demand), besides the budget its cache reserves.
CPU_AUTO_PILOT_OFF = (
    "on the CPU device the pilot prefetches only when asked for (pilot='markov' or "
    "'lightgbm', e.g. for its simulated GPU stall): a copy there cannot overlap compute, so "
    "prefetching adds step time and hides none"
)

#: Step compositions remembered as already checked against the budget (then forgotten).
_MAX_CHECKED_STEPS = 4096
#: Profiles kept per fragment for the sizes its calls had (dynamic shapes).
_MAX_SIZE_PROFILES = 256

# A step that never sees a backward (inference loops) is cut at this many calls.
_MAX_STEP_EVENTS = 100_000

_all_compilers: weakref.WeakSet[MemCompiler] = weakref.WeakSet()

#: Dynamo's recompile limit for a model memcompile sees is dynamic (when the limit is still
#: torch's default): MoE expert graphs, early exits and trees recompile for new shapes/paths.
DYNAMIC_RECOMPILE_LIMIT = 64


def _apply_dynamo_settings() -> None:
    # An empty resume graph otherwise makes Dynamo skip a *shared* resume frame for good, running
    # every later call eagerly (research/04, "no ops traced"); empty graphs cost nothing here.
    if not torch._dynamo.config.allow_empty_graphs:
        log.debug("setting torch._dynamo.config.allow_empty_graphs = True")
        torch._dynamo.config.allow_empty_graphs = True


def _view_storages(args: Sequence[Any], positions: Sequence[int]) -> dict[int, int]:
    """:data:`ViewStorages` of one call: the storages of its inputs at ``positions``."""
    out: dict[int, int] = {}
    for i in positions:
        t = args[i] if i < len(args) else None
        if isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            out[storage.data_ptr()] = storage.nbytes()
    return out


def _frame_location(frame: Any) -> str:
    return f"{frame.name} ({frame.filename}:{frame.lineno})" if frame is not None else "<unknown>"


def _code_location(code: CodeType | None) -> str:
    if code is None:
        return "<unknown>"
    return f"{code.co_name} ({code.co_filename}:{code.co_firstlineno})"


def _compiling_code() -> CodeType | None:
    """The code object Dynamo is compiling (``None`` outside a Dynamo compile)."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    try:
        return InstructionTranslator.current_tx().f_code
    except AttributeError:  # no translator on this thread: the backend was called directly
        return None


def _profiler_enabled() -> bool:
    return torch.autograd.profiler._is_profiler_enabled


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


def _cap_note(cap: int | None) -> str:
    """``", saved <= 12.00 KiB"`` for a re-plan's saved-set cap, ``""`` without one."""
    return "" if cap is None else f", saved <= {format_bytes(cap)}"


class _FragmentBuild:
    """Closure state shared by one fragment's partition_fn and compilers (bw compiles lazily)."""

    def __init__(self, compiler: MemCompiler, index: int, example_inputs: Sequence[Any]) -> None:
        self.compiler = compiler
        self.index = index
        self.example_inputs = list(example_inputs)
        #: The fragment's device, read before any of its parameters moves to the host tier.
        self.device = _device_of(example_inputs)
        self.stats = FragmentStats()
        self.profile: FragmentProfile | None = None
        self.plan: FragmentPlan | None = None
        self._fw_gm: fx.GraphModule | None = None
        self.static_inputs: tuple[int, ...] = ()
        #: (input position, dim or -1 for a SymInt input, sympy symbol) of each size symbol of
        #: the forward graph's inputs: a call's values of them are its size key.
        self.size_slots: tuple[tuple[int, int, Any], ...] = ()
        self._profile_args: dict[str, Any] = {}
        self._sized_profiles: dict[SizeKey, FragmentProfile] = {}
        # Inputs the graphs fetch from the host tier (host-placed parameters and their aliases).
        self.hosted_inputs: tuple[int, ...] = ()
        #: Position of each input that is an alias of another input -> that input's position
        #: (one placeholder per read, rewrites/input_uses.py). An alias of a host-placed
        #: parameter is fetched like it; only the parameter itself moves to the host tier.
        self.alias_sources: dict[int, int] = {}
        #: Positions of inputs whose several contributions the backward graph sums (parameters
        #: not split, several-edge reads): ``MemCompiler._check_grad_order`` watches them.
        self.summed_inputs: tuple[int, ...] = ()
        # block key -> parameter storages (address -> bytes) of the calls with that key
        self.blocks: dict[int, dict[int, int]] = {}
        # block key -> storage address of each parameter/buffer input, by position
        self.block_inputs: dict[int, dict[int, int]] = {}
        # Bytes this fragment's plan leaves to the pilot's prefetch cache (dynamic/prefetch.py).
        self.prefetch_reserve = 0
        self._bw_gm: fx.GraphModule | None = None
        #: A re-plan (planning/replan.py): what the rest of the step holds at this fragment's
        #: worst call, from the step's prediction; ``None``: planned as a new fragment.
        self.replan_resident: int | None = None
        #: A re-plan's cap on the bytes the plan holds from forward to backward (saved sets held
        #: while other fragments run); ``None``: no cap.
        self.replan_saved_cap: int | None = None
        #: Re-planned by the round that put the step's parameters on the host: planned as a
        #: new fragment, but the step's check, not this plan, says whether the step fits.
        self.host_replan = False
        #: Positions among the forward's outputs of user outputs a step showed the caller drops
        #: before the backward: planned and profiled as not held (``MemCompiler``'s
        #: ``_check_dropped_outputs``).
        self.dropped_outputs: frozenset[int] = frozenset()
        #: Tensors the previous plan of this graph kept (a re-plan for dropped outputs): the
        #: search starts from them too, so the new plan, with less held, is no worse.
        self.replan_start: tuple[str, ...] = ()
        #: Names of incoming gradients a step showed no one else holds through the backward
        #: (AOTAutograd's zeros for outputs without a gradient): planned and profiled as freed
        #: after their last reader.
        self.released_tangents: frozenset[str] = frozenset()
        #: The joint models of the graphs one partition plans, by graph (``_joint_model``);
        #: emptied when it is done.
        self._models: dict[int, tuple[fx.GraphModule, JointModel]] = {}

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
        config = self.compiler.config
        if (
            config.budget is None
            and not config.reorder
            and config.offload_params is not True
            and not self._host_placed()
        ):
            fw, bw = default_partition(
                joint,
                joint_inputs,
                num_fwd_outputs=num_fwd_outputs,
                static_lifetime_input_indices=static_lifetime_input_indices,
                **kwargs,
            )
        else:
            try:
                fw, bw = self._planned_partition(
                    joint, num_fwd_outputs, static_lifetime_input_indices or []
                )
            finally:
                self._models.clear()
        self._bw_gm = bw
        return fw, bw

    # -- host-placed parameters -------------------------------------------------------------
    def _host_placed(self) -> list[int]:
        """Positions of inputs already in the host tier (placed by an earlier fragment), with
        their aliases."""
        placed = [
            i
            for i, t in enumerate(self.example_inputs)
            if i not in self.alias_sources and isinstance(t, torch.Tensor) and is_host_placed(t)
        ]
        return self._with_aliases(placed)

    def _with_aliases(self, positions: Sequence[int]) -> list[int]:
        """``positions`` and the positions of the aliases of those inputs."""
        chosen = set(positions)
        return [*positions, *(j for j, i in self.alias_sources.items() if i in chosen)]

    def _own_inputs(self, positions: Sequence[int]) -> tuple[int, ...]:
        """``positions`` without the aliases (the tensors that move to the host tier)."""
        return tuple(i for i in positions if i not in self.alias_sources)

    def _realias(self, hosted: Sequence[int]) -> None:
        """Point the example aliases of the parameters just moved to the host tier at their
        host storage: the old ones would keep the device copies alive."""
        inputs = self.example_inputs
        for j, i in self.alias_sources.items():
            if i in hosted:
                inputs[j] = torch.ops.aten.alias.default(inputs[i])

    def _host_candidates(self, static: Sequence[int]) -> list[int]:
        """Parameters of this fragment that may move to the host tier (CPU or CUDA leaf
        parameters that cover their storage, see ``store.place_on_host``, not already there),
        with their aliases."""
        out = []
        for i in static:
            t = self.example_inputs[i] if i < len(self.example_inputs) else None
            if isinstance(t, torch.Tensor) and self.compiler.may_host(t) and not is_host_placed(t):
                out.append(i)
        return self._with_aliases(out)

    def _fetch_params(
        self, joint: fx.GraphModule, num_fwd_outputs: int, primals: Sequence[int]
    ) -> fx.GraphModule:
        return param_fetch_pass(
            joint,
            PassContext(fragment=f"F{self.index}", graph="joint"),
            primals=primals,
            num_fwd_outputs=num_fwd_outputs,
            device=self.device or torch.device("cpu"),
            store=self.compiler.store_key,
        )

    def _planned_partition(
        self, joint: fx.GraphModule, num_fwd_outputs: int, static: Sequence[int]
    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        # Without a budget the plan keeps eager's saved set and only reorders (it costs nothing).
        config, compiler = self.compiler.config, self.compiler
        ctx = PassContext(fragment=f"F{self.index}", graph="joint")
        traced = joint
        joint = self._in_place(joint, ctx)
        # Host placement needs the joint graph's primals to be the fragment's inputs, in order
        # (AOTAutograd may rewrite them, e.g. for mutated inputs that alias each other).
        aligned = len(
            [p for p in joint.graph.find_nodes(op="placeholder") if not P._is_tangent(p)]
        ) == len(self.example_inputs)
        if not aligned and config.offload_params is True:
            warnings.warn(
                f"memcompile: F{self.index}: AOTAutograd changed this fragment's inputs, so its "
                "parameters stay on the device (offload_params=True)",
                MemoryBudgetWarning,
                stacklevel=2,
            )
        placed = self._host_placed() if aligned else []
        if placed:  # another fragment moved some of these parameters: fetch them here too
            joint = self._fetch_params(joint, num_fwd_outputs, placed)
        model, plan = self._plan(joint, num_fwd_outputs, static, start=self.replan_start)
        # The joint graph with its loss heads made by blocks, for a plan that does not fit:
        # tried below where nothing else fits (it costs two matmuls of the head's size, or
        # three copies of its log-softmax to the host tier and back).
        blocked: fx.GraphModule | None = None
        if config.budget is not None and not plan.feasible and LINEAR_CE_BLOCKS:
            # With the host tier allowed, a head may keep its log-softmax there (cheaper than
            # making the logits again where copies cost less than matmuls: a CPU).
            host_tier = config.swap and config.offload_to == "host"
            heads = find_linear_ce(
                traced,
                ctx,
                host_profile=compiler.cost_profile(self.example_inputs) if host_tier else None,
            )
            if heads:
                blocked = self._in_place(linear_ce_pass(traced, ctx, decided=heads), ctx)
                if placed:
                    blocked = self._fetch_params(blocked, num_fwd_outputs, placed)
        mode = DROPOUT_REWRITE
        if config.budget is not None and config.recompute and mode != "never":
            # Dropout outputs (and all that is computed from them) become recomputable once
            # rebuilt from the saved mask, and the masks too once replayed from the generator's
            # state; each costs forward time, so only when needed, the cheaper first.
            original, plain = joint, plan
            kept = [d.tensor for d in plain.decisions if d.action != "recompute"]
            for replay in (False, True):
                forced = mode == ("replay" if replay else "always")
                if not forced and (plan.feasible or mode != "auto"):
                    continue
                rewritten = dropout_pass(original, ctx, replay=replay)
                rewrites = rewritten.meta["memcompile_dropouts"]
                if not rewrites or (replay and all(r.state is None for r in rewrites)):
                    continue
                # The search also starts from the plain plan's choices carried over (greedy
                # ends depend on the start: seen 75.4 MB from eager's set, 65.4 MB from there).
                start = saved_after(kept, rewrites)
                model2, plan2 = self._plan(rewritten, num_fwd_outputs, static, start=start)
                log.info(
                    "F%d: with recomputable dropouts%s the plan peaks at %s (%s without)",
                    self.index,
                    " and replayed masks" if replay else "",
                    format_bytes(plan2.predicted_peak),
                    format_bytes(plan.predicted_peak),
                )
                better = plan2.feasible or plan2.predicted_peak < plan.predicted_peak
                if better or forced:
                    joint, model, plan = rewritten, model2, plan2
        hosted: list[int] = []
        host_reserve = 0  # the prefetch reserve the plan with parameters on the host leaves
        host_peak: int | None = None  # the plan with parameters on the host, when tried
        candidates = self._host_candidates(static) if aligned else []
        wants = config.offload_params is True or (
            config.offload_params == "auto"
            and config.budget is not None
            and (not plan.feasible or compiler.host_step)
        )
        if wants and candidates:
            # Parameters to the host tier: their bytes leave the resident set, and each reader
            # fetches its own copy (rewrites/params.py); "auto" only when nothing else fits.
            fetched = self._fetch_params(joint, num_fwd_outputs, candidates)
            model2, plan2 = self._plan(fetched, num_fwd_outputs, static, host=candidates)
            if not plan2.feasible and blocked is not None:
                # Neither plan fits: with the parameters on the host the head may be what
                # is left (its matmuls cost less than a plan that does not fit).
                fetched3 = self._fetch_params(blocked, num_fwd_outputs, candidates)
                model3, plan3 = self._plan(fetched3, num_fwd_outputs, static, host=candidates)
                log.info(
                    "F%d: with its loss heads made by blocks and the parameters on the host the "
                    "plan peaks at %s (%s without blocks)",
                    self.index,
                    format_bytes(plan3.predicted_peak),
                    format_bytes(plan2.predicted_peak),
                )
                if plan3.feasible:
                    fetched, model2, plan2 = fetched3, model3, plan3
            host_peak = plan2.predicted_peak
            log.info(
                "F%d: with %d parameters on the host the plan peaks at %s (%s without)",
                self.index,
                len(self._own_inputs(candidates)),
                format_bytes(plan2.predicted_peak),
                format_bytes(plan.predicted_peak),
            )
            reserve = self._reserve(candidates)
            if config.offload_params == "auto" and not plan2.feasible and reserve:
                # The pilot's reserve is a speed-up, the host tier what fits: rather than keep
                # the parameters on the device over the budget, give the cache what is left.
                room, bare_model, bare = self._room_without_reserve(
                    fetched, num_fwd_outputs, static, candidates
                )
                if room is not None:
                    reserve = min(reserve, room)
                    # (No room left: the plan without a reserve is the one that measured it.)
                    model2, plan2 = (
                        self._plan(
                            fetched, num_fwd_outputs, static, host=candidates, reserve=reserve
                        )
                        if reserve
                        else (bare_model, bare)
                    )
                    log.info(
                        "F%d: the pilot's prefetch reserve is cut to %s for the host tier to "
                        "fit (plan peaks at %s)",
                        self.index,
                        format_bytes(reserve),
                        format_bytes(plan2.predicted_peak),
                    )
            if (
                config.offload_params is True
                or plan2.feasible
                or plan2.predicted_peak < plan.predicted_peak
            ):
                joint, model, plan, hosted = fetched, model2, plan2, candidates
                host_reserve = reserve
        self.prefetch_reserve = host_reserve if hosted else self._reserve(hosted)
        if config.budget is not None and not plan.feasible and self.prefetch_reserve:
            # The same for parameters an earlier fragment put on the host (the GRU's longer
            # buckets: a 196 KiB reserve in a 144 KiB budget): the reserve is a speed-up and
            # gives way to what fits, and to nothing where nothing fits (the smallest plan).
            room, model, plan = self._room_without_reserve(joint, num_fwd_outputs, static, hosted)
            reserve = 0 if room is None else min(self.prefetch_reserve, room)
            if reserve:  # else the plan without a reserve is this one
                model, plan = self._plan(
                    joint, num_fwd_outputs, static, host=hosted, reserve=reserve
                )
            log.info(
                "F%d: the pilot's prefetch reserve is cut from %s to %s: the plan does not fit "
                "with it (plan peaks at %s)",
                self.index,
                format_bytes(self.prefetch_reserve),
                format_bytes(reserve),
                format_bytes(plan.predicted_peak),
            )
            self.prefetch_reserve = reserve
        # Building the graphs changes nothing outside them: an infeasible plan still raises
        # below with the parameters untouched.
        fw, bw, plan = self._build(joint, model, plan, static, num_fwd_outputs)
        if not plan.feasible and self.replan_resident is None:
            # The rewrites of a plan over its target (in place, blocks of rows, reloads by
            # rows) act on what the plan recomputes and what it swaps differently, which the
            # planner does not price: a plan with one of the two only may end lower.
            tried = self._with_alternatives(
                joint, num_fwd_outputs, static, hosted, (fw, bw, model, plan)
            )
            # Then the loss heads by blocks, where nothing else fits (their matmuls are not in
            # the plans' times) and the joint model's peak was not theirs: the rewrites of the
            # built graphs may bring the rest below the head (bench GPT, parameters on the
            # host: 22.9 MiB planned either way, 20.05 MiB built, 16 MiB of it the head).
            other, by_blocks = None, []
            fits = any(t[3].feasible for t in tried)
            if not fits and blocked is not None and not joint.meta.get("memcompile_linear_ce"):
                other = self._fetch_params(blocked, num_fwd_outputs, hosted) if hosted else blocked
                by_blocks = self._with_blocks(other, num_fwd_outputs, static, hosted, plan)
                tried += by_blocks
            # One that fits, the least predicted time (copies counted as not hidden); else
            # the lowest peak.
            chosen = min(
                tried,
                key=lambda t: (
                    not t[3].feasible,
                    t[3].recompute_time + t[3].swap_time if t[3].feasible else 0.0,
                    t[3].predicted_peak,
                ),
            )
            fw, bw, model, plan = chosen
            if other is not None and any(chosen is t for t in by_blocks):
                joint = other
        if not plan.feasible:
            held = sum(model.nbytes[s] for s in model.held_outputs)
            compiler.infeasible(
                self, plan, hosted=bool(hosted), host_peak=host_peak, held_outputs=held
            )
        self.hosted_inputs = tuple(hosted) + tuple(placed)
        compiler.planned_reserve(self, tuple(hosted) + tuple(placed))
        if hosted:  # only now: an infeasible plan raised above with the parameters untouched
            with _disable_current_modes():  # partitioning runs under the fake mode
                compiler.host_params_pinned |= self.device is not None and (
                    self.device.type == "cuda"
                )
                moved = sum(
                    compiler.move_to_host(self.example_inputs[i]) for i in self._own_inputs(hosted)
                )
                self._realias(hosted)
            compiler.host_param_bytes += moved
            log.info(
                "F%d: %d parameters (%s) moved to the host tier",
                self.index,
                len(self._own_inputs(hosted)),
                format_bytes(moved),
            )
        heads = joint.meta.get("memcompile_linear_ce", ())
        if heads:
            plan = dataclasses.replace(plan, linear_ce=tuple(h.describe() for h in heads))
        if self.hosted_inputs:
            names = [p.name for p in joint.graph.find_nodes(op="placeholder")]
            plan = dataclasses.replace(
                plan, host_params=tuple(names[i] for i in sorted(self.hosted_inputs))
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
        return fw, bw

    def _in_place(self, joint: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
        """``joint`` with its loss heads and its dying gradients' elementwise ops computed in
        place (the same kernels: always)."""
        config = self.compiler.config
        if LOSS_HEAD_IN_PLACE:
            # Under a budget in 16 blocks of rows (least scratch); without one in blocks big
            # enough that their calls cost no time.
            min_block = (
                min_block_bytes(self.compiler.cost_profile(self.example_inputs))
                if config.budget is None
                else 0
            )
            joint = loss_head_pass(joint, ctx, min_block_bytes=min_block)
        if ELEMENTWISE_IN_PLACE and config.inner == "eager":
            joint = in_place_pass(joint, ctx)  # the same kernels, writing into dying gradients
        return joint

    def _build(
        self,
        joint: fx.GraphModule,
        model: JointModel,
        plan: FragmentPlan,
        static: Sequence[int],
        num_fwd_outputs: int,
    ) -> tuple[fx.GraphModule, fx.GraphModule, FragmentPlan]:
        """The forward and backward graphs of ``plan`` (partitioned, swaps inserted), and for
        a plan over its target the rewrites that may still bring it under (``plan`` with the
        peak they reach). Changes nothing outside the graphs."""
        config, compiler = self.compiler.config, self.compiler
        ctx = PassContext(fragment=f"F{self.index}", graph="joint")
        fw, bw = partition_pass(joint, ctx, model=model, plan=plan)
        if plan.swapped:
            saved = {
                model.storage_named(d.tensor) for d in plan.decisions if d.action != "recompute"
            }
            by_storage = {model.storage_named(n): tier for n, tier in plan.swapped.items()}
            holders = model.swap_holders(saved, by_storage)
            swaps = {holders[s]: tier for s, tier in by_storage.items()}
            fw, bw = swap_pass(fw, bw, ctx, swaps=swaps, store=compiler.store_key)
        # Not in a re-plan (planning/replan.py): its caps share the budget between fragments
        # by the joint model's figures, which do not price the splits.
        if not plan.feasible and self.replan_resident is None:
            split = (
                tuple(static),
                model.num_mutated_outputs,
                num_fwd_outputs - model.num_mutated_outputs,
            )
            if BUILT_IN_PLACE and config.inner == "eager":
                fw, bw, plan = self._built_rewrite(
                    fw,
                    bw,
                    plan,
                    split,
                    functools.partial(in_place_pass, built=True),
                    "elementwise results written into the graphs' own dying values",
                )
            if not plan.feasible and ROW_TILING and config.inner == "eager":
                fw, bw, plan = self._tiled(fw, bw, plan, split)
                tiled = tuple(
                    f"{graph}:{t.node}"
                    for graph, gm in (("forward", fw), ("backward", bw))
                    for t in gm.meta.get("memcompile_row_tiles", ())
                )
                plan = dataclasses.replace(plan, row_tiled=tiled)
            if not plan.feasible and REMATERIALIZE:
                plan = self._rematerialize(fw, bw, plan, split)
        return fw, bw, plan

    def _plan(
        self,
        joint: fx.GraphModule,
        num_fwd_outputs: int,
        static: Sequence[int],
        *,
        host: Sequence[int] = (),
        start: Collection[str] = (),
        reserve: int | None = None,
        swap: bool = True,
        recompute: bool = True,
        floor: bool = False,
    ) -> tuple[JointModel, FragmentPlan]:
        """The joint model of ``joint`` and the planner's plan for this fragment's target, with
        the inputs at positions ``host`` counted as host-placed (not resident); ``start``: a
        saved set the search also starts from (``planner.search_saved_set``); ``reserve``: the
        prefetch cache's share of the budget (``None``: :meth:`_reserve`'s); ``swap=False``:
        recompute only, whatever the ``swap`` option; ``recompute=False``: swap only, whatever
        the ``recompute`` option; ``floor``: searched for the smallest peak (a target of 0),
        feasible where that peak meets the budget."""
        config, compiler = self.compiler.config, self.compiler
        model = self._joint_model(joint, num_fwd_outputs, static)
        if reserve is None:
            reserve = self._reserve(host)
        resident = compiler.resident_bytes(self, host=host) + reserve
        target = None if config.budget is None else config.budget - resident
        plan = plan_fragment(
            model,
            target=0 if floor and target is not None else target,
            resident_bytes=resident,
            recompute=config.recompute and recompute,
            swap_tier=config.offload_to if config.swap and swap else None,
            reorder=config.reorder,
            start=start,
            saved_cap=self.replan_saved_cap,
        )
        if floor and target is not None:
            plan = dataclasses.replace(
                plan,
                target=target,
                feasible=plan.predicted_peak - resident <= target
                and (plan.saved_cap is None or plan.held_bytes <= plan.saved_cap),
            )
        return model, plan

    def _joint_model(
        self, joint: fx.GraphModule, num_fwd_outputs: int, static: Sequence[int]
    ) -> JointModel:
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
        _, bw_outs, _, _ = P._extract_fwd_bwd_outputs(joint, num_fwd_outputs=num_fwd_outputs)
        grads = [o.meta.get("val") if isinstance(o, fx.Node) else None for o in bw_outs]
        model = JointModel(
            joint,
            num_fwd_outputs=num_fwd_outputs,
            static_input_indices=static,
            profile=self.compiler.cost_profile(primals),
            workspace=probe_workspaces(joint),
            clone_bytes=accumulate_clone_bytes(grads, primals, set(static), clone_workspace),
            dropped_outputs=self.dropped_outputs,
            released_tangents=self.released_tangents,
        )
        self._models[id(joint)] = (joint, model)
        return model

    def _with_blocks(
        self,
        joint: fx.GraphModule,
        num_fwd_outputs: int,
        static: Sequence[int],
        hosted: Sequence[int],
        planned: FragmentPlan,
    ) -> list[tuple[fx.GraphModule, fx.GraphModule, JointModel, FragmentPlan]]:
        """The plan of ``joint`` (its loss heads made by blocks, ``rewrites/linearce.py``) built
        with the rewrites, and while none fits its alternatives (:meth:`_alternatives`);
        ``planned``: the plan without blocks, for the log."""
        model, plan = self._plan(
            joint, num_fwd_outputs, static, host=hosted, reserve=self.prefetch_reserve
        )
        fw, bw, plan = self._build(joint, model, plan, static, num_fwd_outputs)
        log.info(
            "F%d: with its loss heads made by blocks the built plan peaks at %s (%s without)",
            self.index,
            format_bytes(plan.predicted_peak),
            format_bytes(planned.predicted_peak),
        )
        return self._with_alternatives(
            joint, num_fwd_outputs, static, hosted, (fw, bw, model, plan)
        )

    def _with_alternatives(
        self,
        joint: fx.GraphModule,
        num_fwd_outputs: int,
        static: Sequence[int],
        hosted: Sequence[int],
        built: tuple[fx.GraphModule, fx.GraphModule, JointModel, FragmentPlan],
    ) -> list[tuple[fx.GraphModule, fx.GraphModule, JointModel, FragmentPlan]]:
        """``built`` (a plan of ``joint`` built with the rewrites), and while it does not fit
        its :meth:`_alternatives`, then those searched for the smallest peak."""
        tried = [built]
        if built[3].feasible:
            return tried
        tried += self._alternatives(joint, num_fwd_outputs, static, hosted, tried)
        # Also with no room at all (a target of 0 or less): the plan for such a target is
        # searched from other starts than the floor's searches (the dropouts' saved set), and
        # the rewrites take the two elsewhere (bench GPT, recompute only, a 1000 B budget:
        # 52.40 MiB as planned, 50.82 MiB searched for the smallest peak). A floor plan whose
        # decisions were tried already is not built again.
        if not any(t[3].feasible for t in tried):
            tried += self._alternatives(joint, num_fwd_outputs, static, hosted, tried, floor=True)
        return tried

    def _alternatives(
        self,
        joint: fx.GraphModule,
        num_fwd_outputs: int,
        static: Sequence[int],
        hosted: Sequence[int],
        tried: Sequence[tuple[fx.GraphModule, fx.GraphModule, JointModel, FragmentPlan]],
        *,
        floor: bool = False,
    ) -> list[tuple[fx.GraphModule, fx.GraphModule, JointModel, FragmentPlan]]:
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
        config = self.compiler.config
        planned = tried[0][3]
        seen = {t[3].decisions for t in tried}
        built: list[tuple[fx.GraphModule, fx.GraphModule, JointModel, FragmentPlan]] = []
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
            model2, plan2 = self._plan(
                joint,
                num_fwd_outputs,
                static,
                host=hosted,
                reserve=self.prefetch_reserve,
                swap=swap,
                recompute=recompute,
                floor=floor,
            )
            if plan2.decisions in seen:
                continue
            seen.add(plan2.decisions)
            fw2, bw2, plan2 = self._build(joint, model2, plan2, static, num_fwd_outputs)
            log.info(
                "F%d: %s%s, the plan peaks at %s (%s as planned)",
                self.index,
                what,
                " and searched for the smallest peak" if floor else "",
                format_bytes(plan2.predicted_peak),
                format_bytes(planned.predicted_peak),
            )
            built.append((fw2, bw2, model2, plan2))
        return built

    def _room_without_reserve(
        self,
        fetched: fx.GraphModule,
        num_fwd_outputs: int,
        static: Sequence[int],
        host: Sequence[int],
    ) -> tuple[int | None, JointModel, FragmentPlan]:
        """Bytes the plan of ``fetched`` (parameters at ``host`` on the host) leaves under the
        budget with no prefetch reserve (``None``: it does not fit even so), and that plan."""
        budget = self.compiler.config.budget
        model, bare = self._plan(fetched, num_fwd_outputs, static, host=host, reserve=0)
        if budget is None or not bare.feasible:
            return None, model, bare
        return max(0, budget - bare.predicted_peak), model, bare

    def _built_profiler(
        self, fw: fx.GraphModule, bw: fx.GraphModule, split: tuple[tuple[int, ...], int, int]
    ) -> Callable[[fx.GraphModule, fx.GraphModule], FragmentProfile]:
        """Exact profiles of rewrites of the built graphs ``fw`` and ``bw``: the kernel scratch
        measured on them, a copy's that of its original (the same op on the same metadata).
        ``split``: see :meth:`_rematerialize`."""
        return self._profiler_of(*self._built_workspaces(fw, bw, split))

    @staticmethod
    def _profiler_of(
        args: dict[str, Any], ws: Callable[[str, fx.GraphModule], dict[str, int]]
    ) -> Callable[[fx.GraphModule, fx.GraphModule], FragmentProfile]:
        """:meth:`_built_profiler` from :meth:`_built_workspaces`' answer."""

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

    def _built_backward_profiler(
        self,
        fw: fx.GraphModule,
        built: tuple[dict[str, Any], Callable[[str, fx.GraphModule], dict[str, int]]],
    ) -> Callable[[fx.GraphModule], GraphProfile]:
        """:meth:`_built_profiler`'s backward profile of rewrites of the built backward alone
        (``fw`` as built; ``built``: :meth:`_built_workspaces` of both): the forward profiled
        once (``fragment.backward_profiler``)."""
        args, ws = built
        profile = backward_profiler(
            fw,
            static_input_indices=args["static_input_indices"],
            num_mutated_inputs=args["num_mutated_inputs"],
            num_user_outputs=args["num_user_outputs"],
            forward_workspace=ws("forward", fw),
            released_tangents=args["released_tangents"],
        )
        return lambda b: profile(b, ws("backward", b))

    def _built_workspaces(
        self, fw: fx.GraphModule, bw: fx.GraphModule, split: tuple[tuple[int, ...], int, int]
    ) -> tuple[dict[str, Any], Callable[[str, fx.GraphModule], dict[str, int]]]:
        """The profile arguments of the built graphs less their workspaces, and the workspace
        of a rewrite of either graph: each node's measured one, a copy's that of its
        original (the same op on the same metadata)."""
        args = self._profile_args_of(fw, bw, split=split)
        measured = {
            graph: dict(args.pop(f"{graph}_workspace") or {}) for graph in ("forward", "backward")
        }

        def workspace(graph: str, g: fx.GraphModule) -> dict[str, int]:
            return {
                n.name: measured[graph].get(n.meta.get("memcompile_copy_of", n.name), 0)
                for n in g.graph.nodes
            }

        return args, workspace

    def _built_rewrite(
        self,
        fw: fx.GraphModule,
        bw: fx.GraphModule,
        plan: FragmentPlan,
        split: tuple[tuple[int, ...], int, int],
        rewrite: Callable[[fx.GraphModule, PassContext], fx.GraphModule],
        what: str,
    ) -> tuple[fx.GraphModule, fx.GraphModule, FragmentPlan]:
        """``fw``, ``bw`` and ``plan`` (over its target) after ``rewrite`` of both built graphs,
        when that lowers a phase's exact peak (else as they were). The joint model the planner
        searched with does not see these rewrites, so only a plan over its target tries them
        (as :meth:`_rematerialize`): ``inplace.in_place_pass(built=True)`` writes elementwise
        results into the graphs' own dying values (a value the plan recomputes for the
        backward, rather than saves, is the graph's own in both graphs);
        ``tiling.row_tile_pass`` makes elementwise results a block of rows at a time. ``what``
        names the rewrite in the log."""
        target = plan.target
        if target is None or (plan.saved_cap is not None and plan.held_bytes > plan.saved_cap):
            return fw, bw, plan
        fw2 = rewrite(fw, PassContext(f"F{self.index}", "forward"))
        bw2 = rewrite(bw, PassContext(f"F{self.index}", "backward"))
        if fw2 is fw and bw2 is bw:
            return fw, bw, plan
        before = max(self._built_profiler(fw, bw, split)(fw, bw).phase_peaks().values())
        # Probed as rewritten: an out= kernel may need a temporary its original did not.
        after = max(self._built_profiler(fw2, bw2, split)(fw2, bw2).phase_peaks().values())
        if after >= before:
            return fw, bw, plan
        log.info(
            "F%d: %s: the step peaks at %s (%s without; budget %s)",
            self.index,
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

    def _tiled(
        self,
        fw: fx.GraphModule,
        bw: fx.GraphModule,
        plan: FragmentPlan,
        split: tuple[tuple[int, ...], int, int],
    ) -> tuple[fx.GraphModule, fx.GraphModule, FragmentPlan]:
        """:meth:`_built_rewrite` with row tiling: first with no matmul made again by the
        blocks (a value kept whole for another reader is read whole instead), which costs no
        time; where that does not fit, also with them, and the lower peak is kept."""
        best = None
        search = _TilingSearch()
        for kept in sorted({0, MAX_KEPT_MATMULS}):
            if kept and _same_tilings(fw, bw, kept, search):
                break  # no op's blocks would make a matmul again: the same rewrite
            found = self._built_rewrite(
                fw,
                bw,
                plan,
                split,
                functools.partial(_tile_rows, max_kept_matmuls=kept, search=search),
                f"elementwise ops made by blocks of rows ({kept} matmuls made again)",
            )
            if best is None or found[2].predicted_peak < best[2].predicted_peak:
                best = found
            if best[2].feasible:
                break
        assert best is not None
        return best

    def _rematerialize(
        self,
        fw: fx.GraphModule,
        bw: fx.GraphModule,
        plan: FragmentPlan,
        split: tuple[tuple[int, ...], int, int],
    ) -> FragmentPlan:
        """``plan`` (over its target) after making backward values again for their late
        readers where that lowers the backward's exact profile (``rematerialize.py``); ``bw``
        is rewritten in place. The plan fits afterwards if every phase meets the target.
        ``split``: the static inputs, the forward's leading outputs that are mutated inputs,
        and the user outputs after them (AOT's metadata is not there yet while partitioning)."""
        target = plan.target
        if target is None or (plan.saved_cap is not None and plan.held_bytes > plan.saved_cap):
            return plan
        # The kernel scratch is probed once (it runs every kernel) for both profilers.
        workspaces = self._built_workspaces(fw, bw, split)
        built = self._profiler_of(*workspaces)

        def profile(g: fx.GraphModule) -> FragmentProfile:
            return built(fw, g)

        before = profile(bw)
        if before.backward is None or before.phase_peaks()["backward"] <= target:
            return plan
        ctx = PassContext(fragment=f"F{self.index}", graph="backward")
        # Each trial profiles a rewrite of the backward only (the forward once, not per trial).
        backward = self._built_backward_profiler(fw, workspaces)
        splits = plan_rematerialize(
            bw, ctx, backward, target=target - before.held_output_bytes, start=before.backward
        )
        if not splits:
            return plan
        rematerialize_pass(bw, ctx, splits=splits)
        after = max(profile(bw).phase_peaks().values())
        moved = sum(r.moved for r in splits)
        log.info(
            "F%d: %d backward values made again for their late readers, %d moved to them: the "
            "step peaks at %s (%s without; budget %s)",
            self.index,
            len(splits) - moved,
            moved,
            format_bytes(plan.resident_bytes + after),
            format_bytes(plan.resident_bytes + max(before.phase_peaks().values())),
            format_bytes(plan.resident_bytes + target),
        )
        return dataclasses.replace(
            plan,
            predicted_peak=min(plan.predicted_peak, plan.resident_bytes + after),
            feasible=after <= target,
            rematerialized=tuple((r.node, r.before) for r in splits),
        )

    def _reserve(self, host: Sequence[int]) -> int:
        """The prefetch cache's share of the budget if this fragment fetches the inputs at
        ``host`` (and those already in the host tier); see dynamic/prefetch.py."""
        compiler = self.compiler
        if not compiler.pilot_plans():
            return 0
        storages = {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for i in (*host, *self._host_placed())
            if isinstance(t := self.example_inputs[i], torch.Tensor)
        }
        own_bytes = sum(storages.values())
        return compiler.config.prefetch_depth * max(compiler.max_block_host_bytes, own_bytes)

    def _profile(self, gm: fx.GraphModule, bw: fx.GraphModule | None) -> None:
        self._profile_args = self._profile_args_of(gm, bw)
        self.static_inputs = self._profile_args["static_input_indices"]
        self.profile = profile_fragment(
            gm, bw, clone_workspace=clone_workspace, **self._profile_args
        )
        self.size_slots = _size_slots(gm)
        self._sized_profiles.clear()

    def _profile_args_of(
        self,
        gm: fx.GraphModule,
        bw: fx.GraphModule | None,
        *,
        split: tuple[tuple[int, ...], int, int] | None = None,
    ) -> dict[str, Any]:
        """``profile_fragment``'s arguments for these graphs: AOT's input and output split
        (from its metadata, or ``split``: static inputs, mutated-input and user output counts)
        and the measured kernel workspaces."""
        ctx = torch._guards.TracingContext.try_get()
        meta = ctx.fw_metadata if ctx is not None else None
        static: tuple[int, ...]
        if split is not None:
            static, mutated, user = split
        elif meta is None:  # should not happen under Dynamo; profile without the output split
            log.warning(
                "memcompile: no AOT metadata for fragment F%d; profile is approximate", self.index
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
            dropped_outputs=self.dropped_outputs,
            released_tangents=self.released_tangents,
        )

    def size_key(self, args: Sequence[Any]) -> SizeKey:
        """The values of the forward graph's size symbols in a call with ``args``."""
        return tuple(
            int(args[pos]) if dim < 0 else int(args[pos].shape[dim])
            for pos, dim, _ in self.size_slots
        )

    def profile_at(self, sizes: SizeKey) -> FragmentProfile | None:
        """The profile of the built graphs at a call's sizes (:meth:`size_key`), exact where the
        example's sizes (the profile's hints) are not; cached."""
        profile, fw = self.profile, self._fw_gm
        if not sizes or profile is None or fw is None or len(sizes) != len(self.size_slots):
            return profile
        found = self._sized_profiles.get(sizes)
        if found is None:
            bindings = {sym: v for (_, _, sym), v in zip(self.size_slots, sizes, strict=True)}
            with bound_sizes(bindings):
                found = profile_fragment(fw, self._bw_gm, **self._profile_args)
            # Gradient copies are of parameters, whose sizes are static: the example's figure.
            found = dataclasses.replace(found, clone_bytes=profile.clone_bytes)
            if len(self._sized_profiles) < _MAX_SIZE_PROFILES:
                self._sized_profiles[sizes] = found
        return found

    def _prefetch(self, example_inputs: Sequence[Any]) -> None:
        # Move reloads up the backward where their copies can hide behind compute without
        # raising the profiled peak past what the budget leaves above the plan's prediction,
        # then profile again (exactly) with the new order.
        bw, plan, profile = self._bw_gm, self.plan, self.profile
        if bw is None or plan is None or not plan.swapped or profile is None:
            return
        assert profile.backward is not None
        cost = self.compiler.cost_profile(example_inputs)
        slack = 0
        if plan.target is not None and plan.feasible:  # tracked bytes, as the phase peaks
            slack = max(0, plan.target - profile.phase_peaks()["backward"])
        decided = plan_prefetch(bw, profile.backward, cost, slack=slack)
        prefetch_pass(bw, PassContext(fragment=f"F{self.index}", graph="backward"), plan=decided)
        self.plan = dataclasses.replace(
            plan, prefetch=decided.issue_before, swap_stall=decided.after.stall
        )
        if decided.issue_before:
            self._profile(self._fw_gm, bw)  # type: ignore[arg-type]

    def _pilot_prefetch(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
        # Where the pilot predicts and copies the next blocks: inside this forward graph, where
        # the copy overlaps the rest of it, once plans leave the cache a reserve; else (and for
        # the simulated stall, always) the decision at the tail. Before profiling: the profile
        # then describes the graph as built.
        compiler = self.compiler
        prefetcher = compiler.prefetcher
        if prefetcher is None:
            return
        cost = compiler.cost_profile(example_inputs)
        depth = compiler.config.prefetch_depth
        name = f"F{self.index}"
        observed = observed_outputs(gm)
        decided = plan_pilot_prefetch(
            gm,
            cost,
            fragment=name,
            copy_bytes=max(compiler.max_block_host_bytes, self.prefetch_reserve // depth),
            copy_tensors=max(compiler.max_block_host_tensors, 1),
            observed=observed,
        )
        # A CUDA router's counts are read at the tail: in the graph the host would wait there.
        if PILOT_IN_GRAPH and compiler.pilot_plans() and not device_observed(observed):
            ctx = PassContext(fragment=name, graph="forward")
            pilot_prefetch_pass(gm, ctx, plan=decided, hook=prefetcher.key, fragment=self.index)
        else:
            decided = decided.at_tail()
        prefetcher.place(self.index, decided, cost)

    def forward_compiler(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> BoxedCallable:
        self._fw_gm = gm
        self._pilot_prefetch(gm, example_inputs)
        self._profile(gm, self._bw_gm)
        self._prefetch(example_inputs)
        if self.plan is not None:
            # The final plan (with its prefetches) for tlparse; a no-op unless TORCH_TRACE is set.
            plan = self.plan
            trace_structured_artifact(
                f"memcompile_plan_F{self.index}", "json", lambda: json.dumps(plan.to_dict())
            )
        self.compiler.check_budget(self)
        fn = compile_inner(
            self.compiler.config.inner,
            gm,
            example_inputs,
            role="forward",
            static_input_indices=self.static_inputs,
        )
        return self._wrap(fn, "forward")

    def backward_compiler(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> BoxedCallable:
        if gm is not self._bw_gm:
            # AOT changed the graph after partitioning; the profile describes the partitioned one.
            log.debug("F%d: backward graph differs from the partitioned one", self.index)
        fn = compile_inner(self.compiler.config.inner, gm, example_inputs, role="backward")
        return self._wrap(fn, "backward")

    def inference_compiler(
        self, gm: fx.GraphModule, example_inputs: Sequence[Any]
    ) -> BoxedCallable:
        self._profile(gm, None)
        fn = compile_inner(
            self.compiler.config.inner,
            gm,
            example_inputs,
            role="inference",
            static_input_indices=self.static_inputs,
        )
        return self._wrap(fn, "inference")

    # -- runtime -----------------------------------------------------------------------------
    def _wrap(self, fn: Callable[[list[Any]], Any], kind: str) -> BoxedCallable:
        on_call = self.compiler._on_call
        stats, index = self.stats, self.index
        counter = f"{kind}_calls"
        range_name = f"memcompile:F{index}:{kind}"
        # Forward inputs start with the graph's parameters; the backward's block is its forward's.
        static = self.static_inputs if kind != "backward" else ()
        key_pos = static[0] if static else -1
        # FSDP2 frees a unit's unsharded parameters after each use and all-gathers them into a
        # new allocation of the same object next time (backends/sharded.py): their address
        # would make every step's call a new block (a new expert) where the object is stable.
        inputs = self.example_inputs
        sharded_key = 0 <= key_pos < len(inputs) and self.compiler.is_sharded(inputs[key_pos])
        key_of: Callable[[Any], int] = id if sharded_key else _data_ptr
        blocks, block_inputs = self.blocks, self.block_inputs
        if kind == "forward" and self.profile is not None:
            # Which input storages this call's backward keeps (whole or through views), and
            # which inputs get gradients: read per call, so that the step's replay counts a
            # storage several calls keep, or a gradient several calls add to, once.
            whole = self.profile.saved_input_positions
            kept = whole + self.profile.saved_view_inputs
            grads = tuple(i for i, _ in self.profile.activation_grads)
            if kept or grads:
                self.compiler._call_reads[self.index] = (kept, grads, whole)
        shared_out = (
            self.profile.saved_output_positions
            if kind == "forward" and self.profile is not None
            else ()
        )
        held_out = (
            self.profile.held_output_positions
            if kind == "forward" and self.profile is not None
            else ()
        )
        tangent_pos = (
            tuple(pos for pos, _ in self.profile.tangent_storages)
            if kind == "backward" and self.profile is not None
            else ()
        )
        guard = self._resident_guard() if kind == "forward" else None
        # The host-placed inputs themselves, and the aliases the graph reads them through.
        hosted = self._own_inputs(self.hosted_inputs) if kind == "forward" else ()
        aliases = [(j, i) for j, i in self.alias_sources.items() if i in hosted]
        compiler = self.compiler
        prefetcher = compiler.prefetcher  # the pilot (None: pilot="off"); dynamic/prefetch.py
        build = self
        sized = kind != "backward" and bool(self.size_slots)  # backward: its forward's sizes
        # A CUDA backward that sends gradients to pinned host memory (host-placed parameters)
        # returns before their side-stream copies are done; autograd sums them on the host at
        # once: wait for the copies first (runtime/pinned.py).
        device = self.device
        finish = (
            functools.partial(compiler.store.finish_puts, device)
            if kind == "backward"
            and self.hosted_inputs
            and device is not None
            and device.type == "cuda"
            else None
        )

        # Under a budget, how long the caller holds a forward's outputs (simulate_step's lives:
        # ~6 us a call, which a step without a budget does not pay: nothing is planned on it).
        lives = kind == "forward" and compiler.config.budget is not None
        static_set = frozenset(static)
        positions: list[tuple[int, ...]] = []  # the activation inputs' positions, once known

        def activations(args: list[Any]) -> tuple[int, ...]:
            if not positions:
                positions.append(tuple(i for i in range(len(args)) if i not in static_set))
            return positions[0]

        def place(args: list[Any]) -> None:
            for i in hosted:
                if not is_host_placed(args[i]):
                    try:
                        compiler.host_param_bytes += compiler.move_to_host(args[i])
                    except ValueError as e:  # still correct: the graph fetches a device copy
                        log.warning("memcompile: F%d input %d stays on the device: %s", index, i, e)
            # The aliases were made before the move: the graph reads the host copy through them
            # too (autograd's edges are made already; this call's forward only reads the data).
            for j, i in aliases:
                args[j] = args[i]

        def run(args: list[Any]) -> Any:
            # Pass the same list through: the inner callable clears it (boxed convention).
            setattr(stats, counter, getattr(stats, counter) + 1)
            if guard is not None:
                guard()
            block = key_of(args[key_pos]) if key_pos >= 0 else 0
            if block not in blocks:  # a new set of parameters (another expert): remember them
                if hosted:  # one graph serves every expert: these join the host tier now
                    place(args)
                    block = key_of(args[key_pos])
                if block and any(blocks):  # a second parameter set (key 0: none)
                    compiler.note_dynamic(f"F{index} serves several parameter sets")
                blocks[block] = storage_sizes((args[i] for i in static), keep_host=True)
                block_inputs[block] = {
                    i: args[i].untyped_storage().data_ptr()
                    for i in static
                    if isinstance(args[i], torch.Tensor)
                }
            # The step's first backward: which incoming gradients outlive the call (held by
            # someone else through it); AOTAutograd's zeros for outputs without a gradient die
            # inside it. One weak reference per incoming gradient, first backward only.
            roots = (
                [
                    (pos, StorageWeakRef(args[pos].untyped_storage()))
                    for pos in tangent_pos
                    if pos < len(args) and isinstance(args[pos], torch.Tensor)
                ]
                if kind == "backward" and compiler._last_kind != "backward"
                else None
            )
            on_call(index, kind, block, args, build.size_key(args) if sized else ())
            # A forward call's activation input storages, read before the call clears args.
            reads = _view_storages(args, activations(args)) if lives else None
            tail = prefetcher is not None and prefetcher.before(
                compiler.steps_observed,
                index,
                kind,
                block,
                args,
                hosted,
                build.prefetch_reserve,
                device,
            )
            if tail:  # what the cache holds beside the graph (simulate_step's CacheUse)
                cache = prefetcher.cache  # type: ignore[union-attr]
                cached, taken = cache.bytes, cache.taken
            if _profiler_enabled():
                with torch.profiler.record_function(range_name):
                    out = fn(args)
            else:
                out = fn(args)
            if finish is not None:
                finish()
            if roots is not None:
                held = frozenset(p for p, ref in roots if not ref.expired())
                compiler._after_first_backward(index, held)
            # The outputs' small integer values, read once for everyone: by the graph's pilot
            # op when it ran (the same values), else by the first observer that wants them.
            small_ints = None
            if tail:
                small_ints = prefetcher.take_in_graph_small_ints()  # type: ignore[union-attr]
            if shared_out:  # saved outputs other fragments may save too (simulate_step)
                compiler._on_saved_outputs(_view_storages(out, shared_out))
            if held_out:  # does the caller still hold them when the backward begins?
                compiler._on_held_outputs(index, out, held_out)
            if reads is not None:  # how long the caller holds them (simulate_step's lives)
                compiler._on_forward_outputs(reads, out, held_out)
            if kind != "backward":  # observers see the outputs (a router's counts)
                small_ints = compiler._on_call_end(index, kind, block, out, small_ints)
            if tail:  # the tail of a forward call: predict the next blocks, prefetch them
                prefetcher.after(out, small_ints=small_ints)  # type: ignore[union-attr]
                at = prefetcher.in_graph_cached  # type: ignore[union-attr]
                use = CacheUse(
                    cached,
                    cache.taken - taken,
                    None if at is None else at[0],
                    0 if at is None else at[1] - taken,
                )
                compiler._on_cache(cache.bytes, use)
            return out

        run._boxed_call = True  # type: ignore[attr-defined]
        return run  # type: ignore[return-value]

    def _resident_guard(self) -> Callable[[], None] | None:
        # CUDA: the plan assumed ``plan.resident_bytes`` on the device when this fragment
        # starts. Memory allocated after compilation (optimizer state made at the first step,
        # gradients kept with zero_grad(set_to_none=False), other models) is not in the plan:
        # say so once instead of running over the budget silently. One allocator query per call.
        plan, budget = self.plan, self.compiler.config.budget
        device = self.device
        if plan is None or budget is None or device is None or device.type != "cuda":
            return None
        limit = plan.resident_bytes + budget // 100  # 1 % slack: caching-allocator rounding
        compiler, index, warned = self.compiler, self.index, [False]

        def check() -> None:
            now = torch.cuda.memory_allocated(device)
            if now <= limit or warned[0]:
                return
            warned[0] = True
            compiler.over_budget = True
            warnings.warn(
                f"memcompile: F{index} starts with {format_bytes(now)} allocated on {device}, "
                f"{format_bytes(now - plan.resident_bytes)} more than its plan assumed "
                f"({format_bytes(plan.resident_bytes)}: inputs, parameters and what was on the "
                "device when it was planned); the step may exceed "
                f"budget={format_bytes(budget)} by as much. Memory allocated after compilation "
                "(e.g. optimizer state created at the first step, or gradients kept by "
                "zero_grad(set_to_none=False)) is not in the plan: create it before the first "
                "compiled call, or call torch._dynamo.reset() to plan again",
                MemoryBudgetWarning,
                stacklevel=2,
            )

        return check


def _device_of(values: Sequence[Any]) -> torch.device | None:
    """The device of a fragment's inputs: the first one not on the CPU (host-placed parameters
    of a CUDA model are CPU tensors), else the CPU; ``None``: no tensors."""
    devices = [t.device for t in values if isinstance(t, torch.Tensor)]
    return next((d for d in devices if d.type != "cpu"), devices[0] if devices else None)


class _TilingSearch:
    """:func:`find_row_tilings` of the built graphs one ``_tiled`` call rewrites, each graph and
    ``max_kept_matmuls`` searched once: the search only decides, and the graphs do not change
    meanwhile (the rewrites make copies). Keyed by the graph object (hashed by identity)."""

    def __init__(self) -> None:
        self._found: dict[tuple[fx.GraphModule, int], tuple[RowTiling, ...]] = {}

    def __call__(self, gm: fx.GraphModule, kept: int) -> tuple[RowTiling, ...]:
        found = self._found.get((gm, kept))
        if found is None:
            found = self._found[(gm, kept)] = find_row_tilings(gm, max_kept_matmuls=kept)
        return found


def _same_tilings(fw: fx.GraphModule, bw: fx.GraphModule, kept: int, search: _TilingSearch) -> bool:
    """Whether both graphs tile alike with ``kept`` matmuls made again and with none (a graph
    the search fails on: not known to, ``_tile_rows`` then says why)."""
    try:
        return all(search(g, kept) == search(g, 0) for g in (fw, bw))
    except Exception:  # the rewrite that follows reports it
        return False


def _tile_rows(
    gm: fx.GraphModule,
    ctx: PassContext,
    *,
    max_kept_matmuls: int = MAX_KEPT_MATMULS,
    search: _TilingSearch | None = None,
) -> fx.GraphModule:
    """``row_tile_pass``, then the in-place pass again where it tiled: a value the blocks now
    make again dies at its other reader, which may then write into it. ``search``: the
    decisions already made for ``gm``."""
    try:
        decided = None if search is None else search(gm, max_kept_matmuls)
        tiled = row_tile_pass(gm, ctx, max_kept_matmuls=max_kept_matmuls, decided=decided)
    except Exception:  # a graph the pass does not know: the plan stands without it
        log.warning(
            "%s %s: row tiling failed; left as built", ctx.fragment, ctx.graph, exc_info=True
        )
        return gm
    return gm if tiled is gm else in_place_pass(tiled, ctx, built=True)


class _PrimeWorkspaces(torch.autograd.Function):
    # Its backward runs on autograd's device thread, whose cuBLAS handle is not the main
    # thread's: the matmuls there create that handle's cuBLAS and cuBLASLt workspaces (32 MiB +
    # 1 MiB on an H100, kept for the process's life) now rather than in the first step's backward
    # (a recomputed addmm with bias does it), so the memory measured at planning includes them.
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        a = torch.ones(16, 16, device=grad.device)
        torch.addmm(a[0], a, a)  # cuBLASLt (gemm with a bias epilogue)
        torch.mm(a, a)  # cuBLAS
        return grad


def _prime_backward_workspaces(device: torch.device) -> None:
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch.enable_grad():
        x = torch.zeros(2, device=device, requires_grad=True)
        _PrimeWorkspaces.apply(x).sum().backward()
    torch.cuda.synchronize(device)


def _data_ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


class MemCompiler:
    """Dynamo backend object; one per ``torch.compile`` call.

    Args:
        options: a dict of memcompile options (validated into :class:`MemConfig`) or a config.

    Attributes:
        config: the validated options.
        fragments: one :class:`FragmentRecord` per fragment compiled, in compile order.
        fallbacks: frames Dynamo ran eagerly while this compiler's model ran.
        last_step: fragment calls of the last complete training step observed.
    """

    def __init__(self, options: Mapping[str, Any] | MemConfig | None = None) -> None:
        self.config = MemConfig.from_options(options)
        self.fragments: list[FragmentRecord] = []
        self.fallbacks: list[Fallback] = []
        self.last_step: tuple[StepEvent, ...] = ()
        #: Each call's size-symbol values (``_FragmentBuild.size_key``), parallel to the steps.
        self.last_step_sizes: tuple[SizeKey, ...] = ()
        #: Each call's :class:`CallStorages` (empty but for forwards saving inputs or making
        #: gradients of activation inputs).
        self.last_step_storages: tuple[CallStorages, ...] = ()
        self.steps_observed = 0
        self._lock = threading.Lock()
        self._step: list[StepEvent] = []
        self._step_sizes: list[SizeKey] = []
        self._step_storages: list[CallStorages] = []
        #: Fragment index -> positions of activation inputs its backward reads, whole or through
        #: views (its profile's saved_input_positions and saved_view_inputs), those that get
        #: gradients, and those of the first kind (whole storages).
        self._call_reads: dict[int, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = {}
        # The step's latest forward call with held outputs: its position in the step and weak
        # references to those outputs' storages with their bytes (``_on_held_outputs``).
        self._held_refs: tuple[int, list[tuple[int, StorageWeakRef, int, int]]] = (-1, [])
        # This step's weak references to its forward calls' held output storages, whose
        # callbacks note when each dies (``_on_forward_outputs``); dropped with the step.
        self._output_refs: list[weakref.ref[Any]] = []
        # Device storage addresses of parameters moved to the host tier (``move_to_host``).
        self._moved_storages: set[int] = set()
        #: Fragments that made a step's latest forward call with held outputs, the one its first
        #: backward checks: only their calls take those weak references (empty: every
        #: fragment's, until a backward shows which; a tree's cells, called hundreds of times
        #: a step, then take none). ``_latest_held``: (position in the step, fragment) of the
        #: step's latest such call so far.
        self._last_forwards: set[int] = set()
        self._latest_held: tuple[int, int] = (-1, -1)
        # What the step's first backward found of its last forward's held outputs: (fragment
        # index, positions the caller had dropped, positions it still held).
        self._step_dropped: tuple[int, frozenset[int], frozenset[int]] | None = None
        # Fragment identity -> incoming gradients (names) its plan assumes no one else holds.
        self._released_tangents: dict[str, frozenset[str]] = {}
        # Fragment index -> re-plans made for what a first backward showed (_check_observed).
        self._observed_replans: dict[int, int] = {}
        # Fragment identity -> output positions its plan assumes dropped before the backward.
        self._dropped_outputs: dict[str, frozenset[int]] = {}
        self._dropped_warned: set[str] = set()
        self._step_trains = False
        self._last_kind = ""
        self._open_blocks: dict[int, list[tuple[int, SizeKey]]] = {}
        self._checked_steps: set[tuple[Any, ...]] = set()
        self._order_checked_steps: set[tuple[StepEvent, ...]] = set()
        #: ``F{i}: source`` of each input whose gradient a step added up in another order than
        #: eager (summed in a fragment's backward after another call added to it).
        self.summed_grads: list[str] = []
        self.over_budget = False
        #: CUDA with a budget: each step's measured peak against it (runtime/peakwatch.py).
        self.peak_watch: PeakWatch | None = None
        self._compiled_in_step = False
        # Whether a step over the budget was warned about, for steps that compiled (planning
        # runs kernels on the device) and for those that did not: once each.
        self._peak_warned: set[bool] = set()
        #: Re-planning rounds of steps predicted over budget (planning/replan.py), in order.
        self.replans: list[Replan] = []
        # Dynamo code object of each fragment (weakly): what reset_code drops to re-plan it.
        self._codes: dict[int, weakref.ref[CodeType]] = {}
        # Prefetch reserve each fragment's plan added to its resident bytes.
        self._reserves: dict[int, int] = {}
        # Fragment index -> times re-planned; indices whose current plan is a re-plan.
        self._replan_counts: dict[int, int] = {}
        self._replanned: set[int] = set()
        # Step calls (without sizes) -> position in ``replans`` of its latest round.
        self._replan_rounds: dict[tuple[tuple[int, str], ...], int] = {}
        # Step calls -> the round that put the step's parameters on the host (``host_step``);
        # and the fragments it re-planned that have not compiled again yet.
        self._host_rounds: dict[tuple[tuple[int, str], ...], int] = {}
        self._hosting_replans: set[int] = set()
        # Identity -> (record, resident, saved cap) of fragments whose code was dropped: the
        # next compile of the same graph takes the record's index and plans with those.
        self._awaiting: dict[str, list[tuple[FragmentRecord, int | None, int | None]]] = {}
        # Codes to drop before the model's next call (between two calls nothing of them runs).
        self._pending_codes: list[CodeType] = []
        self._hooked = False
        #: Monitor position when the hook was attached in the middle of a model call, until
        #: the rest of that call's fallbacks are claimed (:meth:`claim_late`).
        self._late_cursor: int | None = None
        self._warned_steps: set[tuple[tuple[int, str], ...]] = set()
        #: Bytes of parameters this compiler moved to the host tier (``offload_params``).
        self.host_param_bytes = 0
        #: ``offload_params="auto"`` decided for the whole step: a step that re-planning its
        #: saved sets did not fit put every fragment's parameters on the host (one fragment's
        #: alone leave the others' on the device, so none fit: the MoE at 0.6x its unplanned
        #: peak). Every plan from then on also tries the host tier, and takes it where that
        #: fits or peaks lower, as when its own plan does not fit.
        self.host_step = False
        #: Whether host-placed parameters are a CUDA model's pinned ones (runtime/pinned.py).
        self.host_params_pinned = False
        #: CUDA: device bytes allocated at the first plan that belong to none of memcompile's
        #: inputs (other models, optimizer state, cuBLAS workspaces); ``None`` until measured.
        self.device_other_bytes: int | None = None
        # The compiled module, when known (memcompile.compile): its parameters are resident.
        self.model: weakref.ref[torch.nn.Module] | None = None
        #: The model's parameters FSDP2 manages (backends/sharded.py), as of the latest compile;
        #: ``_sharded_ids`` gathers their ids over all compiles (each unit's unsharded
        #: parameters are in the module only while FSDP has all-gathered them).
        self.sharded: ShardedParams | None = None
        self._sharded_ids: set[int] = set()
        self._sharded_bytes: dict[str, int] = {}
        #: ``check_ranks=True`` on an FSDP2 model: the ranks compare units (backends/sharded.py).
        self.rank_check: RankCheck | None = None
        self._paths_warned = False
        self.store = TieredStore(self.config.disk_path)
        self.store_key = register_store(self.store)
        #: Told of every fragment call, in order (dynamic/: the trace recorder, the pilot).
        self.block_observers: list[BlockObserver] = []
        #: Why the model counts as dynamic ("" until seen): a fragment with symbolic shapes, a
        #: recompiled frame, or one graph serving several parameter sets (MoE experts).
        self.dynamic = ""
        #: (old, new) when memcompile raised Dynamo's recompile limit for this dynamic model.
        self.recompile_limit_raised: tuple[int, int] | None = None
        #: The largest host-placed parameter bytes of one block planned so far (the reserve).
        self.max_block_host_bytes = 0
        #: The most host-placed parameters of one block planned so far (each is one copy).
        self.max_block_host_tensors = 0
        #: The pilot: predicts the next blocks and prefetches their host-placed parameters
        #: (dynamic/prefetch.py); ``None`` with ``pilot="off"``.
        self.prefetcher: Prefetcher | None = None
        if self.config.pilot != "off":
            from memcompile.dynamic.prefetch import Prefetcher

            self.prefetcher = Prefetcher(
                self.config.pilot,
                self.config.prefetch_depth,
                records=self.records,
                model=self._model,
                gate=self._pilot_gate if self.config.pilot == "auto" else None,
            )
            self.store.prefetched = self.prefetcher.cache
        if self.config.trace_path is not None:
            from memcompile.dynamic.trace import TraceRecorder

            self.block_observers.append(
                TraceRecorder(self.config.trace_path, records=self.records, model=self._model)
            )
        _apply_dynamo_settings()
        install_pinned_hooks()  # before this model's first trace (pinned.py)
        _all_compilers.add(self)

    def _model(self) -> torch.nn.Module | None:
        return self.model() if self.model is not None else None

    def move_to_host(self, t: torch.Tensor) -> int:
        """:func:`place_on_host` for ``t``, and forget its device storage: records made before
        the move (a frame compiled again since) would count it as resident."""
        address = t.untyped_storage().data_ptr()
        freed = place_on_host(t)
        if freed:
            self._moved_storages.add(address)
        return freed

    def _static_storages(self, r: FragmentRecord) -> Iterator[tuple[int, int]]:
        """``r``'s parameter and buffer storages at compile time, less those moved to the host
        tier since."""
        moved = self._moved_storages
        return ((a, n) for a, n in r.static_storages if a not in moved)

    def _untaken_bytes(self, build: _FragmentBuild) -> int:
        """Bytes of the model's parameters and buffers that neither ``build`` nor a recorded
        fragment takes as an input (read by eager frames, or by fragments not compiled yet)."""
        taken = set(storage_sizes(t for t in build.example_inputs if isinstance(t, torch.Tensor)))
        for r in self.records():
            taken.update(address for address, _ in self._static_storages(r))
        model = storage_sizes(self._untaken_resident(set(), False))
        return sum(size for address, size in model.items() if address not in taken)

    def _untaken_resident(self, hosted: set[int], hosting: bool) -> list[torch.Tensor]:
        """The model's parameters and buffers a plan counts as resident, but those with ids in
        ``hosted``: with ``offload_params=True``, or when the plan moves parameters to the host
        (``hosting``), not the parameters later fragments will move too."""
        assume = self.config.offload_params is True or hosting
        return [
            t
            for t in self._model_tensors()
            if id(t) not in hosted and not (assume and self.may_host(t))
        ]

    def _model_tensors(self) -> tuple[torch.Tensor, ...]:
        """The compiled model's parameters and buffers, when the model is known: resident
        whether or not a fragment takes them (eager frames read some)."""
        model = self._model()
        return (*model.parameters(), *model.buffers()) if model is not None else ()

    # -- dynamic models and the pilot ------------------------------------------------------------
    def pilot_plans(self) -> bool:
        """Whether plans leave a prefetch reserve (and forward graphs a prediction op): an
        explicit pilot. ``"auto"`` runs on no device today (:meth:`_pilot_gate`), so it
        reserves nothing."""
        return self.config.pilot in ("markov", "lightgbm")

    def _pilot_gate(self) -> bool:
        # pilot="auto": the pilot where its prefetches pay, once the model is dynamic and has
        # parameters on the host; the report says why it does not run. Measured so far, they
        # pay on no device: on CUDA issuing the copies costs the host more step time than the
        # copies hid (benchmarks/results/dynamic_prefetch_cuda.md), and on the CPU device a
        # copy cannot overlap compute at all.
        if not self.dynamic or not self.host_param_bytes:
            return False
        reason = CUDA_AUTO_PILOT_OFF if self.host_params_pinned else CPU_AUTO_PILOT_OFF
        if self.prefetcher is not None and self.prefetcher.blocked is None:
            self.prefetcher.blocked = reason
            log.info("memcompile pilot: %s", reason)
        return False

    def note_dynamic(self, reason: str) -> None:
        """The model is dynamic (first reason kept). Dynamo's recompile limit is raised for it,
        deliberately and once, unless the user changed it: a dynamic model recompiles more
        often, and a frame over the limit runs eagerly (reported as a fallback)."""
        if self.dynamic:
            return
        self.dynamic = reason
        log.info("memcompile: the model is dynamic (%s)", reason)
        self._warn_paths()
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
        """A fragment with symbolic input shapes, or a recompiled frame, makes the model
        dynamic."""
        for p in gm.graph.find_nodes(op="placeholder"):
            v = p.meta.get("example_value", p.meta.get("val"))
            if isinstance(v, torch.SymInt) or (
                isinstance(v, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in v.shape)
            ):
                self.note_dynamic(f"F{index} has symbolic shapes")
                break
        compile_id = torch._guards.CompileContext.current_compile_id()
        if compile_id is not None and getattr(compile_id, "frame_compile_id", None):
            self.note_dynamic(f"F{index} recompiles a frame")

    def planned_reserve(self, build: _FragmentBuild, fetched: Sequence[int]) -> None:
        """``build`` was planned with ``build.prefetch_reserve`` for the cache and fetches the
        inputs at ``fetched`` from the host tier."""
        self._reserves[build.index] = build.prefetch_reserve
        own = {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for i in fetched
            if isinstance(t := build.example_inputs[i], torch.Tensor)
        }
        self.max_block_host_bytes = max(self.max_block_host_bytes, sum(own.values()))
        self.max_block_host_tensors = max(self.max_block_host_tensors, len(own))
        if self.prefetcher is not None:
            self.prefetcher.add_reserve(build.prefetch_reserve)

    def __repr__(self) -> str:
        return f"MemCompiler({len(self.fragments)} fragments, inner={self.config.inner!r})"

    # -- Dynamo backend protocol ---------------------------------------------------------------
    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        device = _device_of(example_inputs)
        if self.config.pilot in ("markov", "lightgbm") and device is not None:
            if device.type not in HOSTABLE_DEVICES:
                raise NotImplementedError(
                    f"memcompile option pilot={self.config.pilot!r} prefetches host-placed "
                    "parameters, which is only implemented for the CPU and CUDA devices; on "
                    f"{device.type} parameters cannot be host-placed (use pilot='off' or 'auto')"
                )
        ctx = calling_dynamo_context()
        if ctx is not None and self.attach(ctx):
            # torch.compile(backend="memcompile"), in the model's first call: its hook watches
            # the later calls only. The frames Dynamo gave up on so far in this call are still
            # running (they call the one compiling now), or were called by one of them; those
            # after this point are claimed when the next call starts (or by report()).
            self._claim(monitor.claim_running(sys._getframe(1)))
            self._late_cursor = monitor.cursor()
            if self.model is None:
                # Its parameters count against the budget, those only eager frames read too
                # (no fragment takes them as inputs; _predict).
                model = calling_compiled_module(ctx)
                if model is not None:
                    self.model = weakref.ref(model)
        self._compiled_in_step = True
        if (
            self.peak_watch is None
            and self.config.budget is not None
            and device is not None
            and device.type == "cuda"
        ):
            self.peak_watch = PeakWatch(
                self.config.budget, functools.partial(torch.cuda.max_memory_allocated, device)
            )
        identity = fragment_identity(gm, example_inputs)
        awaiting = self._awaiting.get(identity.id)
        old, resident, saved_cap = awaiting.pop(0) if awaiting else (None, None, None)
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
        self._note_sharded(index)
        build = _FragmentBuild(self, index, split.expand(real))
        build.alias_sources = split.aliases(len(example_inputs))
        build.summed_inputs = split.summed
        build.dropped_outputs = self._dropped_outputs.get(identity.id, frozenset())
        build.released_tangents = self._released_tangents.get(identity.id, frozenset())
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
            build.host_replan = index in self._hosting_replans
            self._hosting_replans.discard(index)
        self.note_dynamic_fragment(build.index, gm)
        with slow_compile_notice(f"F{index}", nodes=len(gm.graph.nodes), budget=self.config.budget):
            compiled, record = self._compile_fragment(build, gm, compile_inputs, identity)
        compiled = split.wrap(compiled)
        code = _compiling_code()
        with self._lock:
            if code is not None:
                self._codes[record.index] = weakref.ref(code)
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

    def _next_index(self) -> int:
        return max((r.index for r in self.fragments), default=-1) + 1

    def _note_sharded(self, index: int) -> None:
        """Find the parameters FSDP2 manages (backends/sharded.py) and, at the first compile
        that sees them, say what memcompile leaves to FSDP (and start ``check_ranks``)."""
        model = self._model()
        found = sharded_params(model)
        if found is None:
            if self.config.check_ranks and not self.fragments:  # the first compile only
                warnings.warn(
                    "memcompile: check_ranks=True, but the model has no FSDP2 fully_shard units "
                    "(found at its first compile): there is nothing to check",
                    UserWarning,
                    stacklevel=3,
                )
            return
        first = self.sharded is None
        self.sharded = found
        self._sharded_ids.update(found.param_ids)
        for name, n in found.param_bytes:  # the sharded dtype's size, where a compile saw it
            self._sharded_bytes[name] = max(n, self._sharded_bytes.get(name, 0))
        if not first:
            return
        if self.config.check_ranks and model is not None:
            # Every rank compiles its first fragment at the same point of the first step.
            self.rank_check = RankCheck(model)
        self._warn_paths()
        size = format_bytes(self.sharded_param_bytes)
        if self.config.offload_params is True:
            warnings.warn(
                f"memcompile: F{index}: the model's parameters ({size} unsharded, "
                f"{found.units} fully_shard units) are managed by FSDP2 and stay with it "
                "(offload_params=True moves none of them); FSDP2's "
                "offload_policy=CPUOffloadPolicy() keeps them on the host",
                MemoryBudgetWarning,
                stacklevel=3,
            )
        if self.config.budget is not None:
            warnings.warn(
                f"memcompile: the model is sharded by FSDP2 ({found.units} fully_shard units, "
                f"{size} of parameters unsharded): the parameters FSDP all-gathers, the "
                "gradients before their reduce-scatter and the collectives' buffers are "
                "allocated outside memcompile's graphs, and neither the plans nor the predicted "
                "peak count them, so the budget can be exceeded there"
                + (
                    " (each step's measured peak is checked against it)"
                    if self.peak_watch is not None
                    else ""
                ),
                MemoryBudgetWarning,
                stacklevel=3,
            )

    def _warn_paths(self) -> None:
        # FSDP2 with control flow (another path recompiles a frame; one graph serves several
        # experts): a rank that skips a unit skips its all-gather. Said once, unless checked.
        if (
            self.sharded is None
            or self.rank_check is not None
            or self._paths_warned
            or not self.dynamic
            or "symbolic shapes" in self.dynamic
        ):
            return
        self._paths_warned = True
        warnings.warn(
            f"memcompile: the model is sharded by FSDP2 and takes different paths ({self.dynamic}"
            "): every rank must run the same fully_shard units in the same order, or FSDP's "
            "collectives hang or abort; check_ranks=True makes memcompile compare them before "
            "each unit and raise RankDivergenceError instead (one small collective per unit)",
            UserWarning,
            stacklevel=3,
        )

    @property
    def sharded_param_bytes(self) -> int:
        """The FSDP2-managed parameters' unsharded bytes, each at the largest size a compile saw
        (the sharded parameter's dtype, not a mixed-precision compute copy); 0: no FSDP2."""
        return sum(self._sharded_bytes.values())

    def is_sharded(self, t: torch.Tensor) -> bool:
        """Whether FSDP2 manages ``t`` (a parameter memcompile must leave in place)."""
        return id(t) in self._sharded_ids

    def may_host(self, t: Any) -> bool:
        """Whether ``t`` is a parameter the host tier may take (``store.can_host_place``) and
        no one else manages (FSDP2's are FSDP's)."""
        return isinstance(t, torch.nn.Parameter) and can_host_place(t) and not self.is_sharded(t)

    def _compile_fragment(
        self,
        build: _FragmentBuild,
        gm: fx.GraphModule,
        example_inputs: Sequence[Any],
        identity: FragmentIdentity,
    ) -> tuple[Callable[..., Any], FragmentRecord]:
        why = getattr(gm, "compile_subgraph_reason", None)
        stack = list(getattr(why, "user_stack", None) or [])
        reason = (getattr(why, "reason", "") or "").strip().splitlines()
        compile_id = torch._guards.CompileContext.current_compile_id()
        has_ops = any(
            n.op in ("call_function", "call_method", "call_module") for n in gm.graph.nodes
        )
        if has_ops:
            compiled = aot_autograd(
                fw_compiler=build.forward_compiler,
                bw_compiler=build.backward_compiler,
                inference_compiler=build.inference_compiler,
                partition_fn=build.partition,
                decompositions=decompositions(self.config.inner),
                keep_inference_input_mutations=True,
            )(gm, example_inputs)
        else:
            # Nothing to plan or run through AOTAutograd (an empty resume graph).
            compiled = self._wrap_plain(build, gm)
        record = FragmentRecord(
            index=build.index,
            identity=identity,
            # Dynamo gives no user stack for some graphs (a return at the top level of a
            # resume function): the code object it compiles still says where it is.
            code=_frame_location(stack[0]) if stack else _code_location(_compiling_code()),
            reason=reason[0] if reason else "",
            break_at=_frame_location(stack[-1] if stack else None),
            compile_id=str(compile_id) if compile_id is not None else "",
            static_inputs=build.static_inputs,
            static_storages=tuple(
                storage_sizes(
                    build.example_inputs[i]
                    for i in build.static_inputs
                    if i < len(build.example_inputs)
                ).items()
            ),
            profile=build.profile,
            plan=build.plan,
            inner=self.config.inner,
            stats=build.stats,
            blocks=build.blocks,
            block_inputs=build.block_inputs,
            profile_at=build.profile_at if build.size_slots else None,
            summed_inputs=build.summed_inputs,
            hostable=frozenset(
                storage_sizes(
                    t
                    for i in build.static_inputs
                    if i < len(build.example_inputs) and self.may_host(t := build.example_inputs[i])
                )
            ),
        )
        return compiled, record

    def _wrap_plain(self, build: _FragmentBuild, gm: fx.GraphModule) -> Callable[..., Any]:
        forward = gm.forward
        on_call, stats, index = self._on_call, build.stats, build.index
        compiler = self

        def run(*args: Any) -> Any:
            stats.inference_calls += 1
            on_call(index, "inference", 0)
            out = forward(*args)
            compiler._on_call_end(index, "inference", 0, out)
            return out

        return run

    def reset(self) -> None:
        """Forget fragments and steps (``torch._dynamo.reset()`` calls this: code is dropped)."""
        with self._lock:
            self.fragments.clear()
            self.fallbacks.clear()
            self.last_step = ()
            self.last_step_sizes = ()
            self.last_step_storages = ()
            self._step = []
            self._step_sizes = []
            self._step_storages = []
            self._call_reads.clear()
            self._step_trains = False
            self._last_kind = ""
            self._open_blocks.clear()
            self._checked_steps.clear()
            self.over_budget = False
            self.peak_watch = None
            self._peak_warned.clear()
            self.steps_observed = 0
            self.replans.clear()
            self._codes.clear()
            self._reserves.clear()
            self._replan_counts.clear()
            self._replanned.clear()
            self._replan_rounds.clear()
            self._host_rounds.clear()
            self._hosting_replans.clear()
            self.host_step = False
            self._awaiting.clear()
            self._pending_codes.clear()
            self._warned_steps.clear()
            self._order_checked_steps.clear()
            self.summed_grads.clear()
            self._held_refs = (-1, [])
            self._output_refs = []
            self._moved_storages.clear()
            self._last_forwards.clear()
            self._latest_held = (-1, -1)
            self._dropped_outputs.clear()
            self._dropped_warned.clear()
            self._step_dropped = None
            self._released_tangents.clear()
            self._observed_replans.clear()
        for observer in self.block_observers:
            observer.reset()
        if self.prefetcher is not None:
            self.prefetcher.reset()

    # -- budget bookkeeping ----------------------------------------------------------------------
    def cost_profile(self, example: Sequence[Any]) -> DeviceProfile:
        """The cost model for graphs whose tensors look like ``example``."""
        device = _device_of(example) or torch.device("cpu")
        return device_profile(resolve_profile_name(self.config.device_profile, device))

    def resident_bytes(self, build: _FragmentBuild, *, host: Sequence[int] = ()) -> int:
        """What counts against the budget besides ``build``'s own graphs: its inputs
        (parameters, buffers, user inputs; not those at positions ``host``, or already in the
        host tier), other fragments' parameters, and (an upper bound, for multi-fragment models)
        what the other training fragments save. Recompiles of the same frame (new shapes)
        replace each other in a step and are not counted.

        A re-plan (``build.replan_resident``) takes the step prediction's figure instead, less
        the inputs at ``host`` that would leave the device now."""
        skip = set(host)
        if build.replan_resident is not None:
            moved = storage_sizes(build.example_inputs[i] for i in skip)
            return max(0, build.replan_resident - sum(moved.values()))
        storages = storage_sizes(t for i, t in enumerate(build.example_inputs) if i not in skip)
        # The model's parameters no fragment takes (read by eager frames, or by fragments not
        # compiled yet) count too; but for those the later fragments will move to the host
        # tier as this one does (the step's check re-plans if they do not).
        hosted = {id(t) for i, t in enumerate(build.example_inputs) if i in skip}
        storages.update(storage_sizes(self._untaken_resident(hosted, bool(skip))))
        compile_id = torch._guards.CompileContext.current_compile_id()
        frame = str(compile_id).split("/")[0] if compile_id is not None else None
        others = 0
        for r in self.records():
            # Not itself: a fragment compiled again keeps its index (its old record is there
            # until the new one replaces it). Nor another compile of its frame: recompiles (new
            # shapes) replace each other in a step. That skips the other pieces DDP's graph
            # splitter cuts from one compile too: counted, their saved bytes (an upper bound)
            # made the first step's pieces miss budgets the step fits once the step check
            # re-plans them (zoo GPT small at 0.3x eager DDP's peak: two pieces warned).
            if r.compile_id.split("/")[0] == frame or r.index == build.index:
                continue
            # A plan on the host tier for the whole step: the others' parameters move too (the
            # step's check re-plans if they do not).
            gone = r.hostable if skip and self.host_step else frozenset()
            storages.update((a, n) for a, n in self._static_storages(r) if a not in gone)
            if r.profile is not None and r.profile.training:
                others += r.profile.saved_bytes + r.profile.saved_input_bytes
        return sum(storages.values()) + others + self._device_other(build, sum(storages.values()))

    def _device_other(self, build: _FragmentBuild, known: int) -> int:
        # The budget is what max_memory_allocated sees, so on CUDA it covers device memory that
        # memcompile does not own: other tensors, optimizer state, cuBLAS workspaces (32 MiB per
        # handle on Hopper; the workspace probes have just created the one for this stream).
        # Measured once, at the first plan: later compiles would see this model's activations.
        device = build.device
        if device is None or device.type != "cuda":
            return 0
        if self.device_other_bytes is None:
            _prime_backward_workspaces(device)
            self.device_other_bytes = max(0, torch.cuda.memory_allocated(device) - known)
            if self.device_other_bytes:
                log.info(
                    "memcompile: %s already allocated on %s besides the model's inputs; counted "
                    "against the budget",
                    format_bytes(self.device_other_bytes),
                    device,
                )
        return self.device_other_bytes

    def infeasible(
        self,
        build: _FragmentBuild,
        plan: FragmentPlan,
        *,
        hosted: bool = False,
        host_peak: int | None = None,
        held_outputs: int = 0,
    ) -> None:
        """No plan fits: raise MemoryBudgetError, or warn (``on_infeasible="best_effort"``).
        ``hosted``: the plan keeps this fragment's parameters on the host; ``host_peak``: the
        smallest peak found with them there, when that was tried and did not help;
        ``held_outputs``: bytes of the user outputs the plan counts as held by the caller
        through the backward."""
        budget = self.config.budget
        assert budget is not None
        tips = [f"enable {k}=True" for k in ("recompute", "swap") if not getattr(self.config, k)]
        device = build.device
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
        elif self.sharded is not None:
            tips.append(
                f"{resident} of the peak is parameters, buffers and inputs; FSDP2 manages the "
                "parameters (more ranks shard them thinner, and FSDP2's "
                "offload_policy=CPUOffloadPolicy() keeps them on the host)"
            )
        elif self.config.offload_params is False:
            tips.append(
                f"{resident} of the peak is parameters, buffers and inputs: offload_params=True "
                "(or 'auto') keeps parameters on the host"
            )
        else:
            tips.append(f"{resident} of the peak is buffers, inputs and other fragments' memory")
        if self.device_other_bytes:
            tips.append(
                f"of which {format_bytes(self.device_other_bytes)} was already allocated on the "
                "device by others (other tensors, optimizer state, library workspaces)"
            )
        untaken = self._untaken_bytes(build)
        if untaken:
            tips.append(
                f"of which {format_bytes(untaken)} is the model's parameters and buffers that no "
                "fragment compiled so far reads (those of frames Dynamo runs eagerly stay on "
                "the device: see the EagerFallbackWarning)"
            )
        if held_outputs >= plan.predicted_peak // 100 and not build.dropped_outputs:
            # Step 1 cannot know what the caller keeps; the first backward shows it.
            tips.append(
                f"the plan counts F{build.index}'s outputs ({format_bytes(held_outputs)}) as "
                "held by the caller through the backward, as a loop that keeps the logits "
                "does: if yours drops them before backward(), on_infeasible='best_effort' runs "
                "the smallest plan for the first step and plans again without them once its "
                "backward shows it"
            )
        if build.prefetch_reserve:
            tips.append(
                f"{format_bytes(build.prefetch_reserve)} of it is reserved for the pilot's "
                "prefetch cache (pilot='off', or a smaller prefetch_depth, frees it)"
            )
        hint = "; ".join(tips)
        if build.replan_resident is not None or build.host_replan:
            # A re-plan runs its smallest plan: the next step's prediction tells whether the
            # step fits with every re-planned fragment, and warns if not (_check_step_budget).
            cap = plan.saved_cap
            log.info(
                "memcompile: re-planned F%d cannot meet its share of budget=%s (smallest peak "
                "%s%s); running its smallest plan: %s",
                build.index,
                format_bytes(budget),
                format_bytes(plan.predicted_peak),
                ""
                if cap is None
                else f", holding {format_bytes(plan.held_bytes)} for the backward, cap "
                f"{format_bytes(cap)}",
                hint,
            )
            return
        if self.config.on_infeasible == "error":
            raise MemoryBudgetError(budget, plan.predicted_peak, hint)
        # The same reasons the error gives: a best-effort run is told why it does not fit too
        # (the GRU's longer buckets: they named the pilot's reserve, which then gave way).
        warnings.warn(
            f"memcompile: F{build.index} does not fit budget={format_bytes(budget)}; running the "
            f"smallest plan found, predicted peak {format_bytes(plan.predicted_peak)} "
            f"(on_infeasible='best_effort'): {hint}",
            MemoryBudgetWarning,
            stacklevel=2,
        )

    def check_budget(self, build: _FragmentBuild) -> None:
        """Warn if the built graphs' exact profile exceeds a budget the plan claimed to meet."""
        budget, plan, profile = self.config.budget, build.plan, build.profile
        if budget is None or plan is None or profile is None or not plan.feasible:
            return
        peak = plan.resident_bytes + max(profile.phase_peaks().values())
        if peak > budget:
            warnings.warn(
                f"memcompile: F{build.index}'s built graphs are predicted to peak at "
                f"{format_bytes(peak)}, over budget={format_bytes(budget)} (the planner expected "
                f"{format_bytes(plan.predicted_peak)})",
                MemoryBudgetWarning,
                stacklevel=2,
            )

    # -- runtime bookkeeping ---------------------------------------------------------------------
    def attach(self, ctx: Any) -> bool:
        """Claim the eager fallbacks of every call of the model compiled through ``ctx`` (a
        ``torch._dynamo`` context) when the call ends; see dynamo_hooks.py. Returns whether the hook
        was installed now (False: it already was)."""

        def enter() -> Callable[[], None]:
            install_pinned_hooks()  # torch._dynamo.reset() drops them; traces need them
            self._between_calls()
            self.claim_late()
            # Under a dispatch mode Dynamo runs the call eagerly, compiled code or not, and
            # says so nowhere the monitor reads.
            self._dispatch_mode_call()
            cursor = monitor.cursor()
            return lambda: self._claim(monitor.claim_since(cursor))

        self._hooked = True
        return install_call_hook(ctx, enter)

    def _between_calls(self) -> None:
        # A model call starts and none of its frames runs: the place to end a step whose backward
        # is done (so its check runs now, not in the next step's first fragment) and to drop the
        # code of the fragments to re-plan, which Dynamo then compiles again in this call.
        if self._step and self._last_kind == "backward":
            self._end_step()
        self._apply_replans()

    def _apply_replans(self) -> None:
        codes, self._pending_codes = self._pending_codes, []
        if codes:
            with torch._dynamo.convert_frame.compile_lock:
                for code in codes:
                    torch._dynamo.reset_code(code)
            log.info("memcompile: dropped %d compiled frame(s) to re-plan them", len(codes))

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

    def claim_late(self) -> None:
        """Claim what Dynamo gave up on in the rest of the call that attached the hook (its
        cleanup never ran: the hook was not there when the call started)."""
        cursor, self._late_cursor = self._late_cursor, None
        if cursor is not None:
            self._claim(monitor.claim_since(cursor))

    def claim_fallbacks_of(self, functions: Collection[FunctionSpan]) -> None:
        """Claim unclaimed fallbacks of frames of these functions (for hooks attached late, after
        the model's first call)."""
        self._claim(monitor.claim_functions(functions))

    def _on_call(
        self, index: int, kind: str, block: int, args: Sequence[Any] = (), sizes: SizeKey = ()
    ) -> None:
        # A training step is its forward calls, then its backward calls: the next forward after a
        # backward starts a new step. A step of inference calls ends when its first call repeats
        # (a training forward may repeat a shared fragment, e.g. one graph for every expert).
        step = self._step
        if (
            kind != "backward"
            and step
            and (
                self._last_kind == "backward"
                or (not self._step_trains and step[0][:2] == (index, kind))
                or len(step) >= _MAX_STEP_EVENTS
            )
        ):
            self._end_step()
            step = self._step
            if not self._hooked:  # no call hook: drop the code now (this frame keeps running)
                self._apply_replans()
        if kind == "forward":
            self._open_blocks.setdefault(index, []).append((block, sizes))
        elif kind == "backward":
            if self._last_kind != "backward":
                self._check_held_outputs()
            # Backward calls come in reverse forward order: pair with the latest open forward
            # (its parameters, and the sizes its saved tensors have).
            opened = self._open_blocks.get(index)
            block, sizes = opened.pop() if opened else (0, ())
        step.append((index, kind, block))
        self._step_sizes.append(sizes)
        read = self._call_reads.get(index) if kind == "forward" else None
        if read is None:
            self._step_storages.append(_NO_STORAGES)
        else:
            kept, grads, whole = read
            addresses = {
                i: args[i].untyped_storage().data_ptr()
                for i in grads
                if i < len(args) and isinstance(args[i], torch.Tensor)
            }
            # Used with the outputs' lives only, which are measured under a budget.
            kept_at = (
                {
                    args[i].untyped_storage().data_ptr(): i
                    for i in reversed(whole)
                    if i < len(args) and isinstance(args[i], torch.Tensor)
                }
                if self.config.budget is not None
                else {}
            )
            self._step_storages.append(
                CallStorages(_view_storages(args, kept), {}, addresses, kept_at=kept_at)
            )
        self._step_trains |= kind == "forward"
        self._last_kind = kind
        for observer in self.block_observers:
            observer.on_block(self.steps_observed, index, kind, block, args)

    def _on_held_outputs(
        self, index: int, outputs: Sequence[Any], positions: Sequence[int]
    ) -> None:
        # After a forward call of F{index} with held outputs (the step's latest such call so
        # far): weak references to the storages of its user outputs the backward does not
        # read, checked when the backward begins. Taken only by the fragments a backward
        # showed to make a step's latest such call (by every fragment until one did).
        at = len(self._step) - 1
        self._latest_held = (at, index)
        last = self._last_forwards
        if last and index not in last:
            return
        refs: list[tuple[int, StorageWeakRef, int, int]] = []
        for j in positions:
            t = outputs[j] if j < len(outputs) else None
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                refs.append((j, StorageWeakRef(storage), storage.data_ptr(), storage.nbytes()))
        self._held_refs = (at, refs)

    def _on_forward_outputs(
        self, reads: ViewStorages, outputs: Sequence[Any], positions: Sequence[int]
    ) -> None:
        # After a forward call: the storages it read, and a weak reference to each storage of
        # its held outputs whose callback notes the position in the step of the first call
        # after its death. Storage objects are preserved while the storage lives (its last
        # tensor or view), so the callback runs when the memory is freed. The references are
        # dropped with the step: a death after it leaves ``died`` unset (alive to its end).
        storages, step = self._step_storages, self._step
        if not storages:
            return
        at = len(storages) - 1
        lives: list[OutputLife] = []
        for j in positions:
            t = outputs[j] if j < len(outputs) else None
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            address, nbytes = storage.data_ptr(), storage.nbytes()
            if not nbytes or any(life.address == address for life in lives):
                continue
            died = functools.partial(self._output_died, storages, step, at, len(lives))
            self._output_refs.append(weakref.ref(storage, died))
            lives.append(OutputLife(address, nbytes, None))
        storages[at] = storages[at]._replace(inputs=reads, lives=tuple(lives))

    def _output_died(
        self, storages: list[CallStorages], step: list[StepEvent], at: int, k: int, _ref: Any
    ) -> None:
        # A held output's storage was freed (weak reference callback; see _on_forward_outputs).
        if storages is not self._step_storages:  # a later step's: the step ended with it alive
            return
        lives = list(storages[at].lives)
        lives[k] = lives[k]._replace(died=len(step))
        storages[at] = storages[at]._replace(lives=tuple(lives))

    def _after_first_backward(self, index: int, held: frozenset[int]) -> None:
        # After the step's first backward call (the latest recorded, of F{index}): its
        # incoming gradients (input positions) that someone else held through it. With what
        # the call's start found of the last forward's outputs, decide on re-plans.
        if self._step_storages and self._step and self._step[-1][1] == "backward":
            self._step_storages[-1] = self._step_storages[-1]._replace(tangents=held)
        outputs, self._step_dropped = self._step_dropped, None
        if self.config.budget is None:  # nothing to re-plan: the replay reads the above
            return
        records = {r.index: r for r in self.records()}
        record = records.get(index)
        tangents: tuple[int, frozenset[str], frozenset[str]] | None = None
        if record is not None and record.profile is not None:
            prof = record.profile
            positions = [p for p, _ in prof.tangent_storages]
            names = dict(zip(positions, prof.tangent_names, strict=True))
            tangents = (
                index,
                frozenset(n for p, n in names.items() if p not in held),
                frozenset(n for p, n in names.items() if p in held),
            )
        self._check_observed(outputs, tangents, records)

    def _check_held_outputs(self) -> None:
        # The step's first backward: how much of its last forward's held outputs the caller
        # still holds (a loop keeping only ``out.loss`` has dropped the logits by now).
        at, refs = self._held_refs
        (latest, index), self._latest_held = self._latest_held, (-1, -1)
        self._held_refs = (-1, [])
        if latest < 0:
            return
        self._last_forwards.add(index)
        if at != latest:  # that call took no references: its fragment does from now on
            return
        if not 0 <= at < len(self._step_storages) or self._step[at][1] != "forward":
            return
        alive: dict[int, int] = {}  # storage -> bytes
        dead: list[int] = []
        held: list[int] = []
        for j, ref, address, nbytes in refs:
            if ref.expired():
                dead.append(j)
            else:
                held.append(j)
                alive[address] = nbytes
        self._step_storages[at] = self._step_storages[at]._replace(held=sum(alive.values()))
        # Decided at the end of this backward call, with its incoming gradients: not at the
        # step's end (the next step's first call), so a re-plan applies from the next model
        # call on (the step after next, otherwise).
        self._step_dropped = (self._step[at][0], frozenset(dead), frozenset(held))

    def _on_cache(self, nbytes: int, use: CacheUse) -> None:
        # The forward call just recorded left the prefetch cache holding nbytes (its tail ran);
        # use: what the cache held through the call.
        if self._step_storages and (nbytes or use.start or use.at_op):
            self._step_storages[-1] = self._step_storages[-1]._replace(cache=nbytes, cache_use=use)

    def _on_saved_outputs(self, storages: ViewStorages) -> None:
        # The forward call just recorded by _on_call returned these saved user outputs.
        if self._step_storages:
            self._step_storages[-1] = self._step_storages[-1]._replace(outputs=storages)

    def _end_step(self) -> None:
        self.last_step = tuple(self._step)
        self.last_step_sizes = tuple(self._step_sizes)
        self.last_step_storages = tuple(self._step_storages)
        self.steps_observed += 1
        self._step = []
        self._step_sizes = []
        self._step_storages = []
        self._step_trains = False
        self._open_blocks.clear()
        self._output_refs = []
        self._held_refs = (-1, [])
        self._latest_held = (-1, -1)
        self._step_dropped = None
        self._check_measured_peak()
        self._check_step_budget()
        self._check_grad_order()

    def dropped_outputs_of(self, record: FragmentRecord) -> frozenset[int]:
        """Positions among ``record``'s forward outputs its plan counts as dropped by the
        caller before the backward (as steps showed); empty: all held."""
        return self._dropped_outputs.get(record.identity.id, frozenset())

    def released_tangents_of(self, record: FragmentRecord) -> frozenset[str]:
        """Names of ``record``'s incoming gradients its plan counts as freed after their last
        reader (no one else held them, as steps showed); empty: all held to the end."""
        return self._released_tangents.get(record.identity.id, frozenset())

    def _check_observed(
        self,
        outputs: tuple[int, frozenset[int], frozenset[int]] | None,
        tangents: tuple[int, frozenset[str], frozenset[str]] | None,
        records: Mapping[int, FragmentRecord],
    ) -> None:
        # What the step's first backward showed a plan assumes wrongly. ``outputs``: the last
        # forward's fragment, its user-output positions the caller had dropped when the
        # backward began, and those it still held; ``tangents``: the first backward's
        # fragment, its incoming gradients (names) no one else held through it, and those
        # someone did. Plans count user outputs as held by the caller through the backward (a
        # loop that keeps only the loss has dropped the logits by then) and incoming gradients
        # as held to its end (only the loss's is, by the engine's root: AOTAutograd's zeros for
        # an output that got no gradient die at their last reader). A plan the budget
        # constrained (it recomputes, swaps, offloads or does not fit) is made again without
        # what is not held, which leaves it that much more room; a plan that assumed something
        # not held that a later step holds again is made again with it.
        budget = self.config.budget
        assert budget is not None, "called with a budget only"
        chosen: dict[int, int | None] = {}
        findings = (
            (outputs, self._dropped_outputs, "output(s)"),
            (tangents, self._released_tangents, "incoming gradient(s)"),
        )
        for found, table, what in findings:
            if found is None:
                continue
            index, free, held = found
            record = records.get(index)
            if record is None or record.plan is None or record.profile is None:
                continue
            plan, key = record.plan, record.identity.id
            assumed: frozenset[Any] = table.get(key, frozenset())
            again = assumed & held
            if again:
                wanted = assumed - held
            else:
                constrained = (
                    plan.recomputed or plan.swapped or plan.host_params or not plan.feasible
                )
                if not (free - assumed) or not constrained:
                    continue
                wanted = assumed | free
            if index not in chosen and (
                self._code_of(index) is None or self._observed_replans.get(index, 0) >= MAX_REPLANS
            ):
                if again and key not in self._dropped_warned:
                    self._dropped_warned.add(key)
                    self.over_budget = True
                    warnings.warn(
                        f"memcompile: {record.name}'s plan assumed some of its {what} are not "
                        "held through its backward (as earlier steps showed), but this step "
                        f"held them: the step may exceed budget={format_bytes(budget)} by "
                        "their size, and the fragment was re-planned too often to plan again",
                        MemoryBudgetWarning,
                        stacklevel=3,
                    )
                continue
            table[key] = wanted
            chosen[index] = None
            log.info(
                "memcompile: %s: %s %s %s through the backward; re-planning it",
                record.name,
                what,
                sorted(again or free - assumed),
                "held again" if again else "not held",
            )
        if chosen:
            # Counted apart from the budget's re-plans (``MAX_REPLANS`` each): these follow
            # what the caller does, not the step's composition.
            self._request_replan(chosen, records, {}, counts=self._observed_replans)

    def _check_grad_order(self) -> None:
        # An input whose several contributions a fragment's backward graph sums (a parameter
        # read several times, not split; an input an op reads through several autograd edges,
        # torch.rms_norm: rewrites/input_uses.py): eager adds them one at a time to what earlier
        # backward calls gave the same gradient, so where an earlier call of the step added to
        # it first the association (and the last bits) differ. Inputs by storage: parameters
        # by their call's parameter set, activations by the addresses their forward call saw
        # (an activation's address could be reused within the step: then this warns when it
        # need not). Once per new step composition; warned once per fragment input. Only
        # fragment calls are seen: a frame Dynamo runs eagerly that adds to the same gradient
        # first is not (it is warned about as an eager frame already).
        everyone = {r.index: r for r in self.records()}
        records = {i: r for i, r in everyone.items() if r.summed_inputs}
        step = self.last_step
        if not records or step in self._order_checked_steps:
            return
        if len(self._order_checked_steps) >= _MAX_CHECKED_STEPS:
            self._order_checked_steps.clear()
        self._order_checked_steps.add(step)
        storages = self.last_step_storages
        opened: dict[int, list[Mapping[int, int]]] = {}  # fragment -> its open forwards' grads
        added: set[int] = set()  # storages some backward call added a gradient to so far
        for k, (index, kind, block) in enumerate(step):
            if kind == "forward":
                grads = storages[k].grad_inputs if k < len(storages) else {}
                opened.setdefault(index, []).append(grads)
            if kind != "backward" or index not in everyone:
                continue
            stack = opened.get(index)
            inputs = dict(stack.pop() if stack else {})  # activations, then parameters
            inputs.update(everyone[index].block_inputs.get(block, {}))
            record = records.get(index)
            if record is not None:
                for pos in record.summed_inputs:
                    address = inputs.get(pos)
                    if address is not None and address in added:
                        self._warn_grad_order(record, pos)
            added.update(inputs.values())

    def _warn_grad_order(self, record: FragmentRecord, pos: int) -> None:
        sources = record.identity.sources
        source = parameter_name(sources[pos]) if pos < len(sources) else f"input {pos}"
        name = f"{record.name}: {source}"
        if name in self.summed_grads:
            return
        self.summed_grads.append(name)
        if pos in record.static_inputs:
            what = (
                f"reads parameter {source} several times and sums those gradient "
                "contributions in its backward graph"
            )
            fix = (
                "options={'split_param_reads': True} adds them in eager's order, at the "
                "memory cost of one gradient per read at the end of the fragment's backward"
            )
        else:
            what = (
                f"sums the gradient contributions of its input {source}, which an op reads "
                "through several autograd edges (torch.rms_norm), in its backward graph"
            )
            fix = "no option splits such reads"
        warnings.warn(
            f"memcompile: {record.name} {what}, after another backward call of the step "
            "already added to its gradient: eager adds them one at a time, so this gradient "
            "may differ from eager's in the last bits (as torch.compile's aot_eager does); "
            f"{fix}",
            GradientOrderWarning,
            stacklevel=3,
        )

    def _check_measured_peak(self) -> None:
        # CUDA: what the allocator saw during the step that just ended (runtime/peakwatch.py).
        watch, compiled = self.peak_watch, self._compiled_in_step
        self._compiled_in_step = False
        if watch is None:
            return
        peak = watch.step_boundary()
        if peak is None:
            return
        self.over_budget = True
        if compiled in self._peak_warned:
            return
        self._peak_warned.add(compiled)
        eager = len(self.fallbacks)
        why = (
            f"{eager} frame(s) Dynamo runs eagerly (report(...).fallbacks), whose memory no plan "
            "manages, or "
            if eager
            else ""
        )
        compiling = (
            " (fragments were compiled during that step: planning measures kernels on the device)"
            if compiled
            else ""
        )
        warnings.warn(
            f"memcompile: a training step reached {format_bytes(peak)} on the device "
            f"(torch.cuda.max_memory_allocated), above budget={format_bytes(watch.budget)}"
            f"{compiling}; what the plans do not see exceeds it: {why}memory the step's Python "
            "code or the optimizer allocates between the compiled fragments. Warned once "
            "(once more for a step without compiles); report(...).measured_peak keeps the "
            "highest step peak",
            MemoryBudgetWarning,
            stacklevel=2,
        )

    def _on_call_end(
        self,
        index: int,
        kind: str,
        block: int,
        outputs: Any,
        small_ints: tuple[tuple[int, ...], ...] | None = None,
    ) -> tuple[tuple[int, ...], ...] | None:
        # After a forward or inference call returned: its outputs, e.g. an MoE router's
        # per-expert counts, which decide the next blocks (dynamic/pilot.py). The compiler reads
        # nothing here unless an observer wants them: reading a CUDA tensor's values waits for
        # the device (dynamic/trace.py: at a call's end only, where the model's own Python
        # reads a router's counts next anyway).
        # The small integer values are read once per call, here unless given (``small_ints``:
        # the graph's pilot op read them), and returned for the prefetcher's tail (None: no
        # observer wanted them; the tail reads them itself).
        for observer in self.block_observers:
            end = getattr(observer, "on_block_end", None)
            if end is not None:
                if small_ints is None:
                    small_ints = small_int_outputs(outputs)
                end(self.steps_observed, index, kind, block, outputs, small_ints=small_ints)
        return small_ints

    def step_sequence(self) -> tuple[StepEvent, ...]:
        """The step predictions replay: :meth:`current_step`, with the backward assumed (reverse
        forward order) when only the forward has been seen so far."""
        return self._sequence_and_sizes()[0]

    def _sequence_and_sizes(self) -> tuple[tuple[StepEvent, ...], tuple[SizeKey, ...]]:
        """:meth:`step_sequence` and each call's size key."""
        seq, sizes, _ = self._sequence_sizes_views()
        return seq, sizes

    def _sequence_sizes_views(
        self,
    ) -> tuple[tuple[StepEvent, ...], tuple[SizeKey, ...], tuple[CallStorages, ...] | None]:
        """:meth:`step_sequence`, each call's size key and :class:`CallStorages` (``None``: not
        recorded; the replay then counts each call's saved inputs by its profile)."""
        seq, sizes, recorded = self._current_step()
        if len(sizes) != len(seq):  # not recorded (calls made before sizes were): the hints
            sizes = ((),) * len(seq)
        kept = recorded if len(recorded) == len(seq) else None
        if seq and not any(kind == "backward" for _, kind, _ in seq):
            training = {
                r.index for r in self.records() if r.profile is not None and r.profile.training
            }
            back = [
                (e, k)
                for e, k in zip(reversed(seq), reversed(sizes), strict=True)
                if e[1] == "forward" and e[0] in training
            ]
            seq = seq + tuple((i, "backward", b) for (i, _, b), _ in back)
            sizes = sizes + tuple(k for _, k in back)
            if kept is not None:
                kept = kept + (_NO_STORAGES,) * len(back)
        return seq, sizes, kept

    def predict_step(
        self, extra_resident: Iterable[torch.Tensor] = ()
    ) -> tuple[StepPrediction | None, tuple[StepEvent, ...], int]:
        """(prediction, replayed calls, resident bytes) of the most recent step.

        Resident: the parameters and buffers of every block that ran, of the compiled module when
        known, and ``extra_resident``."""
        return self._predict(extra_resident)[:3]

    def _predict(
        self, extra_resident: Iterable[torch.Tensor] = ()
    ) -> tuple[StepPrediction | None, tuple[StepEvent, ...], int, list[FragmentProfile | None]]:
        """:meth:`predict_step` and the profile each call was replayed with."""
        records = self.records()
        static: dict[int, int] = {}
        moved = self._moved_storages
        for r in records:
            static.update(self._static_storages(r))
            for storages in list(r.blocks.values()):
                static.update((a, n) for a, n in storages.items() if a not in moved)
        static.update(storage_sizes(self._model_tensors()))
        static.update(storage_sizes(extra_resident))
        resident = sum(static.values()) + (self.device_other_bytes or 0)
        seq, sizes, kept = self._sequence_sizes_views()
        profiles = {r.index: r.profile for r in records}
        # A graph compiled for dynamic sizes (an expert's token count) is profiled at each
        # call's own sizes: its example's would under- or overstate the other calls.
        at = {r.index: r.profile_at for r in records if r.profile_at is not None}
        call_profiles = [
            at[i](k) if i in at else profiles.get(i)
            for (i, _, _), k in zip(seq, sizes, strict=True)
        ]
        # Which parameter storages each call reads: fragments sharing parameters (a tree
        # cell's graphs per child count) add to one gradient each.
        inputs = {r.index: r.block_inputs for r in records}
        call_storages = [inputs.get(i, {}).get(b) for i, _, b in seq]
        prediction = (
            simulate_step(
                profiles,
                seq,
                resident_bytes=resident,
                call_profiles=call_profiles,
                call_storages=call_storages,
                call_views=(
                    [{a: n for a, n in c.kept.items() if a not in static} for c in kept]
                    if kept is not None
                    else None
                ),
                call_saved_outputs=[c.outputs for c in kept] if kept is not None else None,
                call_input_grads=[c.grad_inputs for c in kept] if kept is not None else None,
                call_cache=[c.cache for c in kept] if kept is not None else None,
                call_cache_use=[c.cache_use for c in kept] if kept is not None else None,
                call_held=[c.held for c in kept] if kept is not None else None,
                call_tangents=[c.tangents for c in kept] if kept is not None else None,
                call_inputs=[c.inputs for c in kept] if kept is not None else None,
                call_lives=[c.lives for c in kept] if kept is not None else None,
                call_kept_at=[c.kept_at for c in kept] if kept is not None else None,
            )
            if seq
            else None
        )
        return prediction, seq, resident, call_profiles

    def _check_step_budget(self) -> None:
        # Fragments are planned one at a time: check the whole step once per new composition,
        # and re-plan those that did not know what the rest of the step holds (replan.py).
        budget = self.config.budget
        if budget is None or not self.last_step:
            return
        shape = tuple(
            (i, k, n) for (i, k, _), n in zip(self.last_step, self.last_step_sizes, strict=False)
        )
        if shape in self._checked_steps:
            return
        if len(self._checked_steps) >= _MAX_CHECKED_STEPS:  # a dynamic model: new every step
            self._checked_steps.clear()
        self._checked_steps.add(shape)
        prediction, seq, _, call_profiles = self._predict()
        if prediction is None:
            return
        # Rounds count per composition of calls; sizes may change once re-planned (a frame
        # Dynamo compiles again starts with the sizes it learned were dynamic).
        calls = tuple((i, k) for i, k, _ in seq)
        at = self._replan_rounds.get(calls)
        last = self.replans[at] if at is not None else None
        if at is not None and last is not None and last.peak_after is None:
            self.replans[at] = dataclasses.replace(last, peak_after=prediction.peak)
            log.info(
                "memcompile: re-planned (round %d), the step is predicted to peak at %s "
                "(budget %s; %s before)",
                last.round,
                format_bytes(prediction.peak),
                format_bytes(budget),
                format_bytes(last.predicted_peak),
            )
        if prediction.peak <= budget:
            return
        used = {i for i, _, _ in shape}
        records = {r.index: r for r in self.records()}
        # A fragment whose own plan did not fit was reported (error or warning) when it was
        # planned. With other fragments in the step, re-planning still lowers it (best effort):
        # that plan counted what the step held then, e.g. parameters other fragments have
        # moved to the host since. Alone, its plan knew the whole step.
        reported = any(
            r.plan is not None and not r.plan.feasible and i not in self._replanned
            for i, r in records.items()
            if i in used
        )
        if reported and len(used) == 1:
            self.over_budget = True
            return
        rounds = last.round if last is not None else 0
        stuck: tuple[int, ...] = ()
        # Rounds count from the host round (that planned every fragment as new), if any; and
        # once the last round's fragments all ran their smallest plans, the saved sets are
        # spent (another round plans the same): the host tier is what is left to try.
        since = rounds - self._host_rounds.get(calls, 0)
        spent = last is not None and all(
            (p := records[int(f[1:])].plan) is not None and not p.feasible
            for f in last.fragments
            if int(f[1:]) in records
        )
        if since < MAX_ROUNDS and not (spent and self._may_host_step(used, records)):
            assumed = {
                i: r.plan.resident_bytes - self._reserves.get(i, 0)
                for i, r in records.items()
                if r.plan is not None
            }
            decision = decide_replan(
                prediction,
                seq,
                call_profiles,
                budget=budget,
                assumed=assumed,
                replans=self._replan_counts,
                held={i: r.plan.held_bytes for i, r in records.items() if r.plan is not None},
            )
            stuck = decision.stuck
            chosen = {i: b for i, b in decision.resident.items() if self._code_of(i) is not None}
            if chosen:
                # A re-plan without a new cap keeps the one its plan had (caps only tighten).
                caps: dict[int, int | None] = {}
                for i in chosen:
                    old = records[i].plan
                    caps[i] = decision.saved_cap.get(i, old.saved_cap if old else None)
                self._request_replan(chosen, records, caps)
                self.replans.append(
                    Replan(
                        round=rounds + 1,
                        calls=len(seq),
                        budget=budget,
                        predicted_peak=prediction.peak,
                        fragments=tuple(f"F{i}" for i in chosen),
                        resident=tuple(chosen.values()),
                        saved_cap=tuple(caps.values()),
                    )
                )
                self._replan_rounds[calls] = len(self.replans) - 1
                self._checked_steps.discard(shape)  # check it again, re-planned
                log.info(
                    "memcompile: a %d-call step is predicted to peak at %s, over budget=%s: "
                    "re-planning %s (round %d) with what the rest of the step holds",
                    len(seq),
                    format_bytes(prediction.peak),
                    format_bytes(budget),
                    ", ".join(
                        f"F{i} ({format_bytes(b)}{_cap_note(caps[i])})" for i, b in chosen.items()
                    ),
                    rounds + 1,
                )
                return
        if self._host_round(prediction.peak, seq, used, records, rounds + 1):
            self._replan_rounds[calls] = len(self.replans) - 1
            self._host_rounds[calls] = rounds + 1
            self._checked_steps.discard(shape)
            return
        self.over_budget = True
        if reported and not rounds:
            return  # said when its fragment was planned
        if calls in self._warned_steps:  # a dynamic model: the same calls at other sizes
            return
        self._warned_steps.add(calls)
        if rounds:
            why = (
                f"re-planning its fragments with the whole step known did not fit it ({rounds} "
                "round(s))"
            )
        else:
            names = ", ".join(f"F{i}" for i in stuck) or "none"
            why = (
                "none of its fragments can be re-planned tighter (over budget: "
                f"{names}; each already planned for what the rest of the step holds, or "
                "re-planned before)"
            )
        if len(used) > 1 or rounds:
            warnings.warn(
                f"memcompile: a {len(self.last_step)}-call step is predicted to peak at "
                f"{format_bytes(prediction.peak)}, over budget={format_bytes(budget)}: {why}. "
                + self._step_advice(used, records),
                MemoryBudgetWarning,
                stacklevel=2,
            )
        else:
            warnings.warn(
                f"memcompile: the step is predicted to peak at {format_bytes(prediction.peak)}, "
                f"over budget={format_bytes(budget)}, though its plan fit when it was made (the "
                "step's shapes or resident memory changed)",
                MemoryBudgetWarning,
                stacklevel=2,
            )

    def _step_advice(self, used: set[int], records: Mapping[int, FragmentRecord]) -> str:
        """What could fit a step over the budget, among what is not done already."""
        config = self.config
        tips = []
        off = [name for name in ("recompute", "swap") if not getattr(config, name)]
        if off:
            tips.append("allow " + " and ".join(off))
        device = 0
        if self.sharded is not None:
            tips.append("shard over more ranks or use FSDP2's CPUOffloadPolicy")
        elif config.offload_params is not True:
            device = sum(self._hostable_on_device(used, records).values())
            if device:
                tips.append(f"set offload_params=True ({format_bytes(device)} on the device)")
        tips.append("raise the budget")
        held = (
            f"With its parameters on the host ({format_bytes(self.host_param_bytes)}), its "
            "gradients and smallest saved sets"
            if self.host_param_bytes and not device and self.sharded is None
            else "Its parameters, gradients and smallest saved sets"
        )
        options = tips[0] if len(tips) == 1 else ", ".join(tips[:-1]) + ", or " + tips[-1]
        return f"{held} need more ({options}; see memcompile.report())"

    def _hostable_on_device(
        self, used: set[int], records: Mapping[int, FragmentRecord]
    ) -> dict[int, int]:
        """Storage address -> bytes of the parameters of the fragments ``used`` that the host
        tier may take and that are still on the device (once each: fragments share parameters,
        a tree's cells)."""
        moved = self._moved_storages
        return {
            a: n
            for i in sorted(used)
            if i in records
            for a, n in records[i].static_storages
            if a in records[i].hostable and a not in moved
        }

    def _may_host_step(self, used: set[int], records: Mapping[int, FragmentRecord]) -> bool:
        """Whether ``offload_params="auto"`` may still put the parameters of the step's
        fragments (``used``) on the host: not done yet, and some are on the device."""
        if self.host_step or self.config.offload_params != "auto":
            return False
        return bool(self._hostable_on_device(used, records))

    def _host_round(
        self,
        peak: int,
        seq: Sequence[tuple[int, str, int]],
        used: set[int],
        records: Mapping[int, FragmentRecord],
        round_: int,
    ) -> bool:
        """Re-plan every fragment of a step that re-planning its saved sets did not fit with
        the parameters on the host (``offload_params="auto"``), each as a new fragment that
        counts the others' parameters as moved too. Once per compiler; whether it fits is the
        next step's prediction. Returns whether a round was requested."""
        if not self._may_host_step(used, records):
            return False
        chosen: dict[int, int | None] = {
            i: None for i in sorted(used) if i in records and self._code_of(i) is not None
        }
        if not chosen:
            return False
        self.host_step = True
        self._request_replan(chosen, records, dict.fromkeys(chosen))
        self._hosting_replans.update(chosen)
        # Plans of their own now (not the step's figures): the budget's re-plans count afresh.
        for i in chosen:
            self._replan_counts.pop(i, None)
        self.replans.append(
            Replan(
                round=round_,
                calls=len(seq),
                budget=self.config.budget or 0,
                predicted_peak=peak,
                fragments=tuple(f"F{i}" for i in chosen),
                resident=(None,) * len(chosen),
                saved_cap=(None,) * len(chosen),
                host_params=True,
            )
        )
        log.info(
            "memcompile: a %d-call step is predicted to peak at %s, over budget=%s, and "
            "re-planning its saved sets did not fit it: re-planning %s (round %d) with the "
            "parameters on the host (offload_params='auto')",
            len(seq),
            format_bytes(peak),
            format_bytes(self.config.budget or 0),
            ", ".join(f"F{i}" for i in chosen),
            round_,
        )
        return True

    def _code_of(self, index: int) -> CodeType | None:
        ref = self._codes.get(index)
        return ref() if ref is not None else None

    def _request_replan(
        self,
        chosen: Mapping[int, int | None],
        records: Mapping[int, FragmentRecord],
        caps: Mapping[int, int | None],
        *,
        counts: dict[int, int] | None = None,
    ) -> None:
        """Drop the code of the fragments in ``chosen`` (index -> resident bytes to plan with,
        ``None``: as a new fragment; ``caps``: index -> saved-set cap) before the model's next
        call. Every fragment of a dropped code compiles again: those not chosen with the
        resident bytes and cap their plan assumed (the same target). ``counts``: the re-plan
        counter to add to (default: the budget re-plans', which also marks them re-planned)."""
        codes: dict[int, CodeType] = {}
        for i in chosen:
            code = self._code_of(i)
            assert code is not None
            codes.setdefault(id(code), code)
        for index, r in records.items():
            code = self._code_of(index)
            if code is None or id(code) not in codes:
                continue
            resident: int | None
            cap = r.plan.saved_cap if r.plan is not None else None
            if index in chosen:
                resident, cap = chosen[index], caps.get(index, cap)
                if counts is None:
                    self._replan_counts[index] = self._replan_counts.get(index, 0) + 1
                    self._replanned.add(index)
                else:
                    counts[index] = counts.get(index, 0) + 1
            elif r.plan is not None:
                resident = r.plan.resident_bytes - self._reserves.get(index, 0)
            else:
                resident = None
            # A request made before the last one was served replaces it: the fragment compiles
            # again once, and a second entry would name the record that compile replaced.
            queued = self._awaiting.setdefault(r.identity.id, [])
            queued[:] = [q for q in queued if q[0].index != index]
            queued.append((r, resident, cap))
        self._pending_codes.extend(codes.values())

    def current_step(self) -> tuple[StepEvent, ...]:
        """The most recent step: the one in progress once it has reached its backward (or the
        last complete one before that), else the calls seen so far."""
        return self._current_step()[0]

    def _current_step(
        self,
    ) -> tuple[tuple[StepEvent, ...], tuple[SizeKey, ...], tuple[CallStorages, ...]]:
        """:meth:`current_step`, each call's size key and :class:`CallStorages`."""
        step = self._step
        if step and (step[-1][1] == "backward" or not self.last_step):
            return tuple(step), tuple(self._step_sizes), tuple(self._step_storages)
        return self.last_step, self.last_step_sizes, self.last_step_storages

    def records(self) -> list[FragmentRecord]:
        """A snapshot of the compiled fragments, in compile order."""
        with self._lock:
            return list(self.fragments)


def reset_all() -> None:
    """Reset every live compiler (used by the entry-point backend's ``reset``)."""
    for c in list(_all_compilers):
        c.reset()
