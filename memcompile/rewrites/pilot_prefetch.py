"""The pilot's prefetch inside the forward graph: predict and copy the next blocks' parameters
while this fragment still computes.

The only hook between fragment k and the guards of fragment k+1 is the tail of k's callable
(research/04 §Q1), ~0.1 ms ahead of k+1: a copy issued there has no compute to hide behind. This
pass puts the pilot's prediction and copy (``memcompile::pilot_prefetch``, runtime/ops.py; its
kernel is :meth:`memcompile.dynamic.prefetch.Prefetcher.in_graph`) inside k's forward graph:

    before                                    after
      h = layer_norm(x, ...)                    h = layer_norm(x, ...)
      counts = sum(one_hot(expert), 0)          counts = sum(one_hot(expert), 0)
      g = index(gate, order)                    pilot_prefetch(hook, 3, [counts])  # predict, copy
      ...                                       g = index(gate, order)             # ... overlaps
      return (x, h, tok, g, counts, ...)        ...                                #     these ops
                                                return (x, h, tok, g, counts, ...)

Decide (:func:`plan_pilot_prefetch`), then rewrite (:func:`pilot_prefetch_pass`). The op goes to
the **latest** point from which the expected copy still finishes before the graph's compute ends,
by the two-stream timeline (timeline.py: roofline op times on the device profile; the copy waits
for copies issued before it, FIFO): late, so that the prediction sees as much as possible and the
copies hold memory for as short a time as possible. It never goes before the producers of the
values the predictor reads (:func:`observed_outputs`: the graph's small integer outputs, e.g. the
MoE router's per-expert counts, which the output rule (dynamic/rules.py) reads); they are the
op's inputs, so the data dependency itself orders it after them, under any inner compiler. When
the two constraints conflict (the counts are produced too late for the copy to finish), the data
dependency wins and the plan records the predicted stall.

The expected copy is one block's host-placed parameters, the largest known (the fragment's
prefetch reserve over ``prefetch_depth``): once the pilot runs, each forward call copies about
one new block (a block predicted j > 1 ahead was copied by an earlier call).

On CPU the copies are synchronous, so nothing overlaps here: the times are the device profile's
estimate (a GPU's with ``device_profile="h100"``), and the pilot's simulated stall uses them
(:attr:`memcompile.dynamic.prefetch.PilotReport.sim_stall_us`). Under Inductor, only the data
dependency pins the op (it may move later, never before the observed values).

On CUDA the copies run on a side stream and overlap the rest of the graph, but a graph whose
observed values are CUDA tensors predicts at its tail instead (:func:`device_observed`): reading
them inside the graph would make the host wait for the device before it queues the rest of the
graph; at the tail the model's own Python reads them next anyway (trace.py).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import fx

from memcompile.analysis.costmodel import DeviceProfile
from memcompile.analysis.graph import StorageIds, sym_to_int
from memcompile.analysis.timeline import OFFLOAD, RELOAD, copy_seconds, node_seconds
from memcompile.errors import format_bytes
from memcompile.rewrites.context import PassContext
from memcompile.runtime.small_ints import MAX_OUTPUT_ELEMENTS, MAX_OUTPUTS, READ_DEVICES

log = logging.getLogger(__name__)

__all__ = [
    "PILOT_PREFETCH",
    "PilotPrefetchPlan",
    "observed_outputs",
    "pilot_prefetch_pass",
    "plan_pilot_prefetch",
]

PILOT_PREFETCH = torch.ops.memcompile.pilot_prefetch.default

# Integer dtypes the predictor reads (as runtime/small_ints.py's small_int_outputs: not bool,
# masks).
_INT_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)


@dataclass(frozen=True)
class PilotPrefetchPlan:
    """Where a forward graph predicts and prefetches the next blocks.

    Attributes:
        fragment: the fragment (``F3``).
        in_graph: the op is in the graph; ``False``: the prediction is made at the tail of the
            fragment's callable (the timing fields then describe the tail).
        before: the node the op is inserted before (``output``: at the graph's end).
        position: how many compute nodes (not placeholders) run before the op.
        observed: the nodes whose values the predictor reads, in output order.
        copy_bytes: the expected copy (one block's host-placed parameters).
        copy_tensors: how many tensors that is (one copy each).
        copy_seconds: its time over the host link, launches included.
        issue_seconds: predicted compute time before the op.
        graph_seconds: predicted compute time of the whole forward graph (example sizes).
        overlap_seconds: copy time hidden behind the graph's compute.
        stall_seconds: how long after the graph's compute ends the copy is done (the data
            dependency placed the op too late to hide it all, the graph is too short, or the
            graph's own copies hold the copy stream).
        profile: the device profile of the times (``cpu``: this machine; ``h100``: estimate).
    """

    fragment: str
    in_graph: bool
    before: str
    position: int
    observed: tuple[str, ...]
    copy_bytes: int
    copy_tensors: int
    copy_seconds: float
    issue_seconds: float
    graph_seconds: float
    overlap_seconds: float
    stall_seconds: float
    profile: str

    def at_tail(self) -> PilotPrefetchPlan:
        """The same graph with the prediction left at the callable's tail: no overlap."""
        return dataclasses.replace(
            self,
            in_graph=False,
            before="output",
            issue_seconds=self.graph_seconds,
            overlap_seconds=0.0,
            stall_seconds=self.copy_seconds if self.copy_bytes else 0.0,
        )


def observed_outputs(gm: fx.GraphModule) -> tuple[fx.Node, ...]:
    """The output nodes that ``small_int_outputs`` (runtime/small_ints.py) may read at run time, in
    output order (repeats kept): CPU and CUDA integer tensors with 1 to ``MAX_OUTPUT_ELEMENTS``
    elements (CPU ones whose count is symbolic too), up to ``MAX_OUTPUTS`` certain ones. Passing
    exactly these keeps the predictor's view, output positions included, the same as at the
    tail (on CUDA, a graph with none predicts in the graph and its tail reads nothing more)."""
    (out,) = gm.graph.find_nodes(op="output")
    found: list[fx.Node] = []
    certain = 0
    for a in out.args[0]:
        if certain >= MAX_OUTPUTS:
            break
        if not isinstance(a, fx.Node):
            continue
        val = a.meta.get("val")
        if not (
            isinstance(val, torch.Tensor)
            and val.dtype in _INT_DTYPES
            and val.device.type in READ_DEVICES
        ):
            continue
        numel, symbolic = sym_to_int(val.numel())
        if not symbolic and not 0 < numel <= MAX_OUTPUT_ELEMENTS:
            continue
        if symbolic and val.device.type != "cpu":
            # Read in the graph only if small at run time, which would wait for the device
            # there; a router's counts have a fixed size (one per expert).
            continue
        found.append(a)
        certain += not symbolic
    return tuple(found)


def device_observed(observed: Sequence[fx.Node]) -> bool:
    """Whether any of ``observed`` (:func:`observed_outputs`) is a device tensor (not a CPU one):
    its values can be read without waiting for the device only after the graph."""
    return any(n.meta["val"].device.type != "cpu" for n in observed)


def plan_pilot_prefetch(
    gm: fx.GraphModule,
    profile: DeviceProfile,
    *,
    fragment: str,
    copy_bytes: int,
    copy_tensors: int = 1,
    observed: Sequence[fx.Node] = (),
) -> PilotPrefetchPlan:
    """Choose where ``gm`` (a forward graph) predicts and prefetches; see the module docstring.

    Args:
        gm: a forward graph (after the swap pass: its own copies go first on the copy stream).
        profile: the device's cost model.
        fragment: the fragment's name, for the plan and the log.
        copy_bytes: the expected copy's bytes (0: nothing to copy; the op goes at the end).
        copy_tensors: how many tensors it is (each copy pays the profile's launch overhead).
        observed: the nodes the predictor reads (:func:`observed_outputs`).

    Raises:
        ValueError: ``copy_bytes`` is negative, ``copy_tensors`` is below 1, or an observed
            node is not in ``gm``.
    """
    if copy_bytes < 0:
        raise ValueError(f"plan_pilot_prefetch: copy_bytes must be >= 0; got {copy_bytes}")
    if copy_tensors < 1:
        raise ValueError(f"plan_pilot_prefetch: copy_tensors must be >= 1; got {copy_tensors}")
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    missing = [n.name for n in observed if n not in index]
    if missing:
        raise ValueError(f"plan_pilot_prefetch: observed nodes not in the graph: {missing}")
    # Compute-stream start of each node, and the copy stream's free time before it (the
    # graph's own offloads and parameter fetches go first: FIFO).
    ids = StorageIds()
    start_s: list[float] = []
    copy_free_s: list[float] = []
    clock = copy_free = 0.0
    for n in nodes:
        start_s.append(clock)
        copy_free_s.append(copy_free)
        if n.target in (OFFLOAD, RELOAD):
            copy_free = max(clock, copy_free) + copy_seconds(n, profile)
        else:
            clock += node_seconds(n, profile, ids)
    end = clock
    seconds = 0.0
    if copy_bytes:
        seconds = copy_tensors * profile.launch_overhead + profile.copy_time(copy_bytes, "host")
    first = next(i for i, n in enumerate(nodes) if n.op != "placeholder")
    floor = max([first, *(index[n] + 1 for n in observed)])
    last = len(nodes) - 1  # before the output node: the graph's end

    def done(i: int) -> float:
        return max(start_s[i], copy_free_s[i]) + seconds

    # ``done`` never decreases with the position: walk back from the end to the latest point
    # whose copy finishes in time; the data dependency's floor wins a conflict.
    q = last
    while q > floor and done(q) > end:
        q -= 1
    stall = max(0.0, done(q) - end)
    # The copy starts once issued and the copy stream is free; it overlaps compute until `end`.
    overlap = min(seconds, max(0.0, end - (done(q) - seconds)))
    plan = PilotPrefetchPlan(
        fragment=fragment,
        in_graph=True,
        before=nodes[q].name,
        position=sum(1 for n in nodes[:q] if n.op != "placeholder"),
        observed=tuple(n.name for n in observed),
        copy_bytes=copy_bytes,
        copy_tensors=copy_tensors,
        copy_seconds=seconds,
        issue_seconds=start_s[q],
        graph_seconds=end,
        overlap_seconds=overlap,
        stall_seconds=stall,
        profile=profile.name,
    )
    if stall > 0 and q == floor and floor > first:
        log.info(
            "%s: the pilot's inputs (%s) are ready %.3g s before the graph ends; the %s copy "
            "needs %.3g s: %.3g s predicted stall (%s profile)",
            fragment,
            ", ".join(plan.observed),
            end - start_s[q],
            format_bytes(copy_bytes),
            seconds,
            stall,
            profile.name,
        )
    return plan


def pilot_prefetch_pass(
    gm: fx.GraphModule, ctx: PassContext, *, plan: PilotPrefetchPlan, hook: int, fragment: int
) -> fx.GraphModule:
    """Insert ``memcompile::pilot_prefetch(hook, fragment, observed)`` before ``plan.before``
    (in place; returns ``gm``). ``plan.in_graph=False``: nothing to insert.

    Raises:
        ValueError: the plan's nodes are not in ``gm``, or the graph already has the op.
    """
    if not plan.in_graph:
        return gm
    by_name = {n.name: n for n in gm.graph.nodes}
    if any(n.target is PILOT_PREFETCH for n in gm.graph.nodes):
        raise ValueError(f"{ctx.fragment}: the graph already predicts in-graph")
    missing = [name for name in (plan.before, *plan.observed) if name not in by_name]
    if missing:
        raise ValueError(f"{ctx.fragment}: plan names nodes not in the graph: {missing}")
    observed = [by_name[name] for name in plan.observed]
    with gm.graph.inserting_before(by_name[plan.before]):
        node = gm.graph.call_function(PILOT_PREFETCH, (hook, fragment, observed))
    node.meta["val"] = None
    gm.graph.lint()
    gm.recompile()
    log.info(
        "%s: pilot prefetch in-graph before %s (%d of the compute nodes before it), predicted "
        "overlap %.3g s, stall %.3g s (%s profile)",
        ctx.fragment,
        plan.before,
        plan.position,
        plan.overlap_seconds,
        plan.stall_seconds,
        plan.profile,
    )
    return gm
