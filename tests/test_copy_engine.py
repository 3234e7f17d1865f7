"""The CPU device's copy thread (``runtime/copy_engine.py``): reloads of swapped tensors and the
pilot's prefetches copied beside the compute, waited for before their first reader."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import torch

import memcompile
from memcompile import zoo
from memcompile.report import find_compiler
from memcompile.runtime import copy_engine
from memcompile.runtime.store import OffloadError, TieredStore, register_store

from helpers import assert_same_state, predicted_peak, train_under_budget
from predictors import AlwaysWrong

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


@pytest.fixture
def every_copy_threaded(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The copy thread on (off by default), every CPU copy to it (the tiny models' are under
    ``MIN_BYTES``); yields the list of bytes of each copy (or block of copies) submitted."""
    submitted: list[int] = []
    real, real_many = copy_engine.submit, copy_engine.submit_many

    def counting(dst: torch.Tensor, src: torch.Tensor) -> copy_engine.CopyJob:
        submitted.append(src.numel() * src.element_size())
        return real(dst, src)

    def counting_many(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> copy_engine.CopyJob:
        submitted.append(sum(s.numel() * s.element_size() for s in srcs))  # a block: one job
        return real_many(dsts, srcs)

    monkeypatch.setattr(copy_engine, "MIN_BYTES", 0)
    monkeypatch.setattr(copy_engine, "submit", counting)
    monkeypatch.setattr(copy_engine, "submit_many", counting_many)
    with copy_engine.using(True):
        yield submitted


def test_a_copy_runs_on_the_thread_and_its_reader_waits_for_it() -> None:
    src = torch.randn(512, 512)
    dst = torch.empty_like(src)
    job = copy_engine.submit(dst, src)
    job.wait()
    assert job.done and torch.equal(dst, src) and copy_engine.running()


def test_a_copy_from_a_parameter_leaves_no_autograd_history() -> None:
    # Grad mode is per thread and on in the copy thread: the copy must not record one.
    p = torch.nn.Parameter(torch.randn(64))
    dst = torch.empty(64)
    copy_engine.submit(dst, p).wait()
    assert dst.grad_fn is None and not dst.requires_grad and torch.equal(dst, p.detach())


def test_the_thread_is_off_by_default_and_small_copies_run_at_once() -> None:
    # Measured slower than copying at once on the CPU (benchmarks/results/copy_thread.md).
    assert not copy_engine.active() and not copy_engine.worth(1 << 30)
    with copy_engine.using(True):
        assert not copy_engine.worth(copy_engine.MIN_BYTES - 1)
        assert copy_engine.worth(copy_engine.MIN_BYTES)
    assert not copy_engine.worth(copy_engine.MIN_BYTES)


def test_the_environment_switch_takes_0_and_1_and_warns_about_anything_else() -> None:
    assert copy_engine._from_env("1") and not copy_engine._from_env("0")
    assert not copy_engine._from_env(None) and not copy_engine._from_env("")
    with pytest.warns(UserWarning, match=r"MEMCOMPILE_COPY_THREAD='yes': expected 0 or 1; the "):
        assert not copy_engine._from_env("yes")


def test_a_failed_copy_raises_in_the_waiter_as_an_offload_error(every_copy_threaded) -> None:
    store = TieredStore()
    key = register_store(store)
    host = torch.ops.memcompile.offload(torch.randn(16, 16), key, 0)
    y = torch.ops.memcompile.reload(host, torch.device("cpu"), key, 0)
    torch.ops.memcompile.wait(y, key)  # a good one first
    assert every_copy_threaded and store.in_flight() == 0
    bad = copy_engine.submit(torch.empty(3), torch.empty(4))  # shapes do not broadcast
    with pytest.raises(RuntimeError):
        bad.wait()
    store._pending[y.data_ptr()] = bad  # as if y's reload had failed on the thread
    with pytest.raises(OffloadError, match="reading a swapped tensor back failed"):
        store.wait(y)


def test_the_thread_stops_when_idle_and_at_shutdown_and_starts_again(monkeypatch) -> None:
    copy_engine.shutdown()
    assert not copy_engine.running()
    monkeypatch.setattr(copy_engine, "IDLE_EXIT_S", 0.05)
    a, b = torch.randn(8), torch.empty(8)
    copy_engine.submit(b, a).wait()
    assert copy_engine.running()
    deadline = time.monotonic() + 5
    while copy_engine.running() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not copy_engine.running()  # idle: gone
    monkeypatch.setattr(copy_engine, "IDLE_EXIT_S", 30.0)
    c = torch.empty(8)
    copy_engine.submit(c, a).wait()  # started again
    assert torch.equal(c, a) and copy_engine.running()
    copy_engine.shutdown()
    assert not copy_engine.running()
    assert not any(t.name == "memcompile-copy" for t in threading.enumerate())


def test_dynamo_reset_stops_the_copy_thread(every_copy_threaded) -> None:
    wl = zoo.build("moe", size="tiny")
    compiled = memcompile.compile(wl.model, offload_params=True, pilot="markov")
    opt = torch.optim.SGD(wl.model.parameters(), lr=0.1)
    for i in range(3):
        wl.loss(compiled, i).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert every_copy_threaded and copy_engine.running()
    torch._dynamo.reset()
    assert not copy_engine.running()
    assert not any(t.name == "memcompile-copy" for t in threading.enumerate())


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_swap_plans_train_bit_identically_with_reloads_on_the_thread(
    tier: str, tmp_path, every_copy_threaded
) -> None:
    # Reloads of swapped activations go to the thread; the plan's prediction stays exact (the
    # copies' memory is allocated where the plan says), training bit-identical to eager.
    name = "gpt_manual"
    budget = int(predicted_peak(name) * 0.85)
    compiled, _, measured = train_under_budget(
        name, "adam", budget, recompute=False, offload_to=tier, disk_path=str(tmp_path)
    )
    rep = memcompile.report(compiled)
    assert rep.plan.fragments[0].swapped
    store = find_compiler(compiled)[0].store
    assert store.bytes_in[tier] > 0 and store.in_flight() == 0
    assert every_copy_threaded  # the reloads went to the thread
    assert measured <= budget * 1.02 and abs(rep.predicted_peak - measured) <= 0.03 * measured


@pytest.mark.parametrize("pilot", ["markov", "adversarial"])
def test_the_pilots_prefetches_on_the_thread_train_bit_identically(
    pilot: str, every_copy_threaded
) -> None:
    eager, comp = zoo.build("moe", size="tiny"), zoo.build("moe", size="tiny")
    expected = eager.train(eager.model, 5, optimizer="adam")
    compiled = memcompile.compile(comp.model, offload_params=True, pilot="markov")
    prefetcher = find_compiler(compiled)[0].prefetcher
    assert prefetcher is not None
    if pilot == "adversarial":
        prefetcher.predictor = AlwaysWrong()
    losses = comp.train(compiled, 5, optimizer="adam")
    assert all(torch.equal(a, b) for a, b in zip(expected, losses, strict=True))
    assert_same_state(eager.model, comp.model)
    p = memcompile.report(compiled).pilot
    assert p is not None and p.prefetched_bytes > 0 and every_copy_threaded
    if pilot == "adversarial":
        assert p.hit_bytes == 0 and p.wasted_bytes == p.prefetched_bytes
    else:
        assert p.hit_rate is not None and p.hit_rate > 0.6


def test_a_copy_failing_on_the_thread_fails_the_step_and_leaves_parameters_untouched(
    every_copy_threaded, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = "gpt_manual"
    budget = int(predicted_peak(name) * 0.85)
    wl = zoo.build(name, size="tiny")
    compiled = memcompile.compile(wl.model, budget=budget, recompute=False)
    opt = torch.optim.Adam(wl.model.parameters(), lr=1e-3)
    wl.loss(compiled, 0).backward()  # compile and one good step
    opt.step()
    opt.zero_grad(set_to_none=True)
    before = {k: v.clone() for k, v in wl.model.state_dict().items()}

    def broken(self: copy_engine.CopyJob) -> None:
        self._error = RuntimeError("simulated copy failure")
        self._dst = self._src = None
        self._done.set()

    monkeypatch.setattr(copy_engine.CopyJob, "_run", broken)
    with pytest.raises(OffloadError, match="simulated copy failure"):
        wl.loss(compiled, 1).backward()
        opt.step()
    assert all(torch.equal(before[k], v) for k, v in wl.model.state_dict().items())


def test_two_compiled_models_train_in_one_process_with_the_copy_thread(
    every_copy_threaded,
) -> None:
    # One thread serves both models' copies, interleaved step by step; under
    # torch.set_num_threads(1) (the tests' OMP_NUM_THREADS=1) nothing waits on anything else.
    torch.set_num_threads(1)
    eager = [zoo.build("moe", size="tiny") for _ in range(2)]
    comp = [zoo.build("moe", size="tiny") for _ in range(2)]
    compiled = [memcompile.compile(w.model, offload_params=True, pilot="markov") for w in comp]
    opts = [torch.optim.Adam(w.model.parameters(), lr=1e-3) for w in (*eager, *comp)]
    for i in range(4):
        for k in range(2):
            for model, wl, opt in (
                (eager[k].model, eager[k], opts[k]),
                (compiled[k], comp[k], opts[2 + k]),
            ):
                loss = wl.loss(model, i)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
    for k in range(2):
        assert_same_state(eager[k].model, comp[k].model)
        p = memcompile.report(compiled[k]).pilot
        assert p is not None and p.prefetched_bytes > 0
    assert every_copy_threaded


def test_the_interpreter_exits_with_the_copy_thread_alive(tmp_path) -> None:
    script = tmp_path / "exit.py"
    script.write_text(
        "import torch\n"
        "from memcompile.runtime import copy_engine\n"
        "a, b = torch.randn(1 << 20), torch.empty(1 << 20)\n"
        "job = copy_engine.submit(b, a)\n"
        "job.wait()\n"
        "assert copy_engine.running() and torch.equal(a, b)\n"
        "print('done')\n"
    )
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0 and out.stdout.strip() == "done", out.stderr
