"""The pilot in training (``pilot`` option, dynamic/prefetch.py): bit-identical to eager whatever
it predicts, prefetch hits and waste reported, the budget kept with the cache, clear errors, and
Dynamo's recompile limit for dynamic models."""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Iterator, Sequence

import pytest
import torch
from torch import fx, nn

import memcompile
from memcompile import zoo
from memcompile.backends import advice
from memcompile.backends.compiler import DYNAMIC_RECOMPILE_LIMIT, MemCompiler
from memcompile.config import MemConfig
from memcompile.dynamic import prefetch, trace, trial
from memcompile.dynamic.pilot import Prediction
from memcompile.pipeline import features
from memcompile.report import find_compiler
from memcompile.runtime import copy_engine
from memcompile.runtime.cache import PrefetchCache
from memcompile.step import monitor as step_monitor

from helpers import assert_same_state, train_under_budget
from predictors import AlwaysWrong

# The Pilot trains inline after two steps, so it predicts with LightGBM within a short test.
_FAST_PILOT = {"warmup_steps": 2, "retrain_every": 1, "background": False}
# The in-graph prediction op (rewrites/pilot_prefetch.py), as the profiles name targets.
PILOT_OP = "memcompile.pilot_prefetch.default"


def _pilot_ops(rep: memcompile.MemReport) -> dict[str, int]:
    """Training fragment -> pilot ops in its forward graph."""
    return {
        f.name: sum(n.target == PILOT_OP for n in f.profile.forward.nodes)
        for f in rep.fragments
        if f.training and f.profile is not None
    }


def _run(name: str, pilot: str, steps: int, optimizer: str = "sgd") -> memcompile.MemReport:
    """Train ``name`` (tiny) eagerly and under memcompile with parameters on the host and
    ``pilot`` ("adversarial": markov replaced by :class:`AlwaysWrong`); assert bit-identical
    losses and parameters; return the report."""
    torch._dynamo.reset()
    eager, comp = zoo.build(name, size="tiny"), zoo.build(name, size="tiny")
    expected = eager.train(eager.model, steps, optimizer=optimizer)
    option = "markov" if pilot == "adversarial" else pilot
    compiled = memcompile.compile(comp.model, offload_params=True, pilot=option)
    if pilot == "adversarial":
        compiler = find_compiler(compiled)[0]
        assert compiler.prefetcher is not None
        compiler.prefetcher.predictor = AlwaysWrong()
    losses = comp.train(compiled, steps, optimizer=optimizer)
    assert all(torch.equal(a, b) for a, b in zip(expected, losses, strict=True))
    assert_same_state(eager.model, comp.model)
    return memcompile.report(compiled)


@pytest.mark.parametrize("pilot", ["off", "markov", "lightgbm", "adversarial"])
@pytest.mark.parametrize("name", ["moe", "early_exit"])
def test_training_is_bit_identical_whatever_the_pilot_predicts(
    name: str, pilot: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(prefetch, "PILOT_KNOBS", _FAST_PILOT)
    rep = _run(name, pilot, 5 if name == "moe" else 6)
    p = rep.pilot
    ops = _pilot_ops(rep)
    if pilot == "off":
        assert p is None and rep.to_dict()["pilot"] is None
        assert ops and not any(ops.values())  # no prediction op in any graph
        return
    # Each forward graph predicts once, in the graph; no tail predicts again.
    assert ops and set(ops.values()) == {1}
    assert p.in_graph_predictions > 0 and p.tail_predictions == 0
    assert p is not None and p.enabled and p.mode == ("markov" if pilot != "lightgbm" else pilot)
    assert p.needed_bytes > 0 and p.predictions > 0 and p.predict_us_p50 is not None
    assert p.reserve_bytes > 0 and p.cache_peak_bytes <= p.reserve_bytes
    assert rep.to_dict()["pilot"] == p.to_dict()
    assert "pilot (" in str(rep)
    if pilot == "adversarial":
        assert p.active == "adversarial"
        if name == "moe":  # no block runs twice in an MoE forward: always wrong
            assert p.accuracy == 0 and p.k_ahead_accuracy == 0
            assert p.hit_rate == 0 and p.hit_bytes == 0
            assert p.prefetched_bytes > 0 and p.wasted_bytes == p.prefetched_bytes
    elif name == "moe":  # every expert gets tokens every step: a periodic stream
        assert p.accuracy is not None and p.accuracy > 0.7
        assert p.hit_rate is not None and p.hit_rate > 0.6
    if pilot == "lightgbm" and name == "moe":
        assert p.active == "lightgbm" and p.models_trained is not None and p.models_trained >= 1


def test_a_periodic_stream_is_prefetched_in_time_with_no_waste() -> None:
    # The tiny MoE routes tokens to every expert in every step: once one step has been seen,
    # Markov predicts every block, the first block of a step too (prefetched after the
    # optimizer step): nothing is fetched on demand.
    torch._dynamo.reset()
    wl = zoo.build("moe", size="tiny")
    compiled = memcompile.compile(wl.model, offload_params=True, pilot="markov")
    opt = torch.optim.SGD(wl.model.parameters(), lr=0.1)

    def step(i: int) -> None:
        opt.zero_grad(set_to_none=True)
        wl.loss(compiled, i).backward()
        opt.step()

    for i in range(2):
        step(i)
    before = memcompile.report(compiled).pilot
    for i in range(2, 6):
        step(i)
    after = memcompile.report(compiled).pilot
    assert before is not None and after is not None
    needed = after.needed_bytes - before.needed_bytes
    hit = after.hit_bytes - before.hit_bytes
    assert needed > 0 and hit == needed
    assert after.misses == before.misses and after.stall_us == before.stall_us
    assert after.wasted_bytes == before.wasted_bytes  # nothing prefetched in vain
    assert after.accuracy is not None and after.accuracy > before.accuracy  # type: ignore[operator]
    assert before.stall_us > 0  # the first step was fetched on demand


def test_the_next_steps_first_block_is_prefetched_after_the_optimizer_step() -> None:
    torch._dynamo.reset()
    wl = zoo.build("moe", size="tiny")
    compiled = memcompile.compile(wl.model, offload_params=True, pilot="markov")
    prefetcher = find_compiler(compiled)[0].prefetcher
    assert prefetcher is not None
    opt = torch.optim.SGD(wl.model.parameters(), lr=0.1)
    other = torch.optim.SGD([nn.Parameter(torch.ones(3))], lr=0.1)
    for i in range(3):
        opt.zero_grad(set_to_none=True)
        wl.loss(compiled, i).backward()
        other.step()  # another model's optimizer: nothing is copied
        assert prefetcher.cache.bytes == 0
        opt.step()
        # Step 0 ends with no prediction past the head (it has not been followed yet).
        assert prefetcher.step_start_prefetches == i
        assert (prefetcher.cache.bytes > 0) == (i > 0)
    before = memcompile.report(compiled).pilot
    wl.loss(compiled, 3).backward()
    after = memcompile.report(compiled).pilot
    assert before is not None and after is not None
    assert after.misses == before.misses and after.hit_bytes > before.hit_bytes
    assert after.wasted_bytes == before.wasted_bytes


class WrongSecond(prefetch.MarkovBlocks):
    """Markov 1 block ahead; 2 ahead, the block that just ran (never right in an MoE forward)."""

    def __init__(self) -> None:
        super().__init__(2)
        self.last: str | None = None

    def observe(
        self, block: str, fragment: str, sizes: Sequence[int] = (), idioms: object = None
    ) -> None:
        super().observe(block, fragment)
        self.last = block

    def predict(self) -> Prediction:
        markov = super().predict()
        return Prediction(
            blocks=(markov.blocks[0], self.last),
            sources=("markov", "hedge"),
            confidence=(math.nan, math.nan),
        )


def test_a_wasteful_hedge_is_muted_and_probed() -> None:
    torch._dynamo.reset()
    wl = zoo.build("moe", size="tiny")
    compiled = memcompile.compile(wl.model, offload_params=True, pilot="markov")
    prefetcher = find_compiler(compiled)[0].prefetcher
    assert prefetcher is not None
    prefetcher.predictor = WrongSecond()
    opt = torch.optim.SGD(wl.model.parameters(), lr=0.1)
    for i in range(6):
        opt.zero_grad(set_to_none=True)
        wl.loss(compiled, i).backward()
        opt.step()
    tags = prefetcher.cache.by_tag
    assert prefetcher._muted == {"hedge@2"} and prefetcher.muted_predictions > 0
    hedge = tags["hedge@2"]
    assert hedge.hit == 0 and hedge.wasted == hedge.prefetched > 0  # probes still copy
    assert tags["markov@1"].hit > 0
    rep = memcompile.report(compiled)
    p = rep.pilot
    assert p is not None and p.wasted_bytes >= hedge.wasted
    # Predictions it did not act on are in the report, not dropped quietly.
    assert p.muted_predictions == prefetcher.muted_predictions > 0
    assert f"{p.muted_predictions} predictions muted" in str(rep)
    assert rep.to_dict()["pilot"]["muted_predictions"] == p.muted_predictions


def test_measured_peak_stays_within_the_budget_with_prefetch() -> None:
    budget = 600_000
    peaks = {}
    for pilot in ("off", "markov"):
        compiled, _, measured = train_under_budget(
            "moe", "sgd", budget, offload_params=True, pilot=pilot
        )
        assert measured <= budget
        peaks[pilot] = measured
        rep = memcompile.report(compiled)
        if pilot == "markov":
            assert rep.pilot is not None and rep.pilot.hit_bytes > 0
            reserve = rep.pilot.reserve_bytes
            # The plans left the reserve out of their target.
            plans = [f.plan for f in rep.fragments if f.plan is not None and f.plan.host_params]
            assert plans and all(p.target is not None for p in plans)
    assert peaks["markov"] <= peaks["off"] + reserve


def test_a_stale_copy_is_never_served() -> None:
    cache = PrefetchCache()
    p = torch.ones(4)
    cache.watch([p])
    cache.counting = True
    cache.prefetch(p, torch.device("cpu"), "b")
    with torch.no_grad():
        p.add_(1)  # an optimizer step: the version counter moves
    got = cache.fetch(p, lambda: p.clone())
    assert torch.equal(got, p) and cache.hit == 0 and cache.stale == p.nbytes
    assert cache.wasted == p.nbytes and cache.misses == 1


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"pilot": "xgboost"}, ValueError, "option 'pilot' must be one of 'auto', 'lightgbm'"),
        ({"pilot": True}, ValueError, "option 'pilot' must be one of"),
        ({"prefetch_depth": 0}, ValueError, "option 'prefetch_depth' must be >= 1; got 0"),
        ({"prefetch_depth": "2"}, TypeError, "option 'prefetch_depth' must be an int"),
    ],
)
def test_bad_pilot_options_name_the_key(options: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        MemConfig.from_options(options)


@pytest.mark.parametrize("pilot", ["markov", "lightgbm"])
def test_an_explicit_pilot_refuses_a_device_it_cannot_prefetch_to(pilot: str) -> None:
    gm = fx.symbolic_trace(lambda x: x + 1)
    with pytest.raises(
        NotImplementedError, match=r"only implemented for the CPU and CUDA devices; on meta"
    ):
        MemCompiler({"pilot": pilot})(gm, [torch.empty(2, device="meta")])


def test_pilot_auto_stays_off_for_a_static_model() -> None:
    torch._dynamo.reset()
    wl = zoo.build("gpt", size="tiny")
    compiled = memcompile.compile(wl.model, offload_params=True)
    wl.train(compiled, 2)
    rep = memcompile.report(compiled)
    assert rep.dynamic == "" and rep.pilot is not None and not rep.pilot.enabled
    assert rep.pilot.active == "none" and "not running" in str(rep)


class _FakeClock:
    """The trial's clock: each step takes ``on`` seconds with the pilot, ``off`` without."""

    def __init__(self, prefetcher: prefetch.Prefetcher, on: float, off: float) -> None:
        self.prefetcher, self.on, self.off, self.now = prefetcher, on, off, 0.0

    def __call__(self) -> float:
        # Called at each step's first forward call, before the switch: the step that ended
        # ran with the prefetcher as it is now.
        self.now += self.on if self.prefetcher.enabled else self.off
        return self.now


def test_pilot_auto_runs_no_trial_on_the_cpu_with_copies_on_the_computing_thread() -> None:
    # There a prefetched copy takes as long as the on-demand one it replaces: a trial could
    # only cost its steps with the pilot. The report names the reason, the plans reserve
    # nothing and the graphs hold no prediction op.
    assert not copy_engine.active()
    rep = _run("moe", "auto", 3)
    assert "symbolic shapes" in rep.dynamic or "parameter sets" in rep.dynamic
    assert rep.pilot is not None and not rep.pilot.enabled and rep.pilot.hit_bytes == 0
    assert rep.pilot.reason == advice.CPU_AUTO_PILOT_OFF and rep.pilot.decision == ""
    assert rep.pilot.reserve_bytes == 0 and set(_pilot_ops(rep).values()) == {0}
    assert "not running (on the CPU device with its copies on the computing thread" in str(rep)


@pytest.fixture
def copy_thread_on() -> Iterator[None]:
    """The CPU's copy thread on: a prefetch can overlap compute, so "auto" runs a trial."""
    with copy_engine.using(True):
        yield


@pytest.mark.usefixtures("copy_thread_on")
@pytest.mark.parametrize("faster", ["pilot", "on_demand"])
def test_pilot_auto_times_the_pilot_against_fetching_on_demand_and_keeps_the_faster(
    faster: str,
) -> None:
    # The dynamic MoE with parameters on the host: "auto" runs a trial (dynamic/trial.py),
    # steps with the pilot against steps fetching on demand, and keeps the faster; the
    # report says what it measured. Training is bit-identical either way.
    torch._dynamo.reset()
    eager, comp = zoo.build("moe", size="tiny"), zoo.build("moe", size="tiny")
    steps = 2 + 4 * trial.ROUNDS + 3
    expected = eager.train(eager.model, steps)
    compiled = memcompile.compile(comp.model, offload_params=True)  # pilot="auto"
    prefetcher = find_compiler(compiled)[0].prefetcher
    assert prefetcher is not None and prefetcher.mode == "auto"
    on, off = (0.010, 0.020) if faster == "pilot" else (0.020, 0.010)
    prefetcher.clock = _FakeClock(prefetcher, on, off)
    losses = comp.train(compiled, steps)
    assert all(torch.equal(a, b) for a, b in zip(expected, losses, strict=True))
    assert_same_state(eager.model, comp.model)
    rep = memcompile.report(compiled)
    p = rep.pilot
    assert p is not None and prefetcher.trial is not None and prefetcher.trial.decided
    assert "symbolic shapes" in rep.dynamic or "parameter sets" in rep.dynamic
    assert p.decision.startswith("pilot='auto' measured ")
    assert p.reserve_bytes > 0  # plans made once the model was dynamic reserve for the cache
    if faster == "pilot":
        assert p.enabled and p.reason == "" and p.decision.endswith(": on")
        assert "10.0 ms a step with the pilot against 20.0 ms fetching on demand" in p.decision
        assert p.hit_bytes > 0 and "pilot trial: pilot='auto' measured" in str(rep)
    else:
        assert not p.enabled and p.decision.endswith(": off") and p.reason == p.decision
        assert "20.0 ms a step with the pilot against 10.0 ms fetching on demand" in p.decision
        assert f"not running ({p.decision})" in str(rep)
    explicit = _run("moe", "lightgbm", 3)  # asked for: it runs from the start, no trial
    assert explicit.pilot is not None and explicit.pilot.enabled and explicit.pilot.hit_bytes
    assert explicit.pilot.decision == "" and any(_pilot_ops(explicit).values())


@pytest.mark.usefixtures("copy_thread_on")
def test_pilot_auto_times_whole_iterations_of_a_loop_accumulating_gradients() -> None:
    # 2 micro-batches an iteration: only the second ends with the optimizer step, so the trial
    # times iterations once the loop's optimizer has stepped, not micro-batches.
    torch._dynamo.reset()
    wl = zoo.build("moe", size="tiny")
    compiled = memcompile.compile(wl.model, offload_params=True)
    prefetcher = find_compiler(compiled)[0].prefetcher
    assert prefetcher is not None
    calls: list[int] = []

    def clock() -> float:
        calls.append(1)
        return float(len(calls))

    prefetcher.clock = clock
    opt = torch.optim.Adam(wl.model.parameters(), lr=1e-3)
    iterations = 2 + 4 * trial.ROUNDS + 2
    for it in range(iterations):
        for micro in range(2):
            (wl.loss(compiled, 2 * it + micro) / 2).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert prefetcher.trial is not None and prefetcher.trial.decided
    assert len(calls) <= iterations + 1  # one a trial step: an iteration, not a micro-batch


def test_a_trial_step_with_a_compile_is_run_again_and_the_decision_names_both_medians() -> None:
    t = trial.PilotTrial(rounds=1)
    assert [t.begin_step(0.0, 0), t.begin_step(1.0, 0)] == [False, False]
    assert t.begin_step(3.0, 1) is False  # the measured step compiled: the pair again
    assert t.repeats == 1 and t.samples[False] == []
    assert [t.begin_step(4.0, 1), t.begin_step(5.0, 1)] == [False, True]
    assert t.samples[False] == [1.0]
    assert t.begin_step(5.5, 1) is True
    assert t.begin_step(6.0, 1) is True and t.decided and t.keep  # 0.5 s against 1.0 s
    assert t.reason == (
        "pilot='auto' measured 500.0 ms a step with the pilot against 1000.0 ms fetching on "
        "demand (median of 1 and 1 steps): on"
    )
    assert t.begin_step(9.0, 2) is True  # decided: it stands


def test_a_trial_whose_every_step_compiled_keeps_fetching_on_demand() -> None:
    t = trial.PilotTrial(rounds=1)
    compiles = 0
    while not t.decided:
        t.begin_step(float(compiles), compiles)
        compiles += 1
    assert not t.keep and t.repeats == trial.MAX_REPEATS
    assert "could not time the pilot against fetching on demand" in t.reason


class _Repeat(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mode: str) -> torch.Tensor:
        return self.lin(x).sum() * len(mode)  # every new string recompiles


def test_recompile_limit_is_raised_for_a_dynamic_model(monkeypatch: pytest.MonkeyPatch) -> None:
    # (After 8 distinct graphs of its forward the model would go regional, kind "recompiling":
    # tests/test_regions.py. Here the limit itself is the subject.)
    from memcompile.backends import compiler

    monkeypatch.setattr(compiler, "REGIONAL_AFTER", 64)
    torch._dynamo.reset()
    model = _Repeat()
    with torch._dynamo.config.patch(recompile_limit=8), warnings.catch_warnings():
        warnings.simplefilter("error", memcompile.EagerFallbackWarning)
        compiled = memcompile.compile(model)
        for i in range(12):  # past torch's default of 8 compiles of the frame
            compiled(torch.ones(2, 4), "m" * (i + 1)).backward()
        assert torch._dynamo.config.recompile_limit == DYNAMIC_RECOMPILE_LIMIT
    rep = memcompile.report(compiled)
    assert "recompiles a frame" in rep.dynamic
    assert rep.recompile_limit_raised == (8, DYNAMIC_RECOMPILE_LIMIT)
    assert rep.eager_frames == 0 and "recompile limit raised 8 -> 64" in str(rep)


def test_an_evaluation_under_no_grad_does_not_make_the_model_dynamic() -> None:
    # Dynamo compiles the frame again for inference (it guards on grad mode): a training loop
    # with evaluations between its steps is still a static model.
    torch._dynamo.reset()
    model = _Repeat()
    compiled = memcompile.compile(model)
    for _ in range(2):
        compiled(torch.ones(2, 4), "m").backward()
        with torch.no_grad():
            compiled(torch.ones(2, 4), "m")
    rep = memcompile.report(compiled)
    assert len(rep.fragments) == 2 and rep.dynamic == "" and rep.recompile_limit_raised is None


def test_a_limit_the_user_set_is_kept_and_its_fallback_reported() -> None:
    torch._dynamo.reset()
    model = _Repeat()
    with torch._dynamo.config.patch(recompile_limit=2), warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        compiled = memcompile.compile(model, pilot="markov")
        for i in range(4):
            compiled(torch.ones(2, 4), "m" * (i + 1)).backward()
        assert torch._dynamo.config.recompile_limit == 2
    rep = memcompile.report(compiled)
    assert rep.recompile_limit_raised is None and rep.dynamic
    assert rep.eager_frames >= 1 and rep.fallbacks[0].kind == "recompile_limit"
    assert rep.to_dict()["eager_frames"] == rep.eager_frames
    assert "EAGER" in str(rep)


class SeesOutputs(AlwaysWrong):
    """AlwaysWrong that records what the prefetcher shows it after each forward call."""

    def __init__(self, horizon: int = 2) -> None:
        super().__init__(horizon)
        self.outputs: list[tuple[str | None, tuple[tuple[int, ...], ...]]] = []

    def observe_outputs(self, outputs: tuple[tuple[int, ...], ...]) -> None:
        self.outputs.append((self.last, outputs))


def test_the_prefetchers_predictor_sees_the_routers_counts() -> None:
    # The output rule (rules.py) needs each block's small integer outputs: the prefetcher
    # passes them on at the tail of every forward call, the router's per-expert counts included.
    torch._dynamo.reset()
    wl = zoo.build("moe", size="tiny")
    compiled = memcompile.compile(wl.model, offload_params=True, pilot="markov")
    compiler = find_compiler(compiled)[0]
    assert compiler.prefetcher is not None
    seen = compiler.prefetcher.predictor = SeesOutputs()
    wl.train(compiled, 2)
    experts = wl.model.blocks[0].experts
    counts = [
        out
        for block, outputs in seen.outputs
        for out in outputs
        if block is not None and len(out) == len(experts)
    ]
    assert counts, seen.outputs[:5]
    tokens = wl.batch(0)[0].numel()
    top_k = wl.model.blocks[0].top_k
    assert any(sum(c) == tokens * top_k for c in counts)  # every routed slot, counted once


def test_the_moe_router_predicts_in_its_graph_after_its_counts() -> None:
    torch._dynamo.reset()
    wl = zoo.build("moe", size="tiny")
    compiled = memcompile.compile(wl.model, offload_params=True, pilot="markov")
    wl.train(compiled, 1)
    rep = memcompile.report(compiled)
    assert rep.pilot is not None
    placed = {pl.fragment: pl for pl in rep.pilot.placements}
    routers = 0
    for f in rep.fragments:
        assert f.profile is not None
        nodes = f.profile.forward.nodes
        at = {n.name: i for i, n in enumerate(nodes)}
        (op,) = (i for i, n in enumerate(nodes) if n.target == PILOT_OP)
        plan = placed[f.name]
        assert plan.in_graph and nodes[op + 1].name == plan.before
        assert nodes[op].inputs == plan.observed  # what the predictor reads
        assert all(at[o] < op for o in plan.observed)  # ... is computed before it
        counts = [o for o in plan.observed if nodes[at[o]].target == "aten.sum.dim_IntList"]
        routers += bool(counts)
    assert routers == 1  # one route graph serves both blocks; its per-expert counts


class CountsPredictions(prefetch.MarkovBlocks):
    """Markov, counting its predictions."""

    def __init__(self) -> None:
        super().__init__(2)
        self.predictions = 0

    def predict(self) -> Prediction:
        self.predictions += 1
        return super().predict()


def _moe_with(
    in_graph: bool, monkeypatch: pytest.MonkeyPatch
) -> tuple[memcompile.MemReport, CountsPredictions, list[torch.Tensor]]:
    monkeypatch.setattr(features, "FEATURES", features.FEATURES.replace(pilot_in_graph=in_graph))
    torch._dynamo.reset()
    wl = zoo.build("moe", size="tiny")
    compiled = memcompile.compile(
        wl.model, offload_params=True, pilot="markov", device_profile="h100"
    )
    prefetcher = find_compiler(compiled)[0].prefetcher
    assert prefetcher is not None
    predictor = prefetcher.predictor = CountsPredictions()
    losses = wl.train(compiled, 4)
    return memcompile.report(compiled), predictor, losses


def test_in_graph_predictions_hide_copies_the_tail_cannot(monkeypatch: pytest.MonkeyPatch) -> None:
    inside, inside_predictor, inside_losses = _moe_with(True, monkeypatch)
    tail, tail_predictor, tail_losses = _moe_with(False, monkeypatch)
    p, q = inside.pilot, tail.pilot
    assert p is not None and q is not None
    forward_calls = sum(f.forward_calls for f in inside.fragments)
    # One prediction per forward call: in the graph, or (the old way) at the tail, never both.
    assert inside_predictor.predictions == p.in_graph_predictions == forward_calls
    assert p.tail_predictions == 0
    assert tail_predictor.predictions == q.tail_predictions == forward_calls
    assert q.in_graph_predictions == 0 and set(_pilot_ops(tail).values()) == {0}
    # The same predictions and copies, only issued earlier: same hits, waste and losses ...
    assert (p.hit_bytes, p.wasted_bytes, p.misses) == (q.hit_bytes, q.wasted_bytes, q.misses)
    assert all(torch.equal(a, b) for a, b in zip(inside_losses, tail_losses, strict=True))
    # ... and less simulated (H100) time waiting for copies issued too late.
    assert p.sim_profile == q.sim_profile == "h100"
    assert p.sim_late_us is not None and q.sim_late_us is not None
    assert p.sim_late_us < q.sim_late_us
    assert p.sim_stall_us is not None and q.sim_stall_us is not None
    assert q.sim_stall_us - p.sim_stall_us == pytest.approx(q.sim_late_us - p.sim_late_us)
    assert "predictions in-graph" in str(inside) and "h100 profile estimate" in str(inside)


def test_small_int_outputs_are_read_once_per_call_for_the_recorder_and_the_prefetcher(
    tmp_path, monkeypatch
) -> None:
    # The trace recorder and the prefetcher's predictor both want each forward call's small
    # integer outputs: the compiler reads them once per call and hands the same values to both.
    torch._dynamo.reset()
    wl = zoo.build("moe", size="tiny")
    path = tmp_path / "moe.jsonl"
    compiled = memcompile.compile(
        wl.model, offload_params=True, pilot="markov", trace_path=str(path)
    )
    compiler = find_compiler(compiled)[0]
    assert compiler.prefetcher is not None
    seen = compiler.prefetcher.predictor = SeesOutputs()
    reads: list[object] = []
    real = trace.small_int_outputs

    def counting(outputs: object) -> tuple[tuple[int, ...], ...]:
        reads.append(outputs)
        return real(outputs)

    for module in (step_monitor, trace, prefetch):  # wherever it might be called from
        monkeypatch.setattr(module, "small_int_outputs", counting)
    wl.train(compiled, 2)
    calls = sum(r.stats.forward_calls + r.stats.inference_calls for r in compiler.records())
    assert calls > 0 and len(reads) == calls  # once per call, not once per consumer
    assert len({id(o) for o in reads}) == len(reads)  # ...each call's outputs read once
    # both consumers got them: the predictor saw router counts, the trace recorded them
    assert any(outputs for _, outputs in seen.outputs)
    (recorder,) = compiler.block_observers
    recorder.flush()  # type: ignore[attr-defined]
    recorded = [e.outputs for s in trace.read_trace(path) for e in s.events if e.outputs]
    assert recorded and [o for _, o in seen.outputs if o] == recorded


def test_the_report_gives_the_gpus_measured_stall_when_cuda_copies_were_timed() -> None:
    # On CUDA the host only queues the copies: the CPU-time stall says nothing there, the
    # events' figures replace it (runtime/cache.py).
    rep = _run("moe", "markov", 3)
    assert rep.pilot is not None and rep.pilot.gpu_miss_us is None  # the CPU device: no events
    assert "stall" in str(rep) and "(CPU)" in str(rep) and "GPU stall" not in str(rep)
    timed = dataclasses.replace(
        rep,
        pilot=dataclasses.replace(
            rep.pilot, gpu_miss_us=1500.0, gpu_wait_us=250.0, gpu_late_bytes=4096
        ),
    )
    line = next(x for x in str(timed).splitlines() if x.startswith("  pilot ("))
    assert "GPU stall 1.75 ms (on-demand copies 1.50 ms, late prefetches 0.25 ms; measured)" in line
    assert "(CPU)" not in line
