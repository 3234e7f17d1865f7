"""Regional capture (backends/regions.py): the torch.nn modules a frame Dynamo runs eagerly calls
are compiled as fragments of the model's own MemCompiler; training stays bit-identical."""

from __future__ import annotations

import logging
import threading
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memcompile
from memcompile import EagerFallbackWarning, zoo
from memcompile.backends.fallbacks import Fallback
from memcompile.backends.regions import find_regions, forward_label
from memcompile.pipeline import features
from memcompile.report import find_compiler

from helpers import assert_same_state, quiet_peak

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

NATURAL = ("moe_natural", "moe_natural_top2", "early_exit_natural")


def _train_both(name: str, optimizer: str = "sgd", steps: int = 4, **options: object) -> tuple:
    eager, comp = zoo.build(name, size="tiny"), zoo.build(name, size="tiny")
    eager_losses = eager.train(eager.model, steps, optimizer=optimizer)
    compiled = memcompile.compile(comp.model, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EagerFallbackWarning)
        losses = comp.train(compiled, steps, optimizer=optimizer)
    for step, (a, b) in enumerate(zip(eager_losses, losses, strict=True)):
        assert torch.equal(a, b), f"step {step}: loss {a.item()} != {b.item()}"
    assert_same_state(eager.model, comp.model)
    return compiled, comp


def _region_fragments(rep: memcompile.MemReport) -> list[str]:
    return [f.code for f in rep.fragments if "<memcompile region " in f.code]


@pytest.mark.parametrize("name", NATURAL)
def test_natural_models_train_bit_identical_with_their_modules_as_fragments(name: str) -> None:
    compiled, wl = _train_both(name, optimizer="adam")
    rep = memcompile.report(compiled)
    (fallback,) = rep.fallbacks
    assert fallback.kind in ("skipped_frame", "failed_frame")
    assert fallback.code == forward_label(wl.model)
    # Every torch.nn module the forward holds, in module order (tiny: 2 layers of 4 experts;
    # 4 blocks with an exit each).
    expected = {
        "moe_natural": ["emb", "norms.0", "norms.1", "routers.0", "routers.1"]
        + [f"experts.{layer}.{e}" for layer in range(2) for e in range(4)]
        + ["head"],
        "early_exit_natural": ["inp"]
        + [f"blocks.{i}" for i in range(4)]
        + [f"exits.{i}" for i in range(4)],
    }
    expected["moe_natural_top2"] = expected["moe_natural"]
    assert [r.path for r in rep.regions] == expected[name]
    assert all(r.caller == fallback.code for r in rep.regions)
    # The regions ran, as fragments of this model, with a backward.
    regional = [f for f in rep.fragments if "<memcompile region " in f.code]
    assert regional and all(f.forward_calls > 0 for f in regional)
    assert any(f.backward_calls > 0 for f in regional)
    assert "torch.nn module(s) run as fragments" in str(rep)
    assert rep.to_dict()["regions"][0]["caller"] == fallback.code


def test_a_frame_recompiled_per_input_structure_goes_regional() -> None:
    # The tree network's forward recurses over a new tree each step: Dynamo compiles a graph
    # per tree; after REGIONAL_AFTER of them memcompile runs it eagerly with its modules as
    # fragments, instead of compiling up to the (raised) recompile limit.
    from memcompile.backends.compiler import REGIONAL_AFTER

    steps = REGIONAL_AFTER + 4
    compiled, wl = _train_both("tree_natural", steps=steps)
    rep = memcompile.report(compiled)
    (fallback,) = rep.fallbacks
    assert fallback.kind == "recompiling" and fallback.code == forward_label(wl.model)
    assert f"compiled {REGIONAL_AFTER} times" in fallback.reason
    assert [r.path for r in rep.regions] == ["emb", "cell", "head"]
    whole = [f for f in rep.fragments if "<memcompile region " not in f.code]
    assert len(whole) == REGIONAL_AFTER  # one per tree, then none
    cell = next(f for f in rep.fragments if "region cell" in f.code)
    assert cell.forward_calls >= 3 * 3  # the last steps' trees: at least 4 leaves each


@features.patch(direct_unplanned=False)  # counts what every watched step does
def test_modules_of_one_structure_share_one_graph() -> None:
    compiled, _ = _train_both("moe_natural")
    rep = memcompile.report(compiled)
    # The routers (Linear 32 -> 4) of both layers, the experts (Sequential) of every layer.
    codes = _region_fragments(rep)
    assert sum("routers." in c for c in codes) == 1, codes
    assert sum("experts." in c for c in codes) == 1, codes
    experts = next(f for f in rep.fragments if "experts." in f.code)
    assert experts.forward_calls >= 2 * 3  # two layers, three steps after the first


def test_the_first_call_logs_what_it_compiles(caplog: pytest.LogCaptureFixture) -> None:
    # (The EagerFallbackWarning is once per frame and process: tests/test_fallbacks.py.)
    wl = zoo.build("moe_natural", size="tiny")
    compiled = memcompile.compile(wl.model)
    with caplog.at_level(logging.WARNING, logger="memcompile.backends.compiler"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", EagerFallbackWarning)
            wl.loss(compiled, 0).backward()
    (message,) = [r.getMessage() for r in caplog.records if "fragments of their own" in r.message]
    assert "the 14 torch.nn module(s) it calls (emb, norms.0," in message
    assert memcompile.report(compiled).fragments == ()  # the first call ran eagerly
    wl.loss(compiled, 1).backward()
    assert len(memcompile.report(compiled).fragments) == 5


def test_switched_off_the_modules_stay_eager() -> None:
    with features.patch(regional=False):
        compiled, _ = _train_both("moe_natural")
        rep = memcompile.report(compiled)
    assert rep.regions == ()
    assert rep.fragments == ()  # every module is torch.nn: nothing compiled


def test_a_budget_is_held_with_regions() -> None:
    wl = zoo.build("moe_natural", size="tiny")
    batch = wl.batch(1)
    step = lambda m: lambda: m(*batch).backward()  # noqa: E731
    step(wl.model)()
    wl.model.zero_grad(set_to_none=True)
    eager = quiet_peak(step(wl.model), wl.model, batch)
    wl.model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    budget = int(0.75 * eager)
    compiled, comp = _train_both("moe_natural", budget=budget)
    comp.model.zero_grad(set_to_none=True)
    measured = quiet_peak(step(compiled), comp.model, batch)
    rep = memcompile.report(compiled)
    assert measured <= budget, (measured, budget, str(rep))
    assert rep.predicted_peak <= budget


class _Shared(nn.Module):
    """A user block (Dynamo compiles it) that calls a Linear the eager forward also calls."""

    def __init__(self, shared: nn.Linear) -> None:
        super().__init__()
        self.shared = shared
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.shared(x)))


class _Mixed(nn.Module):
    """The top forward breaks in its loop (``.item()``); ``block`` compiles; ``proj`` is called
    from both; ``drop`` is a region with dropout, and ``F.dropout`` runs in the glue."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.block = _Shared(self.proj)
        self.drop = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            x = self.block(x) + self.proj(x)
            x = F.dropout(self.drop(x), 0.2, self.training)
            if x.abs().mean().item() > 1e6:
                break
        return x.square().mean()


def test_mixed_frames_shared_modules_and_dropout_are_bit_identical() -> None:
    torch.manual_seed(0)
    eager = _Mixed()
    model = _Mixed()
    model.load_state_dict(eager.state_dict())
    compiled = memcompile.compile(model)
    x = torch.randn(8, 16)
    for step in range(4):
        for m, fn in ((eager, eager), (model, compiled)):
            torch.manual_seed(step)
            m.zero_grad(set_to_none=True)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", EagerFallbackWarning)
                loss = fn(x)
            loss.backward()
            if m is eager:
                expected = loss
        assert torch.equal(loss, expected), step
        for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), name
    rep = memcompile.report(compiled)
    assert {r.path for r in rep.regions} == {"proj", "drop"}  # block is the user's: Dynamo's
    assert any("Shared" in f.code or "forward" in f.code for f in rep.fragments)
    # proj: once for the input that needs no gradient, once for those that do.
    assert {code.rsplit(":", 1)[0] for code in _region_fragments(rep)} == {
        "Linear (<memcompile region proj>",
        "Sequential (<memcompile region drop>",
    }


def test_a_fallen_back_submodule_is_searched_too() -> None:
    class Router(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = nn.Linear(8, 2)
            self.paths = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(2):
                x = x + self.paths[int(self.gate(x).sum(0).argmax())](x)
            return x

    class Top(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.router = Router()
            self.out = nn.Linear(8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.router(torch.tanh(x))).sum()

    regions = find_regions(
        Top(), [Fallback(forward_label(Router()) or "", "skipped_frame", "", "", "")]
    )
    assert [r.path for r in regions] == ["router.gate", "router.paths.0", "router.paths.1"]
    assert regions[1].structure == regions[2].structure != regions[0].structure
    # A recompile limit or dispatch mode is not a frame regions help with.
    assert (
        find_regions(Top(), [Fallback(forward_label(Top()) or "", "dispatch_mode", "", "", "")])
        == ()
    )

    torch.manual_seed(0)
    eager, model = Top(), Top()
    model.load_state_dict(eager.state_dict())
    compiled = memcompile.compile(model)
    x = torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EagerFallbackWarning)
        for _ in range(3):
            a, b = eager(x), compiled(x)
            assert torch.equal(a, b)
    rep = memcompile.report(compiled)
    assert {r.path for r in rep.regions} == {"router.gate", "router.paths.0", "router.paths.1"}


def test_outside_the_compiled_model_the_module_runs_as_usual() -> None:
    compiled, wl = _train_both("moe_natural")
    rep = memcompile.report(compiled)
    head = next(f for f in rep.fragments if "region head" in f.code)
    x = torch.randn(2, 32)
    expected = F.linear(x, wl.model.head.weight, wl.model.head.bias)
    assert torch.equal(wl.model.head(x), expected)  # the user calls it directly
    other = []
    thread = threading.Thread(target=lambda: other.append(wl.model.head(x)))
    thread.start()
    thread.join()
    assert torch.equal(other[0], expected)
    after = next(f for f in memcompile.report(compiled).fragments if "region head" in f.code)
    assert after.forward_calls == head.forward_calls and after.inference_calls == 0


def test_a_module_the_user_compiled_is_left_alone() -> None:
    wl = zoo.build("moe_natural", size="tiny")
    wl.model.head.compile(backend="eager")
    users = wl.model.head._compiled_call_impl
    compiled = memcompile.compile(wl.model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EagerFallbackWarning)
        wl.train(compiled, 2)
    assert wl.model.head._compiled_call_impl is users
    assert "head" not in {r.path for r in memcompile.report(compiled).regions}


def test_through_torch_compile_with_the_backend_name() -> None:
    # No fragment compiles in the first call (every module is torch.nn): the compiler attaches
    # when Dynamo starts on the forward (compiler.py's start hook), so the second call has its
    # regions. A fresh process registers the hook at import, and it is registered again after
    # each torch._dynamo.reset() (the fixture's), once, with no memcompile code run since.
    from torch._dynamo.callback import callback_handler

    from memcompile.backends.compiler import _on_compile_start

    assert callback_handler.start_callbacks.count(_on_compile_start) == 1
    torch._dynamo.reset()
    assert callback_handler.start_callbacks.count(_on_compile_start) == 1
    memcompile.MemCompiler()
    assert callback_handler.start_callbacks.count(_on_compile_start) == 1
    eager, wl = zoo.build("moe_natural", size="tiny"), zoo.build("moe_natural", size="tiny")
    compiled = torch.compile(wl.model, backend="memcompile", options={"budget": "1GiB"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EagerFallbackWarning)
        losses = wl.train(compiled, 3)
    assert all(torch.equal(a, b) for a, b in zip(eager.train(eager.model, 3), losses, strict=True))
    rep = memcompile.report(compiled)
    assert len(rep.regions) == 14 and len(rep.fragments) == 5
    assert rep.fallbacks[0].code == forward_label(wl.model)


def test_a_region_call_is_not_a_model_call(monkeypatch: pytest.MonkeyPatch) -> None:
    # The model's call hook (step boundaries, fallback claims) runs once per model call, not
    # once per region: a region's Dynamo context is marked hooked (dynamo_hooks.hookless).
    wl = zoo.build("moe_natural", size="tiny")
    compiled = memcompile.compile(wl.model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EagerFallbackWarning)
        wl.train(compiled, 2)
        compiler = memcompile.report.__globals__["find_compiler"](compiled)[0]
        calls = []
        original = compiler._between_calls
        monkeypatch.setattr(compiler, "_between_calls", lambda: calls.append(1) or original())
        wl.train(compiled, 2)
    assert len(calls) == 2
    assert sum(f.forward_calls for f in memcompile.report(compiled).fragments) >= 2 * 7


class _Glue(nn.Module):
    """Most of its memory is the glue's: tensor ops on a raw parameter in a fallen-back loop."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(64, 64) / 8)
        self.head = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(6):
            x = torch.tanh(x @ self.w)
            if x.mean().item() > 1e9:
                break
        return self.head(x).sum()


def _glue_loop(
    monkeypatch: pytest.MonkeyPatch, fraction: int, calls: int
) -> tuple[nn.Module, Any, torch.Tensor, int, list[Any]]:
    # A loop without an optimizer over _Glue at eager's peak / fraction; the CPU samples an
    # iteration after each compile, from the call's start (before the glue) to the end of its
    # backward (conftest.py turns sampling off outside test_iteration).
    from memcompile.step import checks

    monkeypatch.setattr(checks, "SAMPLED_ITERATIONS", 1)
    torch.manual_seed(0)
    model = _Glue()
    x = torch.randn(512, 64)
    eager = quiet_peak(lambda: model(x).backward(), model, x)
    model.zero_grad(set_to_none=True)
    budget = eager // fraction
    compiled = memcompile.compile(model, budget=budget)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(calls):
            model.zero_grad(set_to_none=True)
            compiled(x).backward()
    over = [w for w in caught if issubclass(w.category, memcompile.MemoryBudgetWarning)]
    return model, compiled, x, budget, over


def test_glue_over_the_budget_goes_to_the_host_in_a_loop_without_an_optimizer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The plans see only the head. The sample of a call runs through its backward
    # (runtime/after_backward.py): over the budget with an eager frame, the glue's saved
    # tensors go to the host tier, and the loop then fits, unwarned.
    model, compiled, x, budget, over = _glue_loop(monkeypatch, 2, 4)
    assert not over, [str(w.message) for w in over]
    rep = memcompile.report(compiled)
    glue = rep.glue
    assert glue.on and "a sampled iteration measured" in glue.why and glue.bytes > 0
    # The report's measured peak is the latest sample's (the highest, before, is named too).
    assert rep.measured_peak is not None and rep.latest_measured_peak is not None
    assert rep.latest_measured_peak <= budget < rep.measured_peak
    assert "(latest sample; the highest" in str(rep) and not rep.over_budget
    # The fallen-back frame's memory is measured and counted: not reported as unmanaged.
    assert rep.glue_measured and rep.to_dict()["glue_measured"]
    assert "  eager forward" in str(rep) and "its memory measured, in the budget" in str(rep)
    assert "EAGER" not in str(rep)
    model.zero_grad(set_to_none=True)
    assert quiet_peak(lambda: compiled(x).backward(), model, x) <= budget


def test_glue_over_the_budget_is_warned_about_in_a_loop_without_an_optimizer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # With the glue on the host already, the next sample still passes the budget: warned
    # (forward and backward sampled), and what it saw beyond the prediction is counted.
    model, compiled, x, budget, over = _glue_loop(monkeypatch, 4, 10)
    sampled = [str(w.message) for w in over if "a training iteration" in str(w.message)]
    assert len(sampled) == 1, [str(w.message) for w in over]
    assert "(a model call, no optimizer step: its forward and backward)" in sampled[0]
    rep = memcompile.report(compiled)
    assert rep.over_budget and rep.measured_peak is not None and rep.measured_peak > budget
    assert rep.unseen_bytes > 0 and "measured beyond the plans" in str(rep)
    # The prediction is then the measured peak, but for the call's argument (not known where
    # the sample begins: the call hook has none).
    model.zero_grad(set_to_none=True)
    measured = quiet_peak(lambda: compiled(x).backward(), model, x)
    assert rep.predicted_peak is not None
    assert abs(rep.predicted_peak + x.nbytes - measured) <= 0.02 * measured


def test_a_loop_without_an_optimizer_is_sampled_to_the_end_of_its_backward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # No profiler runs once the backward has returned (nor after a call with no backward), and
    # the wrapper of autograd's entry point is gone once nothing waits.
    from memcompile.step import checks

    monkeypatch.setattr(checks, "SAMPLED_ITERATIONS", 1)
    engine_entry = torch.autograd._engine_run_backward
    torch.manual_seed(0)
    model = _Glue()
    x = torch.randn(64, 64)
    compiled = memcompile.compile(model, budget="1GiB")
    for _ in range(2):  # falls back, then compiles the head: the next call is sampled
        compiled(x).backward()
        model.zero_grad(set_to_none=True)
    out = compiled(x)
    assert torch._C._autograd._profiler_enabled()  # through the backward
    assert torch.autograd._engine_run_backward is not engine_entry
    out.backward()
    assert not torch._C._autograd._profiler_enabled()
    assert torch.autograd._engine_run_backward is engine_entry
    assert compiled_checks(compiled).samples == 1
    # A call with gradients on that no backward follows: dropped at the next call, and the
    # samples after it end with their call.
    compiled_checks(compiled).sample_again()
    model.zero_grad(set_to_none=True)
    compiled(x)
    assert torch._C._autograd._profiler_enabled()
    model.zero_grad(set_to_none=True)
    compiled(x)
    assert not torch._C._autograd._profiler_enabled()
    assert torch.autograd._engine_run_backward is engine_entry
    assert compiled_checks(compiled).samples == 2


def compiled_checks(compiled: Any) -> Any:
    compiler, _ = find_compiler(compiled)
    return compiler.checks


def test_recompiles_are_counted_by_distinct_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    # A re-plan compiles the same graph again (and resets Dynamo's own per-frame count): only
    # distinct graphs of one frame count towards going regional.
    from memcompile.backends import compiler as compiler_module
    from memcompile.backends.compiler import REGIONAL_AFTER

    wl = zoo.build("tree_natural", size="tiny")
    compiled = memcompile.compile(wl.model)
    compiler = memcompile.report.__globals__["find_compiler"](compiled)[0]
    code = type(wl.model).forward.__code__
    monkeypatch.setattr(compiler_module, "compiling_code", lambda: code)
    for _ in range(3 * REGIONAL_AFTER):
        compiler._regional_after_recompiles("the same graph, re-planned")
    for i in range(REGIONAL_AFTER - 2):
        compiler._regional_after_recompiles(f"tree {i}")
    assert compiler._skip_pending == [] and compiler.fallbacks == []
    compiler._regional_after_recompiles("one more tree")
    assert compiler._skip_pending == [code]
    (fallback,) = compiler.fallbacks
    assert fallback.kind == "recompiling" and fallback.code == forward_label(wl.model)
    assert [r.path for r in compiler.regional.regions] == ["emb", "cell", "head"]


def test_copies_and_saved_models_carry_no_gate() -> None:
    import copy
    import io

    _, wl = _train_both("moe_natural", steps=2)
    assert wl.model.head._compiled_call_impl is not None
    assert copy.deepcopy(wl.model).head._compiled_call_impl is None  # Module.__getstate__
    buffer = io.BytesIO()
    torch.save(wl.model, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=False).head._compiled_call_impl is None


def test_a_decorator_shared_by_several_module_types_is_never_skipped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Hugging Face decorates forwards: one wrapper code object for every module type it wraps.
    import functools

    from memcompile.backends import compiler as compiler_module
    from memcompile.backends.compiler import REGIONAL_AFTER

    def decorated(fn):  # type: ignore[no-untyped-def]
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
            return fn(*args, **kwargs)

        return wrapper

    class A(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        @decorated
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x)

    class B(A):
        @decorated
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) * 2

    class Both(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = A(), B()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x)).sum()

    model = Both()
    assert A.forward.__code__ is B.forward.__code__
    compiled = memcompile.compile(model)
    compiler = memcompile.report.__globals__["find_compiler"](compiled)[0]
    monkeypatch.setattr(compiler_module, "compiling_code", lambda: A.forward.__code__)
    for i in range(2 * REGIONAL_AFTER):
        compiler._regional_after_recompiles(f"graph {i}")
    assert compiler._skip_pending == [] and compiler.fallbacks == []


def test_a_forward_another_backend_gave_up_on_is_claimed_and_goes_regional() -> None:
    # aot_eager gives up on the class's forward first: Dynamo skips that code object from then
    # on, for every instance, and records nothing in memcompile's calls. The first call that
    # compiles nothing claims the earlier record: warned, and the modules become regions.
    eager, other, wl = (zoo.build("moe_natural", size="tiny") for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.compile(other.model, backend="aot_eager")(*other.batch(0)).backward()
    compiled = memcompile.compile(wl.model, budget="1GiB")
    with warnings.catch_warnings():  # warned once per frame in the process: maybe before
        warnings.simplefilter("ignore", EagerFallbackWarning)
        losses = wl.train(compiled, 3)
    assert all(torch.equal(a, b) for a, b in zip(eager.train(eager.model, 3), losses, strict=True))
    assert_same_state(eager.model, wl.model)
    rep = memcompile.report(compiled)
    assert rep.fallbacks[0].code == forward_label(wl.model)
    assert len(rep.regions) == 14 and len(rep.fragments) == 5
