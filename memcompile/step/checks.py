"""What is checked when a step ends, besides the budget's prediction (``budget.py``).

    measured peak   CUDA: the allocator's peak over the step against the budget
                    (runtime/peakwatch.py); over it -> MemoryBudgetWarning, once (once more for
                    a step without compiles)
    gradient order  an input whose several contributions a fragment's backward sums, after
                    another call of the step added to its gradient first: the last bits may
                    differ from eager's -> GradientOrderWarning, once per fragment input

Both only read the step the monitor recorded; neither changes a plan.
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable, Mapping

import torch

from memcompile.config import MemConfig
from memcompile.errors import GradientOrderWarning, MemoryBudgetWarning, format_bytes
from memcompile.records import FragmentRecord, StepEvent, parameter_name
from memcompile.runtime.peakwatch import PeakWatch
from memcompile.step.budget import MAX_CHECKED_STEPS, StepBudget
from memcompile.step.monitor import StepMonitor

__all__ = ["StepChecks"]

log = logging.getLogger(__name__)


class StepChecks:
    """The end-of-step checks of one compiler.

    Args:
        config: the compiler's options.
        records: the compiled fragments (``MemCompiler.records``).
        monitor: the recorded steps.
        budget: told when a measured step exceeds the budget (``over_budget``).
        eager_frames: how many frames Dynamo ran eagerly (named in the warning).

    Attributes:
        peak_watch: CUDA with a budget: each step's measured peak against it.
        summed_grads: ``F{i}: source`` of each input whose gradient a step added up in another
            order than eager (summed in a fragment's backward after another call added to it).
    """

    def __init__(
        self,
        config: MemConfig,
        records: Callable[[], list[FragmentRecord]],
        monitor: StepMonitor,
        budget: StepBudget,
        eager_frames: Callable[[], int],
    ) -> None:
        self._config = config
        self._records = records
        self._monitor = monitor
        self._budget = budget
        self._eager_frames = eager_frames
        self.peak_watch: PeakWatch | None = None
        self.summed_grads: list[str] = []
        self.compiled_in_step = False
        # Whether a step over the budget was warned about, for steps that compiled (planning
        # runs kernels on the device) and for those that did not: once each.
        self._peak_warned: set[bool] = set()
        self._order_checked_steps: set[tuple[StepEvent, ...]] = set()

    def reset(self) -> None:
        """Forget what was checked (the fragments are gone)."""
        self.peak_watch = None
        self._peak_warned.clear()
        self._order_checked_steps.clear()
        self.summed_grads.clear()

    def watch(self, device: torch.device | None) -> None:
        """A fragment compiles for ``device``: on CUDA with a budget, start reading the
        allocator's peak at step boundaries (once)."""
        budget = self._config.budget
        if self.peak_watch is None and budget is not None and device is not None:
            if device.type == "cuda":
                self.peak_watch = PeakWatch(
                    budget, functools.partial(torch.cuda.max_memory_allocated, device)
                )

    # -- the measured peak -------------------------------------------------------------------
    def measured_peak(self) -> None:
        """CUDA: what the allocator saw during the step that just ended."""
        watch, compiled = self.peak_watch, self.compiled_in_step
        self.compiled_in_step = False
        if watch is None:
            return
        peak = watch.step_boundary()
        if peak is None:
            return
        self._budget.over_budget = True
        if compiled in self._peak_warned:
            return
        self._peak_warned.add(compiled)
        eager = self._eager_frames()
        why = (
            f"{eager} frame(s) Dynamo runs eagerly (report(...).fallbacks), whose memory no plan "
            "manages, or "
            if eager
            else ""
        )
        compiling = (
            " (fragments were compiled during that step: planning measures kernels on the device)"
            if compiled
            else ""
        )
        warnings.warn(
            f"memcompile: a training step reached {format_bytes(peak)} on the device "
            f"(torch.cuda.max_memory_allocated), above budget={format_bytes(watch.budget)}"
            f"{compiling}; what the plans do not see exceeds it: {why}memory the step's Python "
            "code or the optimizer allocates between the compiled fragments. Warned once "
            "(once more for a step without compiles); report(...).measured_peak keeps the "
            "highest step peak",
            MemoryBudgetWarning,
            stacklevel=3,
        )

    # -- the gradients' order ----------------------------------------------------------------
    def grad_order(self) -> None:
        """Warn about inputs whose gradient the step that just ended added up out of eager's
        order.

        An input whose several contributions a fragment's backward graph sums (a parameter
        read several times, not split; an input an op reads through several autograd edges,
        torch.rms_norm: rewrites/input_uses.py): eager adds them one at a time to what earlier
        backward calls gave the same gradient, so where an earlier call of the step added to
        it first the association (and the last bits) differ. Inputs by storage: parameters by
        their call's parameter set, activations by the addresses their forward call saw (an
        activation's address could be reused within the step: then this warns when it need
        not). Once per new step composition; warned once per fragment input. Only fragment
        calls are seen: a frame Dynamo runs eagerly that adds to the same gradient first is
        not (it is warned about as an eager frame already)."""
        everyone = {r.index: r for r in self._records()}
        records = {i: r for i, r in everyone.items() if r.summed_inputs}
        step = self._monitor.last_step
        if not records or step in self._order_checked_steps:
            return
        if len(self._order_checked_steps) >= MAX_CHECKED_STEPS:
            self._order_checked_steps.clear()
        self._order_checked_steps.add(step)
        storages = self._monitor.last_step_storages
        opened: dict[int, list[Mapping[int, int]]] = {}  # fragment -> its open forwards' grads
        added: set[int] = set()  # storages some backward call added a gradient to so far
        for k, (index, kind, block) in enumerate(step):
            if kind == "forward":
                grads = storages[k].grad_inputs if k < len(storages) else {}
                opened.setdefault(index, []).append(grads)
            if kind != "backward" or index not in everyone:
                continue
            stack = opened.get(index)
            inputs = dict(stack.pop() if stack else {})  # activations, then parameters
            inputs.update(everyone[index].block_inputs.get(block, {}))
            record = records.get(index)
            if record is not None:
                for pos in record.summed_inputs:
                    address = inputs.get(pos)
                    if address is not None and address in added:
                        self._warn_grad_order(record, pos)
            added.update(inputs.values())

    def _warn_grad_order(self, record: FragmentRecord, pos: int) -> None:
        sources = record.identity.sources
        source = parameter_name(sources[pos]) if pos < len(sources) else f"input {pos}"
        name = f"{record.name}: {source}"
        if name in self.summed_grads:
            return
        self.summed_grads.append(name)
        if pos in record.static_inputs:
            what = (
                f"reads parameter {source} several times and sums those gradient "
                "contributions in its backward graph"
            )
            fix = (
                "options={'split_param_reads': True} adds them in eager's order, at the "
                "memory cost of one gradient per read at the end of the fragment's backward"
            )
        else:
            what = (
                f"sums the gradient contributions of its input {source}, which an op reads "
                "through several autograd edges (torch.rms_norm), in its backward graph"
            )
            fix = "no option splits such reads"
        warnings.warn(
            f"memcompile: {record.name} {what}, after another backward call of the step "
            "already added to its gradient: eager adds them one at a time, so this gradient "
            "may differ from eager's in the last bits (as torch.compile's aot_eager does); "
            f"{fix}",
            GradientOrderWarning,
            stacklevel=4,
        )
