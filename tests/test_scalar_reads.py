"""Numbers the model's Python reads from tensors (runtime/scalar_reads.py), in the trace and for
the pilot: a natural MoE's ``int(router(x).argmax())`` names the next expert, a natural early
exit's ``conf.item()`` tells whether the next block runs (issue 39, item 3)."""

from __future__ import annotations

import json
import logging
import threading
import warnings
from pathlib import Path

import pytest
import torch

import memcompile
from memcompile import EagerFallbackWarning, zoo
from memcompile.backends.compiler import MemCompiler
from memcompile.dynamic.markov import UNKNOWN
from memcompile.dynamic.pilot import Pilot
from memcompile.dynamic.rules import READ_SLOT, RoutingRule
from memcompile.dynamic.trace import TraceRecorder, read_trace
from memcompile.report import find_compiler
from memcompile.runtime import scalar_reads

from helpers import assert_same_state

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def test_numbers_read_from_tensors_reach_the_sink_and_nothing_else_does() -> None:
    got: list[tuple[int, ...]] = []
    x = torch.tensor([[3.0, 9.0, 1.0], [2.0, 0.0, 7.0]])
    own = {name: vars(torch.Tensor).get(name) for name in scalar_reads.READ_METHODS}
    with scalar_reads.reading(got.append):
        assert {name: vars(torch.Tensor).get(name) for name in own} != own
        assert int(x.argmax()) == 1  # Tensor.__int__
        assert x.flatten().argmax().item() == 1  # an integer item
        assert x[0].topk(2).indices.tolist() == [1, 0]  # a list of indices, in its order
        assert ["a", "b", "c"][torch.tensor(2)] == "c"  # Tensor.__index__
        assert float(x.sum()) == x.sum().item() == 22.0  # Tensor.__float__, a float item
        (x > 0).all().item()  # a bool: not a decision of this kind
        x.tolist(), x[0].tolist()  # a 2-D list, a list of floats: a tensor's contents
        torch.arange(scalar_reads.MAX_READ + 1).tolist()  # too long for indices
    assert got == [(1,), (1,), (1, 0), (2,), (22.0,), (22.0,)]
    # Outside, torch.Tensor is as it was, to its own attributes.
    assert not scalar_reads.installed()
    assert {name: vars(torch.Tensor).get(name) for name in own} == own
    assert torch.Tensor.item is torch._C.TensorBase.item
    int(x.argmax())
    assert len(got) == 6


def test_nested_sinks_get_their_own_reads_and_other_threads_none() -> None:
    outer: list[tuple[int, ...]] = []
    inner: list[tuple[int, ...]] = []
    other: list[int] = []
    t = torch.tensor(5)
    with scalar_reads.reading(outer.append):
        int(t)
        with scalar_reads.reading(inner.append):
            int(t + 1)
            thread = threading.Thread(target=lambda: other.append(int(t + 2)))
            thread.start()
            thread.join()
        int(t + 3)
        assert scalar_reads.installed()
    assert (outer, inner, other) == ([(5,), (8,)], [(6,)], [7])
    assert not scalar_reads.installed()


def test_a_failing_sink_changes_nothing_the_user_computes(caplog: pytest.LogCaptureFixture) -> None:
    def sink(values: tuple[int, ...]) -> None:
        raise RuntimeError("observer broke")

    with caplog.at_level(logging.WARNING, logger="memcompile.runtime.scalar_reads"):
        with scalar_reads.reading(sink):
            assert int(torch.tensor(4)) == 4
            assert torch.tensor([1, 2]).tolist() == [1, 2]
    assert "failed in its observer" in caplog.text
    assert not scalar_reads.installed()


def test_dynamo_traces_the_unwrapped_tensor_methods() -> None:
    # A frame Dynamo compiles breaks its graph at the user's int() as it would without
    # memcompile; the wrappers are out while it traces, and the eager remainder is read.
    seen_installed: list[bool] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        seen_installed.append(scalar_reads.installed())
        return gm.forward

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, int]:
        y = x * 2
        k = int(y.sum().argmax())
        return y + k, k

    x = torch.arange(6.0)
    torch._dynamo.utils.counters.clear()
    plain = torch.compile(fn, backend=backend)(x)
    breaks = dict(torch._dynamo.utils.counters["graph_break"])
    graphs = len(seen_installed)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    got: list[tuple[int, ...]] = []
    with scalar_reads.reading(got.append):
        read = torch.compile(fn, backend=backend)(x)
        assert scalar_reads.installed()  # back after the compile
    assert torch.equal(read[0], plain[0]) and read[1] == plain[1] == 0
    assert dict(torch._dynamo.utils.counters["graph_break"]) == breaks
    assert len(seen_installed) == 2 * graphs and not any(seen_installed)
    assert got == [(0,)]


def test_the_rule_learns_blocks_named_by_reads_in_their_order() -> None:
    # Block 1 (a router) is followed by reads naming two of the experts 10..13 (ids 10 + i),
    # in the read's order, then block 20 (the next layer).
    rule = RoutingRule(min_checks=2)
    for picks in ([2, 0], [1, 3], [3, 2], [0, 1], [2, 3]):
        rule.observe(1)
        rule.emitted(1, [picks], indices=True)
        for p in picks:
            rule.observe(10 + p)
        rule.observe(20)
        rule.end_step()
    rule.observe(1)
    rule.emitted(1, [[3, 0]], indices=True)
    assert [rule.ahead(j) for j in (1, 2, 3, 4)] == [13, 10, 20, UNKNOWN]
    (stats,) = rule.slot_stats([str(i) for i in range(21)])
    assert (stats.slot, stats.trusted, stats.accuracy) == (READ_SLOT, True, 1.0)


def test_a_trace_line_with_malformed_reads_is_refused_with_its_place(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    event = {"phase": "forward", "fragment": "f", "block": "f/", "t_us": 0.0, "reads": [3]}
    path.write_text(json.dumps({"step": 0, "events": [event]}) + "\n")
    with pytest.raises(
        ValueError, match=r"bad.jsonl:1 event 0: reads must be a list of lists of n"
    ):
        read_trace(path)


def _natural_trace(tmp_path: Path, name: str, steps: int, **options: object) -> tuple:
    wl = zoo.build(name, size="tiny")
    eager = zoo.build(name, size="tiny")
    eager_losses = eager.train(eager.model, steps, optimizer="adam")
    path = tmp_path / "trace.jsonl"
    compiled = memcompile.compile(wl.model, trace_path=path, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EagerFallbackWarning)
        losses = wl.train(compiled, steps, optimizer="adam")
    assert [loss.item() for loss in losses] == [loss.item() for loss in eager_losses]
    assert all(torch.equal(a, b) for a, b in zip(losses, eager_losses, strict=True))
    assert_same_state(eager.model, wl.model)
    compiler, _ = find_compiler(compiled)
    (recorder,) = [o for o in compiler.block_observers if hasattr(o, "flush")]
    recorder.flush()  # type: ignore[attr-defined]
    assert not scalar_reads.installed()  # only during the model's calls
    steps = recorder.steps()  # type: ignore[attr-defined]
    assert read_trace(path) == steps  # the reads go through the file too
    return compiled, wl, steps


@pytest.mark.parametrize("name", ["moe_natural", "moe_natural_top2"])
def test_a_natural_moes_trace_has_the_experts_its_python_read(tmp_path: Path, name: str) -> None:
    _, _, steps = _natural_trace(tmp_path, name, 4)
    assert len(steps) >= 3
    for step in steps[1:]:  # after the first call (the model's regions start on its second)
        forward = [e for e in step.events if e.phase != "backward"]
        routers = [i for i, e in enumerate(forward) if e.block.split("/")[1].startswith("routers")]
        assert len(routers) == 2  # tiny: 2 layers
        for i in routers:
            layer = forward[i].block.split("/")[1].split(".")[1]
            (read,) = forward[i].reads  # one int() or one tolist() after the router
            assert len(read) == (1 if name == "moe_natural" else 2)
            ran = [e.block.split("/")[1] for e in forward[i + 1 : i + 1 + len(read)]]
            assert ran == [f"experts.{layer}.{e}" for e in read]
        assert all(not e.reads for i, e in enumerate(forward) if i not in routers)


def test_a_natural_early_exits_confidence_is_read_and_predicts_the_exit(tmp_path: Path) -> None:
    # Each exit head's `conf.item()` is on its event; replayed, the pilot that sees it predicts
    # the block after each exit head (the next block, or the next step's first) better than
    # the same pilot without it.
    _, _, steps = _natural_trace(tmp_path, "early_exit_natural", 40)
    exits = [e for s in steps for e in s.events if "/exits." in e.block and e.phase != "backward"]
    assert exits and all(len(e.reads) == 1 and type(e.reads[0][0]) is float for e in exits)

    def replay(reads: bool) -> float:
        pilot = Pilot(horizon=1, warmup_steps=5, retrain_every=5, seed=0, background=False)
        stream = [e for s in steps for e in (*s.events, None) if e is None or e.phase != "backward"]
        for e in stream:
            if e is None:
                pilot.end_step()
                continue
            pilot.observe(e.block, e.fragment, e.sizes)
            for values in e.reads if reads else ():
                pilot.observe_read(values)
            pilot.predict()
        accuracy = pilot.stats().accuracy
        assert accuracy is not None
        return accuracy

    with_reads, without = replay(True), replay(False)
    assert with_reads > without + 0.03, (with_reads, without)


def test_the_pilot_prefetches_the_expert_a_read_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With its parameters on the host, the natural MoE's pilot predicts again at a read once
    # its rule trusts the router's reads: the next block is the expert the read named. Its
    # predictions one block ahead are right more often than the same run's without reads, and
    # more of what it fetched was used; training stays bit-identical either way.
    def run(tag: str) -> memcompile.MemReport:
        torch._dynamo.reset()
        (tmp_path / tag).mkdir()
        compiled, _, _ = _natural_trace(
            tmp_path / tag, "moe_natural", 12, pilot="lightgbm", offload_params=True
        )
        return memcompile.report(compiled)

    rep = run("reads")
    with monkeypatch.context() as m:
        m.setattr(MemCompiler, "_wants_reads", lambda self: False)
        m.delattr(TraceRecorder, "on_block_reads")
        without = run("none")
    read, plain = rep.pilot, without.pilot
    assert read is not None and plain is not None and read.enabled
    assert read.read_predictions > 0 and plain.read_predictions == 0
    assert read.accuracy is not None and plain.accuracy is not None
    assert read.accuracy > plain.accuracy, (read, plain)
    assert read.hit_rate is not None and plain.hit_rate is not None
    assert read.hit_rate > plain.hit_rate, (read, plain)
    assert "after a read" in str(rep)
    # What the pilot does at a read (the prefetch cache's copies) is never compiled by Dynamo:
    # only the model's own modules are fragments.
    assert all("<memcompile region " in f.code for f in rep.fragments), [
        f.code for f in rep.fragments
    ]


def test_without_a_trace_or_the_pilot_nothing_is_wrapped(monkeypatch: pytest.MonkeyPatch) -> None:
    # The default costs nothing: no model call wraps torch.Tensor's methods (~14 us a call).
    started: list[object] = []
    monkeypatch.setattr(scalar_reads, "start", lambda sink: started.append(sink))
    wl = zoo.build("moe_natural", size="tiny")
    compiled = memcompile.compile(wl.model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EagerFallbackWarning)
        wl.train(compiled, 3)
    assert memcompile.report(compiled).regions and not started


def test_memcompiles_own_reads_of_a_calls_outputs_are_not_the_models(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The zoo MoE's Python reads its router's counts once a layer (`counts.tolist()`); the pilot
    # reads the same counts as each call's small integer outputs (runtime/small_ints.py). Those
    # reads of memcompile's own went to the sink as the model's (47 of 51 a step on the small
    # MoE): the rule took router counts for block indices, and predicted again at each.
    reads: list[tuple[int | float, ...]] = []
    real = MemCompiler._on_read
    monkeypatch.setattr(
        MemCompiler, "_on_read", lambda self, values: reads.append(values) or real(self, values)
    )
    wl = zoo.build("moe", size="tiny")
    compiled = memcompile.compile(wl.model, offload_params=True, pilot="lightgbm")
    wl.train(compiled, 3)
    layers = len(wl.model.blocks)
    assert len(reads) == 3 * layers, reads
    assert memcompile.report(compiled).pilot.in_graph_predictions > 0
