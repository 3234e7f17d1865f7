"""A fragment whose compile runs long says so (backends/progress.py): once while it runs, once
when done; a short one says nothing."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

import memcompile
from memcompile import zoo
from memcompile.backends import progress
from memcompile.backends.progress import slow_compile_notice
from memcompile.pipeline import stage

LOGGER = "memcompile.backends.progress"


def test_a_long_compile_is_announced_once_and_its_end_too(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    with slow_compile_notice("F3", nodes=812, budget=3 * 2**20, after_s=0.01):
        time.sleep(0.3)
    messages = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(messages) == 2, messages
    assert messages[0].startswith("memcompile: F3 is still compiling after 0 s")
    assert "(a graph of 812 nodes, budget 3.00 MiB)" in messages[0]
    assert 'TORCH_LOGS="+memcompile"' in messages[0]
    assert messages[1] == "memcompile: F3 compiled in 0 s"
    assert all(r.levelno == logging.WARNING for r in caplog.records if r.name == LOGGER)


def test_a_short_compile_says_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    with slow_compile_notice("F0", nodes=5, budget=None, after_s=5.0):
        pass
    time.sleep(0.05)  # a timer that was not cancelled would have no reason to fire yet either
    assert not [r for r in caplog.records if r.name == LOGGER]


def test_a_notice_is_not_left_pending_by_a_compile_that_fails(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    with pytest.raises(RuntimeError, match="boom"):
        with slow_compile_notice("F1", nodes=5, budget=None, after_s=0.2):
            raise RuntimeError("boom")
    time.sleep(0.4)  # past the notice's time: it was cancelled with the compile
    assert not [r for r in caplog.records if r.name == LOGGER]


def test_the_compiler_announces_a_fragment_that_compiles_long(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(progress, "SLOW_COMPILE_S", 0.0)  # every compile counts as long
    caplog.set_level(logging.WARNING, logger=LOGGER)
    torch._dynamo.reset()
    wl = zoo.build("gpt", size="tiny")
    compiled = memcompile.compile(wl.model, budget="64MiB")
    wl.loss(compiled, 0).backward()
    messages = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert any(m.startswith("memcompile: F0 is still compiling after") for m in messages)
    assert any("budget 64.00 MiB" in m for m in messages)
    assert "memcompile: F0 compiled in" in " ".join(messages)


def test_a_long_compile_says_again_what_the_pipeline_is_doing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    with slow_compile_notice("F2", nodes=9, budget=None, after_s=0.01, every_s=0.05):
        stage.say("the planner, call 2: recomputing only")
        time.sleep(0.3)
    messages = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert (
        "(a graph of 9 nodes, no budget; now: the planner, call 2: recomputing only)"
        in (messages[0])
    )
    again = [m for m in messages[1:-1] if m.startswith("memcompile: F2 is still compiling")]
    assert again and all(m.endswith("(now: the planner, call 2: recomputing only)") for m in again)
    assert messages[-1] == "memcompile: F2 compiled in 0 s"
    assert stage.now(threading.get_ident()) is None  # cleared with the compile


def test_the_compiler_says_which_stage_a_budgeted_compile_is_in(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    said: list[str] = []
    monkeypatch.setattr(stage, "say", said.append)
    torch._dynamo.reset()
    wl = zoo.build("gpt", size="tiny")
    compiled = memcompile.compile(wl.model, budget=1, on_infeasible="best_effort")
    with pytest.warns(memcompile.MemoryBudgetWarning):
        wl.loss(compiled, 0).backward()
    assert said[0] == "the planner, call 1"
    assert "building plan 1" in said and "building plan 1: row tiling" in said
    assert any(s.endswith("for the smallest peak") for s in said)
