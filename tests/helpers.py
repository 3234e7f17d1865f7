"""Helpers shared by test modules (tests/ is on sys.path under pytest's default import mode)."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from torch import fx
from torch._dynamo.backends.common import aot_autograd
from torch._functorch import partitioners as P

from memcompile import zoo
from memcompile.analysis.costmodel import device_profile
from memcompile.analysis.fragment_profile import profile_fragment
from memcompile.analysis.joint_model import JointModel
from memcompile.analysis.workspace import probe_workspaces
from memcompile.backends.inner import compile_inner
from memcompile.planning.plan import FragmentPlan, TensorDecision
from memcompile.zoo import Workload


def run_benchmark(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``benchmarks/SCRIPT`` with ``args`` in a subprocess (one thread), output captured."""
    path = Path(__file__).resolve().parent.parent / "benchmarks" / script
    return subprocess.run(
        [sys.executable, str(path), *args],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=600,
    )


def assert_same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    """Parameters and buffers of ``a`` and ``b`` are bit-identical (wherever each lives: one
    model's parameter may be on the host where the other's is on a CUDA device)."""
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    differ = [k for k in sa if not torch.equal(sa[k].cpu(), sb[k].cpu())]
    assert not differ, f"differ: {differ}"


def training_loop(
    wl: Workload,
    model: Callable[..., torch.Tensor],
    opt: torch.optim.Optimizer | None,
    *,
    micro: int,
    set_to_none: bool = True,
    scheduler: Any = None,
    extra: torch.optim.Optimizer | None = None,
) -> Callable[[int], list[torch.Tensor]]:
    """A training loop as users write it: iteration ``k`` runs ``micro`` micro-batches
    accumulating gradients, the optimizer's step (and ``extra``'s), the scheduler's, then
    zero_grad (the model's, without an optimizer); it returns the micro-batches' losses."""
    optimizers = [o for o in (opt, extra) if o is not None]

    def iteration(k: int) -> list[torch.Tensor]:
        losses = []
        for j in range(micro):
            loss = wl.loss(model, k * micro + j) / micro
            loss.backward()
            losses.append(loss.detach())
        for o in optimizers:
            o.step()
        if scheduler is not None:
            scheduler.step()
        for o in optimizers:
            o.zero_grad(set_to_none=set_to_none)
        if not optimizers:
            wl.model.zero_grad(set_to_none=set_to_none)
        return losses

    return iteration


def quiet_peak(fn: Callable[[], Any], *resident: Any) -> int:
    """``memcompile.measure_peak(fn, resident=...)`` without its note on tensors from before
    the measurement freed during it (a loop's gradients, zeroed in the measured iteration)."""
    import warnings

    import memcompile

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return memcompile.measure_peak(fn, resident=list(resident))


def capture_module(module: torch.nn.Module, *inputs: Any) -> dict[str, Any]:
    """The joint graph AOTAutograd builds for one training step of ``module`` on ``inputs``
    (which must return a scalar loss), and its facts: ``joint``, ``n`` (forward outputs),
    ``static``, ``mutated`` and ``model`` (its :class:`JointModel`, h100 costs)."""
    found: dict[str, Any] = {}

    def partition(joint, inputs, *, num_fwd_outputs, static_lifetime_input_indices=None, **kw):
        found.update(joint=joint, n=num_fwd_outputs, static=static_lifetime_input_indices or [])
        return P.default_partition(
            joint,
            inputs,
            num_fwd_outputs=num_fwd_outputs,
            static_lifetime_input_indices=static_lifetime_input_indices,
        )

    def fw(gm, ex):
        return compile_inner("eager", gm, ex, role="forward")

    def bw(gm, ex):
        return compile_inner("eager", gm, ex, role="backward")

    torch._dynamo.reset()
    compiled = torch.compile(
        module, backend=aot_autograd(fw_compiler=fw, bw_compiler=bw, partition_fn=partition)
    )
    compiled(*inputs).backward()
    torch._dynamo.reset()
    joint = found["joint"]
    _, _, descs, _ = P._extract_fwd_bwd_outputs(joint, num_fwd_outputs=found["n"])
    found["mutated"] = sum(type(d).__name__ == "InputMutationAOTOutput" for d in descs)
    found["model"] = JointModel(
        joint,
        num_fwd_outputs=found["n"],
        static_input_indices=found["static"],
        profile=device_profile("h100"),  # spec numbers: the same costs on every machine
        workspace=probe_workspaces(joint),
    )
    return found


def capture_joint(name: str) -> dict[str, Any]:
    """:func:`capture_module` of zoo workload ``name`` (tiny) on its first batch."""
    wl = zoo.build(name, size="tiny")
    return capture_module(wl.model, *wl.batch(0))


def search_under(name: str, fraction: float, swap_tier: str | None) -> Any:
    """The planner's search (``search_saved_set``) of zoo workload ``name`` (tiny, a fresh
    joint model) for ``fraction`` of its no-budget plan's peak."""
    from memcompile.planning.planner import search_saved_set

    model = capture_joint(name)["model"]
    base = search_saved_set(model, None)
    return search_saved_set(model, int(fraction * base.final.peak), swap_tier=swap_tier)


def built_phase_peaks(
    found: dict[str, Any], fw: fx.GraphModule, bw: fx.GraphModule
) -> dict[str, int]:
    """Exact phase peaks of the forward/backward graphs built from ``found``'s joint graph."""
    exact = profile_fragment(
        fw,
        bw,
        static_input_indices=found["static"],
        num_mutated_inputs=found["mutated"],
        num_user_outputs=1,
        forward_workspace=probe_workspaces(fw),
        backward_workspace=probe_workspaces(bw),
    )
    return exact.phase_peaks()


def plan_for(model: JointModel, keep: frozenset[int]) -> FragmentPlan:
    e = model.evaluate(keep)
    base = model.default_saved() | e.saved
    return FragmentPlan(
        fragment="",
        decisions=tuple(
            TensorDecision(
                model.describe(s), model.nbytes[s], "keep" if s in e.saved else "recompute"
            )
            for s in sorted(base)
        ),
        backward_order=tuple(model.nodes[i].name for i in e.backward_order),
        target=None,
        resident_bytes=0,
        predicted_peak=e.peak,
        baseline_peak=e.peak,
        recompute_time=e.recompute_time,
        feasible=True,
    )


def predicted_peak(name: str, *, size: str = "tiny", device: str = "cpu", **options: Any) -> int:
    """memcompile's predicted step peak of zoo workload ``name`` (``size``, on ``device``)
    after one step."""
    import memcompile

    wl = zoo.build(name, size=size).to(device)
    compiled = memcompile.compile(wl.model, **options)
    wl.loss(compiled, 0).backward()
    return memcompile.report(compiled).predicted_peak


def train_under_budget(
    name: str,
    optimizer: str,
    budget: int,
    *,
    size: str = "tiny",
    device: str = "cpu",
    over_budget: bool = False,
    **options: Any,
) -> tuple[Callable[..., torch.Tensor], Workload, int]:
    """Train ``name`` (``size``) 3 steps eagerly and under memcompile with ``budget`` (no budget
    warning allowed, unless ``over_budget``: a budget no plan meets, with
    ``on_infeasible="best_effort"``); assert the losses and state are bit-identical; return the
    compiled model, its workload and the measured peak of one more step."""
    import warnings

    import memcompile

    torch._dynamo.reset()
    eager = zoo.build(name, size=size).to(device)
    comp = zoo.build(name, size=size).to(device)
    eager_losses = eager.train(eager.model, 3, optimizer=optimizer)
    compiled = memcompile.compile(comp.model, budget=budget, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore" if over_budget else "error", memcompile.MemoryBudgetWarning)
        losses = comp.train(compiled, 3, optimizer=optimizer)
    assert all(torch.equal(a, b) for a, b in zip(eager_losses, losses, strict=True))
    assert_same_state(eager.model, comp.model)
    comp.model.zero_grad(set_to_none=True)
    batch = comp.batch(2)
    measured = memcompile.measure_peak(
        lambda: compiled(*batch).backward(), resident=[comp.model, batch]
    )
    return compiled, comp, measured


def measure_settled(compiled: Callable[..., Any], wl: Workload, batch: Any, steps: int = 4) -> int:
    """Measured peak of one forward and backward of ``compiled`` on ``batch``, in a step that
    compiled nothing: a re-plan the previous step decided compiles its fragments in the next
    one, which then runs half the old plans and half the new (a dynamic model moving a
    parameter to the host mid-step). At most ``steps`` tries; asserts one was settled."""
    import memcompile

    stats = torch._dynamo.utils.counters["stats"]
    for _ in range(steps):
        wl.model.zero_grad(set_to_none=True)
        before = stats["unique_graphs"]
        measured = memcompile.measure_peak(
            lambda: compiled(*batch).backward(), resident=[wl.model, batch]
        )
        if stats["unique_graphs"] == before:
            wl.model.zero_grad(set_to_none=True)
            return measured
    raise AssertionError(f"still compiling after {steps} measured steps")


#: Seconds a group of spawned ranks gets (about 15 s on a 2-core machine, 4 processes).
RANKS_DEADLINE = int(os.environ.get("MC_DDP_DEADLINE", "150"))


def spawn_ranks(fn: Callable[..., None], args: tuple[Any, ...], out: Path, world: int = 2) -> list:
    """Run ``fn(rank, *args)`` in ``world`` spawned processes and return what each wrote to
    ``out/rank{r}.json``. A rank that raises fails the call; ranks past the deadline are killed
    and fail the test (a collective mismatch can hang rather than fail)."""
    ranks = mp.start_processes(fn, args=args, nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + RANKS_DEADLINE
    while not ranks.join(timeout=5):  # raises if a rank failed
        if time.monotonic() > deadline:
            for p in ranks.processes:
                p.kill()
            pytest.fail(f"the spawned ranks did not finish in {RANKS_DEADLINE} s")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def join_ranks(rank: int, world: int, out: str | Path, seconds: int = 120) -> None:
    """In a rank :func:`spawn_ranks` started: join the gloo group, meeting the others through a
    file in ``out`` (a TCP port picked free could be taken by a test running beside it), giving
    up after ``seconds`` rather than hang; one thread, seed 0."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"file://{Path(out, 'store')}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=seconds),
    )
    torch.set_num_threads(1)
    torch.manual_seed(0)


def train_side_by_side(
    pairs: Any, steps: int, batch: Callable[[int], tuple[torch.Tensor, ...]]
) -> None:
    """``steps`` steps of each ``(model, optimizer)`` in ``pairs`` in turn, on ``batch(step)``
    (the models return their loss)."""
    for step in range(steps):
        inputs = batch(step)
        for fn, opt in pairs:
            opt.zero_grad(set_to_none=True)
            fn(*inputs).backward()
            opt.step()


def examples(n: int) -> int:
    """``max_examples`` for a random-network property test that draws ``n`` in full: a tenth
    (at least 3) by default, for CI's time, ``n`` with ``MEMCOMPILE_FUZZ=full``."""
    return n if os.environ.get("MEMCOMPILE_FUZZ") == "full" else max(3, n // 10)
