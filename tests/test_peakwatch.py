"""Each step's measured device peak against the budget (runtime/peakwatch.py): what the plans
do not see (eager frames, code between fragments) is told, not silent. The counter is CUDA's
``max_memory_allocated``; here a stand-in drives it (the last test reads the real one on a
GPU)."""

from __future__ import annotations

import warnings

import pytest
import torch

import memcompile
from memcompile import zoo
from memcompile.report import find_compiler
from memcompile.runtime.peakwatch import PeakWatch

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class _Counter:
    """A peak counter that only rises, as the allocator's does without a reset."""

    def __init__(self) -> None:
        self.value = 0

    def rise_to(self, value: int) -> None:
        self.value = max(self.value, value)

    def __call__(self) -> int:
        return self.value


def test_a_step_counts_only_when_it_set_a_new_peak() -> None:
    counter = _Counter()
    counter.rise_to(5000)  # before the first step (another model): not this step's
    watch = PeakWatch(1000, counter)
    assert watch.step_boundary() is None and watch.measured is None
    counter.rise_to(4000)
    assert watch.step_boundary() is None  # no new peak: nothing new is known
    assert watch.measured is None and watch.exceeded == 0
    counter.rise_to(7000)
    assert watch.step_boundary() == 7000
    assert watch.measured == 7000 and watch.exceeded == 1


def test_a_counter_reset_during_a_step_still_shows_its_peak() -> None:
    # torch.cuda.reset_peak_memory_stats() (memcompile.measure_peak calls it) lowers the
    # counter: what it reads at the next boundary was reached after the reset, in that step.
    counter = _Counter()
    counter.rise_to(9000)
    watch = PeakWatch(1000, counter)
    counter.value = 3000  # reset, then the step reached 3000
    assert watch.step_boundary() == 3000
    assert watch.measured == 3000 and watch.exceeded == 1


def test_a_peak_within_two_percent_of_the_budget_is_measured_not_exceeded() -> None:
    counter = _Counter()
    watch = PeakWatch(1000, counter)
    counter.rise_to(1020)
    assert watch.step_boundary() is None
    assert watch.measured == 1020 and watch.exceeded == 0
    counter.rise_to(1021)
    assert watch.step_boundary() == 1021


def test_a_step_measured_over_the_budget_is_warned_once_and_reported() -> None:
    wl = zoo.build("gpt", size="tiny")
    compiled = memcompile.compile(wl.model, budget="64MiB")
    wl.loss(compiled, 0).backward()
    comp, _ = find_compiler(compiled)
    assert comp.peak_watch is None  # a CPU model: the profiler measures, not the backend
    counter = _Counter()
    comp.peak_watch = PeakWatch(comp.config.budget, counter)  # as a CUDA model gets it
    counter.rise_to(2**20)  # during step 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a step within the budget says nothing
        wl.loss(compiled, 1).backward()
    assert memcompile.report(compiled).measured_peak == 2**20
    counter.rise_to(2**27)  # 128 MiB during step 1
    with pytest.warns(memcompile.MemoryBudgetWarning, match="reached 128.00 MiB") as seen:
        wl.loss(compiled, 2).backward()
    message = str(seen[0].message)
    assert "max_memory_allocated" in message and "were compiled" not in message
    counter.rise_to(2**28)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        wl.loss(compiled, 3).backward()
    report = memcompile.report(compiled)
    assert report.over_budget and report.measured_peak == 2**28
    assert report.to_dict()["measured_peak"] == 2**28
    assert "measured step peak 256.00 MiB" in str(report)


def test_a_step_that_compiled_does_not_silence_later_steps() -> None:
    # Planning measures kernels on the device: a step that compiled is told apart, and a later
    # step over the budget without compiles is still warned about.
    wl = zoo.build("gpt", size="tiny")
    compiled = memcompile.compile(wl.model, budget="64MiB")
    comp, _ = find_compiler(compiled)
    counter = _Counter()
    comp.peak_watch = PeakWatch(comp.config.budget, counter)
    counter.rise_to(2**27)
    with pytest.warns(memcompile.MemoryBudgetWarning, match="were compiled during that step"):
        wl.loss(compiled, 0).backward()  # compiles the model
        wl.loss(compiled, 1).backward()
    counter.rise_to(2**28)
    with pytest.warns(memcompile.MemoryBudgetWarning, match="reached 256.00 MiB") as seen:
        wl.loss(compiled, 2).backward()
    assert "were compiled" not in str(seen[0].message)


def test_cpu_models_have_no_measured_peak() -> None:
    wl = zoo.build("gpt", size="tiny")
    compiled = memcompile.compile(wl.model, budget="64MiB")
    for step in range(2):
        wl.loss(compiled, step).backward()
    report = memcompile.report(compiled)
    assert report.measured_peak is None and report.to_dict()["measured_peak"] is None


def test_step_over_budget_on_cuda_is_measured() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    # A 64 MiB buffer made between two fragments' calls: no plan sees it, the allocator does,
    # in the very first step (the same overrun every step adds no new peak after it).
    wl = zoo.build("gpt", size="tiny").to("cuda")
    base = torch.cuda.memory_allocated()
    compiled = memcompile.compile(wl.model, budget=base + 32 * 2**20)

    def step(i: int) -> None:
        loss = wl.loss(compiled, i)
        junk = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
        loss.backward()
        del junk

    step(0)
    with pytest.warns(memcompile.MemoryBudgetWarning, match="were compiled during that step"):
        step(1)
    peak = memcompile.report(compiled).measured_peak
    assert peak is not None and peak > base + 64 * 2**20
