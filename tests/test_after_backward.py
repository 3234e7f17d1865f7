"""runtime/after_backward.py: code run when a backward pass has returned to its caller."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from memcompile.runtime import after_backward


def _loss() -> torch.Tensor:
    w = torch.randn(8, 8, requires_grad=True)
    return (torch.randn(4, 8) @ w).tanh().sum()


def test_a_callback_runs_once_the_outermost_backward_returns() -> None:
    # A reentrant checkpoint runs a backward inside the backward: only the outer one's return
    # counts (inside the pass the thread's state is not its caller's).
    entry = torch.autograd._engine_run_backward
    seen: list[int] = []

    def done() -> bool:
        seen.append(torch._C._current_graph_task_id())  # -1: outside any backward pass
        return True

    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    after_backward.after_backward(done)
    assert after_backward.waiting() and torch.autograd._engine_run_backward is not entry
    checkpoint(lambda a: (a @ w).tanh(), x, use_reentrant=True).sum().backward()
    assert seen == [-1]
    assert not after_backward.waiting() and torch.autograd._engine_run_backward is entry
    _loss().backward()
    assert seen == [-1]


def test_a_callback_that_returns_false_waits_for_the_next_backward() -> None:
    calls: list[int] = []

    def second() -> bool:
        calls.append(1)
        return len(calls) == 2

    after_backward.after_backward(second)
    after_backward.after_backward(second)  # registered once
    _loss().backward()
    assert after_backward.waiting()
    torch.autograd.grad(_loss(), [torch.ones(1, requires_grad=True)], allow_unused=True)
    assert calls == [1, 1] and not after_backward.waiting()


def test_cancel_restores_autograds_entry_point() -> None:
    entry = torch.autograd._engine_run_backward

    def never() -> bool:
        raise AssertionError("cancelled: not called")

    after_backward.after_backward(never)
    after_backward.cancel(never)
    after_backward.cancel(never)  # no-op
    assert not after_backward.waiting() and torch.autograd._engine_run_backward is entry
    _loss().backward()


def test_a_failing_callback_is_logged_and_the_backward_still_returns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken() -> bool:
        raise RuntimeError("bookkeeping bug")

    w = torch.randn(3, requires_grad=True)
    after_backward.after_backward(broken)
    with caplog.at_level(logging.ERROR, logger="memcompile.runtime.after_backward"):
        (w * 2).sum().backward()
    assert w.grad is not None and torch.equal(w.grad, torch.full((3,), 2.0))
    assert "a callback after the backward failed" in caplog.text
    assert not after_backward.waiting()


def test_a_wrapper_put_over_it_is_left_in_place() -> None:
    # Another library wraps autograd's entry point while memcompile waits: cancelling does not
    # undo theirs, and backward still runs through both.
    calls: list[str] = []
    after_backward.after_backward(lambda: False)
    ours = torch.autograd._engine_run_backward

    def theirs(*args: object, **kwargs: object) -> object:
        calls.append("theirs")
        return ours(*args, **kwargs)

    torch.autograd._engine_run_backward = theirs  # type: ignore[attr-defined]
    try:
        for fn in list(after_backward._thread_waiting()):
            after_backward.cancel(fn)
        assert torch.autograd._engine_run_backward is theirs
        _loss().backward()
        assert calls == ["theirs"]
    finally:
        torch.autograd._engine_run_backward = after_backward._original or ours  # type: ignore[attr-defined]
        after_backward._original = None
