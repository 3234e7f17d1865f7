"""The boxed callable around each compiled graph: what runs at every fragment call.

    run(args):                                    # args: the boxed list (cleared by the graph)
        count the call
        an inference graph on CUDA: a device copy of each host-placed parameter it reads
        the direct mode (no budget, the step seen: backends/unplanned.py): graph(args), no more
        check what the device holds (CUDA, under a budget)
        block key = the first parameter's address: a new key is a new parameter set (an expert)
        call = monitor.on_call(site, block, args, sizes)
        prefetcher.before(...)                    # the pilot: fetch what this block needs
        out = graph(args)                         # under a profiler range when one records
        monitor.on_return(call, out, small_ints)  # outputs the caller keeps, tangents, observers
        prefetcher.after(out); monitor.on_cache(...)  # the pilot: predict, prefetch the next

One closure per graph (the hot path: a handful of dict lookups and no allocation beyond the
call record when nothing new is seen).
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import fx

from memcompile.analysis.fragment_profile import FragmentProfile
from memcompile.analysis.step_model import CacheUse
from memcompile.backends.build_env import BuildEnv
from memcompile.backends.inner import BoxedCallable
from memcompile.errors import MemoryBudgetWarning, format_bytes
from memcompile.planning.plan import FragmentPlan
from memcompile.records import FragmentStats, SizeKey
from memcompile.runtime.measure import storage_sizes
from memcompile.runtime.store import is_host_placed
from memcompile.step.monitor import CallSite, StepMonitor

__all__ = ["Wrapped", "wrap", "wrap_plain"]

log = logging.getLogger(__name__)


class Wrapped(Protocol):
    """What a wrapper reads of its fragment's build (``fragment_build.Wrapped``, which
    imports this module): fixed once the graph is compiled, but ``blocks`` and
    ``block_inputs``, which the calls fill."""

    env: BuildEnv
    index: int
    device: torch.device | None
    stats: FragmentStats
    profile: FragmentProfile | None
    plan: FragmentPlan | None
    static_inputs: tuple[int, ...]
    example_inputs: list[Any]
    hosted_inputs: tuple[int, ...]
    alias_sources: dict[int, int]
    size_slots: tuple[tuple[int, int, Any], ...]
    prefetch_reserve: int
    blocks: dict[int, dict[int, int]]
    block_inputs: dict[int, dict[int, int]]

    def size_key(self, args: Sequence[Any]) -> SizeKey: ...


def _data_ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def _profiler_enabled() -> bool:
    return torch.autograd.profiler._is_profiler_enabled


def _site(build: Wrapped, kind: str) -> CallSite:
    """What the monitor reads of ``build``'s ``kind`` graph's calls; a forward's backward reads
    are registered with the monitor."""
    profile, index = build.profile, build.index
    if profile is None:
        return CallSite(index, kind)
    if kind == "forward":
        # Which input storages this call's backward keeps (whole or through views), and
        # which inputs get gradients: read per call, so that the step's replay counts a
        # storage several calls keep, or a gradient several calls add to, once.
        whole = profile.saved_input_positions
        kept = whole + profile.saved_view_inputs
        grads = tuple(i for i, _ in profile.activation_grads)
        if kept or grads:
            build.env.monitor.reads(index, kept, grads, whole)
        return CallSite(
            index,
            kind,
            static=frozenset(build.static_inputs),
            saved_outputs=profile.saved_output_positions,
            held_outputs=profile.held_output_positions,
        )
    if kind == "backward":
        return CallSite(index, kind, tangents=tuple(pos for pos, _ in profile.tangent_storages))
    return CallSite(index, kind)


def _placer(
    build: Wrapped, hosted: Sequence[int], aliases: Sequence[tuple[int, int]]
) -> Callable[[list[Any]], None]:
    """What a call with a new parameter set does first: its host-placed inputs join the host
    tier (one graph serves every expert), and the aliases read them there."""
    resident, index = build.env.pipeline.resident, build.index

    def place(args: list[Any]) -> None:
        for i in hosted:
            if not is_host_placed(args[i]):
                try:
                    resident.host_param_bytes += resident.move_to_host(args[i])
                except ValueError as e:  # still correct: the graph fetches a device copy
                    log.warning("memcompile: F%d input %d stays on the device: %s", index, i, e)
        # The aliases were made before the move: the graph reads the host copy through them
        # too (autograd's edges are made already; this call's forward only reads the data).
        for j, i in aliases:
            args[j] = args[i]

    return place


def _finisher(build: Wrapped, kind: str) -> Callable[[], None] | None:
    """A CUDA backward that sends gradients to pinned host memory (host-placed parameters)
    returns before their side-stream copies are done; autograd sums them on the host at once:
    wait for the copies first (runtime/pinned.py)."""
    device = build.device
    if kind != "backward" or not build.hosted_inputs or device is None or device.type != "cuda":
        return None
    return functools.partial(build.env.store.finish_puts, device)


def _fetching(
    fn: Callable[[list[Any]], Any], index: int, static: Sequence[int], device: torch.device
) -> Callable[[list[Any]], Any]:
    """``fn`` (an inference graph on a CUDA ``device``) given a device copy of each host-placed
    parameter among its ``static`` inputs: those placed on the host after the graph was
    compiled (by the plan of the same module's training graph: an early exit's head, whose
    confidence test calls it under ``no_grad``), which the graph does not fetch itself
    (``rewrites/params.find_inference_fetches``). The copies live for the call: unplanned device
    bytes, at most the module's parameters. (On the CPU device the graph reads the host tier's
    memory directly.)"""
    logged = [False]

    def run(args: list[Any]) -> Any:
        for i in static:
            a = args[i]
            if isinstance(a, torch.Tensor) and a.device != device and is_host_placed(a):
                args[i] = a.to(device, non_blocking=True)  # ordered before the graph's kernels
                if not logged[0]:
                    logged[0] = True
                    log.info("F%d: its inference graph fetches host-placed parameters", index)
        return fn(args)

    return run


def wrap(build: Wrapped, fn: Callable[[list[Any]], Any], kind: str) -> BoxedCallable:
    """``fn`` (``build``'s compiled ``kind`` graph) as the boxed callable Dynamo runs."""
    env = build.env
    if kind == "inference" and build.device is not None and build.device.type != "cpu":
        # Parameters placed on the host after the graph was compiled (the graph fetches those
        # that were there then: its hosted_inputs).
        later = tuple(i for i in build.static_inputs if i not in build.hosted_inputs)
        fn = _fetching(fn, build.index, later, build.device)
    monitor, prefetcher, unplanned = env.monitor, env.prefetcher, env.unplanned
    stats, index = build.stats, build.index
    counter = f"{kind}_calls"
    range_name = f"memcompile:F{index}:{kind}"
    site = _site(build, kind)
    # Forward inputs start with the graph's parameters; the backward's block is its forward's.
    static = build.static_inputs if kind != "backward" else ()
    key_pos = static[0] if static else -1
    # FSDP2 frees a unit's unsharded parameters after each use and all-gathers them into a
    # new allocation of the same object next time (backends/sharded.py): their address
    # would make every step's call a new block (a new expert) where the object is stable.
    inputs = build.example_inputs
    sharded_key = 0 <= key_pos < len(inputs) and env.fsdp.is_sharded(inputs[key_pos])
    key_of: Callable[[Any], int] = id if sharded_key else _data_ptr
    blocks, block_inputs = build.blocks, build.block_inputs
    guard = resident_guard(build) if kind == "forward" else None
    # The host-placed inputs themselves, and the aliases the graph reads them through.
    spec_inputs = build.hosted_inputs if kind == "forward" else ()
    hosted = tuple(i for i in spec_inputs if i not in build.alias_sources)
    aliases = [(j, i) for j, i in build.alias_sources.items() if i in hosted]
    sized = kind != "backward" and bool(build.size_slots)  # backward: its forward's sizes
    reserve = build.prefetch_reserve
    device = build.device
    finish = _finisher(build, kind)
    place = _placer(build, hosted, aliases)

    def run(args: list[Any]) -> Any:
        # Pass the same list through: the inner callable clears it (boxed convention).
        setattr(stats, counter, getattr(stats, counter) + 1)
        if unplanned.direct:  # no budget, the step seen: nothing else to watch
            return fn(args)
        if guard is not None:
            guard()
        block = key_of(args[key_pos]) if key_pos >= 0 else 0
        if block not in blocks:  # a new set of parameters (another expert): remember them
            if hosted:  # one graph serves every expert: these join the host tier now
                place(args)
                block = key_of(args[key_pos])
            if block and any(blocks):  # a second parameter set (key 0: none)
                env.note_dynamic(f"F{index} serves several parameter sets")
            blocks[block] = storage_sizes((args[i] for i in static), keep_host=True)
            block_inputs[block] = {
                i: args[i].untyped_storage().data_ptr()
                for i in static
                if isinstance(args[i], torch.Tensor)
            }
        call = monitor.on_call(site, block, args, build.size_key(args) if sized else ())
        tail = prefetcher is not None and prefetcher.before(
            monitor.steps_observed,
            index,
            kind,
            block,
            args,
            hosted,
            reserve,
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
        # The outputs' small integer values, read once for everyone: by the graph's pilot
        # op when it ran (the same values), else by the first observer that wants them.
        small_ints = None
        if tail:
            small_ints = prefetcher.take_in_graph_small_ints()  # type: ignore[union-attr]
        small_ints = monitor.on_return(call, out, small_ints)
        if tail:  # the tail of a forward call: predict the next blocks, prefetch them
            prefetcher.after(out, small_ints=small_ints)  # type: ignore[union-attr]
            at = prefetcher.in_graph_cached  # type: ignore[union-attr]
            use = CacheUse(
                cached,
                cache.taken - taken,
                None if at is None else at[0],
                0 if at is None else at[1] - taken,
            )
            monitor.on_cache(cache.bytes, use)
        return out

    run._boxed_call = True  # type: ignore[attr-defined]
    return run  # type: ignore[return-value]


def wrap_plain(monitor: StepMonitor, build: Wrapped, gm: fx.GraphModule) -> Callable[..., Any]:
    """A graph with no operations (an empty resume graph): nothing to plan or run through
    AOTAutograd; its calls are still counted and seen."""
    forward = gm.forward
    stats, site = build.stats, CallSite(build.index, "inference")

    def run(*args: Any) -> Any:
        stats.inference_calls += 1
        call = monitor.on_call(site, 0, (), ())
        out = forward(*args)
        monitor.on_return(call, out)
        return out

    return run


def resident_guard(build: Wrapped) -> Callable[[], None] | None:
    """CUDA: the plan assumed ``plan.resident_bytes`` on the device when this fragment starts.
    Memory allocated after compilation (optimizer state made at the first step, gradients kept
    with zero_grad(set_to_none=False), other models) is not in the plan: say so once instead of
    running over the budget silently. One allocator query per call."""
    plan, budget = build.plan, build.env.pipeline.config.budget
    device = build.device
    if plan is None or budget is None or device is None or device.type != "cuda":
        return None
    limit = plan.resident_bytes + budget // 100  # 1 % slack: caching-allocator rounding
    step_budget, index, warned = build.env.budget, build.index, [False]

    def check() -> None:
        now = torch.cuda.memory_allocated(device)
        if now <= limit or warned[0]:
            return
        warned[0] = True
        step_budget.over_budget = True
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
