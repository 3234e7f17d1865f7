"""The whole step against the budget, and the re-plans that follow.

Fragments are planned one at a time, each with what it knows of the rest of the step. Once a
step has run, its calls are replayed (``analysis/step_model.py``)::

    prediction = simulate_step(profiles, calls, resident)     # predict()
    over the budget?  -> decide_replan (planning/replan.py): which fragments to plan again,
                         with what the rest of the step holds, and a cap on their saved sets
                      -> the host round (offload_params="auto"): every fragment of the step
                         again, its parameters on the host tier
                      -> else a StepOver for the compiler to warn about

A re-plan drops the fragments' Dynamo code before the model's next call; Dynamo compiles them
again and the compiler takes each one's queued figures (:meth:`StepBudget.take_awaiting`). The
step's first backward also shows what plans assume wrongly (outputs the caller dropped,
incoming gradients no one else held): those fragments are re-planned without them.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import CodeType
from typing import Any

import torch

from memcompile.analysis.fragment_profile import FragmentProfile
from memcompile.analysis.step_model import StepPrediction, simulate_step
from memcompile.config import MemConfig
from memcompile.errors import MemoryBudgetWarning, format_bytes
from memcompile.planning.replan import MAX_REPLANS, MAX_ROUNDS, Replan, decide_replan
from memcompile.records import FragmentRecord, StepEvent
from memcompile.runtime.measure import storage_sizes
from memcompile.step.iteration import IterationWatch
from memcompile.step.monitor import OutputsFound, StepMonitor
from memcompile.step.resident import ResidentSet

__all__ = ["Awaited", "OptimizerOver", "StepBudget", "StepOver"]

log = logging.getLogger(__name__)

#: Step compositions remembered as already checked against the budget (then forgotten).
MAX_CHECKED_STEPS = 4096

#: (record, resident bytes, saved-set cap) a fragment whose code was dropped compiles again
#: with: the next compile of the same graph takes the record's index and plans with those.
Awaited = tuple[FragmentRecord, int | None, int | None]


@dataclass(frozen=True)
class StepOver:
    """A step predicted over the budget that re-planning does not fit (to be warned about).

    Attributes:
        peak: the predicted step peak.
        calls: calls in the step.
        why: why re-planning did not fit it.
        used: the step's fragments.
        several: whether to say so as a multi-fragment step (several fragments, or re-planned):
            else as a single fragment whose plan fit when it was made.
        state_bytes: the optimizers' state the step held (``step/iteration.py``).
        grad_bytes: the gradients the step began with (a later micro-batch).
    """

    peak: int
    calls: int
    why: str
    used: frozenset[int]
    several: bool
    state_bytes: int = 0
    grad_bytes: int = 0


@dataclass(frozen=True)
class OptimizerOver:
    """An optimizer step predicted over the budget (to be raised or warned about).

    Attributes:
        peak: its predicted peak.
        resident: the parameters and buffers on the device (and others' memory, on CUDA).
        grads: the gradients on the device when it began.
        state: the optimizers' state on the device.
        transient: what the step allocates and frees again.
        optimizers: each optimizer of the model, described (``AdamW (for-loop) state 1 MiB``).
    """

    peak: int
    resident: int
    grads: int
    state: int
    transient: int
    optimizers: tuple[str, ...]


def _cap_note(cap: int | None) -> str:
    """``", saved <= 12.00 KiB"`` for a re-plan's saved-set cap, ``""`` without one."""
    return "" if cap is None else f", saved <= {format_bytes(cap)}"


def reset_codes(codes: Iterable[CodeType]) -> None:
    """Drop Dynamo's compiled code of these frames: they compile again at their next call (no
    frame of them may be running)."""
    with torch._dynamo.convert_frame.compile_lock:
        for code in codes:
            torch._dynamo.reset_code(code)


class StepBudget:
    """The step's prediction against ``config.budget`` and the re-plan queue.

    Attributes:
        replans: re-planning rounds of steps predicted over budget, in order.
        over_budget: a step was predicted or measured over the budget (or started with more
            allocated than its plan assumed).
        unseen: bytes a measured iteration peaked above its prediction (CPU samples): memory
            the plans do not see, such as the glue a fallen-back frame runs between fragments
            (backends/regions.py). Every later prediction counts them as resident, so a step
            they push over the budget is re-planned with that much less room.
    """

    def __init__(
        self,
        config: MemConfig,
        records: Any,
        monitor: StepMonitor,
        resident: ResidentSet,
        iteration: IterationWatch | None = None,
    ) -> None:
        self._config = config
        self._records = records
        self._monitor = monitor
        self._resident = resident
        self._iteration = iteration
        self.replans: list[Replan] = []
        self.over_budget = False
        self.unseen = 0
        #: The iteration's phases, as last predicted (``"first micro-batch"``, ``"later
        #: micro-batches"``, ``"optimizer step"``) -> peak: what ``report().iteration`` shows.
        self.iteration_peaks: dict[str, int] = {}
        self._optimizer_warned: set[tuple[str, ...]] = set()
        # An optimizer step over the budget asked for the host round: judged at the next one.
        self._optimizer_hosting = False
        self._checked_steps: set[tuple[Any, ...]] = set()
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
        # Identity -> fragments whose code was dropped, queued to compile again.
        self._awaiting: dict[str, list[Awaited]] = {}
        # Codes to drop before the model's next call (between two calls nothing of them runs).
        self._pending_codes: list[CodeType] = []
        self._warned_steps: set[tuple[tuple[int, str], ...]] = set()
        # Fragment identity -> incoming gradients (names) its plan assumes no one else holds.
        self._released_tangents: dict[str, frozenset[str]] = {}
        # Fragment index -> re-plans made for what a first backward showed (_check_observed).
        self._observed_replans: dict[int, int] = {}
        # Fragment identity -> output positions its plan assumes dropped before the backward.
        self._dropped_outputs: dict[str, frozenset[int]] = {}
        self._dropped_warned: set[str] = set()

    def reset(self) -> None:
        """Forget every check and queued re-plan (the fragments are gone)."""
        self.replans.clear()
        self.over_budget = False
        self.unseen = 0
        self.iteration_peaks.clear()
        self._optimizer_warned.clear()
        self._optimizer_hosting = False
        self._checked_steps.clear()
        self._codes.clear()
        self._reserves.clear()
        self._replan_counts.clear()
        self._replanned.clear()
        self._replan_rounds.clear()
        self._host_rounds.clear()
        self._hosting_replans.clear()
        self._awaiting.clear()
        self._pending_codes.clear()
        self._warned_steps.clear()
        self._dropped_outputs.clear()
        self._dropped_warned.clear()
        self._released_tangents.clear()
        self._observed_replans.clear()

    # -- what a fragment compiles with -------------------------------------------------------
    def take_awaiting(self, identity: str) -> Awaited | tuple[None, None, None]:
        """The queued re-plan of a fragment with this identity, if one awaits its compile."""
        awaiting = self._awaiting.get(identity)
        if not awaiting:
            return (None, None, None)
        # The step changes with its fragment: every composition is checked again, and the
        # micro-batches' predicted peaks are those of the steps checked from now on.
        self._checked_steps.clear()
        for phase in ("first micro-batch", "later micro-batches"):
            self.iteration_peaks.pop(phase, None)
        return awaiting.pop(0)

    def host_replan(self, index: int) -> bool:
        """Whether F{index} compiles again for the host round (then no longer awaited)."""
        hosting = index in self._hosting_replans
        self._hosting_replans.discard(index)
        return hosting

    def compiled(self, index: int, code: CodeType | None, reserve: int | None = None) -> None:
        """F{index} compiled from Dynamo ``code`` (what a re-plan drops); ``reserve``: the
        prefetch reserve its plan added to its resident bytes."""
        if code is not None:
            self._codes[index] = weakref.ref(code)
        if reserve is not None:
            self._reserves[index] = reserve

    def drop_compiled(self) -> int:
        """Drop the code of every fragment compiled (and still alive) now, as a re-plan does:
        Dynamo compiles them all again (``budget="60%"`` once measured). Returns how many."""
        codes = (self._codes[i]() for i in sorted(self._codes))
        alive = [c for c in codes if c is not None]
        self._pending_codes.extend(alive)
        self.apply_replans()
        return len(alive)

    def dropped_outputs(self, identity: str) -> frozenset[int]:
        """Output positions a fragment's plan counts as dropped by the caller before the
        backward (as steps showed); empty: all held."""
        return self._dropped_outputs.get(identity, frozenset())

    def released_tangents(self, identity: str) -> frozenset[str]:
        """Names of a fragment's incoming gradients its plan counts as freed after their last
        reader (no one else held them, as steps showed); empty: all held to the end."""
        return self._released_tangents.get(identity, frozenset())

    def apply_replans(self) -> None:
        """Drop the code of the fragments to re-plan (between two model calls, or in a call when
        there is no call hook); Dynamo then compiles them again."""
        codes, self._pending_codes = self._pending_codes, []
        if codes:
            reset_codes(codes)
            log.info("memcompile: dropped %d compiled frame(s) to re-plan them", len(codes))

    # -- the step's prediction ---------------------------------------------------------------
    def predict(
        self, extra_resident: Iterable[torch.Tensor] = (), *, iteration: bool = False
    ) -> tuple[StepPrediction | None, tuple[StepEvent, ...], int, list[FragmentProfile | None]]:
        """(prediction, replayed calls, resident bytes, the profile each call was replayed
        with) of the most recent step.

        Resident: the parameters and buffers of every block that ran, of the compiled module when
        known, and ``extra_resident``. With ``iteration``, as the training loop runs it: also
        the state of the optimizers that step the model, and the gradients the step began with
        (a later micro-batch; ``step/iteration.py``)."""
        records = self._records()
        static = self._resident.step_storages()
        static.update(storage_sizes(extra_resident))
        resident = sum(static.values()) + (self._resident.device_other_bytes or 0) + self.unseen
        present: Mapping[int, int] = {}
        if iteration and self._iteration is not None:
            present = self._monitor.current_step_grads()
            resident += self._iteration.state_bytes + sum(present.values())
        seq, sizes, kept = self._monitor.sequence_sizes_views()
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
                grads_present=frozenset(present),
            )
            if seq
            else None
        )
        return prediction, seq, resident, call_profiles

    # -- the step's check --------------------------------------------------------------------
    def step_peak(self) -> int:
        """The predicted peak of the most recent step, as predicted now (0: none predicted)."""
        prediction = self.predict(iteration=True)[0]
        return 0 if prediction is None else prediction.peak

    def forward_peak(self) -> int:
        """The predicted peak of the most recent step's forward calls (0: none predicted)."""
        prediction, seq, _, _ = self.predict(iteration=True)
        if prediction is None:
            return 0
        peaks = [
            p
            for p, (_, kind, _) in zip(prediction.call_peaks, seq, strict=True)
            if kind != "backward"
        ]
        return max(peaks, default=0)

    def measured_unseen(self, nbytes: int) -> None:
        """A measured iteration peaked ``nbytes`` above its prediction: count them from now on
        (:attr:`unseen`), and check the next step again with them."""
        self.unseen += nbytes
        self._checked_steps.clear()
        log.warning(
            "memcompile: a measured iteration peaked %s above its prediction (memory the plans "
            "do not see: eager code between fragments); predictions count %s more from now on, "
            "and a step that puts over the budget is re-planned",
            format_bytes(nbytes),
            format_bytes(self.unseen),
        )

    def check(self) -> StepOver | None:
        """Check the step that just ended, once per new composition, and re-plan the fragments
        that did not know what the rest of the step holds (planning/replan.py). Returns what to
        warn about when nothing re-planned fits it."""
        budget = self._config.budget
        last_step = self._monitor.last_step
        if budget is None or not last_step:
            return None
        shape = tuple(
            (i, k, n)
            for (i, k, _), n in zip(last_step, self._monitor.last_step_sizes, strict=False)
        )
        # The loop's state too: the optimizers' state, and the gradients the step began with.
        grads = sum(self._monitor.last_step_grads.values())
        state = self._iteration.state_bytes if self._iteration is not None else 0
        key = (shape, state, grads)
        if key in self._checked_steps:
            return None
        if len(self._checked_steps) >= MAX_CHECKED_STEPS:  # a dynamic model: new every step
            self._checked_steps.clear()
        self._checked_steps.add(key)
        prediction, seq, _, call_profiles = self.predict(iteration=True)
        if prediction is None:
            return None
        if prediction.peak > budget and self._offload_state():
            key = (shape, self._iteration.state_bytes if self._iteration else 0, grads)
            self._checked_steps.add(key)
            prediction, seq, _, call_profiles = self.predict(iteration=True)
            assert prediction is not None
        phase = "later micro-batches" if grads else "first micro-batch"
        self.iteration_peaks[phase] = prediction.peak
        if self._pending_codes:  # re-plans asked for since (what a backward showed): they tell
            self._checked_steps.discard(key)
            return None
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
            return None
        used = {i for i, _, _ in shape}
        records = {r.index: r for r in self._records()}
        # A fragment whose own plan did not fit was reported (error or warning) when it was
        # planned. With other fragments in the step, re-planning still lowers it (best effort):
        # that plan counted what the step held then, e.g. parameters other fragments have
        # moved to the host since. Alone, its plan knew the whole step.
        reported = any(
            r.plan is not None
            and not r.plan.feasible
            and not r.step_decides  # (left to this check: not reported)
            and i not in self._replanned
            for i, r in records.items()
            if i in used
        )
        if reported and len(used) == 1:
            self.over_budget = True
            return None
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
            stuck, requested = self._replan_round(prediction, seq, call_profiles, records, rounds)
            if requested:
                self._replan_rounds[calls] = len(self.replans) - 1
                self._checked_steps.discard(key)  # check it again, re-planned
                return None
        if self._host_round(prediction.peak, seq, used, records, rounds + 1):
            self._replan_rounds[calls] = len(self.replans) - 1
            self._host_rounds[calls] = rounds + 1
            self._checked_steps.discard(key)
            return None
        self.over_budget = True
        if reported and not rounds:
            return None  # said when its fragment was planned
        if calls in self._warned_steps:  # a dynamic model: the same calls at other sizes
            return None
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
        return StepOver(
            peak=prediction.peak,
            calls=len(last_step),
            why=why,
            used=frozenset(used),
            several=len(used) > 1 or bool(rounds),
            state_bytes=state,
            grad_bytes=grads,
        )

    def _replan_round(
        self,
        prediction: StepPrediction,
        seq: Sequence[StepEvent],
        call_profiles: list[FragmentProfile | None],
        records: Mapping[int, FragmentRecord],
        rounds: int,
    ) -> tuple[tuple[int, ...], bool]:
        """Re-plan the fragments :func:`decide_replan` picks with what the rest of the step
        holds. Returns the fragments over budget that cannot be re-planned tighter, and whether
        a round was requested."""
        budget = self._config.budget
        assert budget is not None
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
        chosen = {i: b for i, b in decision.resident.items() if self._code_of(i) is not None}
        if not chosen:
            return decision.stuck, False
        # A re-plan without a new cap keeps the one its plan had (caps only tighten).
        caps: dict[int, int | None] = {}
        for i in chosen:
            old = records[i].plan
            caps[i] = decision.saved_cap.get(i, old.saved_cap if old else None)
        self.request_replan(chosen, records, caps)
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
        log.info(
            "memcompile: a %d-call step is predicted to peak at %s, over budget=%s: "
            "re-planning %s (round %d) with what the rest of the step holds",
            len(seq),
            format_bytes(prediction.peak),
            format_bytes(budget),
            ", ".join(f"F{i} ({format_bytes(b)}{_cap_note(caps[i])})" for i, b in chosen.items()),
            rounds + 1,
        )
        return decision.stuck, True

    def _may_host_step(self, used: set[int], records: Mapping[int, FragmentRecord]) -> bool:
        """Whether ``offload_params="auto"`` may still put the parameters of the step's
        fragments (``used``) on the host: not done yet, and some are on the device."""
        if self._resident.host_step or self._config.offload_params != "auto":
            return False
        return bool(self._resident.hostable_on_device(used, dict(records)))

    def _host_round(
        self,
        peak: int,
        seq: Sequence[StepEvent],
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
        self._resident.host_step = True
        self.request_replan(chosen, records, dict.fromkeys(chosen))
        self._hosting_replans.update(chosen)
        # Plans of their own now (not the step's figures): the budget's re-plans count afresh.
        for i in chosen:
            self._replan_counts.pop(i, None)
        self.replans.append(
            Replan(
                round=round_,
                calls=len(seq),
                budget=self._config.budget or 0,
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
            format_bytes(self._config.budget or 0),
            ", ".join(f"F{i}" for i in chosen),
            round_,
        )
        return True

    def _offload_state(self) -> bool:
        """``offload_optimizer="auto"`` on a step or optimizer step over the budget: the
        optimizers' state to the host tier, first (on the CPU device it costs no step time: the
        step updates it in place there). Returns whether any moved."""
        watch = self._iteration
        if watch is None or self._config.offload_optimizer != "auto" or watch.offloading:
            return False
        if not watch.state_bytes:
            return False
        return watch.offload_state() > 0

    def _code_of(self, index: int) -> CodeType | None:
        ref = self._codes.get(index)
        return ref() if ref is not None else None

    def request_replan(
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

    # -- the optimizer step ------------------------------------------------------------------
    def first_step_over(self, new_state: int, transient: int) -> bool:
        """Whether an optimizer's first step, about to make ``new_state`` bytes of state on the
        device, with this ``transient``, would pass the budget (``offload_optimizer="auto"``
        then makes the state in the tier: ``step/iteration.py``)."""
        budget, watch = self._config.budget, self._iteration
        if budget is None or watch is None:
            return False
        base = sum(self._resident.step_storages().values())
        base += self._resident.device_other_bytes or 0
        return base + watch.grads_at_step + watch.state_bytes + new_state + transient > budget

    def optimizer_step(self) -> OptimizerOver | None:
        """An optimizer of this model stepped (``step/iteration.py``): the optimizer step's
        predicted peak. Over the budget, re-planning cannot lower it but by the host tier: with
        ``offload_params="auto"`` the step's fragments are planned again with their parameters
        (and so their gradients) on the host. Returns it when nothing pending or possible can
        bring it under and it was not reported for this state yet."""
        watch = self._iteration
        if watch is None:
            return None
        base = sum(self._resident.step_storages().values())
        base += self._resident.device_other_bytes or 0
        grads, state, transient = watch.grads_at_step, watch.state_bytes, watch.transient
        peak = base + grads + state + transient
        budget = self._config.budget
        if budget is not None and peak > budget and self._offload_state():
            state = watch.state_bytes
            peak = base + grads + state + transient
        self.iteration_peaks["optimizer step"] = peak
        if budget is None or peak <= budget:
            return None
        if self._optimizer_hosting:  # the host round it asked for had its iteration
            self._optimizer_hosting = False
        else:
            records = {r.index: r for r in self._records()}
            seq = self._monitor.last_step
            used = {i for i, _, _ in seq}
            round_ = max((r.round for r in self.replans), default=0) + 1
            if self._host_round(peak, seq, used, records, round_):
                self._optimizer_hosting = True  # the next optimizer step tells
                return None
        self.over_budget = True
        costs = tuple(sorted(c.describe() for c in list(watch.optimizers.values())))
        key = (*costs, str(grads))
        if key in self._optimizer_warned:
            return None
        self._optimizer_warned.add(key)
        return OptimizerOver(peak, base, grads, state, transient, costs)

    # -- what the step's first backward showed -----------------------------------------------
    def first_backward(
        self, index: int, outputs: OutputsFound | None, held: frozenset[int]
    ) -> None:
        """With what the step's first backward (of F{index}) showed, decide on re-plans:
        ``outputs``, what its start found of the last forward's held outputs; ``held``, its
        incoming gradients (input positions) that someone else held through it."""
        if self._config.budget is None:  # nothing to re-plan: the replay reads the above
            return
        records = {r.index: r for r in self._records()}
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

    def _check_observed(
        self,
        outputs: OutputsFound | None,
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
        budget = self._config.budget
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
            self.request_replan(chosen, records, {}, counts=self._observed_replans)
