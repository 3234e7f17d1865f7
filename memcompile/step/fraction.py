"""``budget="60%"``: a fraction of the peak of the user's iteration without a plan.

The budget cannot be known before the loop runs, so the first iterations run without one::

    iteration 1        compiles without a budget (its peak includes compiling: not measured)
    iteration 2        the first without a compile: measured, from its first fragment call to
                       its last optimizer step (a loop without an optimizer: to the next step
                       that begins with no gradients; CPU: the profiler, as ``measure_peak``;
                       CUDA: the allocator's peak counter, reset at its start)
                       -> budget = floor(fraction x peak); every frame compiled so far is
                       dropped and the compiler starts over with that budget
    iteration 3        compiles with the budget (re-plans once the loop is known, as always)
    iteration 4        sampled against the budget (step/checks.py)

The measured iteration must fit the device unplanned: to train a model that does not fit
without a plan, give the budget in bytes. On the CPU it is measured inside the user's own
``measure_peak`` too (its session, read when it ends: ``runtime/measure.py``), but never while
another profiler runs: after :data:`PROFILED_ITERATIONS` such iterations in a row the user is
told that the model runs without a budget.
"""

from __future__ import annotations

import logging
import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from memcompile.errors import MemoryBudgetWarning, format_bytes
from memcompile.runtime.measure import CpuInterval

__all__ = ["MAX_MEASURED_STEPS", "PROFILED_ITERATIONS", "BudgetFraction", "MeasuredBudget"]

log = logging.getLogger(__name__)

#: Steps the measured iteration may have: a loop that never ends one (no optimizer step, the
#: gradients never zeroed) is given up on there, not profiled forever.
MAX_MEASURED_STEPS = 64

#: Iterations in a row begun under another profiler (the user's own, which memcompile never
#: disturbs) after which the user is told that the budget waits for one without.
PROFILED_ITERATIONS = 3


@dataclass(frozen=True)
class MeasuredBudget:
    """A budget given as a fraction, resolved.

    Attributes:
        fraction: the fraction of the unplanned peak (``"60%"``: 0.6).
        unplanned_peak: the measured peak of an iteration without a plan, bytes.
        budget: ``floor(fraction * unplanned_peak)``, bytes.
        micro_batches: the measured iteration's steps (forward and backward).
        device: ``"cpu"`` or ``"cuda"``.
    """

    fraction: float
    unplanned_peak: int
    budget: int
    micro_batches: int
    device: str

    def describe(self) -> str:
        return (
            f"{format_bytes(self.budget)} ({100 * self.fraction:g}% of the "
            f"{format_bytes(self.unplanned_peak)} an iteration without a plan measured on the "
            f"{self.device}, {self.micro_batches} micro-batch(es))"
        )


class BudgetFraction:
    """Measures one unplanned iteration and resolves ``fraction`` of its peak to bytes.

    Args:
        fraction: in (0, 1].

    Attributes:
        resolved: the measured budget, once an iteration was measured (``None`` until then).
        attempts: iterations sampled so far (a sample that saw a compile is measured again).
        gave_up: the loop ended no iteration where it can be seen (:meth:`step_began`).
    """

    def __init__(self, fraction: float) -> None:
        self.fraction = fraction
        self._told = False  # how the budget is found: said at the first compile
        self.resolved: MeasuredBudget | None = None
        self.attempts = 0
        #: No iteration end was seen in :data:`MAX_MEASURED_STEPS` steps: not measured.
        self.gave_up = False
        self._sample: CpuInterval | None = None
        self._cuda: torch.device | None = None
        self._dirty = False
        self._steps = 0
        self._profiled = 0  # iterations in a row that began under another profiler
        self._told_profiled = False

    @property
    def measuring(self) -> bool:
        """An iteration is being measured now."""
        return self._sample is not None or self._cuda is not None

    def iteration_began(self, roots: tuple[Any, ...], device: torch.device) -> None:
        """An iteration's first step begins: measure it, unless the budget is known already, a
        measurement runs, or the user's profiler does (CPU: never disturbed)."""
        self._steps = 1
        if self.resolved is not None or self.measuring or self.gave_up:
            return
        self._dirty = False
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            self._cuda = device
        elif device.type == "cpu":
            self._sample = CpuInterval.start(*roots)  # None while the user's profiler runs
            self._profiled = 0 if self._sample is not None else self._profiled + 1
            if self._profiled == PROFILED_ITERATIONS and not self._told_profiled:
                self._told_profiled = True
                warnings.warn(
                    f"memcompile: budget={self.fraction:.0%} is measured over an iteration "
                    f"that runs under no other profiler; the last {self._profiled} began under "
                    "one (torch.profiler), so the model runs without a budget until an "
                    "iteration does. Give the budget in bytes to profile every iteration",
                    MemoryBudgetWarning,
                    stacklevel=6,
                )

    def step_began(self) -> None:
        """A step that does not begin an iteration begins (a later micro-batch). After
        :data:`MAX_MEASURED_STEPS` such steps in a row the loop ends no iteration where it can
        be seen: the measurement is given up."""
        self._steps += 1
        if self._steps > MAX_MEASURED_STEPS:
            self.give_up(
                f"nor with a step that begins with no gradients ({MAX_MEASURED_STEPS} steps seen)"
            )

    def give_up(self, where: str) -> None:
        """This loop ends no iteration where it can be measured (``where``: what it lacks): stop,
        for good, and tell the user (once: the loop runs without a budget)."""
        self.cancel()
        if self.gave_up:
            return
        self.gave_up = True
        warnings.warn(
            f"memcompile: budget={self.fraction:.0%} is measured over one iteration, which ends "
            "at an optimizer step of the model or, in a loop without one, where a call begins "
            f"with no gradients; this loop ends none there, {where}, so it runs without a "
            "budget. Give the budget in bytes",
            MemoryBudgetWarning,
            stacklevel=6,
        )

    def compiling(self) -> None:
        """A fragment compiles: the iteration being measured is not a steady one. At the first,
        the user is told how the budget will be found."""
        if self.resolved is not None:
            return
        if not self._told:
            self._told = True
            log.warning(
                "memcompile: budget=%s: the first iterations run without a plan; the first one "
                "that compiles nothing is measured, and the model is compiled again with %s of "
                "its peak as the budget",
                f"{self.fraction:.0%}",
                f"{self.fraction:.0%}",
            )
        self._dirty = True

    def cancel(self) -> None:
        """Stop measuring without a result."""
        sample, self._sample, self._cuda = self._sample, None, None
        if sample is not None:
            sample.cancel()

    def iteration_ended(self) -> MeasuredBudget | None:
        """The measured iteration ended: the budget, or ``None`` when this iteration cannot
        tell it (it compiled, or the profiler lost events) and the next one is measured, or
        when it is measured inside the user's own ``measure_peak``, whose session is read
        when that ends (the budget is resolved then, before the model's next call)."""
        sample, cuda = self._sample, self._cuda
        if sample is None and cuda is None:
            return None
        self._sample = self._cuda = None
        dirty, steps = self._dirty, self._steps
        if cuda is not None:
            return self._measured(torch.cuda.max_memory_allocated(cuda), True, dirty, steps, "cuda")
        assert sample is not None
        m = sample.end()  # incomplete if another profiling session stopped it
        if m is None:
            sample.then(lambda m: self._measured(m.peak, m.complete, dirty, steps, "cpu"))
            return None
        return self._measured(m.peak, m.complete, dirty, steps, "cpu")

    def _measured(
        self, peak: int, complete: bool, dirty: bool, steps: int, device: str
    ) -> MeasuredBudget | None:
        if self.resolved is not None:  # (an iteration measured before, read later)
            return None
        self.attempts += 1
        if dirty or not complete:
            log.info(
                "memcompile: budget %g%%: the measured iteration %s; measuring the next one",
                100 * self.fraction,
                "compiled" if dirty else "lost profiler events",
            )
            return None
        budget = max(1, math.floor(self.fraction * peak))
        self.resolved = MeasuredBudget(self.fraction, peak, budget, steps, device)
        log.info("memcompile: budget resolved to %s", self.resolved.describe())
        return self.resolved
