"""``MemCompiler``: the backend object behind one ``torch.compile(..., backend="memcompile")`` call.

For each fragment Dynamo hands it:

    record identity (structural hash, sources, reason)          fragments.fragment_identity
    aot_autograd(partition_fn, fw/bw/inference compilers)
        partition_fn      torch's partitioner; keeps the backward graph for the forward compiler
        fw compiler       profile forward + backward together        passes.fragment
                          compile with the inner compiler             backends.inner
        bw compiler       (lazy, first backward) inner compiler
    wrap each compiled callable: count calls, track the step sequence, mark profiler ranges

Everything the report, the CLI and the notebooks show is read from ``MemCompiler.fragments`` and
the observed step; nothing is recomputed later.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
import torch._dynamo
from torch import fx
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import default_partition

from memcompile.backends.dynamo_hooks import calling_dynamo_context, install_call_hook
from memcompile.backends.fallbacks import Fallback, FunctionSpan, monitor
from memcompile.backends.fragments import FragmentRecord, FragmentStats, fragment_identity
from memcompile.backends.inner import BoxedCallable, compile_inner, decompositions
from memcompile.config import MemConfig
from memcompile.passes.fragment import FragmentProfile, profile_fragment
from memcompile.passes.workspace import clone_workspace, probe_workspaces
from memcompile.runtime.measure import storage_sizes

log = logging.getLogger(__name__)

__all__ = ["MemCompiler", "StepEvent"]

#: One fragment call in a training step: (fragment index, "forward" | "backward" | "inference",
#: block key). The block key tells apart calls of one graph with different parameters (one
#: compiled graph serves every expert): the address of the first parameter, 0 if none.
StepEvent = tuple[int, str, int]

# A step that never sees a backward (inference loops) is cut at this many calls.
_MAX_STEP_EVENTS = 100_000

_all_compilers: weakref.WeakSet[MemCompiler] = weakref.WeakSet()


def _apply_dynamo_settings() -> None:
    # An empty resume graph otherwise makes Dynamo skip a *shared* resume frame for good, running
    # every later call eagerly (research/04, "no ops traced"); empty graphs cost nothing here.
    if not torch._dynamo.config.allow_empty_graphs:
        log.debug("setting torch._dynamo.config.allow_empty_graphs = True")
        torch._dynamo.config.allow_empty_graphs = True


def _frame_location(frame: Any) -> str:
    return f"{frame.name} ({frame.filename}:{frame.lineno})" if frame is not None else "<unknown>"


def _profiler_enabled() -> bool:
    return torch.autograd.profiler._is_profiler_enabled


class _FragmentBuild:
    """Closure state shared by one fragment's partition_fn and compilers (bw compiles lazily)."""

    def __init__(self, compiler: MemCompiler, index: int) -> None:
        self.compiler = compiler
        self.index = index
        self.stats = FragmentStats()
        self.profile: FragmentProfile | None = None
        self.static_inputs: tuple[int, ...] = ()
        self._bw_gm: fx.GraphModule | None = None

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
        fw, bw = default_partition(
            joint,
            joint_inputs,
            num_fwd_outputs=num_fwd_outputs,
            static_lifetime_input_indices=static_lifetime_input_indices,
            **kwargs,
        )
        self._bw_gm = bw
        return fw, bw

    def _profile(self, gm: fx.GraphModule, bw: fx.GraphModule | None) -> None:
        ctx = torch._guards.TracingContext.try_get()
        meta = ctx.fw_metadata if ctx is not None else None
        static: tuple[int, ...]
        if meta is None:  # should not happen under Dynamo; profile without the output split
            log.warning(
                "memcompile: no AOT metadata for fragment F%d; profile is approximate", self.index
            )
            static, mutated, user = (), 0, len(gm.graph.find_nodes(op="output")[0].args[0])
        else:
            static = tuple(meta.static_input_indices)
            mutated = meta.num_mutated_inp_runtime_indices
            user = meta.num_outputs + meta.num_intermediate_bases
        self.static_inputs = static
        self.profile = profile_fragment(
            gm,
            bw,
            static_input_indices=static,
            num_mutated_inputs=mutated,
            num_user_outputs=user,
            forward_workspace=probe_workspaces(gm),
            backward_workspace=probe_workspaces(bw) if bw is not None else None,
            clone_workspace=clone_workspace,
        )

    def forward_compiler(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> BoxedCallable:
        self._profile(gm, self._bw_gm)
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
        key_pos = self.static_inputs[0] if self.static_inputs and kind != "backward" else -1

        def run(args: list[Any]) -> Any:
            # Pass the same list through: the inner callable clears it (boxed convention).
            setattr(stats, counter, getattr(stats, counter) + 1)
            on_call(index, kind, args[key_pos].data_ptr() if key_pos >= 0 else 0)
            if _profiler_enabled():
                with torch.profiler.record_function(range_name):
                    return fn(args)
            return fn(args)

        run._boxed_call = True  # type: ignore[attr-defined]
        return run  # type: ignore[return-value]


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
        self.steps_observed = 0
        self._lock = threading.Lock()
        self._step: list[StepEvent] = []
        self._step_trains = False
        self._last_kind = ""
        self._open_blocks: dict[int, list[int]] = {}
        _apply_dynamo_settings()
        _all_compilers.add(self)

    def __repr__(self) -> str:
        return f"MemCompiler({len(self.fragments)} fragments, inner={self.config.inner!r})"

    # -- Dynamo backend protocol ---------------------------------------------------------------
    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        ctx = calling_dynamo_context()
        if ctx is not None:
            # torch.compile(backend="memcompile"): watch this model's later calls. (Failures before
            # this point are claimed by report(), which knows the model's methods.)
            self.attach(ctx)
        # Dynamo compiles under its own global lock, so the next index cannot be taken meanwhile.
        build = _FragmentBuild(self, len(self.fragments))
        compiled, record = self._compile_fragment(build, gm, example_inputs)
        with self._lock:
            self.fragments.append(record)
        log.info(
            "compiled %s %s (%s): %s, %d inputs",
            record.name,
            record.id,
            record.code,
            record.reason,
            len(record.identity.sources),
        )
        return compiled

    def _compile_fragment(
        self, build: _FragmentBuild, gm: fx.GraphModule, example_inputs: Sequence[Any]
    ) -> tuple[Callable[..., Any], FragmentRecord]:
        identity = fragment_identity(gm, example_inputs)
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
            code=_frame_location(stack[0] if stack else None),
            reason=reason[0] if reason else "",
            break_at=_frame_location(stack[-1] if stack else None),
            compile_id=str(compile_id) if compile_id is not None else "",
            static_inputs=build.static_inputs,
            static_storages=tuple(
                storage_sizes(
                    example_inputs[i] for i in build.static_inputs if i < len(example_inputs)
                ).items()
            ),
            profile=build.profile,
            inner=self.config.inner,
            stats=build.stats,
        )
        return compiled, record

    def _wrap_plain(self, build: _FragmentBuild, gm: fx.GraphModule) -> Callable[..., Any]:
        forward = gm.forward
        on_call, stats, index = self._on_call, build.stats, build.index

        def run(*args: Any) -> Any:
            stats.inference_calls += 1
            on_call(index, "inference", 0)
            return forward(*args)

        return run

    def reset(self) -> None:
        """Forget fragments and steps (``torch._dynamo.reset()`` calls this: code is dropped)."""
        with self._lock:
            self.fragments.clear()
            self.fallbacks.clear()
            self.last_step = ()
            self._step = []
            self._step_trains = False
            self._last_kind = ""
            self._open_blocks.clear()
            self.steps_observed = 0

    # -- runtime bookkeeping ---------------------------------------------------------------------
    def attach(self, ctx: Any) -> bool:
        """Claim the eager fallbacks of every call of the model compiled through ``ctx`` (a
        ``torch._dynamo`` context) when the call ends; see dynamo_hooks.py. Returns whether the hook
        was installed now (False: it already was)."""

        def enter() -> Callable[[], None]:
            cursor = monitor.cursor()
            return lambda: self._claim(monitor.claim_since(cursor))

        return install_call_hook(ctx, enter)

    def _claim(self, fallbacks: list[Fallback]) -> None:
        if fallbacks:
            with self._lock:
                self.fallbacks.extend(fallbacks)

    def claim_fallbacks_of(self, functions: Collection[FunctionSpan]) -> None:
        """Claim unclaimed fallbacks of frames of these functions (for hooks attached late, after
        the model's first call)."""
        self._claim(monitor.claim_functions(functions))

    def _on_call(self, index: int, kind: str, block: int) -> None:
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
            self.last_step = tuple(step)
            self.steps_observed += 1
            self._step = step = []
            self._step_trains = False
            self._open_blocks.clear()
        if kind == "forward":
            self._open_blocks.setdefault(index, []).append(block)
        elif kind == "backward":
            # Backward calls come in reverse forward order: pair with the latest open forward.
            opened = self._open_blocks.get(index)
            block = opened.pop() if opened else 0
        step.append((index, kind, block))
        self._step_trains |= kind == "forward"
        self._last_kind = kind

    def current_step(self) -> tuple[StepEvent, ...]:
        """The most recent step: the one in progress once it has reached its backward (or the
        last complete one before that), else the calls seen so far."""
        step = self._step
        if step and (step[-1][1] == "backward" or not self.last_step):
            return tuple(step)
        return self.last_step

    def records(self) -> list[FragmentRecord]:
        """A snapshot of the compiled fragments, in compile order."""
        with self._lock:
            return list(self.fragments)


def reset_all() -> None:
    """Reset every live compiler (used by the entry-point backend's ``reset``)."""
    for c in list(_all_compilers):
        c.reset()
