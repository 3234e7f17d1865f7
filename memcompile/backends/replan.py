"""Re-plan the fragments of a step that is predicted over budget, with the whole step known.

Dynamo hands memcompile one fragment at a time, and each is planned when it is compiled: a
fragment compiled first knows nothing of those compiled after it (their parameters, gradients and
saved activations), and later ones count the earlier ones only as an upper bound. After a step,
``MemCompiler`` replays it (``passes/step.py``); when the predicted step peak is over the budget,
this module decides which fragments to plan again and with what they must leave room for:

    prediction = simulate_step(...)                 call_peaks[c]: absolute peak during call c
    own[c]     = F's graph peak in call c           StepPrediction.own_peaks (the forward's, or
                                                    the backward's with its accumulation)
    others[F]  = max over F's calls (call_peaks[c] - own[c])
                                                    what the rest of the step holds at F's worst
                                                    call: parameters, gradients, saved sets of
                                                    the open calls, F's own inputs
    share[F]   = largest share of any over-budget call's excess, split between the running
                 graph's peak and the open calls' saved sets in proportion to their bytes
                                                    (saved sets held across later calls are
                                                    what the rest of the step cannot shrink)
    re-plan F  with resident = max(others[F], budget - own peak of F + share[F]) when that is
               more than its plan assumed (a re-plan only tightens)

The compiler then drops the Dynamo code of those fragments (``torch._dynamo.reset_code``) between
two calls of the model, Dynamo compiles them again at the next call, and the backend plans each
with ``budget - resident`` as its target (the same graph has the same identity, so the new record
replaces the old one). A re-planned fragment whose target cannot be met gets its smallest plan:
whether the step fits is decided by the next step's prediction, not one fragment at a time.
Rounds are bounded (``MAX_ROUNDS`` per step composition, ``MAX_REPLANS`` per fragment); when the
step is still over budget after them, the user is warned and ``memcompile.report()`` says so.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from memcompile.passes.fragment import FragmentProfile
from memcompile.passes.step import StepPrediction

log = logging.getLogger(__name__)

__all__ = ["MAX_REPLANS", "MAX_ROUNDS", "Replan", "ReplanDecision", "decide_replan"]

#: Re-planning rounds for one step composition (the calls and their sizes).
MAX_ROUNDS = 2
#: Re-plans of one fragment (its graph recompiles each time): bounds the work for dynamic models,
#: whose step compositions keep changing.
MAX_REPLANS = 2


@dataclass(frozen=True)
class Replan:
    """One re-planning round, as ``memcompile.report()`` shows it.

    Attributes:
        round: 1-based round for this step composition.
        calls: fragment calls in the step.
        budget: the budget, bytes.
        predicted_peak: the step's predicted peak that triggered the round.
        fragments: names of the fragments re-planned (``F1``, ...).
        resident: per fragment, the bytes its new plan leaves to the rest of the step (what the
            step holds besides its graph at its worst call).
        peak_after: the same composition's predicted peak once re-planned (``None``: not
            observed yet).
    """

    round: int
    calls: int
    budget: int
    predicted_peak: int
    fragments: tuple[str, ...]
    resident: tuple[int, ...]
    peak_after: int | None = None

    @property
    def fits(self) -> bool | None:
        """Whether the re-planned step is predicted to fit (``None``: not observed yet)."""
        return None if self.peak_after is None else self.peak_after <= self.budget


@dataclass(frozen=True)
class ReplanDecision:
    """What :func:`decide_replan` found.

    Attributes:
        resident: fragment index -> resident bytes its new plan must assume (only the fragments
            to re-plan).
        others: fragment index -> what the step holds besides that fragment's graph at its worst
            call (every fragment of the step with a profile).
        stuck: indices of fragments sharing an over-budget call's excess that re-planning
            cannot tighten (their plan already assumed as much, or they were re-planned
            ``MAX_REPLANS`` times).
    """

    resident: Mapping[int, int]
    others: Mapping[int, int]
    stuck: tuple[int, ...]


def decide_replan(
    prediction: StepPrediction,
    sequence: Sequence[tuple[int, str, int]],
    call_profiles: Sequence[FragmentProfile | None],
    *,
    budget: int,
    assumed: Mapping[int, int],
    replans: Mapping[int, int],
) -> ReplanDecision:
    """Which fragments of a step over ``budget`` to re-plan, and with what resident bytes.

    Args:
        prediction: ``simulate_step`` of ``sequence`` with ``call_profiles``.
        sequence: the step's calls (fragment index, kind, block key).
        call_profiles: each call's profile (``None``: an empty fragment).
        budget: the budget, bytes.
        assumed: fragment index -> resident bytes its current plan assumed (fragments without a
            plan are absent: nothing to re-plan).
        replans: fragment index -> times it was re-planned already.
    """
    if len(call_profiles) != len(sequence) or len(prediction.call_peaks) != len(sequence):
        raise ValueError(
            f"{len(sequence)} calls, {len(call_profiles)} call profiles and "
            f"{len(prediction.call_peaks)} call peaks"
        )
    others: dict[int, int] = {}
    own_max: dict[int, int] = {}
    share: dict[int, int] = {}
    # Saved bytes of each fragment's open forward calls (as simulate_step keeps them).
    held: dict[int, int] = {}
    opened: dict[int, list[int]] = {}
    own_peaks = prediction.own_peaks or (None,) * len(sequence)
    for (index, kind, _), prof, peak, own in zip(
        sequence, call_profiles, prediction.call_peaks, own_peaks, strict=True
    ):
        if prof is None or own is None:
            continue
        if kind == "backward" and opened.get(index):
            held[index] -= opened[index].pop()
        others[index] = max(others.get(index, 0), peak - own)
        own_max[index] = max(own_max.get(index, 0), own)
        if peak > budget:
            # The excess is shared by what the plans control at this call: the running graph's
            # peak and the saved sets of the open calls, in proportion to their bytes.
            parts = {f: b for f, b in held.items() if b > 0}
            parts[index] = parts.get(index, 0) + own
            total = sum(parts.values())
            for f, b in parts.items():
                part = -(-(peak - budget) * b // total)  # rounded up
                share[f] = max(share.get(f, 0), part)
        if kind == "forward":
            saved = prof.saved_bytes + prof.saved_input_bytes
            opened.setdefault(index, []).append(saved)
            held[index] = held.get(index, 0) + saved
    resident: dict[int, int] = {}
    stuck: list[int] = []
    for index in sorted(share):
        if index not in assumed or index not in others:
            continue
        # Room for the rest of the step at its worst call, and its share of the excess.
        need = max(others[index], budget - own_max[index] + share[index])
        if need > assumed[index] and replans.get(index, 0) < MAX_REPLANS:
            resident[index] = need
        else:
            stuck.append(index)
    log.debug("re-plan: others %s, shares %s, re-plan %s, stuck %s", others, share, resident, stuck)
    return ReplanDecision(resident=resident, others=others, stuck=tuple(stuck))
