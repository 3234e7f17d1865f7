"""``pilot="auto"`` decides by measurement: steps with the pilot against steps fetching on demand.

Once the model is seen to be dynamic with parameters on the host, the prefetcher runs a trial
(``prefetch.py``) and keeps the faster way::

    trial = PilotTrial()
    on = trial.begin_step(time.perf_counter(), compiles)   # each step's first forward call
    ...                                                    # run the pilot this step, or not
    trial.decided, trial.keep, trial.reason                # once the schedule is done

The schedule is :data:`ROUNDS` rounds of two steps fetching on demand, then two with the pilot.
A step lasts from its first forward call to the next step's (its backward, the loop's own work);
once the loop's optimizer has stepped, the trial's step is the whole iteration (its
micro-batches and the optimizer step: with gradient accumulation the last micro-batch carries
the optimizer step, the others do not). Only the second step of each pair is measured: the first
absorbs the switch (a pilot turned on has not prefetched the step's first block; one turned off
leaves copies to free). A measured step during which a fragment compiled (a re-plan, a new
expert's graph) says nothing about either way: its pair is run again, at most
:data:`MAX_REPEATS` times. The pilot is kept when the median of its steps is below the median of
the on-demand steps; ``reason`` gives both figures, for the report.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

__all__ = ["MAX_REPEATS", "ROUNDS", "PilotTrial"]

#: Rounds of (2 steps on demand, 2 steps with the pilot).
ROUNDS = 3
#: Pairs run again because a fragment compiled in their measured step, at most.
MAX_REPEATS = 6


@dataclass
class PilotTrial:
    """The trial's schedule, its samples and, once done, its decision."""

    rounds: int = ROUNDS
    #: the phase of each step to come: True with the pilot
    schedule: list[bool] = field(default_factory=list)
    #: measured step seconds, by phase (True: with the pilot)
    samples: dict[bool, list[float]] = field(default_factory=lambda: {False: [], True: []})
    decided: bool = False
    keep: bool = False
    reason: str = ""
    repeats: int = 0
    # the step running now: when it began, the compiles before it, its phase, measured or not
    _started: float | None = None
    _compiles: int = 0
    _phase: bool = False
    _measured: bool = False

    def __post_init__(self) -> None:
        if not self.schedule:
            for _ in range(self.rounds):
                self.schedule += [False, False, True, True]

    def begin_step(self, now: float, compiles: int) -> bool:
        """A step begins at ``now`` (seconds) with ``compiles`` fragment compiles so far: close
        the step before it, and return whether the pilot runs in this one."""
        if self.decided:
            return self.keep
        if self._started is not None and self._measured:
            if compiles == self._compiles:
                self.samples[self._phase].append(now - self._started)
            elif self.repeats < MAX_REPEATS:
                self.repeats += 1
                self.schedule[:0] = [self._phase, self._phase]  # that pair again
        if not self.schedule:
            self._decide()
            return self.keep
        # The second of a pair is measured: the first absorbed the switch.
        self._phase = self.schedule.pop(0)
        self._measured = not self.schedule or self.schedule[0] != self._phase
        self._started, self._compiles = now, compiles
        return self._phase

    def _decide(self) -> None:
        self.decided = True
        off, on = self.samples[False], self.samples[True]
        if not off or not on:
            self.keep = False
            self.reason = (
                "pilot='auto' could not time the pilot against fetching on demand (fragments "
                "compiled in every trial step): off"
            )
            return
        t_off, t_on = statistics.median(off), statistics.median(on)
        self.keep = t_on < t_off
        self.reason = (
            f"pilot='auto' measured {1e3 * t_on:.1f} ms a step with the pilot against "
            f"{1e3 * t_off:.1f} ms fetching on demand (median of {len(on)} and {len(off)} "
            f"steps): {'on' if self.keep else 'off'}"
        )
