"""Without a budget, once the step is seen: memcompile stops watching it.

With no budget there is nothing to plan and nothing to check. The fragments' calls are recorded
only so that ``report()`` can predict the step, and the regions (``torch.nn`` modules called
from a frame Dynamo runs eagerly, ``backends/regions.py``) are compiled only for that: a region
runs its module's own ops and keeps what its module's autograd keeps (the natural zoo models
peak at eager's peak under either). Once the steps since the last compile have been seen
(:data:`OBSERVED_STEPS`), each model call runs in the *direct* mode::

    region call         the module's own call (not Dynamo's frame, guards and AOTAutograd's
                        runtime: about 200 us a call, forward and backward, on the 2-core CPU,
                        most of what a small module costs)
    fragment call       the compiled graphs, not recorded (their plans' memory stays)
    optimizer step      not watched

A compile (a new shape, a new frame) turns the mode off from the next model call (a call runs
in one mode) until its steps have been seen too; ``report()`` predicts the last step seen and
says since when the mode runs. Never with a budget, a budget fraction, parameters or optimizer
state in the host tier, a pilot asked for, or a trace.
"""

from __future__ import annotations

import logging

__all__ = ["OBSERVED_STEPS", "UnplannedWatch"]

log = logging.getLogger(__name__)

#: Steps seen through the compiled graphs after each compile, before the direct mode.
OBSERVED_STEPS = 2


class UnplannedWatch:
    """Whether a compiler's model calls run in the direct mode (no budget, the step seen).

    Attributes:
        direct: the mode of the model call in progress.
        since_step: the monitor's step count when the mode last turned on (``None``: off).
    """

    def __init__(self) -> None:
        self.direct = False
        self.since_step: int | None = None
        self._observed_at_compile = 0

    def reset(self) -> None:
        self.direct = False
        self.since_step = None
        self._observed_at_compile = 0

    def compiled(self, steps_observed: int) -> None:
        """A fragment compiled: its steps are seen before the mode turns on again (from the next
        model call: a call runs in one mode)."""
        self._observed_at_compile = steps_observed

    def call_starts(self, allowed: bool, steps_observed: int) -> None:
        """A model call starts: its mode. ``allowed``: nothing to plan or check (no budget, ...)."""
        direct = allowed and steps_observed - self._observed_at_compile >= OBSERVED_STEPS
        if direct and not self.direct:
            self.since_step = steps_observed
            log.info(
                "memcompile: no budget and the step seen (%d steps): regions call their modules "
                "directly and the fragments' calls are not recorded from now on",
                steps_observed,
            )
        elif not direct:
            self.since_step = None
        self.direct = direct
