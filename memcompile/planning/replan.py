"""Re-plan the fragments of a step that is predicted over budget, with the whole step known.

Dynamo hands memcompile one fragment at a time, and each is planned when it is compiled: a
fragment compiled first knows nothing of those compiled after it (their parameters, gradients and
saved activations), and later ones count the earlier ones only as an upper bound. After a step,
``step/budget.py`` replays it (``analysis/step_model.py``); when the predicted step peak is over the
budget, this module decides which fragments to plan again and with what they must leave room for:

    prediction = simulate_step(...)                 call_peaks[c]: absolute peak during call c
    own[c]     = F's graph peak in call c           StepPrediction.own_peaks (the forward's, or
                                                    the backward's with its accumulation)
    others[F]  = max over F's calls (call_peaks[c] - own[c])
                                                    what the rest of the step holds at F's worst
                                                    call: parameters, gradients, saved sets of
                                                    the open calls, F's own inputs
    excess of an over-budget call c, split in proportion to bytes between
               the running graph's peak          -> share[F] (F runs at c)
               each fragment's held saved sets   -> ratio[G] = part / held[G] at c
                                                    (G's open calls' saved tensors and saved
                                                    inputs: held while others run, where G's
                                                    own peak does not show them)
    cap[G]     = G's plan's held bytes * (1 - max ratio[G])   its saved set must shrink by
                                                    its share of the worst call's excess
    others'[F] = max over F's calls (others at c - what the capped fragments' held sets at c
                 give up)
    re-plan F  with resident = max(others'[F], budget - own peak of F + share[F]) and its cap
               (if any): when it has a cap, or when that resident is more than its plan
               assumed (without a cap a re-plan only tightens)

The compiler then drops the Dynamo code of those fragments (``torch._dynamo.reset_code``) between
two calls of the model, Dynamo compiles them again at the next call, and the backend plans each
with ``budget - resident`` as its target (the same graph has the same identity, so the new record
replaces the old one). A re-planned fragment whose target cannot be met gets its smallest plan:
whether the step fits is decided by the next step's prediction, not one fragment at a time.
Rounds are bounded (``MAX_ROUNDS`` per step composition, ``MAX_REPLANS`` per fragment); when the
step is still over budget after them, the user is warned and ``memcompile.report()`` says so.

With ``offload_params="auto"``, one more kind of round comes first (once per model): when the
rounds are spent, or the last one's fragments all ran their smallest plans, and some of the
step's parameters are still on the device, the compiler re-plans every fragment of the step as
a new one with its parameters on the host (``Replan.host_params``), each counting the others'
as moved too. Re-planned one at a time, a fragment's own parameters on the host leave the
others' on the device, so none fits (the MoE at 0.6x its unplanned peak). The rounds above
count again from it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from memcompile.analysis.fragment_profile import FragmentProfile
from memcompile.analysis.step_model import StepPrediction

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
        saved_cap: per fragment, the bytes its new plan may hold from forward to backward
            (``None``: no cap); empty in rounds recorded before caps existed.
        host_params: a round that planned the fragments as new with their parameters on the
            host (``offload_params="auto"`` for the whole step, once the saved sets could give
            no more); its ``resident`` entries are ``None``.
    """

    round: int
    calls: int
    budget: int
    predicted_peak: int
    fragments: tuple[str, ...]
    resident: tuple[int | None, ...]
    peak_after: int | None = None
    saved_cap: tuple[int | None, ...] = ()
    host_params: bool = False

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
        saved_cap: fragment index -> bytes its new plan may hold from forward to backward
            (among the fragments to re-plan: those whose held saved sets share an over-budget
            call's excess).
    """

    resident: Mapping[int, int]
    others: Mapping[int, int]
    stuck: tuple[int, ...]
    saved_cap: Mapping[int, int] = field(default_factory=dict)


def decide_replan(
    prediction: StepPrediction,
    sequence: Sequence[tuple[int, str, int]],
    call_profiles: Sequence[FragmentProfile | None],
    *,
    budget: int,
    assumed: Mapping[int, int],
    replans: Mapping[int, int],
    held: Mapping[int, int] | None = None,
) -> ReplanDecision:
    """Which fragments of a step over ``budget`` to re-plan, with what resident bytes and
    saved-set caps.

    Args:
        prediction: ``simulate_step`` of ``sequence`` with ``call_profiles``.
        sequence: the step's calls (fragment index, kind, block key).
        call_profiles: each call's profile (``None``: an empty fragment).
        budget: the budget, bytes.
        assumed: fragment index -> resident bytes its current plan assumed (fragments without a
            plan are absent: nothing to re-plan).
        replans: fragment index -> times it was re-planned already.
        held: fragment index -> bytes its current plan holds from forward to backward
            (``FragmentPlan.held_bytes``, at the sizes it was planned for): the base of its
            saved-set cap. Fragments absent (or ``None``): no cap, as before caps existed.
    """
    if len(call_profiles) != len(sequence) or len(prediction.call_peaks) != len(sequence):
        raise ValueError(
            f"{len(sequence)} calls, {len(call_profiles)} call profiles and "
            f"{len(prediction.call_peaks)} call peaks"
        )
    held = held or {}
    own_max: dict[int, int] = {}
    share: dict[int, int] = {}
    # Of the held saved sets, the largest fraction any over-budget call asks each to give up.
    ratio: dict[int, float] = {}
    # Saved bytes of each fragment's open forward calls (as simulate_step keeps them).
    open_bytes: dict[int, int] = {}
    opened: dict[int, list[int]] = {}
    # Each call's running fragment, what the rest of the step holds then, and the open bytes.
    calls: list[tuple[int, int, dict[int, int]]] = []
    own_peaks = prediction.own_peaks or (None,) * len(sequence)
    for (index, kind, _), prof, peak, own in zip(
        sequence, call_profiles, prediction.call_peaks, own_peaks, strict=True
    ):
        if prof is None or own is None:
            continue
        if kind == "backward" and opened.get(index):
            open_bytes[index] -= opened[index].pop()
        parts = {f: b for f, b in open_bytes.items() if b > 0}
        calls.append((index, peak - own, parts))
        own_max[index] = max(own_max.get(index, 0), own)
        if peak > budget:
            # The excess is shared by what the plans control at this call: the running graph's
            # peak and the saved sets of the open calls, in proportion to their bytes.
            # Each part gives up the same fraction of its bytes.
            total = sum(parts.values()) + own
            excess = peak - budget
            share[index] = max(share.get(index, 0), -(-excess * own // total))  # rounded up
            for f in parts:
                ratio[f] = max(ratio.get(f, 0.0), min(1.0, excess / total))
        if kind == "forward":
            saved = prof.saved_bytes + prof.saved_input_bytes
            opened.setdefault(index, []).append(saved)
            open_bytes[index] = open_bytes.get(index, 0) + saved
    can = {i for i in assumed if replans.get(i, 0) < MAX_REPLANS}
    caps = {
        f: max(0, int(held[f] * (1.0 - r)))
        for f, r in sorted(ratio.items())
        if f in can and held.get(f) is not None and r > 0
    }
    # What the rest of the step holds at each fragment's worst call, once the capped
    # fragments' held sets have given up their shares (rounded up: never promise more room).
    others: dict[int, int] = {}
    after: dict[int, int] = {}
    for index, rest, parts in calls:
        others[index] = max(others.get(index, 0), rest)
        gives = sum(int(b * ratio[f]) for f, b in parts.items() if f in caps)
        after[index] = max(after.get(index, 0), rest - gives)
    resident: dict[int, int] = {}
    stuck: list[int] = []
    for index in sorted(share.keys() | ratio.keys()):
        if index not in assumed or index not in others:
            continue
        # Room for the rest of the step at its worst call, and its share of the excess.
        need = max(after[index], budget - own_max[index] + share.get(index, 0))
        if index in caps or (need > assumed[index] and index in can):
            resident[index] = need
        else:
            stuck.append(index)
    log.debug(
        "re-plan: others %s (after caps %s), shares %s, held-set ratios %s, re-plan %s, "
        "caps %s, stuck %s",
        others,
        after,
        share,
        {f: round(r, 4) for f, r in ratio.items()},
        resident,
        caps,
        stuck,
    )
    return ReplanDecision(resident=resident, others=others, stuck=tuple(stuck), saved_cap=caps)
