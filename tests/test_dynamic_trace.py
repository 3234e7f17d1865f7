"""Block traces: which blocks ran in each step, with stable ids, saved as JSON lines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import memcompile
from memcompile import zoo
from memcompile.config import MemConfig
from memcompile.dynamic.idioms import IDIOMS
from memcompile.dynamic.trace import (
    BlockEvent,
    TraceRecorder,
    block_owner,
    read_trace,
)
from memcompile.records import FragmentIdentity, FragmentRecord
from memcompile.report import find_compiler
from memcompile.runtime.small_ints import MAX_OUTPUT_ELEMENTS, MAX_OUTPUTS, small_int_outputs
from memcompile.zoo.moe import moe_workload

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

_STEPS = 3


def _train_moe(compiled, wl, steps: int = _STEPS) -> None:
    opt = torch.optim.SGD(wl.model.parameters(), lr=0.1)
    for step in range(steps):
        wl.loss(compiled, step).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _recorder(compiled) -> TraceRecorder:
    compiler, _ = find_compiler(compiled)
    (recorder,) = compiler.block_observers
    assert isinstance(recorder, TraceRecorder)
    return recorder


def test_trace_path_is_accepted_and_records_every_step(tmp_path) -> None:
    path = tmp_path / "moe.jsonl"
    assert MemConfig.from_options({"trace_path": str(path)}).trace_path == str(path)
    wl = zoo.build("moe", size="tiny")
    compiled = memcompile.compile(wl.model, trace_path=str(path))

    class Plain:  # an observer without on_block_end: not told of outputs, not an error
        calls = 0

        def on_block(self, *args: object) -> None:
            Plain.calls += 1

        def reset(self) -> None:
            pass

    find_compiler(compiled)[0].block_observers.append(Plain())
    _train_moe(compiled, wl)
    assert Plain.calls > 0
    find_compiler(compiled)[0].block_observers.pop()
    # a step is written when the next one starts; flush writes the last one
    assert len(path.read_text().splitlines()) == _STEPS - 1
    _recorder(compiled).flush()
    steps = read_trace(path)
    assert [s.step for s in steps] == list(range(_STEPS))

    layers, experts = wl.extra["layers"], wl.extra["experts"]
    compiler, _ = find_compiler(compiled)
    for s in steps:
        # The compiler's own sequence: the same calls, in the same order.
        fwd = s.blocks("forward")
        owners = [b.split("/", 1)[1] for b in fwd]
        assert owners[0] == "" and owners[-1] == ""  # embedding, head: the root module's
        routes = [o for o in owners if o.startswith("blocks.") and o.count(".") == 1]
        assert routes == [f"blocks.{i}" for i in range(layers)]
        ran = [o for o in owners if ".experts." in o]
        assert 0 < len(ran) <= layers * experts
        # one compiled graph serves every expert: one fragment id, told apart by parameters
        assert len({b.split("/")[0] for b in fwd if ".experts." in b}) == 1
        assert len(set(ran)) == len(ran)
        # the backward runs the training blocks in reverse forward order
        assert s.blocks("backward") == tuple(reversed(fwd))
        assert all(e.t_us >= 0 for e in s.events)
        assert [e.t_us for e in s.events] == sorted(e.t_us for e in s.events)
        # cheap features: an expert's routed-token count is among its input sizes
        for e in s.events:
            if e.phase == "forward" and ".experts." in e.block:
                assert len(e.sizes) == 4 and 0 < e.sizes[1] <= wl.extra["batch"] * 16 * 2
            if e.phase == "backward":
                assert e.sizes == ()
        # outputs: a router's per-expert slot counts, read after its call returned, list the
        # experts that run next, in expert order; backward calls record none
        n_slots = wl.extra["batch"] * wl.extra["seq_len"] * wl.extra["top_k"]
        for i, e in enumerate(s.events):
            if e.phase == "backward":
                assert e.outputs == ()
            owner = e.block.split("/", 1)[1]
            if e.phase == "forward" and owner.startswith("blocks.") and owner.count(".") == 1:
                (counts,) = [o for o in e.outputs if len(o) == experts]
                assert sum(counts) == n_slots
                after = [x.block.split("/", 1)[1] for x in s.events[i + 1 :]]
                listed = [f"{owner}.experts.{p}" for p, c in enumerate(counts) if c > 0]
                assert after[: len(listed)] == listed
        idioms = dict(s.idioms)
        assert set(idioms) == {e.fragment for e in s.events}
        assert all(len(v) == len(IDIOMS) for v in idioms.values())
    assert compiler.steps_observed == _STEPS  # each ended by its optimizer step


_CHILD = textwrap.dedent(
    """
    import sys, torch
    from memcompile import zoo
    wl = zoo.build("moe", size="tiny")
    # torch.compile, not memcompile.compile: the model is found from the stack
    compiled = torch.compile(wl.model, backend="memcompile", options={"trace_path": sys.argv[1]})
    opt = torch.optim.SGD(wl.model.parameters(), lr=0.1)
    for step in range(STEPS):
        wl.loss(compiled, step).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    """
).replace("STEPS", str(_STEPS))


def test_block_ids_are_stable_across_processes(tmp_path) -> None:
    mine, theirs = tmp_path / "mine.jsonl", tmp_path / "theirs.jsonl"
    wl = zoo.build("moe", size="tiny")
    compiled = memcompile.compile(wl.model, trace_path=str(mine))
    _train_moe(compiled, wl)
    _recorder(compiled).flush()
    root = os.path.dirname(os.path.dirname(memcompile.__file__))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=root)
    subprocess.run(
        [sys.executable, "-c", _CHILD, str(theirs)], check=True, env=env, timeout=300
    )  # the child's last step is written at exit
    a, b = read_trace(mine), read_trace(theirs)
    assert [s.blocks() for s in a] == [s.blocks() for s in b]
    assert not any("#" in blk for s in a for blk in s.blocks())  # named, not numbered


def _record(index: int, blocks: dict[int, dict[int, int]]) -> FragmentRecord:
    return FragmentRecord(
        index=index,
        identity=FragmentIdentity(f"{index:016x}", (), ()),
        code="f (x.py:1)",
        reason="",
        break_at="",
        compile_id="0/0",
        static_inputs=(0,),
        static_storages=(),
        profile=None,
        plan=None,
        inner="eager",
        blocks=blocks,
    )


def test_without_a_model_blocks_are_numbered_by_first_appearance() -> None:
    records = [_record(0, {100: {100: 4}, 200: {200: 4}, 300: {300: 4}})]
    rec = TraceRecorder(None, records=lambda: records)
    x = torch.zeros(3)
    for block in (200, 100, 200, 300):
        rec.on_block(0, 0, "forward", block, [torch.zeros(2), x])
    rec.on_block(1, 0, "forward", 100, [])  # a new step
    rec.flush()
    first, second = rec.steps()
    assert first.blocks() == tuple(f"{0:016x}/#{k}" for k in (0, 1, 0, 2))
    assert first.events[0].sizes == (3,)  # input 0 is a parameter: not a size
    assert second.blocks() == (f"{0:016x}/#1",)


def test_block_owner_is_the_common_module_path() -> None:
    assert block_owner(["blocks.0.experts.3.fc1.weight", "blocks.0.experts.3.fc2.bias"]) == (
        "blocks.0.experts.3"
    )
    assert block_owner(["blocks.0.ln1.weight", "blocks.0.router.weight"]) == "blocks.0"
    assert block_owner(["tok_emb.weight", "head.bias"]) == ""
    assert block_owner([]) == ""


def test_steps_round_trip_through_json(tmp_path) -> None:
    path = tmp_path / "t.jsonl"
    rec = TraceRecorder(path, records=lambda: [_record(0, {})])
    rec.on_block(0, 0, "forward", 0, [torch.zeros(5), torch.zeros(2, 3)])
    rec.on_block(0, 0, "backward", 0, [])
    rec.flush()
    (step,) = rec.steps()
    assert json.loads(step.to_json())["events"][0]["sizes"] == [6]  # input 0: a parameter
    assert read_trace(path) == [step]


def test_small_int_outputs_keeps_small_integer_host_readable_tensors_only() -> None:
    counts = torch.tensor([2, 0, 1], dtype=torch.int64)
    outs = (
        torch.zeros(4),  # float
        [counts, torch.ones(2, 2, dtype=torch.int32)],  # nested; flattened
        torch.zeros(MAX_OUTPUT_ELEMENTS + 1, dtype=torch.int64),  # too big
        torch.ones(3, dtype=torch.bool),  # a mask, not counts
        torch.zeros(0, dtype=torch.int64),  # empty
        7,  # not a tensor
        torch.tensor([5], dtype=torch.uint8),
        torch.ones(2, dtype=torch.int64, device="meta"),  # no values (CUDA's are read)
    )
    assert small_int_outputs(outs) == ((2, 0, 1), (1, 1, 1, 1), (5,))
    assert small_int_outputs(counts) == ((2, 0, 1),)
    many = [torch.tensor([i]) for i in range(MAX_OUTPUTS + 3)]
    assert small_int_outputs(many) == tuple((i,) for i in range(MAX_OUTPUTS))
    assert small_int_outputs(None) == ()


def test_outputs_are_recorded_and_old_traces_still_read(tmp_path) -> None:
    path = tmp_path / "t.jsonl"
    rec = TraceRecorder(path, records=lambda: [_record(0, {}), _record(1, {})])
    rec.on_block(0, 0, "forward", 0, [torch.zeros(5), torch.zeros(3)])
    rec.on_block_end(0, 0, "forward", 0, (torch.zeros(3), torch.tensor([0, 3, 1])))
    rec.on_block(0, 1, "forward", 0, [torch.zeros(5)])
    rec.on_block_end(0, 1, "forward", 0, torch.zeros(2))  # nothing small and integer
    rec.on_block_end(0, 0, "forward", 0, torch.tensor([9]))  # not the last call: ignored
    rec.on_block(0, 0, "backward", 0, [])
    rec.on_block_end(0, 0, "backward", 0, torch.tensor([1]))  # backward: ignored
    rec.flush()
    (step,) = rec.steps()
    assert [e.outputs for e in step.events] == [((0, 3, 1),), (), ()]
    line = json.loads(path.read_text())
    assert line["events"][0]["outputs"] == [[0, 3, 1]]
    assert "outputs" not in line["events"][1]  # only where there are some
    assert read_trace(path) == [step]
    # a trace written before outputs were recorded (no "outputs" keys) reads back with none
    old = {
        "step": 4,
        "events": [{"phase": "forward", "fragment": "f", "block": "f/", "t_us": 1.5, "sizes": [3]}],
    }
    path.write_text(json.dumps(old) + "\n")
    (s,) = read_trace(path)
    assert s.events == (BlockEvent("forward", "f", "f/", 1.5, (3,)),)
    assert s.events[0].outputs == ()
    old["events"][0]["outputs"] = [[1, "2"]]
    path.write_text(json.dumps(old) + "\n")
    with pytest.raises(ValueError, match=r"t.jsonl:1 event 0: outputs must be a list of lists"):
        read_trace(path)


def test_bad_trace_files_name_file_and_line(tmp_path) -> None:
    path = tmp_path / "bad.jsonl"
    good = '{"step": 0, "events": []}'
    path.write_text(good + "\nnot json\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a JSON line"):
        read_trace(path)
    path.write_text('{"step": 0}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: expected an object with 'step'"):
        read_trace(path)
    event = {"phase": "sideways", "fragment": "f", "block": "f/", "t_us": 0}
    path.write_text(json.dumps({"step": 0, "events": [event]}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1 event 0: phase must be one of"):
        read_trace(path)
    with pytest.raises(ValueError, match="keep must be >= 1; got 0"):
        TraceRecorder(None, records=list, keep=0)


def test_moe_workload_overrides_settings_and_rejects_bad_ones() -> None:
    default, sparse = zoo.build("moe", size="tiny"), moe_workload("tiny", 0, batch=1, seq_len=8)
    assert default.extra == moe_workload("tiny", 0).extra
    tokens, _ = sparse.batch(0)
    assert tokens.shape == (1, 8)
    assert torch.equal(default.batch(3)[0], zoo.build("moe", size="tiny").batch(3)[0])
    with pytest.raises(ValueError, match="unknown setting 'width'"):
        moe_workload("tiny", 0, width=3)
    with pytest.raises(ValueError, match="batch must be a positive int; got 0"):
        moe_workload("tiny", 0, batch=0)
    with pytest.raises(ValueError, match="top_k=2 exceeds experts=1"):
        moe_workload("tiny", 0, experts=1)
