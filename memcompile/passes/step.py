"""Predict the device peak of a whole training step from its fragments' profiles.

Replays the observed call sequence of one step (``F0.fw F1.fw … F1.bw F0.bw``) over the fragments'
:class:`FragmentProfile` s:

    live = resident (parameters, buffers, the first fragment's inputs)
    F.fw        peak = live + saved(earlier fragments) + F's activation inputs + F.forward peak
                saved += F.saved + F.saved inputs (autograd keeps the inputs its backward reads)
    F.bw        peak = live + held loss + saved(others) + grads so far + F.backward peak
                saved -= F.saved; grads += F.grads   (once per block: accumulating is in place)

For a single-fragment step this is exactly :meth:`FragmentProfile.step_peak`. With several
fragments it is an estimate: activations that Python code between fragments allocates or holds
are not visible to memcompile.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from memcompile.passes.fragment import FragmentProfile

__all__ = ["StepPrediction", "simulate_step"]


@dataclass(frozen=True)
class StepPrediction:
    """Result of :func:`simulate_step`.

    Attributes:
        peak: predicted absolute device peak of the step, bytes.
        call_peaks: predicted absolute peak during each call of the sequence.
        peak_call: index into the sequence of the call holding the peak (-1: before any call).
        exact: the step is one fragment called once forward and once backward (the model is exact).
    """

    peak: int
    call_peaks: tuple[int, ...]
    peak_call: int
    exact: bool

    def fragment_peaks(self, sequence: Sequence[tuple[int, str, int]]) -> dict[int, int]:
        """Largest predicted peak during any call of each fragment."""
        out: dict[int, int] = {}
        for (index, _, _), p in zip(sequence, self.call_peaks, strict=True):
            out[index] = max(out.get(index, 0), p)
        return out


def simulate_step(
    profiles: Mapping[int, FragmentProfile | None],
    sequence: Sequence[tuple[int, str, int]],
    *,
    resident_bytes: int,
    call_profiles: Sequence[FragmentProfile | None] | None = None,
) -> StepPrediction:
    """Replay ``sequence`` (fragment index, kind, block key) over ``profiles``.

    Args:
        profiles: fragment index -> profile (``None`` for empty fragments, which allocate nothing).
        sequence: the calls of one step, kinds ``forward``/``backward``/``inference``; calls with
            the same (index, block key) use the same parameters, so their gradients count once.
        resident_bytes: parameters and buffers resident for the whole step (the first fragment's
            activation inputs are added here, they are held by the caller).
        call_profiles: each call's own profile, where it differs from its fragment's (a graph
            compiled for dynamic sizes, profiled at the sizes of that call); a backward call's
            is its forward's.
    """
    if call_profiles is not None and len(call_profiles) != len(sequence):
        raise ValueError(
            f"call_profiles has {len(call_profiles)} entries for {len(sequence)} calls"
        )
    base = resident_bytes
    peak = base
    peak_call = -1
    call_peaks: list[int] = []
    saved = grads = 0
    held = 0
    first_forward = True
    with_grads: set[tuple[int, int]] = set()
    # A forward saves its call's bytes; its backward releases exactly those.
    open_saved: dict[int, list[tuple[int, int]]] = {}
    first_call = -1
    for i, (index, kind, block) in enumerate(sequence):
        prof = call_profiles[i] if call_profiles is not None else profiles.get(index)
        if prof is None:
            call_peaks.append(base + saved + grads)
            continue
        activations = prof.input_bytes - prof.static_input_bytes
        if kind in ("forward", "inference"):
            if first_forward:
                base += activations  # the step's own inputs stay held by the caller
                activations = 0
                first_forward = False
                first_call = i
            p = base + saved + grads + activations + prof.forward.peak_bytes
            if kind == "forward":
                # The first forward's inputs are the caller's (in base): only later ones, which
                # Python may drop while autograd keeps them, add to what is saved. An input two
                # fragments both save counts twice (an overestimate: sizes are not storages).
                inputs = 0 if i == first_call else prof.saved_input_bytes
                saved += prof.saved_bytes + inputs
                open_saved.setdefault(index, []).append((prof.saved_bytes, inputs))
            held = prof.held_output_bytes
        else:  # backward
            bw = prof.backward
            if bw is None:
                call_peaks.append(base + saved + grads)
                continue
            opened = open_saved.get(index)
            outputs, inputs = opened.pop() if opened else (prof.saved_bytes, 0)
            others = max(saved - outputs - inputs, 0)
            # Its saved inputs stay until the call ends (the graph's profile treats every
            # forward input as the caller's).
            p = (
                base
                + held
                + others
                + inputs
                + grads
                + max(bw.peak_bytes, bw.end_bytes + prof.clone_bytes)
            )
            saved = others
            if (index, block) not in with_grads:
                with_grads.add((index, block))
                grads += prof.grad_bytes
        call_peaks.append(p)
        if p > peak:
            peak, peak_call = p, i
    kinds = [k for _, k, _ in sequence]
    exact = len({i for i, _, _ in sequence}) == 1 and kinds in (
        ["forward", "backward"],
        ["inference"],
    )
    return StepPrediction(peak, tuple(call_peaks), peak_call, exact)
