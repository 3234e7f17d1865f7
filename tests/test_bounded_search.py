"""Bounded planning (issue 41): a build profiles each pair of graphs once (``built.ProfileMemo``),
and the memo changes no decision."""

from __future__ import annotations

import pytest

from memcompile.pipeline import built


def test_the_profile_memo_profiles_a_pair_once_until_it_is_forgotten(monkeypatch):
    calls = []

    def profiler(workspaces):
        return lambda fw, bw: calls.append((fw, bw)) or object()

    monkeypatch.setattr(built, "_profiler", profiler)
    monkeypatch.setattr(built, "_workspaces", lambda *a: None)
    memo = built.ProfileMemo()
    fw, bw, other = object(), object(), object()
    first = memo(None, fw, bw, None)
    assert memo(None, fw, bw, None) is first and len(calls) == 1
    assert memo(None, fw, other, None) is not first and len(calls) == 2
    memo.forget(fw, bw)  # changed in place: profiled again
    assert memo(None, fw, bw, None) is not first and len(calls) == 3


@pytest.mark.long
def test_a_build_profiles_fewer_pairs_with_the_memo_and_decides_the_same(monkeypatch):
    # The tiny GPT with no room (best effort): its builds try every late rewrite, each of which
    # profiled the pair the one before had made; with the memo each pair is profiled once
    # (pytest -m long: two searches of ~15 s).
    import torch

    import memcompile
    from memcompile import zoo

    profiles = []
    real = built._profiler
    monkeypatch.setattr(
        built, "_profiler", lambda ws: lambda f, b: profiles.append(1) or real(ws)(f, b)
    )

    def smallest() -> tuple[str, list[str]]:
        torch._dynamo.reset()
        wl = zoo.build("gpt", size="tiny")
        compiled = memcompile.compile(wl.model, budget=1, on_infeasible="best_effort")
        with pytest.warns(memcompile.MemoryBudgetWarning):
            wl.loss(compiled, 0).backward()
        report = memcompile.report(compiled)
        return report.plan.to_json(), [f.plan.predicted_peak for f in report.fragments]

    with_memo = smallest()  # (the memo is on by default)
    memoized = len(profiles)
    profiles.clear()
    monkeypatch.setattr(
        built.ProfileMemo,
        "__call__",
        lambda self, spec, f, b, split: built._profiler(built._workspaces(spec, f, b, split))(f, b),
    )
    assert smallest() == with_memo
    assert memoized < len(profiles), (memoized, len(profiles))


def test_a_rewritten_graph_gets_its_code_only_when_run_and_runs_right():
    # rewrites/rebuild.py: a search builds and profiles many rewrites and keeps one; the code of
    # those it drops is never generated (torch's _LazyGraphModule).
    import torch
    from torch import fx

    from memcompile.rewrites.rebuild import rebuilt_module

    gm = fx.symbolic_trace(lambda x: torch.relu(x) * 2)
    new = fx.Graph()
    env: dict = {}
    for n in gm.graph.nodes:
        env[n] = new.node_copy(n, lambda a: env[a])
    out = rebuilt_module(gm, new, "memcompile_test", ("a record",))
    assert out._needs_recompile() and out.meta["memcompile_test"] == ("a record",)
    x = torch.randn(4)
    assert torch.equal(out(x), torch.relu(x) * 2) and not out._needs_recompile()
