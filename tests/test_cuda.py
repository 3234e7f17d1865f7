"""CUDA paths: asynchronous host-tier copies on a side stream, plans measured with the CUDA
allocator's statistics. Skipped without a GPU (CI has none); run on a GPU machine with
``python -m pytest tests/test_cuda.py``."""

from __future__ import annotations

import gc
import warnings
from typing import Any

import pytest
import torch

import memcompile
from memcompile import zoo
from memcompile.dynamic import prefetch
from memcompile.pipeline import features
from memcompile.report import MemReport, find_compiler
from memcompile.runtime.cache import PrefetchCache
from memcompile.runtime.store import TieredStore, register_store

from helpers import assert_same_state, train_under_budget, training_loop
from predictors import AlwaysWrong

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.usefixtures("fresh_dynamo"),
]


@pytest.fixture(autouse=True)
def _eager_kernels_unless_asked(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """These tests check the eager inner compiler on CUDA (bit-identity, exact peaks), which
    ``inner="auto"`` would not pick here: compiles default to ``inner="eager"``, except in the
    tests of "auto" itself."""
    if "auto" in request.node.name:
        return
    real = memcompile.compile
    monkeypatch.setattr(
        memcompile, "compile", lambda model, **o: real(model, **{"inner": "eager", **o})
    )


def test_auto_picks_inductor_on_cuda_and_its_measured_plan_holds_the_budget() -> None:
    budget = _budget("gpt_manual", 0.5)
    torch._dynamo.reset()
    wl = zoo.build("gpt_manual", size="tiny").to("cuda")
    compiled = memcompile.compile(wl.model, budget=budget)  # inner="auto"
    for step in range(3):
        wl.model.zero_grad(set_to_none=True)
        loss = wl.loss(compiled, step)
        loss.backward()
        assert torch.isfinite(loss)
    wl.model.zero_grad(set_to_none=True)
    batch = wl.batch(3)
    measured = memcompile.measure_peak(
        lambda: compiled(*batch).backward(), resident=[wl.model, batch]
    )
    rep = memcompile.report(compiled)
    assert [f.inner for f in rep.fragments] == ["inductor"]
    assert rep.fragments[0].inner_unmeasured == ""
    assert measured <= budget * 1.02, (measured, budget)
    assert abs(rep.predicted_peak - measured) <= 0.03 * measured, (rep.predicted_peak, measured)


def test_side_stream_round_trip_waits_before_use() -> None:
    store = TieredStore()
    key = register_store(store)
    x = torch.randn(1024, 1024, device="cuda").t()  # dense, permuted
    host = torch.ops.memcompile.offload(x, key, 0)
    assert host.is_pinned() and host.stride() == x.stride()
    y = torch.ops.memcompile.reload(host, x.device, key, 0)
    assert store.in_flight() == 1  # the copy was issued, not waited for
    torch.ops.memcompile.wait(y, key)
    assert store.in_flight() == 0
    assert torch.equal(y, x) and y.stride() == x.stride()


def test_offloaded_source_is_not_reused_before_its_copy_is_done() -> None:
    # x is freed right after the offload is issued; a new allocation of the same size must not
    # overwrite it before the side stream has copied it (record_stream).
    key = register_store(TieredStore())
    for _ in range(20):
        x = torch.full((4096, 1024), 7.0, device="cuda")
        host = torch.ops.memcompile.offload(x, key, 0)
        del x
        torch.full((4096, 1024), -1.0, device="cuda")  # may take x's block only after the copy
        torch.cuda.synchronize()
        assert bool((host == 7.0).all())


def _unbudgeted_report(name: str, *, eager_copy: bool, **options: Any) -> MemReport:
    """The report of tiny ``name`` compiled with ``options`` and no budget, after one step;
    ``eager_copy``: beside an eager copy trained 3 SGD steps and still alive (the device state
    that ``train_under_budget`` compiles in)."""
    torch._dynamo.reset()
    gc.collect()  # earlier tests' models must not count as device memory in use
    eager = zoo.build(name, size="tiny").to("cuda") if eager_copy else None
    if eager is not None:
        eager.train(eager.model, 3)
    wl = zoo.build(name, size="tiny").to("cuda")
    compiled = memcompile.compile(wl.model, **options)
    wl.loss(compiled, 0).backward()
    rep = memcompile.report(compiled)
    del eager, wl, compiled
    torch._dynamo.reset()
    gc.collect()
    return rep


def _budget(name: str, fraction: float) -> int:
    """Resident bytes (inputs, plus what else is on the device: cuBLAS workspaces, the eager
    copy) + ``fraction`` of the step's own memory without a budget, in the device state that
    ``train_under_budget`` compiles in."""
    rep = _unbudgeted_report(name, eager_copy=True)
    return int(rep.resident_bytes + fraction * (rep.predicted_peak - rep.resident_bytes))


@pytest.mark.parametrize(
    ("name", "fraction", "options"),
    [
        ("gpt_manual", 0.85, {"recompute": False, "offload_to": "host"}),
        pytest.param(
            "gpt",
            0.7,
            {"swap": False},
            marks=pytest.mark.xfail(
                reason="H100, torch 2.11: the first backward that recomputes here makes a 1 MiB "
                "library workspace (cuBLASLt-sized) after planning; the resident guard warns "
                "about it, as it should. Passes when an earlier test made it (order-dependent)",
                strict=False,
            ),
        ),
        pytest.param(
            "gpt_manual",
            0.55,
            {"offload_to": "host"},
            marks=pytest.mark.xfail(
                reason="H100, torch 2.11: the same 1 MiB library workspace made after planning "
                "as the case above (the resident guard warns, as it should)",
                strict=False,
            ),
        ),
    ],
)
def test_cuda_plan_is_bit_identical_and_measured_within_3_percent(
    name: str, fraction: float, options: dict
) -> None:
    budget = _budget(name, fraction)
    # SGD without momentum: no optimizer state appears after compilation (state created later
    # is device memory the plan could not see).
    compiled, _, measured = train_under_budget(name, "sgd", budget, device="cuda", **options)
    rep = memcompile.report(compiled)
    compiler = find_compiler(compiled)[0]
    assert compiler.device_other_bytes is not None and compiler.device_other_bytes > 0
    assert measured <= budget * 1.02, (measured, budget)
    assert abs(rep.predicted_peak - measured) <= 0.03 * measured, (rep.predicted_peak, measured)
    assert compiler.store.in_flight() == 0  # every reload was waited for
    (plan,) = rep.plan.fragments
    assert plan.baseline_peak > budget, "the budget must need a plan"
    if options.get("offload_to"):
        assert compiler.store.bytes_in["host"] == compiler.store.bytes_out["host"] > 0
        assert plan.swapped and plan.swap_stall is not None
    else:
        assert plan.recomputed and not plan.swapped


def _five_iterations(run: Any) -> tuple[list[list[torch.Tensor]], int]:
    """Five iterations of the loop ``run`` from the same seed: their losses, and the allocator's
    peak over the last (the loop's state made, plans settled)."""
    torch.manual_seed(7)
    losses = [run(k) for k in range(4)]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    losses.append(run(4))
    torch.cuda.synchronize()
    return losses, torch.cuda.max_memory_allocated()


@pytest.mark.parametrize("micro", [1, 4])
def test_cuda_the_whole_iteration_with_adamw_holds_a_budget_under_eagers(micro: int) -> None:
    # AdamW's state appears at the first optimizer step, after the first plan was made: the loop
    # is learned and the iteration planned (step/iteration.py). Its whole peak (every
    # micro-batch, the optimizer's step), as the allocator measures it, holds a budget of 0.6x
    # eager's (above what else the device holds), with eager's losses and parameters, and
    # nothing is reported over.
    torch._dynamo.reset()
    eager = zoo.build("gpt", size="tiny").to("cuda")
    eager_opt = torch.optim.AdamW(eager.model.parameters(), lr=1e-3)
    run = training_loop(eager, eager.model, eager_opt, micro=micro)
    eager_losses, eager_peak = _five_iterations(run)
    eager_params = [p.detach().cpu() for p in eager.model.parameters()]
    del eager, eager_opt, run
    gc.collect()
    torch.cuda.empty_cache()
    # What stays on the device without either model (cuBLAS's workspace: 32 MiB and more on an
    # H200) is no plan's to move: the budget is a share of what the iteration itself adds.
    other = torch.cuda.memory_allocated()

    comp = zoo.build("gpt", size="tiny").to("cuda")
    opt = torch.optim.AdamW(comp.model.parameters(), lr=1e-3)
    budget = int(other + 0.6 * (eager_peak - other))
    # Eager kernels: bit-identity is their contract (inner="auto" is Inductor on CUDA).
    compiled = memcompile.compile(
        comp.model, budget=budget, on_infeasible="best_effort", inner="eager"
    )
    run = training_loop(comp, compiled, opt, micro=micro)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", memcompile.MemoryBudgetWarning)
        losses, measured = _five_iterations(run)
    over = [str(w.message) for w in seen if issubclass(w.category, memcompile.MemoryBudgetWarning)]
    rep = memcompile.report(compiled)
    print(
        rep,
        f"\nbudget {budget}, measured {measured}, eager {eager_peak}; losses equal per iteration:",
        [
            all(torch.equal(a, b) for a, b in zip(xs, ys, strict=True))
            for xs, ys in zip(eager_losses, losses, strict=True)
        ],
    )
    # Before the first optimizer step the parameters are eager's: so are the losses, bit for bit.
    assert all(torch.equal(a, b) for a, b in zip(eager_losses[0], losses[0], strict=True))
    params = [p.detach().cpu() for p in comp.model.parameters()]
    flat = torch.stack([x for xs in losses for x in xs])
    eager_flat = torch.stack([x for xs in eager_losses for x in xs])
    if rep.host_param_bytes:
        # Their step ran on the host, where Adam's kernels round differently from CUDA's; an
        # update's size is the learning rate whatever the gradient's (an H200, 2026-11-30:
        # within 3.2e-5 after 5 steps at lr 1e-3).
        torch.testing.assert_close(flat, eager_flat, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(params, eager_params, rtol=0, atol=1e-3)
    else:
        assert torch.equal(flat, eager_flat)
        assert all(torch.equal(a, b) for a, b in zip(eager_params, params, strict=True))
    assert measured <= budget * 1.02, (measured, budget, eager_peak, over, str(rep))
    assert not over and not rep.over_budget, over


def test_cuda_rebuilt_dropout_is_bit_identical(monkeypatch) -> None:
    # The dropout pass rebuilds outputs as x * mask * scale with CUDA's float scale; forced on,
    # a whole training step must still match eager bit for bit on the GPU.
    monkeypatch.setattr(features, "FEATURES", features.FEATURES.replace(dropout_rewrite="always"))
    budget = _budget("gpt", 0.75)
    compiled, _, measured = train_under_budget("gpt", "sgd", budget, device="cuda", swap=False)
    rep = memcompile.report(compiled)
    assert abs(rep.predicted_peak - measured) <= 0.03 * measured, (rep.predicted_peak, measured)
    assert measured <= budget * 1.02


# -- parameters on the host (runtime/pinned.py) ---------------------------------------------------
def _assert_grads_equal(eager: torch.nn.Module, hosted: torch.nn.Module) -> None:
    # The hosted copy's gradients were computed on the device (and copied to pinned host memory).
    for (name, pe), ph in zip(eager.named_parameters(), hosted.parameters(), strict=True):
        assert (pe.grad is None) == (ph.grad is None), name
        if pe.grad is not None:
            assert torch.equal(pe.grad.cpu(), ph.grad.cpu()), name


@pytest.mark.parametrize("name", ["gpt", "branchy", "early_exit", "moe", "treelstm"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_cuda_host_placed_parameters_give_eager_gradients_and_train(
    name: str, optimizer: str, request: pytest.FixtureRequest
) -> None:
    if name == "treelstm":
        request.applymarker(
            pytest.mark.xfail(
                reason="H100, torch 2.11: with the parameters on the host, the cell's gradients "
                "(summed over the cell's calls) differ from eager's by up to 1.5e-8, the same in "
                "every run (not a copy race); not understood yet (bit-identical with them on the "
                "device, and on the CPU device)",
                strict=False,
            )
        )
    eager = zoo.build(name, size="tiny").to("cuda")
    comp = zoo.build(name, size="tiny").to("cuda")
    compiled = memcompile.compile(comp.model, offload_params=True)
    make = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1), "adam": torch.optim.Adam}[optimizer]
    opts = make(list(eager.model.parameters())), make(list(comp.model.parameters()))
    for step in range(3):
        for wl, fn, opt in ((eager, eager.model, opts[0]), (comp, compiled, opts[1])):
            opt.zero_grad(set_to_none=True)
            torch.manual_seed(step)
            wl.loss(fn, step).backward()
        if step == 0:  # the same parameters: the gradients are eager's, bit for bit
            _assert_grads_equal(eager.model, comp.model)
        for opt in opts:
            opt.step()
        # The optimizer steps the pinned parameters on the host (ZeRO-Offload's split), eager's
        # on the device, whose kernels may round differently: equal up to rounding after one
        # step from the same gradients (later ones amplify it: Adam normalizes tiny gradients).
        if step == 0:
            se, sc = eager.model.state_dict(), comp.model.state_dict()
            for key in se:
                torch.testing.assert_close(sc[key].cpu(), se[key].cpu(), msg=key)
    # Parameters that only compiled fragments read are on the host (early exit reads some in a
    # frame Dynamo runs eagerly, reported as a fallback: those stay on the device).
    hosted = [p for p in comp.model.parameters() if p.device.type == "cpu"]
    assert hosted and all(p.is_pinned() for p in hosted)
    assert all(p.grad is None or p.grad.device.type == "cpu" for p in hosted)
    assert memcompile.report(compiled).host_param_bytes == sum(p.nbytes for p in hosted)
    if name != "early_exit":
        assert len(hosted) == len(list(comp.model.parameters()))


def test_cuda_auto_hosts_parameters_when_nothing_else_fits() -> None:
    # Without recomputation or swaps only the parameters (and their gradients) can leave the
    # device: a budget between the two peaks fits only with them on the host.
    on_device, on_host = (
        _unbudgeted_report(
            "gpt", eager_copy=False, recompute=False, swap=False, offload_params=hosted
        ).predicted_peak
        for hosted in (False, True)
    )
    assert on_host < on_device
    budget = (on_host + on_device) // 2
    wl = zoo.build("gpt", size="tiny").to("cuda")
    compiled = memcompile.compile(
        wl.model, budget=budget, offload_params="auto", recompute=False, swap=False
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", memcompile.MemoryBudgetWarning)
        wl.train(compiled, 3)
    assert all(p.device.type == "cpu" and p.is_pinned() for p in wl.model.parameters())
    wl.model.zero_grad(set_to_none=True)
    batch = wl.batch(3)
    measured = memcompile.measure_peak(
        lambda: compiled(*batch).backward(), resident=[wl.model, batch]
    )
    rep = memcompile.report(compiled)
    assert measured <= budget * 1.02, (measured, budget)
    assert abs(rep.predicted_peak - measured) <= 0.03 * measured, (rep.predicted_peak, measured)


class _TiedAcrossABreak(torch.nn.Module):
    # The second fragment reads a weight the first one moved to the host.
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 8)
        self.mid = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mid(self.inp(x).relu())
        torch._dynamo.graph_break()
        return (h @ self.inp.weight).square().sum()


def test_cuda_host_placed_parameters_survive_retraces() -> None:
    # A new input shape makes Dynamo trace again, and the fragment after the break is traced
    # after the first moved the weight it reads: both traces see device placeholders.
    torch.manual_seed(0)
    eager = _TiedAcrossABreak().to("cuda")
    hosted = _TiedAcrossABreak().to("cuda")
    hosted.load_state_dict(eager.state_dict())
    compiled = memcompile.compile(hosted, offload_params=True)
    for rows in (4, 6, 4, 9):
        x = torch.randn(rows, 8, device="cuda")
        for m in (eager, hosted):
            m.zero_grad(set_to_none=True)
        le, lh = eager(x), compiled(x)
        le.backward()
        lh.backward()
        assert torch.equal(le, lh)
        _assert_grads_equal(eager, hosted)
        assert all(p.device.type == "cpu" for p in hosted.parameters())
    assert not memcompile.report(compiled).fallbacks


# -- the pilot's prefetches on a side stream (runtime/cache.py, dynamic/prefetch.py) --------------
def _sleep(seconds: float) -> None:
    # Keep the compute stream busy for about ``seconds`` (a spin kernel; ~2 GHz SM clock).
    torch.cuda._sleep(int(seconds * 2e9))


def test_cuda_prefetch_copies_on_a_side_stream_and_a_hit_waits_for_it() -> None:
    cache = PrefetchCache()
    h = torch.randn(4096, 4096).pin_memory()  # 64 MiB: a copy of a millisecond or more
    cache.watch([h])
    cache.counting = True
    cache.prefetch(h, torch.device("cuda"), "b", "t")
    done = cache._entries[PrefetchCache.key(h)].done
    assert done is not None and not done.query()  # issued, not waited for
    y = cache.fetch(h, lambda: pytest.fail("a hit was expected"))
    z = y * 2  # on the compute stream, after its wait for the copy
    assert torch.equal(z.cpu(), h * 2)
    c = cache.counters()
    # Fetched at once: the compute stream waited for the copy, and the events measured it.
    assert c.hit == h.nbytes and c.gpu_late_bytes == h.nbytes
    assert c.gpu_wait_s is not None and c.gpu_wait_s > 0 and c.gpu_miss_s == 0


def test_cuda_prefetch_overlaps_compute_and_is_not_late() -> None:
    cache = PrefetchCache()
    h = torch.randn(4096, 4096).pin_memory()
    cache.watch([h])
    cache.counting = True
    torch.cuda.synchronize()
    cache.prefetch(h, torch.device("cuda"), "b", "t")
    _sleep(0.05)  # compute the copy overlaps (queued after the copy was issued)
    y = cache.fetch(h, lambda: pytest.fail("a hit was expected"))
    assert torch.equal(y.cpu(), h)
    c = cache.counters()
    assert c.gpu_wait_s == 0 and c.gpu_late_bytes == 0


def test_cuda_an_evicted_prefetch_is_not_reused_while_its_copy_runs() -> None:
    # The copy's block must not go to a new tensor before the side stream has written it.
    cache = PrefetchCache()
    h = torch.full((4096, 1024), 7.0).pin_memory()
    cache.watch([h])
    for _ in range(20):
        cache.prefetch(h, torch.device("cuda"), "b", "t")
        assert cache.evict() == h.nbytes
        x = torch.full((4096, 1024), -1.0, device="cuda")
        torch.cuda.synchronize()
        assert bool((x == -1.0).all())


def test_cuda_a_miss_is_timed_on_the_compute_stream() -> None:
    cache = PrefetchCache()
    h = torch.randn(2048, 2048).pin_memory()
    cache.watch([h])
    cache.counting = True
    y = cache.fetch(h, lambda: h.to("cuda", non_blocking=True))
    assert torch.equal(y.cpu(), h)
    c = cache.counters()
    assert c.misses == 1 and c.gpu_miss_s is not None and c.gpu_miss_s > 0


def test_cuda_synchronous_prefetches_copy_on_the_compute_stream() -> None:
    cache = PrefetchCache(asynchronous=False)
    h = torch.randn(1024, 1024).pin_memory()
    cache.watch([h])
    cache.prefetch(h, torch.device("cuda"), "b", "t")
    assert cache._entries[PrefetchCache.key(h)].done is None
    assert torch.equal(cache.fetch(h, lambda: pytest.fail("a hit")).cpu(), h)


def test_cuda_a_blocks_prefetch_is_one_copy_call_with_one_event() -> None:
    # 2 x 32 MiB and a strided one: the copies take milliseconds, so the fetch right after the
    # prefetch waits for them, and the whole block counts as late.
    ps = [torch.randn(4096, 2048).pin_memory(), torch.randn(7).pin_memory()]
    ps.append(torch.randn(2048, 4096).t().pin_memory())
    total = sum(p.untyped_storage().nbytes() for p in ps)
    cache = PrefetchCache()
    cache.watch(ps)
    cache.counting = True
    assert cache.prefetch_many(ps, torch.device("cuda"), "b", "t") == total
    dones = [cache._entries[PrefetchCache.key(p)].done for p in ps]
    assert dones[0] is not None and all(d is dones[0] for d in dones)
    got = [cache.fetch(p, lambda: pytest.fail("a hit was expected")) for p in ps]
    assert len({g.untyped_storage().data_ptr() for g in got}) == len(ps)
    assert all(g.is_cuda and torch.equal(g.cpu(), p) for g, p in zip(got, ps, strict=True))
    c = cache.counters()  # the first hit's wait is the block's: timed once, for all of it
    assert c.hit == total and c.gpu_late_bytes == total and c.gpu_wait_s and c.gpu_wait_s > 0


@pytest.mark.parametrize("pilot", ["markov", "lightgbm", "adversarial"])
@pytest.mark.parametrize("name", ["moe", "early_exit"])
def test_cuda_pilot_trains_bit_identically_to_fetching_on_demand(
    name: str, pilot: str, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    # Both copies keep their parameters on the host and step them there (so both round alike);
    # the pilot's copies must change nothing, whatever it predicts.
    if name == "early_exit":
        request.applymarker(
            pytest.mark.xfail(
                reason="H200, torch 2.11 (2026-11-30): the losses of 6 steps are equal, but "
                "after them most parameters differ from the run without the pilot; before "
                "that, the pilot's run had kept a parameter on the device that the other run "
                "had placed on the host. Not understood yet (benchmarks/results/gpu/README.md)",
                strict=False,
            )
        )
    monkeypatch.setattr(prefetch, "PILOT_KNOBS", {"warmup_steps": 2, "background": False})
    torch._dynamo.reset()
    runs = {}
    for mode in ("off", pilot):
        wl = zoo.build(name, size="tiny").to("cuda")
        option = "markov" if mode == "adversarial" else mode
        compiled = memcompile.compile(wl.model, offload_params=True, pilot=option)
        if mode == "adversarial":
            prefetcher = find_compiler(compiled)[0].prefetcher
            assert prefetcher is not None
            prefetcher.predictor = AlwaysWrong()
        losses = wl.train(compiled, 6, optimizer="adam")
        runs[mode] = (wl, compiled, losses)
    (off_wl, _, off_losses), (wl, compiled, losses) = runs["off"], runs[pilot]
    assert all(torch.equal(a, b) for a, b in zip(off_losses, losses, strict=True))
    assert_same_state(off_wl.model, wl.model)
    p = memcompile.report(compiled).pilot
    assert p is not None and p.enabled and p.prefetched_bytes > 0
    assert p.gpu_miss_us is not None and p.gpu_wait_us is not None  # measured on the GPU
    if pilot != "adversarial":
        assert p.hit_bytes > 0
    assert find_compiler(compiled)[0].store.in_flight() == 0


def test_cuda_a_periodic_stream_is_prefetched_without_misses_or_late_copies() -> None:
    torch._dynamo.reset()
    wl = zoo.build("moe", size="tiny").to("cuda")
    compiled = memcompile.compile(wl.model, offload_params=True, pilot="markov")
    opt = torch.optim.SGD(wl.model.parameters(), lr=0.1)
    reports = []
    for i in range(6):
        opt.zero_grad(set_to_none=True)
        wl.loss(compiled, i).backward()
        opt.step()
        if i in (1, 5):
            reports.append(memcompile.report(compiled).pilot)
    before, after = reports
    assert before is not None and after is not None
    needed = after.needed_bytes - before.needed_bytes
    assert needed > 0 and after.hit_bytes - before.hit_bytes == needed
    assert after.misses == before.misses and after.gpu_miss_us == before.gpu_miss_us
    print(f"GPU waits for late prefetches, steps 2-5: {after.gpu_wait_us - before.gpu_wait_us} us")


def test_cuda_measured_peak_stays_within_the_budget_with_prefetch() -> None:
    rep = _unbudgeted_report("moe", eager_copy=False, offload_params=True, pilot="markov")
    assert rep.pilot is not None and rep.pilot.reserve_bytes > 0
    budget = rep.predicted_peak + rep.pilot.reserve_bytes
    wl = zoo.build("moe", size="tiny").to("cuda")
    compiled = memcompile.compile(wl.model, budget=budget, offload_params=True, pilot="markov")
    with warnings.catch_warnings():
        warnings.simplefilter("error", memcompile.MemoryBudgetWarning)  # the step's peak watch
        for i in range(4):
            wl.model.zero_grad(set_to_none=True)
            wl.loss(compiled, i).backward()
    wl.model.zero_grad(set_to_none=True)
    batch = wl.batch(4)
    measured = memcompile.measure_peak(
        lambda: compiled(*batch).backward(), resident=[wl.model, batch]
    )
    p = memcompile.report(compiled).pilot
    assert p is not None and p.hit_bytes > 0 and p.cache_peak_bytes > 0
    assert measured <= budget * 1.02, (measured, budget)


def test_cuda_router_counts_are_read_at_the_tail_and_the_rule_predicts() -> None:
    # The router's counts are CUDA tensors: read at its graph's tail (not in the graph, where
    # the host would wait), so the output rule (dynamic/rules.py) predicts the experts.
    torch._dynamo.reset()
    wl = zoo.build("moe", size="tiny").to("cuda")
    compiled = memcompile.compile(wl.model, offload_params=True, pilot="lightgbm")
    opt = torch.optim.SGD(wl.model.parameters(), lr=0.1)
    for i in range(6):
        opt.zero_grad(set_to_none=True)
        wl.loss(compiled, i).backward()
        opt.step()
    rep = memcompile.report(compiled)
    p = rep.pilot
    assert p is not None and p.tail_predictions > 0 and p.in_graph_predictions > 0
    assert any(not pl.in_graph for pl in p.placements)  # the routers' graphs
    prefetcher = find_compiler(compiled)[0].prefetcher
    assert prefetcher is not None
    assert prefetcher.cache.by_tag["rule@1"].hit > 0


def test_cuda_the_glue_on_the_host_gives_eager_gradients() -> None:
    # The eager glue's saved tensors through the host tier (runtime/glue.py) and a parameter
    # only eager code reads fetched around the forward (runtime/glue_params.py): gradients bit
    # for bit (SGD with lr=0 keeps the parameters equal, whichever side steps them).
    import copy

    from test_glue import _GlueMoE

    x = torch.randn(256, 32, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    torch.manual_seed(0)
    model = _GlueMoE().cuda()
    eager = copy.deepcopy(model)
    compiled = memcompile.compile(model, offload_params=True)
    opts = tuple(torch.optim.SGD(m.parameters(), lr=0.0) for m in (eager, model))
    compiler, _ = find_compiler(compiled)
    for step in range(5):
        if step == 3:
            compiler.glue.turn_on("test")  # the glue's saved tensors to the host tier too
        for fn, opt in ((eager, opts[0]), (compiled, opts[1])):
            opt.zero_grad(set_to_none=True)
            fn(x).backward()
        _assert_grads_equal(eager, model)
        for opt in opts:
            opt.step()
    assert model.w.device.type == "cpu" and model.w.is_pinned()
    assert model.w.grad is not None and model.w.grad.device.type == "cpu"
    rep = memcompile.report(compiled)
    assert [(g.module, g.name) for g in rep.glue_params] == [("", "w")]
    assert rep.glue.on and rep.glue.tensors > 0
