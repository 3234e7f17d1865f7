"""Two-stream timeline: predicted time of a built graph whose swaps copy on a side stream.

    compute stream   op1 ─ op2 ─ op3 ─ wait(x) ──stall── op4(x) ─ ...
    copy stream        └── offload(a) ──┘   reload(x) ─────┘

Each node on the compute stream takes its roofline time (``DeviceProfile.op_time`` of its FLOPs
and bytes moved). ``offload`` and ``reload`` are issued by the compute stream and run on the
copy stream, first in first out, starting when both the issuing point is reached and the copy
stream is free; they take ``DeviceProfile.copy_time`` of the tensor's bytes for their tier.
``wait`` holds the compute stream until its reload is done: that is the stall. Disk copies are
synchronous (they go through host memory), so they hold the compute stream for their whole time.

On CPU the copies really are synchronous; the timeline is then the GPU estimate for the device
profile given (the report says which).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import fx

from memcompile.analysis.costmodel import DeviceProfile
from memcompile.analysis.graph import StorageIds, node_cost, sym_to_int, tensor_vals
from memcompile.runtime.ops import TIERS

log = logging.getLogger(__name__)

__all__ = ["Timeline", "copied_bytes", "copy_seconds", "node_seconds", "simulate"]

OFFLOAD = torch.ops.memcompile.offload.default
RELOAD = torch.ops.memcompile.reload.default
WAIT = torch.ops.memcompile.wait.default


@dataclass(frozen=True)
class Timeline:
    """Predicted times of one graph run, seconds.

    Attributes:
        compute: time the compute stream spends in ops (no stalls).
        copy: time the copy stream spends copying (asynchronous copies only).
        sync_copy: time of synchronous copies (disk tier), spent on the compute stream.
        stall: time the compute stream waits for reloads.
        total: when both streams are done.
        exposed: per reload name, its stall seconds (0 when fully hidden).
    """

    compute: float
    copy: float
    sync_copy: float
    stall: float
    total: float
    exposed: tuple[tuple[str, float], ...] = ()


def _tier(n: fx.Node) -> str:
    return TIERS[int(n.args[-1])]  # type: ignore[arg-type]


def copied_bytes(n: fx.Node) -> int:
    """Bytes an ``offload`` or ``reload`` node copies (symbolic sizes at their hints)."""
    return sum(sym_to_int(t.untyped_storage().nbytes())[0] for t in tensor_vals(n.meta.get("val")))


def copy_seconds(n: fx.Node, profile: DeviceProfile) -> float:
    """Copy time of an ``offload`` or ``reload`` node (its tensor's bytes, its tier)."""
    return profile.launch_overhead + profile.copy_time(copied_bytes(n), _tier(n))


def node_seconds(n: fx.Node, profile: DeviceProfile, ids: StorageIds) -> float:
    """Compute-stream time of an ordinary node (0 for placeholders, outputs and views)."""
    if n.op != "call_function" or n.target in (OFFLOAD, RELOAD, WAIT):
        return 0.0
    flops, moved, _ = node_cost(n, ids)
    if not flops and not moved:
        return 0.0
    outs = tensor_vals(n.meta.get("val"))
    return profile.op_time(flops, moved, outs[0].dtype if outs else "float32")


def simulate(
    gm: fx.GraphModule, profile: DeviceProfile, *, order: Sequence[fx.Node] | None = None
) -> Timeline:
    """Replay ``gm``'s node order (or ``order``, a permutation of its nodes) on a compute and a
    copy stream (see the module docstring)."""
    ids = StorageIds()
    clock = copy_free = 0.0
    compute = copy = sync_copy = stall = 0.0
    done: dict[fx.Node, float] = {}
    exposed: dict[str, float] = {}
    for n in gm.graph.nodes if order is None else order:
        if n.target in (OFFLOAD, RELOAD):
            seconds = copy_seconds(n, profile)
            if _tier(n) == "disk":  # through host memory, on the issuing thread
                clock += seconds
                sync_copy += seconds
                done[n] = clock
                continue
            start = max(clock, copy_free)
            copy_free = done[n] = start + seconds
            copy += seconds
        elif n.target is WAIT:
            rel = n.args[0]
            assert isinstance(rel, fx.Node)
            ready = done.get(rel, clock)
            if ready > clock:
                exposed[rel.name] = ready - clock
                stall += ready - clock
                clock = ready
        else:
            seconds = node_seconds(n, profile, ids)
            clock += seconds
            compute += seconds
    total = max(clock, copy_free)
    return Timeline(compute, copy, sync_copy, stall, total, tuple(sorted(exposed.items())))
