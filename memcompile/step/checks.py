"""What is checked when a step ends, besides the budget's prediction (``budget.py``).

    measured peak   CUDA: the allocator's peak over the step against the budget
                    (runtime/peakwatch.py); over it -> MemoryBudgetWarning, once (once more for
                    a step without compiles)
                    CPU: the profiler's peak over a whole training iteration (its micro-batches
                    and its optimizers' steps; without an optimizer, one model call from its
                    start: its forward, and its backward to the end of autograd's pass when
                    the call trained), sampled: the first iteration without a compile after
                    each compile; over the budget and the iteration's prediction
                    -> MemoryBudgetWarning, once; what a sample peaks above the prediction
                    (with eager frames, over the budget or not; a forward alone above the
                    forward's) -> StepBudget.unseen, which later predictions count. Between
                    samples the CPU pays nothing; the user's own profiling is never disturbed
                    (no sample begins while another profiler runs; inside the user's
                    measure_peak one reads that session and is read when it ends; without
                    an optimizer none spans the user's code after the backward, or between
                    calls)
    eager glue      a measured peak through the backward (CUDA's step, the CPU's sample of
                    an iteration) over the budget, with eager frames: first the glue's saved
                    tensors go to the host tier (runtime/glue.py) and the next iteration is
                    measured again; only then is the excess warned about or counted
    gradient order  an input whose several contributions a fragment's backward sums, after
                    another call of the step added to its gradient first: the last bits may
                    differ from eager's -> GradientOrderWarning, once per fragment input

They only read the step the monitor recorded; none changes a plan (the unseen bytes make the
budget's next check re-plan).
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from memcompile.config import MemConfig
from memcompile.errors import GradientOrderWarning, MemoryBudgetWarning, format_bytes
from memcompile.records import FragmentRecord, StepEvent, parameter_name
from memcompile.runtime.measure import CpuInterval, PeakMeasurement
from memcompile.runtime.peakwatch import TOLERANCE, PeakWatch
from memcompile.step.budget import MAX_CHECKED_STEPS, StepBudget
from memcompile.step.monitor import StepMonitor

__all__ = ["SAMPLED_ITERATIONS", "StepChecks"]

log = logging.getLogger(__name__)

#: CPU: iterations measured with the profiler after each compile (a re-plan compiles).
SAMPLED_ITERATIONS = 1


class StepChecks:
    """The end-of-step checks of one compiler.

    Args:
        config: the compiler's options.
        records: the compiled fragments (``MemCompiler.records``).
        monitor: the recorded steps.
        budget: told when a measured step exceeds the budget (``over_budget``).
        eager_frames: how many frames Dynamo ran eagerly (named in the warning).
        glue: sends the eager glue's saved tensors to the host tier (runtime/glue.py) given
            why; returns False when they go there already. ``None``: never (``swap=False``).

    Attributes:
        peak_watch: CUDA with a budget: each step's measured peak against it.
        sampled_peak: CPU with a budget: the highest peak a sampled iteration reached.
        last_sampled_peak: the latest sample's peak (after the glue moved or a re-plan: what
            the step holds now).
        samples: CPU iterations measured so far.
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
        *,
        glue: Callable[[str], bool] | None = None,
    ) -> None:
        self._config = config
        self._records = records
        self._monitor = monitor
        self._budget = budget
        self._eager_frames = eager_frames
        self._glue = glue
        self.peak_watch: PeakWatch | None = None
        self.summed_grads: list[str] = []
        self.compiled_in_step = False
        self.sampled_peak: int | None = None
        self.last_sampled_peak: int | None = None
        self.samples = 0
        self._device: torch.device | None = None
        self._sample: CpuInterval | None = None
        self._compiled_in_sample = False
        self._sample_steps = (0, 0)  # steps begun in the sample, the most it may have
        # A loop without an optimizer: the sample of a call that trained runs on to the end of
        # its backward (awaiting); after a call that trained and had none, samples end with
        # their call (forward_only).
        self._awaiting_backward = False
        self._forward_only = False
        self._samples_left = 0
        self._sample_warned = False
        # Whether a step over the budget was warned about, for steps that compiled (planning
        # runs kernels on the device) and for those that did not: once each.
        self._peak_warned: set[bool] = set()
        self._order_checked_steps: set[tuple[StepEvent, ...]] = set()
        self._epoch = 0

    def reset(self) -> None:
        """Forget what was checked (the fragments are gone)."""
        self._epoch += 1  # (a sample read later is not of these plans)
        self.peak_watch = None
        self.sampled_peak = None
        self.last_sampled_peak = None
        self.samples = 0
        self._device = None
        self.cancel_sample()
        self._samples_left = 0
        self._sample_warned = False
        self._forward_only = False
        self._peak_warned.clear()
        self._order_checked_steps.clear()
        self.summed_grads.clear()

    def compiling(self, device: torch.device | None) -> None:
        """A fragment compiles for ``device``: on CUDA with a budget, start reading the
        allocator's peak at step boundaries (once); on the CPU, sample the next iteration
        without a compile."""
        self.compiled_in_step = True
        self._compiled_in_sample = True
        # A sample a compile runs in is dropped when it ends: stop it now, so that the compile
        # is not profiled, and measures what it profiles itself (kernel workspaces, Inductor's
        # code: neither runs inside another profiler session).
        self.cancel_sample()
        self._samples_left = SAMPLED_ITERATIONS
        if self._device is None:
            self._device = device
        budget = self._config.budget
        if self.peak_watch is None and budget is not None and device is not None:
            if device.type == "cuda":
                self.peak_watch = PeakWatch(
                    budget, functools.partial(torch.cuda.max_memory_allocated, device)
                )

    def sample_again(self) -> None:
        """Memory moved without a compile (the glue's parameters to the host tier): on the CPU,
        measure the next iteration as after a compile."""
        self._samples_left = max(self._samples_left, SAMPLED_ITERATIONS)

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
        if self._glue_to_host(peak, watch.budget, "a step"):
            return
        self._budget.over_budget = True
        if compiled in self._peak_warned:
            return
        self._peak_warned.add(compiled)
        why = self._eager_note()
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

    def _glue_to_host(self, peak: int, budget: int, what: str) -> bool:
        """A measured peak over the budget with eager frames in the model: the first answer
        is to send the glue's saved tensors to the host tier and measure again (True)."""
        eager = self._eager_frames()
        if self._glue is None or not eager:
            return False
        why = (
            f"{what} measured {format_bytes(peak)}, above budget={format_bytes(budget)}, "
            f"with {eager} frame(s) Dynamo runs eagerly"
        )
        return self._glue(why)

    def _eager_note(self) -> str:
        """The eager frames, as a reason a measured peak passes the budget ("" if none)."""
        eager = self._eager_frames()
        if not eager:
            return ""
        return (
            f"{eager} frame(s) Dynamo runs eagerly (report(...).fallbacks), whose memory no plan "
            "manages, or "
        )

    # -- the iteration's measured peak, sampled (CPU) ----------------------------------------
    def iteration_began(self, roots: tuple[Any, ...], micro_batches: int) -> None:
        """An iteration's first step begins (its first fragment call): on the CPU with a budget,
        measure the iteration if this plan's have not been yet. ``roots``: what its resident
        bytes are reachable from (the model, its optimizers, the call's arguments);
        ``micro_batches``: the steps the last iteration had (a sample through more is dropped:
        the loop ended, e.g. evaluation follows, and the profiler must not run on)."""
        if not self.wants_sample:
            return
        self._compiled_in_sample = False
        self._sample_steps = (1, micro_batches)
        # None while another profiler runs (inside measure_peak: read when that ends)
        self._sample = CpuInterval.start(*roots)

    def step_began(self) -> None:
        """A later step of the iteration begins: a sample through more steps than the last
        iteration had is dropped (no optimizer step came)."""
        if self._sample is None:
            return
        steps, limit = self._sample_steps
        self._sample_steps = (steps + 1, limit)
        if steps + 1 > limit:
            log.debug("memcompile: the sampled iteration ran past %d step(s); dropped", limit)
            self.cancel_sample()

    @property
    def sampling(self) -> bool:
        """An iteration's sample runs (CPU)."""
        return self._sample is not None

    @property
    def wants_sample(self) -> bool:
        """An iteration beginning now would be sampled (CPU, with a budget, samples left)."""
        return (
            self._sample is None
            and self._samples_left > 0
            and self._config.budget is not None
            and self._device is not None
            and self._device.type == "cpu"
        )

    def cancel_sample(self) -> None:
        """Stop the iteration's sample, if one runs, without reading it."""
        sample, self._sample = self._sample, None
        self._awaiting_backward = False
        if sample is not None:
            sample.cancel()

    # A loop without an optimizer: one model call is the iteration.
    def call_ended(self, *, trains: bool) -> None:
        """A call of a loop without an optimizer ended, its sample (begun at the call's start)
        running: read now, unless the call ``trains`` (a training fragment's forward ran with
        gradients on): then the sample runs on through the backward, to
        :meth:`backward_ended`."""
        if self._sample is None:
            return
        if trains and not self._forward_only:
            self._awaiting_backward = True
            return
        self.iteration_ended(1, "")

    @property
    def awaiting_backward(self) -> bool:
        """The sample of a call without an optimizer waits for the call's backward."""
        return self._awaiting_backward and self._sample is not None

    def backward_ended(self) -> None:
        """The backward of the sampled call ended (autograd's pass is done): read the
        sample, forward and backward."""
        if self.awaiting_backward:
            self.iteration_ended(1, "", backward=True)

    def no_backward(self) -> None:
        """The next call starts and the sampled call's backward never came (a forward with
        gradients on, not trained): the sample is dropped, and later samples of a loop without
        an optimizer end with their call, so that none spans the user's code between calls."""
        if not self.awaiting_backward:
            return
        log.debug("memcompile: the sampled call had no backward; sampled by its forward from now")
        self._forward_only = True
        self.cancel_sample()

    def iteration_ended(
        self, micro_batches: int, optimizer: str, *, backward: bool = False
    ) -> None:
        """The iteration's optimizer steps are done (``optimizer``: their kind; ``""``: a loop
        without one, whose sample is one model call: its forward, and its backward when
        ``backward``): read its sample, if one runs."""
        sample, self._sample = self._sample, None
        self._awaiting_backward = False
        if sample is None or self._config.budget is None:
            return
        compiled, epoch = self._compiled_in_sample, self._epoch
        m = sample.end()
        if m is None:  # inside the user's own measure_peak: read when that ends

            def read(m: PeakMeasurement) -> None:
                if self._epoch == epoch:
                    self._sampled(m, micro_batches, optimizer, backward, compiled)

            sample.then(read)
            return
        self._sampled(m, micro_batches, optimizer, backward, compiled)

    def _sampled(
        self,
        m: PeakMeasurement,
        micro_batches: int,
        optimizer: str,
        backward: bool,
        compiled: bool,
    ) -> None:
        """What the sample of an iteration (:meth:`iteration_ended`) measured: ``m``."""
        through_backward = bool(optimizer) or backward
        budget = self._config.budget
        assert budget is not None
        # Incomplete (lost events; another session stopped it) or compiled in: the next
        # iteration is sampled instead.
        if not m.complete or compiled:
            return
        self._samples_left -= 1
        self.samples += 1
        self.sampled_peak = max(self.sampled_peak or 0, m.peak)
        self.last_sampled_peak = m.peak
        # A tensor from before the iteration freed during it is a free the profiler does not
        # see: the peak may be overstated by that much, so that much is given the benefit of
        # the doubt.
        peak = m.peak - m.unseen_free_bytes
        what = (
            f"{micro_batches} micro-batch(es) and the {optimizer} step"
            if optimizer
            else "a model call, no optimizer step: its forward and backward"
            if backward
            else "a model call, no optimizer step: its forward"
        )
        log.info(
            "memcompile: a sampled iteration (%s) peaked at %s (budget %s)",
            what,
            format_bytes(m.peak),
            format_bytes(budget),
        )
        over = peak > budget * (1 + TOLERANCE)
        if over and through_backward and self._glue_to_host(peak, budget, "a sampled iteration"):
            # Measured again with the glue's saved tensors off the device, before anything it
            # showed is counted. (Only a sample through the backward shows what that costs
            # there: not a forward alone.)
            self._samples_left += 1
            return
        if optimizer:
            predicted = max(self._budget.iteration_peaks.values(), default=0)
        else:
            # One call is the iteration: its step's prediction as of now, with what its
            # backward showed (the outputs the caller did not hold: HF's logits, when only
            # `out.loss` is kept), not the check's of its composition's first step.
            predicted = self._budget.step_peak()
        counted = False
        if self._eager_frames():
            # Eager frames: what the plans do not see (the glue's memory) is counted in every
            # later prediction, over the budget or not, so that the prediction is the measured
            # peak. A forward alone is held against the forward's predicted calls: what the
            # glue saves there is alive when the backward begins too. Through the backward,
            # against the micro-batches' predictions, which are what counts it (the optimizer
            # step's does not; held against a higher step the excess was short).
            steps = [
                p for phase, p in self._budget.iteration_peaks.items() if phase != "optimizer step"
            ]
            reference = (
                self._budget.forward_peak()
                if not through_backward
                else max(steps, default=predicted)
                if optimizer
                else predicted
            )
            if reference and peak > reference * (1 + TOLERANCE):
                self._budget.measured_unseen(peak - reference)
                counted = True
        if not over:
            return
        self._budget.over_budget = True
        # A prediction over the budget was told already: the sample tells only what no plan
        # predicted (the loop's own memory), which later predictions count (re-planning the
        # step with less room).
        if peak <= predicted * (1 + TOLERANCE):
            return
        if predicted and through_backward and not counted:
            self._budget.measured_unseen(peak - predicted)
        if self._sample_warned:
            return
        self._sample_warned = True
        why = self._eager_note()
        warnings.warn(
            f"memcompile: a training iteration ({what}) reached {format_bytes(m.peak)} on the "
            "CPU (profiler, sampled "
            f"after a compile), above budget={format_bytes(budget)}; what the plans do not see "
            f"exceeds it: {why}memory the loop's Python code allocates between the compiled "
            "fragments, or tensors it holds across them. memcompile counts it from now on and "
            "re-plans the step with less room. Warned once; report(...).measured_peak keeps the "
            "highest sampled peak, report(...).unseen_bytes what is counted",
            MemoryBudgetWarning,
            stacklevel=4,
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
