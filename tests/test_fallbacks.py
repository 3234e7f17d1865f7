"""Frames Dynamo runs eagerly are detected, warned about once, and counted in the report."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import memcompile
from memcompile import EagerFallbackWarning

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class ModeSwitch(nn.Module):
    """Hits the recompile limit: each new string ``mode`` fails a guard and recompiles."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mode: str) -> torch.Tensor:
        return self.lin(x).mul(len(mode)).sum()


class LoopBreak(nn.Module):
    """A graph break inside a loop: Dynamo skips the whole frame."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
            torch._dynamo.graph_break()
        return x.sum()


def _fallback_warnings(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, EagerFallbackWarning)]


def test_recompile_limit_is_detected_warned_once_and_reported() -> None:
    compiled = memcompile.compile(ModeSwitch())
    x = torch.randn(2, 8)
    with torch._dynamo.config.patch(recompile_limit=3), warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for i in range(8):  # modes 4..7 exceed the limit and run eagerly
            compiled(x, "m" * (i + 1)).backward()
    msgs = _fallback_warnings(rec)
    assert len(msgs) == 1, msgs
    assert "Dynamo runs forward (" in msgs[0] and "test_fallbacks.py" in msgs[0]
    assert "recompile_limit: Dynamo recompile limit exceeded" in msgs[0]
    assert "raise torch._dynamo.config.recompile_limit (now 3)" in msgs[0]
    rep = memcompile.report(compiled)
    assert [(f.kind, f.code.split(" ")[0]) for f in rep.fallbacks] == [
        ("recompile_limit", "forward")
    ]
    # The three compiles before the limit; past it the frame runs eagerly and its Linear is a
    # fragment of its own (backends/regions.py).
    assert len(rep.fragments) == 4
    assert [r.path for r in rep.regions] == ["lin"]
    assert rep.to_dict()["fallbacks"][0]["kind"] == "recompile_limit"
    assert "EAGER forward" in str(rep)


def test_graph_break_in_a_loop_is_reported_as_a_skipped_frame() -> None:
    compiled = memcompile.compile(LoopBreak())
    with pytest.warns(
        EagerFallbackWarning,
        match=r"skipped_frame: .*Hint: Dynamo cannot resume after a graph break inside a loop",
    ):
        for _ in range(2):
            compiled(torch.randn(2, 8)).backward()
    rep = memcompile.report(compiled)
    assert [f.kind for f in rep.fallbacks] == ["skipped_frame"]
    assert rep.fallbacks[0].code.startswith("forward (")


def test_a_clean_model_reports_no_fallbacks() -> None:
    compiled = memcompile.compile(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for _ in range(3):
            compiled(torch.randn(2, 4)).sum().backward()
    assert _fallback_warnings(rec) == []
    assert memcompile.report(compiled).fallbacks == ()


def test_fallbacks_under_another_backend_are_not_claimed() -> None:
    eager_loop = torch.compile(LoopBreak(), backend="eager")
    eager_loop(torch.randn(2, 8))  # fails under the "eager" backend: not memcompile's business
    compiled = memcompile.compile(nn.Sequential(nn.Linear(8, 8), nn.Tanh()))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        compiled(torch.randn(2, 8)).sum().backward()
        eager_loop(torch.randn(2, 8))
        compiled(torch.randn(2, 8)).sum().backward()
    assert _fallback_warnings(rec) == []
    assert memcompile.report(compiled).fallbacks == ()


class LoopBreak2(LoopBreak):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x).relu()
            torch._dynamo.graph_break()
        return x.sum()


def test_torch_compile_path_reports_a_model_whose_every_frame_fails() -> None:
    # The backend is never called (no frame compiles), yet the report shows the fallback.
    compiled = torch.compile(LoopBreak2(), backend="memcompile")
    compiled(torch.randn(2, 8))  # no memcompile code runs: nothing can warn yet
    with pytest.warns(EagerFallbackWarning, match=r"Dynamo runs forward \(.*test_fallbacks.py"):
        rep = memcompile.report(compiled)  # the report finds the model's failed frame
    assert rep.fragments == ()
    assert [f.kind for f in rep.fallbacks] == ["skipped_frame"]


def _loop_helper(x: torch.Tensor) -> torch.Tensor:
    """Not a method of any module: a library helper whose frame Dynamo gives up on."""
    for _ in range(2):
        x = x * 2
        torch._dynamo.graph_break()
    return x


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).tanh()


class EagerOuter(nn.Module):
    """Its forward runs eagerly (a graph break in a loop) and calls a module Dynamo compiles,
    then a helper that fails too: with ``torch.compile(backend="memcompile")`` the backend first
    runs in the middle of the first call, after the outer failure and before the helper's."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()  # a torch.nn container called from eager code is not compiled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(2):
            x = self.inner(x)
            torch._dynamo.graph_break()
        return _loop_helper(x).sum()


def test_torch_compile_path_claims_fallbacks_around_the_first_compiled_fragment() -> None:
    compiled = torch.compile(EagerOuter(), backend="memcompile")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        compiled(torch.randn(2, 8)).backward()  # the outer frame: still running at attach
        compiled(torch.randn(2, 8)).backward()  # the helper's, after attach: claimed here
    msgs = _fallback_warnings(rec)
    assert len(msgs) == 2, msgs
    assert "Dynamo runs forward (" in msgs[0] and "Dynamo runs _loop_helper (" in msgs[1]
    rep = memcompile.report(compiled)
    assert [(f.kind, f.code.split(" ")[0]) for f in rep.fallbacks] == [
        ("skipped_frame", "forward"),
        ("skipped_frame", "_loop_helper"),
    ]
    assert len(rep.fragments) >= 1  # the inner module compiled


def test_report_claims_the_rest_of_the_first_call_without_a_second_call() -> None:
    compiled = torch.compile(EagerOuter(), backend="memcompile")
    compiled(torch.randn(2, 8)).backward()
    rep = memcompile.report(compiled)
    assert [f.code.split(" ")[0] for f in rep.fallbacks] == ["forward", "_loop_helper"]


class EagerWeight(EagerOuter):
    """A parameter only the eager frame reads: no fragment takes it as an input."""

    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Parameter(torch.randn(256, 256))  # 256 KiB

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(2):
            x = self.inner(x)
            torch._dynamo.graph_break()
        return x.sum() * self.big.sum()


def test_torch_compile_path_counts_parameters_only_eager_frames_read() -> None:
    # The fragments alone fit 64 KiB easily; the model's 256 KiB parameter does not.
    compiled = torch.compile(EagerWeight(), backend="memcompile", options={"budget": 65536})
    with pytest.raises(memcompile.MemoryBudgetError, match="no memory plan fits") as err:
        compiled(torch.randn(2, 8)).backward()
    assert err.value.min_feasible > 256 * 1024
    # The message names what stays on the device whatever the plan.
    assert "256.00 KiB is the model's parameters and buffers that no fragment" in str(err.value)


class _Passthrough(TorchDispatchMode):
    """A dispatch mode that changes nothing (as a flop counter or a memory tracker would not)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _Functional(nn.Module):
    """Functional ops only: a frame Dynamo skips under a mode is marked skipped for good, so no
    ``nn.Linear.forward`` of other tests is touched (the fixture's reset clears the mark)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.w).sum()


def test_a_first_call_under_a_dispatch_mode_is_reported_as_eager() -> None:
    compiled = memcompile.compile(_Functional())
    x = torch.randn(4, 8)
    with pytest.warns(EagerFallbackWarning, match=r"dispatch_mode: a TorchDispatchMode \(_Pass"):
        with _Passthrough():
            compiled(x).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error", EagerFallbackWarning)  # once per model
        with _Passthrough():
            compiled(x).backward()
    rep = memcompile.report(compiled)
    assert rep.eager_frames == 1 and not rep.fragments
    assert "EAGER the compiled model's call: dispatch_mode" in str(rep)


def test_a_call_under_a_dispatch_mode_after_a_compile_is_reported_too() -> None:
    compiled = memcompile.compile(_Functional())
    x = torch.randn(4, 8)
    compiled(x).backward()
    with pytest.warns(EagerFallbackWarning, match=r"until torch._dynamo.reset\(\)"):
        with _Passthrough():
            compiled(x).backward()
    # What the warning says: the compiled code ran in neither that call nor the next one
    # (Dynamo marked the frame skipped; torch 2.13).
    compiled(x).backward()
    rep = memcompile.report(compiled)
    assert rep.eager_frames == 1 and rep.fragments[0].forward_calls == 1
