"""Each training step's measured device peak, against the budget (CUDA).

A plan's prediction covers the compiled fragments. Frames Dynamo runs eagerly (an MoE's
data-dependent expert loop), Python code between fragments and anything else the step allocates
are not planned, so a step can exceed its budget although every fragment fits. On CUDA the
allocator knows: ``torch.cuda.max_memory_allocated``. The backend never resets that counter (it
is the user's figure); it reads it when the first fragment compiles and wherever one step ends
and the next begins, and a step during which it rose above the budget is reported once with a
``MemoryBudgetWarning`` and in ``report(compiled).measured_peak``:

    step k starts:  m0 = max_memory_allocated()
    step k ends:    m1 = max_memory_allocated()
    m1 > m0  ->  step k peaked at m1 (m1 = m0: nothing new is known)
    m1 < m0  ->  someone reset the counter during step k (memcompile.measure_peak does): m1 was
                 reached after that, within step k
    m1 > budget + 2 %  ->  warn once (the DESIGN's tolerance for a measured peak)

The counter only rises, so a step that merely repeats an earlier step's peak adds nothing: the
first step that overruns is the one told (a step overrunning the same way every time is caught
at the first). The optimizer step and other code between two training steps fall in the
interval too: the budget covers them as well. So does compiling (the first step's, or a
recompile's): planning runs kernels on the device to measure their scratch memory
(``analysis/workspace.py``); the warning says when a step compiled.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

__all__ = ["TOLERANCE", "PeakWatch"]

#: How far above the budget a measured peak may be before it counts as exceeded.
TOLERANCE = 0.02


@dataclass
class PeakWatch:
    """Reads the device's peak counter at step boundaries (see the module docstring); the first
    reading is taken when it is made.

    Attributes:
        budget: the step's budget in bytes.
        read: the device's peak counter (``torch.cuda.max_memory_allocated`` for the device).
        measured: the highest peak a step was seen to reach, bytes (``None``: none seen yet).
        exceeded: steps seen over the budget.
    """

    budget: int
    read: Callable[[], int]
    measured: int | None = None
    exceeded: int = 0
    _start: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._start = self.read()

    def step_boundary(self) -> int | None:
        """One step ended and the next begins. Returns the peak the step that ended reached when
        it exceeded the budget."""
        now = self.read()
        start, self._start = self._start, now
        if now == start:  # no new peak (or a reset and the very same one: nothing to tell)
            return None
        self.measured = max(self.measured or 0, now)
        if now <= self.budget * (1 + TOLERANCE):
            return None
        self.exceeded += 1
        log.info(
            "memcompile: a step peaked at %d bytes on the device (budget %d)", now, self.budget
        )
        return now
