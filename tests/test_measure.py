"""measure_peak on known allocation patterns (CPU: resident bytes + profiler peak above start)."""

from __future__ import annotations

import pytest
import torch

import memcompile
from memcompile.runtime.measure import measure, reachable_tensors, resident_bytes

MB = 1_000_000
GLOBAL_WEIGHT = torch.zeros(250_000)  # 1 MB, reachable through a module global


def _alloc(n_bytes: int) -> torch.Tensor:
    return torch.empty(n_bytes, dtype=torch.uint8)


def test_sequential_allocations_peak_is_the_largest_live_set() -> None:
    def fn() -> None:
        a = _alloc(4 * MB)
        del a
        b = _alloc(2 * MB)
        c = _alloc(1 * MB)
        del b, c

    assert measure_no_resident(fn) == 4 * MB


def test_overlapping_allocations_add_up() -> None:
    def fn() -> torch.Tensor:
        a = _alloc(3 * MB)
        b = _alloc(2 * MB)
        return a[:1] + b[:1]  # both live until the add

    m = measure(fn)
    assert m.peak == 5 * MB + 1
    assert m.result.shape == (1,) and m.result.dtype == torch.uint8  # fn's result is returned


def measure_no_resident(fn) -> int:
    m = measure(fn)
    assert m.resident_bytes == 0
    return m.peak


def test_arguments_and_modules_count_as_resident() -> None:
    x = _alloc(1 * MB)
    model = torch.nn.Linear(1000, 500)  # 500500 floats
    param_bytes = sum(p.numel() * 4 for p in model.parameters())

    def fn(x: torch.Tensor, model: torch.nn.Module) -> None:
        _alloc(2 * MB)

    m = measure(fn, x, model)
    assert m.resident_bytes == 1 * MB + param_bytes
    assert m.peak == 1 * MB + param_bytes + 2 * MB


def test_closures_bound_methods_and_globals_are_reachable() -> None:
    model = torch.nn.Linear(10, 10)

    def uses_closure() -> None:
        model.weight.sum()

    def uses_global() -> None:
        GLOBAL_WEIGHT.sum()

    closure_bytes = 110 * 4
    assert measure(uses_closure).resident_bytes == closure_bytes
    assert measure(uses_global).resident_bytes == 1 * MB
    assert measure(model.forward, torch.zeros(1, 10)).resident_bytes == closure_bytes + 40


def test_gradients_and_optimizer_state_are_resident() -> None:
    model = torch.nn.Linear(100, 100)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 100)).sum().backward()
    opt.step()
    n = sum(p.numel() for p in model.parameters())
    # params + grads + exp_avg + exp_avg_sq, plus Adam's two 0-dim step counters (4 B each)
    assert resident_bytes(opt) == 4 * n * 4 + 2 * 4


def test_an_object_first_reached_deep_is_walked_again_from_nearer() -> None:
    # A function's closure reaches the optimizer four levels down, where its state is past the
    # depth limit; the optimizer given as resident itself must still count its state (it once
    # did not: the first, deep visit marked it seen, and measure_peak missed Adam's moments).
    model = torch.nn.Linear(100, 100)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 100)).sum().backward()
    opt.step()
    deep = {"a": {"b": [opt]}}

    def fn() -> object:
        return deep

    state = {id(t) for s in opt.state.values() for t in s.values()}
    assert state <= {id(t) for t in reachable_tensors(fn, [opt])}


def test_shared_storages_are_counted_once() -> None:
    base = _alloc(1 * MB)
    views = [base[:10], base[10:], base.view(2, -1)]
    assert resident_bytes(views) == 1 * MB
    assert len(reachable_tensors(views)) == 3


def test_explicit_resident_objects_are_added() -> None:
    hidden = _alloc(3 * MB)

    def fn() -> None:
        _alloc(1 * MB)

    assert measure(fn, resident=[hidden]).peak == 4 * MB


def test_peak_is_absolute_like_max_memory_allocated() -> None:
    x = _alloc(2 * MB)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return x.clone()  # 2 MB more, returned (still counted at the peak)

    assert memcompile.measure_peak(fn, x) == 4 * MB


def test_per_range_peaks_are_measured() -> None:
    def fn() -> None:
        a = _alloc(1 * MB)
        with torch.profiler.record_function("memcompile:F0:forward"):
            b = _alloc(2 * MB)
            del b
        with torch.profiler.record_function("memcompile:F1:forward"):
            c = _alloc(MB // 2)
            del c
        del a

    m = measure(fn)
    assert m.ranges == {"memcompile:F0:forward": 3 * MB, "memcompile:F1:forward": 3 * MB // 2}


def test_freeing_preexisting_tensors_warns_about_overstatement() -> None:
    model = torch.nn.Linear(500, 500)
    model(torch.randn(1, 500)).sum().backward()  # grads allocated before the measurement
    grad_bytes = sum(p.grad.numel() * 4 for p in model.parameters())

    def step() -> None:
        model.zero_grad(set_to_none=True)  # frees them inside: the profiler cannot see it

    with pytest.warns(
        UserWarning, match="freed during it; the CPU profiler does not see those frees"
    ):
        m = measure(step)
    assert m.unseen_free_bytes == grad_bytes


def test_bad_arguments_have_clear_messages() -> None:
    with pytest.raises(TypeError, match="measure_peak: fn must be callable; got int"):
        memcompile.measure_peak(3)
    with pytest.raises(
        ValueError, match="measure_peak: device must be 'cpu' or 'cuda'; got 'meta'"
    ):
        memcompile.measure_peak(lambda: None, device="meta")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_requested_without_cuda() -> None:
    with pytest.raises(ValueError, match="device='cuda' but CUDA is not available"):
        memcompile.measure_peak(lambda: None, device="cuda")


def test_tiny_allocations_are_measured_exactly_despite_the_canary() -> None:
    def fn() -> torch.Tensor:
        return torch.empty(8, dtype=torch.uint8)

    m = measure(fn)
    assert m.complete and m.peak == 8


def test_lost_profiler_events_are_reported(monkeypatch) -> None:
    from memcompile.runtime import measure as measure_module

    real = measure_module._allocations

    def lossy(prof, prefix="memcompile:"):  # the canary's events vanish
        events, ranges = real(prof, prefix)
        return [e for e in events if abs(e[1]) != measure_module._CANARY_BYTES], ranges

    monkeypatch.setattr(measure_module, "_allocations", lossy)
    with pytest.warns(measure_module.MeasurementWarning, match="lost allocation events"):
        m = measure(lambda: _alloc(MB))
    assert not m.complete


def test_an_interval_begun_inside_a_measurement_is_read_when_it_ends() -> None:
    # memcompile's sample of an iteration inside the user's measure_peak: it reads the same
    # session (no second one, which would stop the first), and gets its figure when that one
    # is read. The sample ends inside a record_function range (as in the optimizer step's
    # hooks), which a session stopped and begun again there corrupts.
    from memcompile.runtime.measure import CpuInterval

    got = []

    def fn() -> None:
        a = _alloc(MB)
        with torch.profiler.record_function("Optimizer.step#AdamW.step"):
            inner = CpuInterval.start(a)  # (a: resident, reachable from its roots)
            assert inner is not None
            b = _alloc(2 * MB)
            assert inner.end() is None  # read with the session
            inner.then(got.append)
        del a, b
        _alloc(MB // 2)
        assert not got

    m = measure(fn)
    assert m.complete and m.peak == 3 * MB  # the markers counted nowhere
    assert len(got) == 1 and got[0].complete and got[0].peak == 2 * MB + MB, got
    assert not torch._C._autograd._profiler_enabled()


def test_a_cancelled_intervals_marker_is_counted_nowhere() -> None:
    from memcompile.runtime.measure import CpuInterval

    def fn() -> None:
        big = _alloc(MB)  # the peak is where the marker comes
        CpuInterval.start().cancel()
        del big

    m = measure(fn)
    assert m.complete and m.peak == MB, m.peak - MB  # (before: + the marker's bytes)


def test_an_interval_still_open_when_the_session_ends_is_incomplete() -> None:
    from memcompile.runtime.measure import CpuInterval

    inner = []
    m = measure(lambda: inner.append(CpuInterval.start()))
    assert m.complete
    late = inner[0].end()
    assert late is not None and not late.complete


def test_a_measurement_inside_a_sample_stops_the_sample_not_itself() -> None:
    # The user measures inside an iteration memcompile samples: the measurement has its own
    # session (the sample's reads as incomplete, and is taken another time).
    from memcompile.runtime.measure import CpuInterval

    sample = CpuInterval.start()
    assert sample is not None
    m = measure(lambda: _alloc(MB))
    assert m.complete and m.peak == MB
    late = sample.end()
    assert late is not None and not late.complete
    assert not torch._C._autograd._profiler_enabled()


def test_no_interval_begins_under_another_profiler() -> None:
    from memcompile.runtime.measure import CpuInterval

    with torch.profiler.profile(profile_memory=True):
        assert CpuInterval.start() is None
