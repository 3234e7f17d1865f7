"""Plans cached across runs (``pipeline/plan_cache.py``): a second process replays what the
first one's search decided, validated against the graphs it builds; a missing, corrupt, stale
or other-version entry is a log line and a search. Each "run" here is a fresh model after
``torch._dynamo.reset()``: what a new process compiles (conftest.py points the cache at a
temporary directory and turns it on for this module only)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

import memcompile
from memcompile import zoo
from memcompile.pipeline import features, plan_cache, search
from memcompile.report import MemReport

BUDGET = 600_000  # the tiny GPT: about half its unplanned peak


def _run(budget: int = BUDGET, name: str = "gpt", **options) -> tuple[MemReport, list, list[int]]:
    """One "process": the first step of the zoo's tiny ``name`` (the GPT) under ``budget``; its
    report, its gradients and the planner's calls (their targets)."""
    torch._dynamo.reset()
    calls: list[int] = []
    planner = search.plan_fragment

    def counted(model, **kwargs):
        calls.append(kwargs.get("target"))
        return planner(model, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(search, "plan_fragment", counted)
        wl = zoo.build(name, size="tiny")
        compiled = memcompile.compile(wl.model, budget=budget, **options)
        wl.loss(compiled, 0).backward()
    grads = [p.grad.clone() for p in wl.model.parameters()]
    return memcompile.report(compiled), grads, calls


def _entries() -> list[Path]:
    return sorted(plan_cache.cache_dir().glob("*.json"))


def _plans(report: MemReport) -> list[str]:
    return [json.dumps(f.plan.to_dict()) for f in report.fragments if f.plan is not None]


def test_a_second_run_replays_the_plan_without_a_search_and_trains_alike():
    first, grads, calls = _run()
    assert calls, "the first run searched"
    assert len(_entries()) == 1
    again, grads2, calls2 = _run()
    assert calls2 == [], "a cached plan is not searched again"
    assert _plans(again) == _plans(first)  # the same plan, byte for byte
    assert again.predicted_peak == first.predicted_peak
    # The report says where the plan came from.
    assert first.fragments[0].plan_cached is None
    assert again.fragments[0].plan_cached == _entries()[0].stem
    assert again.to_dict()["fragments"][0]["plan_cached"] == _entries()[0].stem
    assert "plans from the cache (searched by an earlier run): F0" in str(again)
    assert "plans from the cache" not in str(first)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads2, strict=True))


def test_the_late_rewrites_are_replayed_as_recorded(caplog):
    # Under a budget no plan meets the search tries the late rewrites of the built graphs;
    # the entry records those it kept and the replay applies them, building the same graphs.
    # (The hand-written-attention GPT's smallest plan tiles its softmax by rows.)
    first, grads, _ = _run(1, "gpt_manual", on_infeasible="best_effort")
    entry = json.loads(_entries()[0].read_text())["entry"]
    assert entry["late"], "the smallest plan keeps a late rewrite"
    with caplog.at_level(logging.INFO, logger="memcompile.pipeline.fragment"):
        again, grads2, calls = _run(1, "gpt_manual", on_infeasible="best_effort")
    assert calls == [] and "plan from the cache (does not fit" in caplog.text
    assert _plans(again) == _plans(first)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads2, strict=True))


def test_another_budget_is_another_entry():
    _run()
    _, _, calls = _run(BUDGET - 50_000)
    assert calls and len(_entries()) == 2


def test_a_corrupt_entry_is_a_warning_and_a_search(caplog):
    _run()
    (path,) = _entries()
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="memcompile.pipeline.plan_cache"):
        _, _, calls = _run()
    assert calls, "searched again"
    assert f"plan cache entry {path} is corrupt" in caplog.text
    assert json.loads(path.read_text())["format"] == plan_cache.FORMAT  # written again


@pytest.mark.parametrize(
    ("field", "value", "said"),
    [
        # The graphs the entry builds are not those it was made from (a rewrite changed between
        # versions): the digest check rejects it.
        ("graphs", "0" * 64, "cached plan builds other graphs than it was made from"),
        # A plan whose decisions do not fit the graph (hand-edited): its build fails, logged.
        ("backward_order", ["no_such_node"], "cached plan not replayed"),
    ],
)
def test_an_entry_that_does_not_build_its_graphs_is_planned_again(caplog, field, value, said):
    first, _, _ = _run()
    (path,) = _entries()
    data = json.loads(path.read_text())
    entry = data["entry"] if field in data["entry"] else data["entry"]["plan"]
    entry[field] = value
    path.write_text(json.dumps(data))
    with caplog.at_level(logging.INFO, logger="memcompile.pipeline.fragment"):
        again, _, calls = _run()
    assert calls and said in caplog.text
    assert _plans(again) == _plans(first)


def test_another_memcompile_version_misses(monkeypatch):
    _run()
    monkeypatch.setattr(memcompile.config, "VERSION", "0.0.0-other")
    _, _, calls = _run()
    assert calls and len(_entries()) == 2


def test_the_cache_off_writes_nothing(monkeypatch):
    monkeypatch.setattr(features, "FEATURES", features.FEATURES.replace(plan_cache=False))
    _run()
    assert _entries() == []


def test_the_directory_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("MEMCOMPILE_CACHE_DIR", str(tmp_path / "here"))
    assert plan_cache.cache_dir() == tmp_path / "here"
    monkeypatch.delenv("MEMCOMPILE_CACHE_DIR")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    assert plan_cache.cache_dir() == tmp_path / "inductor" / "memcompile" / "plans"


def test_an_unwritable_directory_is_a_warning_and_the_plan_stands(monkeypatch, tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("MEMCOMPILE_CACHE_DIR", str(blocker / "plans"))
    with caplog.at_level(logging.WARNING, logger="memcompile.pipeline.plan_cache"):
        report, _, calls = _run()
    assert calls and report.predicted_peak is not None and report.predicted_peak <= BUDGET
    assert "plan cache" in caplog.text and "not written" in caplog.text
