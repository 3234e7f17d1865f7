"""What the inner compiler's code peaks at, beside the profile of the graphs it was given.

memcompile plans on the FX graphs AOTAutograd hands over, whose profile is exact for the eager
inner compiler (it runs them node by node). Inductor does not: it fuses pointwise ops (their
intermediates never exist), reuses buffers, reorders kernels and adds its own scratch, so its
code peaks below or above that profile (zoo GPT, hand-written attention, CPU: −20 % to +9 %).
So with ``inner="inductor"`` the fragment's graphs are compiled and run once, at compile time:

    inputs   the fragment's own inputs (parameters, batch) where they match the placeholders,
             else tensors of their metadata (random floats, zero integers: indices stay in
             range); the global RNG forked around the runs
    eager    forward, then backward on its saved outputs (tangents: ones), each peak measured
             above what was allocated when it began (CPU profiler / CUDA peak stats)
    inner    the same with the inner compiler's code (each run twice, the second counted: a
             first call may allocate once-only caches)
    delta    InnerPeaks(forward, held, backward: inner − eager, all above the forward's start)

The delta, not the inner peaks themselves: both runs see the same harness (inputs held by the
caller, saved outputs freed by the backward as they die), so what the harness does differently
from a real step cancels, and the profile's own accounting (resident inputs, held outputs,
gradients) stays as it is. ``FragmentProfile.inner_adjust`` carries the delta into every
prediction; ``FragmentBuild.partition`` re-plans a fragment the delta puts over its budget
(``FragmentSpec.inner_excess``). Graphs with the pilot's in-graph op (it calls the prefetcher)
are not run: the delta stays ``None`` and the report says the prediction is the eager model's.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.utils._python_dispatch import _disable_current_modes

from memcompile.analysis.fragment_profile import FragmentProfile
from memcompile.analysis.workspace import materialize
from memcompile.backends.inner import InnerName, compile_inner
from memcompile.runtime.measure import allocation_trace, range_levels

log = logging.getLogger(__name__)

__all__ = ["InnerPeaks", "measure_inner"]

_RANGE = "memcompile_inner:"


@dataclass(frozen=True)
class InnerPeaks:
    """Bytes by which the inner compiler's code peaks above (negative: below) the eager run of
    the same graphs, per phase.

    Attributes:
        forward: the forward's peak above what was allocated when it began, inner − eager.
        held: what the forward leaves allocated for the backward (its saved values: Inductor
            may return several in one buffer), likewise.
        backward: the backward's peak above the same start, likewise (its saved values
            counted, as in ``backward.peak_bytes``).
        eager: ``(forward, backward)`` peaks of the eager run (for the log and the report).
    """

    forward: int
    held: int
    backward: int
    eager: tuple[int, int]

    def applied(self, profile: FragmentProfile) -> FragmentProfile:
        """``profile`` as the inner compiler's code runs it: its peaks adjusted
        (``inner_adjust``), and the bytes it holds from forward to backward."""
        if profile.backward is None:
            return profile
        return dataclasses.replace(
            profile,
            inner_adjust=(self.forward, self.backward),
            saved_bytes=max(0, profile.saved_bytes + self.held),
        )


def _saved_pairs(fw: fx.GraphModule, bw: fx.GraphModule) -> list[tuple[int, fx.Node]] | None:
    """``(forward output position, backward placeholder)`` of each saved value: the forward's
    last outputs are the backward's first inputs, in order (a swapped value leaves the forward
    as its ``offload`` and enters the backward under its own name); ``None`` where their
    number, shapes or dtypes disagree."""
    outputs = fw.graph.output_node().args[0]
    assert isinstance(outputs, (list, tuple))
    saved = [p for p in bw.graph.find_nodes(op="placeholder") if not p.name.startswith("tangents")]
    first = len(outputs) - len(saved)
    if first < 0:
        return None
    pairs = []
    for k, p in enumerate(saved):
        out = outputs[first + k]
        a = out.meta.get("val") if isinstance(out, fx.Node) else out
        b = p.meta.get("val")
        if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor) or (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and (a.shape != b.shape or a.dtype != b.dtype)
        ):
            return None
        pairs.append((first + k, p))
    return pairs


def unmeasurable(fw: fx.GraphModule, bw: fx.GraphModule) -> str | None:
    """Why the pair cannot be run at compile time, or ``None``."""
    for gm in (fw, bw):
        for n in gm.graph.nodes:
            if n.op == "call_function" and "pilot_prefetch" in str(n.target):
                return "the pilot's in-graph op calls the prefetcher"
    if _saved_pairs(fw, bw) is None:
        return "the forward's saved outputs and the backward's inputs do not line up"
    return None


def _values(gm: fx.GraphModule) -> list[Any]:
    return [p.meta.get("val") for p in gm.graph.find_nodes(op="placeholder")]


def _peaks(
    fw: Callable[[list[Any]], Any],
    bw: Callable[[list[Any]], Any],
    fw_gm: fx.GraphModule,
    bw_gm: fx.GraphModule,
    args: Sequence[Any],
    device: torch.device,
    *,
    measured: bool = True,
) -> tuple[int, int, int]:
    """``(forward peak, held after it, backward peak)`` of one forward and backward, each
    above what was allocated when the forward began (the backward's peak counts the saved
    values it starts with, as the profile's ``backward.peak_bytes`` does); ``measured=False``
    runs them unwatched (a warm-up: the CPU profiler slows a step several times) and returns
    zeros."""
    pairs = _saved_pairs(fw_gm, bw_gm)
    assert pairs is not None  # unmeasurable() said so
    placeholders = list(bw_gm.graph.find_nodes(op="placeholder"))
    saved = {p.name: position for position, p in pairs}

    def run_fw() -> list[Any]:
        return list(fw(list(args)))

    def bw_args(outs: list[Any]) -> list[Any]:
        bases: dict[Any, Any] = {}
        return [
            outs[saved[p.name]]
            if p.name in saved
            else torch.ones_like(
                materialize(p.meta["val"], _device_of(p.meta["val"], device), bases)
            )
            for p in placeholders
        ]

    if not measured:
        bw(bw_args(run_fw()))
        return 0, 0, 0
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        outs = run_fw()
        torch.cuda.synchronize(device)
        fw_peak = torch.cuda.max_memory_allocated(device) - base
        held = torch.cuda.memory_allocated(device) - base
        inputs = bw_args(outs)
        del outs  # the backward's argument list holds the saved values; it frees them
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        bw(inputs)
        torch.cuda.synchronize(device)
        return fw_peak, held, torch.cuda.max_memory_allocated(device) - base
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function(_RANGE + "forward"):
            outs = run_fw()
        with record_function(_RANGE + "held"):
            inputs = bw_args(outs)
        del outs
        with record_function(_RANGE + "backward"):
            bw(inputs)
    levels, ranges = allocation_trace(prof, _RANGE)
    spans = {name[len(_RANGE) :]: (t0, t1) for name, t0, t1 in ranges}
    base, fw_peak = range_levels(levels, *spans["forward"])
    held, _ = range_levels(levels, *spans["held"])
    _, bw_peak = range_levels(levels, *spans["backward"])
    return fw_peak - base, held - base, bw_peak - base


def _with_layouts(bw_gm: fx.GraphModule, fw_gm: fx.GraphModule, outs: list[Any]) -> fx.GraphModule:
    """A copy of ``bw_gm`` whose saved-value placeholders have the strides of ``outs`` (the
    forward's outputs, as its compiled code made them)."""
    bw = copy.deepcopy(bw_gm)
    pairs = _saved_pairs(fw_gm, bw)
    assert pairs is not None  # unmeasurable() said so
    for position, p in pairs:
        real, fake = outs[position], p.meta.get("val")
        if (
            isinstance(real, torch.Tensor)
            and isinstance(fake, torch._subclasses.FakeTensor)
            and real.shape == fake.shape
            and real.stride() != fake.stride()
        ):
            with fake.fake_mode:
                p.meta["val"] = torch.empty_strided(
                    fake.shape, real.stride(), dtype=fake.dtype, device=fake.device
                )
    return bw


def _same_meta(real: Any, fake: Any) -> bool:
    return (
        isinstance(real, torch.Tensor)
        and isinstance(fake, torch.Tensor)
        and not isinstance(real, torch._subclasses.FakeTensor)
        and real.device == fake.device
        and real.dtype == fake.dtype
        and tuple(real.shape) == tuple(fake.shape)
        and tuple(real.stride()) == tuple(fake.stride())
    )


def _arguments(fakes: Sequence[Any], reals: Sequence[Any], device: torch.device) -> list[Any]:
    """The forward's arguments: each real input that matches its placeholder, else one made
    from the placeholder's metadata (inputs sharing a storage share one made buffer)."""
    bases: dict[Any, Any] = {}
    if len(reals) != len(fakes):
        reals = [None] * len(fakes)
    return [
        real if _same_meta(real, fake) else materialize(fake, _device_of(fake, device), bases)
        for real, fake in zip(reals, fakes, strict=True)
    ]


def _device_of(fake: Any, default: torch.device) -> torch.device:
    # A host-placed input (a parameter the graph fetches) is made on the host, as it will be.
    if isinstance(fake, torch.Tensor) and fake.device.type != "meta":
        return fake.device
    return default


def measure_inner(
    inner: InnerName,
    fw_gm: fx.GraphModule,
    bw_gm: fx.GraphModule,
    *,
    static_input_indices: Sequence[int],
    device: torch.device,
    real_inputs: Sequence[Any] = (),
) -> InnerPeaks:
    """Compile the pair with ``inner`` and with the eager inner compiler, run both on inputs
    of the forward's metadata, and return the difference of their peaks. ``real_inputs``: the
    fragment's own inputs, used where one matches its placeholder (its parameters are not
    copied: a model near the device's size must not need two); the others are made. The
    graphs are copied (Inductor's passes change the graph they compile)."""
    fw_vals = _values(fw_gm)
    devices = [device] if device.type == "cuda" else []
    with _disable_current_modes(), torch.random.fork_rng(devices=devices), torch.no_grad():
        args = _arguments(fw_vals, real_inputs, device)
        compiled = {}
        for name in ("eager", inner):
            fw = compile_inner(
                name,
                copy.deepcopy(fw_gm),
                fw_vals,
                role="forward",
                static_input_indices=static_input_indices,
            )
            # The backward is compiled for the layouts the forward's code gives its saved values
            # (Inductor's may differ from the traced ones; AOTAutograd restrides the same way,
            # and Inductor's code asserts them).
            bw = _with_layouts(bw_gm, fw_gm, list(fw(list(args))))
            compiled[name] = (fw, compile_inner(name, bw, _values(bw), role="backward"))
        # Each twice, the second counted: a first call may allocate once-only caches.
        found: dict[str, tuple[int, int, int]] = {}
        for name in ("eager", inner):
            _peaks(*compiled[name], fw_gm, bw_gm, args, device, measured=False)
            found[name] = _peaks(*compiled[name], fw_gm, bw_gm, args, device)
    eager, measured = found["eager"], found[inner]
    peaks = InnerPeaks(
        forward=measured[0] - eager[0],
        held=measured[1] - eager[1],
        backward=measured[2] - eager[2],
        eager=(eager[0], eager[2]),
    )
    log.info(
        "%s's code peaks %+d B in the forward, holds %+d B after it and peaks %+d B in the "
        "backward beside the eager run (peaks %d B, %d B)",
        inner,
        peaks.forward,
        peaks.held,
        peaks.backward,
        *peaks.eager,
    )
    return peaks
