"""backends/unplanned.py: without a budget, once the step is seen, regions call their modules
directly and nothing is watched; training stays bit-identical, the peak the same."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

import memcompile
from memcompile import EagerFallbackWarning, zoo
from memcompile.backends.unplanned import OBSERVED_STEPS
from memcompile.pipeline import features
from memcompile.report import find_compiler

from helpers import assert_same_state

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _train(name: str, steps: int, **options: object) -> tuple[zoo.Workload, object]:
    """``steps`` Adam steps of the zoo model ``name`` (tiny) under memcompile and of an eager
    copy, from the same seed: every loss and then every parameter compared."""
    eager, wl = zoo.build(name, size="tiny"), zoo.build(name, size="tiny")
    compiled = memcompile.compile(wl.model, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EagerFallbackWarning)
        got = wl.train(compiled, steps, optimizer="adam")
    want = eager.train(eager.model, steps, optimizer="adam")
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert_same_state(eager.model, wl.model)
    return wl, compiled


@pytest.mark.parametrize("name", ["gpt", "moe_natural"])
def test_without_a_budget_the_step_is_left_alone_once_seen(name: str) -> None:
    # gpt: Dynamo's frames (their compiled graphs run, unrecorded); moe_natural: regions (the
    # forward falls back), which call their modules directly.
    wl, compiled = _train(name, 6 + OBSERVED_STEPS)
    compiler, _ = find_compiler(compiled)
    rep = memcompile.report(compiled)
    assert rep.direct_since_step is not None and rep.direct_since_step >= OBSERVED_STEPS
    assert "regions call their modules directly" in str(rep)
    assert rep.to_dict()["direct_since_step"] == rep.direct_since_step
    assert rep.predicted_peak is not None  # of the last step seen
    assert compiler.iteration.paused  # the optimizer's steps are not watched either
    assert compiler.unplanned.direct
    assert compiler.regional is not None and compiler.regional.direct
    assert bool(compiler.regional.regions) == (name != "gpt")
    # No step is recorded any more; the fragments' graphs still run (counted), the regions'
    # not (their modules run).
    calls = sum(r.stats.forward_calls for r in compiler.records())
    steps = compiler.step_monitor.steps_observed
    wl.train(compiled, 2, optimizer="adam")
    assert compiler.step_monitor.steps_observed == steps
    now = sum(r.stats.forward_calls for r in compiler.records())
    assert now == calls if name == "moe_natural" else now > calls


def _step(wl: zoo.Workload, compiled: object) -> None:
    wl.loss(compiled, 9).backward()  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["gpt", "moe_natural"])
def test_the_direct_mode_peaks_as_the_watched_step_or_as_eager(name: str) -> None:
    # Fragments still run their graphs: the same peak. Regions call their modules: the step is
    # eager's (the natural MoE's forward falls back whole), a little over their compiled graphs'.
    peaks = {}
    for mode in ("watched", "direct", "eager"):
        torch._dynamo.reset()
        with features.patch(direct_unplanned=mode == "direct"):
            wl, compiled = _train(name, 3 + OBSERVED_STEPS)
            fn = wl.model if mode == "eager" else compiled
            assert find_compiler(compiled)[0].unplanned.direct is (mode == "direct")
            batch = wl.batch(9)
            wl.model.zero_grad(set_to_none=True)
            step = functools.partial(_step, wl, fn)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                peaks[mode] = memcompile.measure_peak(step, resident=[wl.model, batch])
    if name == "gpt":
        assert peaks["direct"] == peaks["watched"], peaks
    else:
        assert peaks["direct"] == peaks["eager"], peaks
        assert peaks["watched"] <= peaks["direct"] <= 1.02 * peaks["watched"], peaks


def test_a_new_compile_runs_the_compiled_graphs_until_its_steps_are_seen() -> None:
    wl = zoo.build("gpt", size="tiny")
    compiled = memcompile.compile(wl.model)
    compiler, _ = find_compiler(compiled)
    tokens, targets = wl.batch(0)
    modes = []
    for k in range(8):
        t = k // 4 + 1  # a new length from the fifth step: Dynamo compiles again
        compiled(tokens[:, : 8 * t], targets[:, : 8 * t]).backward()
        modes.append(compiler.unplanned.direct)
    # A call keeps the mode it began with (the fifth compiles); the next ones are watched until
    # their steps are seen.
    assert modes[OBSERVED_STEPS] and modes[4] and not modes[5] and modes[-1]
    assert modes[:OBSERVED_STEPS] == [False] * OBSERVED_STEPS


@pytest.mark.parametrize(
    "options",
    [{"budget": "1GiB"}, {"budget": "60%"}, {"offload_params": True}, {"pilot": "markov"}],
)
def test_the_compiled_graphs_keep_running_where_something_is_planned(options: dict) -> None:
    _, compiled = _train("gpt", 3 + OBSERVED_STEPS, **options)
    compiler, _ = find_compiler(compiled)
    assert not compiler.unplanned.direct and not compiler.iteration.paused
    assert memcompile.report(compiled).direct_since_step is None


def test_the_feature_switch_keeps_the_compiled_graphs() -> None:
    with features.patch(direct_unplanned=False):
        _, compiled = _train("moe_natural", 3 + OBSERVED_STEPS)
        compiler, _ = find_compiler(compiled)
        assert not compiler.unplanned.direct
        assert compiler.regional is not None and not compiler.regional.direct
