"""The exact MILP planner (``planning/milp.py``) and the greedy planner's optimality gap against it.

Graphs: ``RandomNet`` programs of ``test_planner_random`` (seeded, 2-5 ops, <= 60 joint nodes),
captured through Dynamo + AOTAutograd with measured workspaces; budgets between the smallest
reachable peak (``min_peak``) and eager's. Modes: recompute only, swap only (host), both.
"""

from __future__ import annotations

import functools
import itertools
import math
import random
from dataclasses import dataclass

import pytest
import torch
from test_planner_random import OPS, RandomNet
from torch import nn

from memcompile.analysis.joint_model import JointModel
from memcompile.planning.milp import MilpResult, linear_peak, min_peak, solve_saved_set
from memcompile.planning.planner import search_saved_set

from helpers import capture_module

MODES = {"recompute": (True, None), "swap": (False, "host"), "both": (True, "host")}
FRACTIONS = (0.0, 0.25, 0.5, 0.75)  # target = min_peak + f * (eager's peak - min_peak)
# Seeds 1-13 (0 and 11 make graphs over 60 nodes), plus graphs where the greedy planner misses
# the optimum (see the xfails below).
SEEDS = (*range(1, 11), 12, 13, 14, 20, 44, 47, 135)
GAP = 1.05  # the target: greedy within 5 % of the optimum ...
EPS = 1e-7  # ... plus 0.1 us (a fraction of one launch)


def capture(module: nn.Module, *inputs: torch.Tensor) -> JointModel:
    """The joint model of ``module``'s training step (``helpers.capture_module``)."""
    return capture_module(module, *inputs)["model"]


def program(seed: int) -> tuple[list[tuple[str, int, int]], int]:
    """A random ``RandomNet`` program and batch size."""
    rng = random.Random(seed)
    prog = [
        (rng.choice(OPS), rng.randint(0, 20), rng.randint(0, 20)) for _ in range(rng.randint(2, 5))
    ]
    if not any(op == "linear" for op, _, _ in prog):
        prog[0] = ("linear", *prog[0][1:])
    return prog, rng.choice([16, 64])


@functools.cache
def random_graph(seed: int) -> JointModel:
    prog, batch = program(seed)
    x = torch.randn(batch, 48, generator=torch.Generator().manual_seed(1))
    model = capture(RandomNet(prog, seed=3), x)
    assert len(model.nodes) <= 60, (seed, len(model.nodes))
    return model


@dataclass(frozen=True)
class Case:
    seed: int
    mode: str
    fraction: float
    target: int
    milp: MilpResult
    greedy_time: float | None  # None: the greedy plan misses the target

    def __str__(self) -> str:
        greedy = "infeasible" if self.greedy_time is None else f"{self.greedy_time * 1e6:.3f} us"
        return (
            f"seed {self.seed} {self.mode} target {self.target} B (f={self.fraction}): "
            f"greedy {greedy}, MILP {self.milp.objective * 1e6:.3f} us"
        )


@functools.cache
def cases() -> tuple[Case, ...]:
    out = []
    for seed in SEEDS:
        model = random_graph(seed)
        eager = model.evaluate(model.default_saved() | model.must_save()).peak
        for mode, (recompute, tier) in MODES.items():
            lowest = min_peak(model, recompute=recompute, swap_tier=tier)
            assert lowest is not None and lowest <= eager
            for f in FRACTIONS:
                target = int(lowest + f * (eager - lowest))
                milp = solve_saved_set(model, target, recompute=recompute, swap_tier=tier)
                # The greedy in the MILP's decision space: torch's orders (no memory-aware reorder).
                g = search_saved_set(
                    model, target, recompute=recompute, swap_tier=tier, reorder=False
                ).final
                fits = g.feasible and g.peak <= target
                out.append(Case(seed, mode, f, target, milp, g.time if fits else None))
    return tuple(out)


# -- the MILP ---------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS[:8])
def test_linear_model_equals_the_simulator(seed: int) -> None:
    """For random plans (any forward storage kept, random swaps), the MILP's peak is
    ``evaluate``'s, and a plan ``evaluate`` calls infeasible is outside the MILP."""
    model = random_graph(seed)
    forward = frozenset(s for i in model.forward_order for s in model.storages[i])
    forward -= model.persistent
    rng = random.Random(seed)
    for _ in range(12):
        keep = frozenset(s for s in forward if rng.random() < 0.5) | model.must_save()
        swappable = model.evaluate(keep).swappable
        swaps = {s: "host" for s in sorted(swappable) if rng.random() < 0.3}
        e = model.evaluate(keep, swaps)
        peak = linear_peak(model, keep, swaps, candidates=forward)
        assert peak == (e.peak if e.feasible else None), (sorted(keep), swaps)


def test_milp_plans_fit_and_agree_with_the_simulator() -> None:
    for case in cases():
        r = case.milp
        assert r.status == "optimal" and r.optimal, str(case)
        assert r.exact, str(case)
        assert r.evaluation is not None and r.evaluation.feasible
        assert r.evaluation.peak <= case.target, str(case)
        assert r.evaluation.time == pytest.approx(r.objective, rel=1e-9, abs=1e-15)
        assert r.bound <= r.objective + 1e-12


@pytest.mark.parametrize("mode", MODES)
def test_milp_equals_brute_force(mode: str) -> None:
    """Every plan of the decision space, simulated: none fits the target more cheaply."""
    recompute, tier = MODES[mode]
    checked = 0
    for case in cases():
        if case.mode != mode or case.seed not in SEEDS[:6]:
            continue
        model = random_graph(case.seed)
        base = model.evaluate(model.default_saved() | model.must_save())
        free = sorted(base.saved - model.must_save()) if recompute else []
        swappable = sorted(base.swappable) if tier else []
        if len(free) + len(swappable) > 10:
            continue
        best = math.inf
        for drop in itertools.product((False, True), repeat=len(free)):
            keep = base.saved - {s for s, d in zip(free, drop, strict=True) if d}
            for swap in itertools.product((False, True), repeat=len(swappable)):
                swaps = {s: "host" for s, w in zip(swappable, swap, strict=True) if w}
                e = model.evaluate(keep, swaps)
                if e.feasible and e.peak <= case.target:
                    best = min(best, e.time)
        assert case.milp.objective == pytest.approx(best, rel=1e-9, abs=1e-15), str(case)
        checked += 1
    assert checked >= 8


class SinChain(nn.Module):
    """h = x @ w; three sines; sum. Eager saves h, sin(h), sin(sin(h)) (4 MiB each)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(1024, 1024) / 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.w).sin().sin().sin().sum()


def test_hand_built_graph_optimum() -> None:
    """The backward (in torch's order) holds four 4 MiB tensors from its first op (cos of the
    last saved sine) to its second ``mul``, and h, the matmul's output, is live through all of
    those moments (saved from entry to its last reader, ``cos(h)``). The two other saved
    tensors are read, and so recomputed, inside that window. So a peak of three tensors needs
    h dropped and recomputed right before ``cos(h)``, after the window: one matmul (the most
    expensive op, but the only choice); keeping the two sines costs nothing more."""
    model = capture(SinChain(), torch.randn(1024, 1024))
    mm = next(i for i in model.forward_order if model.nodes[i].target is torch.ops.aten.mm.default)
    sines = [i for i in model.forward_order if model.nodes[i].target is torch.ops.aten.sin.default]
    (h,) = model.storages[mm]
    tensor = model.nbytes[h]
    eager = model.evaluate(model.default_saved())
    assert eager.saved == {h, *(s for i in sines[:2] for s in model.storages[i])}
    assert eager.peak // tensor == 4
    target = 3 * tensor + tensor // 2

    r = solve_saved_set(model, target)
    assert r.optimal and r.exact
    assert r.evaluation is not None
    assert r.evaluation.recompute == (mm,)
    assert r.saved == eager.saved - {h}
    assert r.objective == pytest.approx(model.cost[mm], rel=1e-12)
    assert r.evaluation.peak // tensor == 3
    # One byte under eager's peak, the same plan: every other plan peaks at eager's peak
    # (recomputing the two sines instead would be cheaper, but peaks there exactly).
    r = solve_saved_set(model, eager.peak - 1)
    assert r.optimal and r.evaluation is not None
    assert r.evaluation.recompute == (mm,)


def test_reading_a_recomputed_copy_does_not_swap_the_saved_original_in() -> None:
    """Seed 135: layer norm on the input. Keep its output (swapped), drop mean and rstd: the
    backward recomputes the layer norm (a fresh copy of the output, read by nothing) for its
    getitems. The swapped output is still only needed by its own readers."""
    model = random_graph(135)
    ln = next(i for i in model.forward_order if model.is_tuple[i])
    out, mean, rstd = model.storages[ln]
    keep = model.default_saved() - {mean, rstd}
    plain, swapped = model.evaluate(keep), model.evaluate(keep, {out: "host"})
    assert swapped.swapped == ((out, "host"),)
    assert ln in swapped.recompute
    assert swapped.accumulate_peak <= plain.accumulate_peak
    assert swapped.peak == linear_peak(model, keep, {out: "host"})


def test_infeasible_target_is_a_result_not_an_exception() -> None:
    model = random_graph(1)
    r = solve_saved_set(model, 1, swap_tier="host")
    assert r.status == "infeasible"
    assert not r.optimal
    assert r.evaluation is None and r.saved == frozenset() and r.swapped == ()
    assert r.objective == math.inf
    lowest = min_peak(model, swap_tier="host")
    assert lowest is not None
    assert solve_saved_set(model, lowest - 1, swap_tier="host").status == "infeasible"
    assert solve_saved_set(model, lowest, swap_tier="host").status == "optimal"


# -- the greedy planner against it ------------------------------------------------------------


def _misses(mode: str) -> list[Case]:
    """Cases where the greedy claims infeasible although the MILP found a plan."""
    return [c for c in cases() if c.mode == mode and c.greedy_time is None]


def _gaps(mode: str) -> list[Case]:
    """Cases where both fit and the greedy is more than 5 % (+ EPS) above the optimum."""
    return [
        c
        for c in cases()
        if c.mode == mode
        and c.greedy_time is not None
        and c.greedy_time > GAP * c.milp.objective + EPS
    ]


@pytest.mark.parametrize("mode", MODES)
def test_greedy_within_5_percent_of_the_milp(mode: str) -> None:
    """``benchmarks/planner_gap.py`` runs the same over 130 graphs (0 cases over 5 %)."""
    # Targets eager's plan already meets test nothing: enough must need a move.
    assert sum(c.milp.objective > 0 for c in cases() if c.mode == mode) >= 30
    bad = _gaps(mode)
    assert not bad, "\n".join(map(str, bad))


@pytest.mark.parametrize("mode", MODES)
def test_greedy_finds_a_plan_whenever_the_milp_does(mode: str) -> None:
    missed = _misses(mode)
    assert not missed, "\n".join(map(str, missed))
