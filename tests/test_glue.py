"""The eager glue's saved tensors in the host tier (runtime/glue.py): turned on by a measured
iteration over the budget with eager frames, bit-identical training, the budget held after."""

from __future__ import annotations

import copy
import functools
import gc
import warnings
import weakref

import pytest
import torch
from torch import nn

import memcompile
from memcompile import EagerFallbackWarning
from memcompile.backends.fallbacks import Fallback
from memcompile.backends.regions import eager_readers, forward_label
from memcompile.report import find_compiler
from memcompile.runtime import glue
from memcompile.runtime.glue import GlueOffload, pause
from memcompile.runtime.store import TieredStore, is_host_placed

from helpers import assert_same_state, quiet_peak

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class _GlueMoE(nn.Module):
    """An MoE whose experts are slices of one raw parameter, as Hugging Face's eager experts
    are: the routing loop breaks Dynamo's graph (an ``int`` of a tensor in a loop), so the
    forward runs eagerly and the experts' compute is glue; only the routers and the head are
    ``torch.nn`` modules (regions)."""

    def __init__(self, d: int = 32, experts: int = 4, layers: int = 6) -> None:
        super().__init__()
        self.routers = nn.ModuleList(nn.Linear(d, experts) for _ in range(layers))
        self.w = nn.Parameter(torch.randn(layers, experts, d, 4 * d) / d**0.5)
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer, router in enumerate(self.routers):
            e = int(router(x).mean(0).argmax())
            w = self.w[layer, e]
            x = x + torch.tanh(x @ w) @ w.T / 4
        return self.head(x).pow(2).mean()


def _iteration(model: nn.Module, fn: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor):
    loss = fn(x)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def _eager_peak(x: torch.Tensor) -> int:
    torch.manual_seed(0)
    model = _GlueMoE()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _iteration(model, model, opt, x)
    return quiet_peak(lambda: _iteration(model, model, opt, x), model, opt, x)


def test_glue_goes_to_the_host_tier_when_a_sampled_iteration_is_over_and_the_budget_then_holds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from memcompile.step import checks

    monkeypatch.setattr(checks, "SAMPLED_ITERATIONS", 1)
    x = torch.randn(1024, 32, generator=torch.Generator().manual_seed(1))
    # Half of eager's iteration peak is under what the glue's backward itself needs (a tanh's
    # input, output and gradient at once); 0.6 is not.
    budget = _eager_peak(x) * 6 // 10
    torch.manual_seed(0)
    model = _GlueMoE()
    eager = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-3)
    compiled = memcompile.compile(model, budget=budget, on_infeasible="best_effort")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EagerFallbackWarning)
        for step in range(5):
            got = _iteration(model, compiled, opt, x)
            want = _iteration(eager, eager, eager_opt, x)
            assert torch.equal(got, want), f"iteration {step}"
        peak = quiet_peak(lambda: _iteration(model, compiled, opt, x), model, opt, x)
        _iteration(eager, eager, eager_opt, x)
    assert_same_state(eager, model)
    rep = memcompile.report(compiled)
    assert rep.glue.on and "a sampled iteration measured" in rep.glue.why, rep.glue
    # Each layer's input and tanh output (1024 x 32 and 1024 x 128 floats).
    assert rep.glue.tensors >= 12 and rep.glue.bytes >= 6 * 1024 * 160 * 4, rep.glue
    assert "the eager glue's saved tensors to the host tier" in str(rep)
    assert rep.to_dict()["glue"]["on"] is True
    assert peak <= budget * 1.02, (peak, budget)


def test_glue_stays_on_the_device_when_the_iteration_fits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from memcompile.step import checks

    monkeypatch.setattr(checks, "SAMPLED_ITERATIONS", 1)
    x = torch.randn(256, 32, generator=torch.Generator().manual_seed(1))
    budget = _eager_peak(x) * 2
    torch.manual_seed(0)
    model = _GlueMoE()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    compiled = memcompile.compile(model, budget=budget)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EagerFallbackWarning)
        for _ in range(4):
            _iteration(model, compiled, opt, x)
    rep = memcompile.report(compiled)
    assert not rep.glue.on and rep.glue.tensors == 0
    assert "saved tensors to the host tier" not in str(rep)
    # What the sample saw beyond the plans (the glue) is in the prediction, under the budget too:
    # the iteration is predicted at what it measured.
    assert rep.unseen_bytes > 0
    assert rep.iteration is not None and rep.iteration.peak is not None
    assert rep.measured_peak is not None
    assert abs(rep.iteration.peak - rep.measured_peak) <= 0.02 * rep.measured_peak, (
        rep.iteration.peaks,
        rep.measured_peak,
    )


def test_swap_false_keeps_the_glue_on_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    from memcompile.step import checks

    monkeypatch.setattr(checks, "SAMPLED_ITERATIONS", 1)
    x = torch.randn(1024, 32, generator=torch.Generator().manual_seed(1))
    budget = _eager_peak(x) // 2
    torch.manual_seed(0)
    model = _GlueMoE()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    compiled = memcompile.compile(model, budget=budget, swap=False, on_infeasible="best_effort")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(4):
            _iteration(model, compiled, opt, x)
    assert not memcompile.report(compiled).glue.on


# -- the hooks themselves ---------------------------------------------------------------------
def _offload(*resident: torch.Tensor, store: TieredStore | None = None) -> GlueOffload:
    g = GlueOffload(store or TieredStore(), lambda: torch.device("cpu"), lambda: resident)
    assert g.turn_on("test") and not g.turn_on("again")
    return g


def test_the_glue_moves_saved_activations_and_keeps_parameters_and_small_tensors() -> None:
    w = nn.Parameter(torch.randn(64, 64))
    small = torch.randn(4, requires_grad=True)
    x = torch.randn(128, 64, requires_grad=True)
    store = TieredStore()
    g = _offload(w, store=store)
    g.enter()
    try:
        y = torch.tanh(x @ w)  # mm saves x and w, tanh its output y
        z = (small * 2).sum() + y.sum()
    finally:
        g.leave()
    assert g.stats.tensors == 2 and g.stats.bytes == 2 * 128 * 64 * 4, g.stats
    assert store.bytes_out["host"] == g.stats.bytes  # host-tier copies, outside the allocator
    assert g.stats.kept >= 1  # w: a parameter
    z.backward()
    assert store.bytes_in["host"] == g.stats.bytes  # each read back once, by its node
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    (torch.tanh(xr @ wr).sum() + (small.detach() * 2).sum()).backward()
    assert torch.equal(x.grad, xr.grad) and torch.equal(w.grad, wr.grad)


def test_a_tensor_saved_twice_is_copied_once() -> None:
    x = torch.randn(128, 64, requires_grad=True)
    # Each mm saves x (for a's and b's gradients) and its small weight (kept: under MIN_BYTES).
    a, b = (torch.randn(64, 2, requires_grad=True) for _ in range(2))
    g = _offload()
    g.enter()
    try:
        y = (x @ a).sum() + (x @ b).sum()
    finally:
        g.leave()
    assert g.stats.tensors == 1 and g.stats.kept == 2, g.stats
    y.backward()
    xr, ar, br = (t.detach().clone().requires_grad_() for t in (x, a, b))
    ((xr @ ar).sum() + (xr @ br).sum()).backward()
    assert all(torch.equal(t.grad, r.grad) for t, r in ((x, xr), (a, ar), (b, br)))


def test_fragment_calls_and_the_users_own_hooks_are_left_alone() -> None:
    x = torch.randn(128, 64, requires_grad=True)
    g = _offload()
    run = g.paused(lambda t: torch.tanh(t))
    g.enter()
    try:
        run(x)
    finally:
        g.leave()
    assert g.stats.tensors == 0
    # The caller's own saved-tensor hooks win: the glue adds none.
    with torch.autograd.graph.save_on_cpu():
        g.enter()
        try:
            torch.tanh(x)
        finally:
            g.leave()
    assert g.stats.tensors == 0


def test_pause_restores_the_hooks() -> None:
    packed: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(1) or t, lambda t: t):
        with pause():
            torch.tanh(torch.randn(3, requires_grad=True))
        assert not packed
        torch.tanh(torch.randn(3, requires_grad=True))
    assert packed == [1]


def test_reset_turns_the_glue_off() -> None:
    g = _offload()
    g.reset()
    assert not g.on and g.stats == glue.GlueStats()


# -- parameters only the glue reads ----------------------------------------------------------
def _train(model: nn.Module, fn: nn.Module, x: torch.Tensor, steps: int, micro: int = 1) -> list:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        for _ in range(micro):
            loss = fn(x)
            loss.backward()
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses


@pytest.mark.parametrize("micro", [1, 2])
def test_parameters_only_the_glue_reads_go_to_the_host_and_training_stays_bit_identical(
    micro: int,
) -> None:
    x = torch.randn(256, 32, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    model = _GlueMoE()
    eager = copy.deepcopy(model)
    compiled = memcompile.compile(model, budget=2**30, offload_params=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EagerFallbackWarning)
        got = _train(model, compiled, x, 4, micro)
    want = _train(eager, eager, x, 4, micro)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert_same_state(eager, model)
    # w: no fragment takes it (only the forward's eager loop reads it); the routers and the
    # head are fragments' parameters, on the host too (offload_params=True).
    assert is_host_placed(model.w) and model._parameters["w"] is model.w
    rep = memcompile.report(compiled)
    assert [(g.module, g.name) for g in rep.glue_params] == [("", "w")]
    assert rep.glue_params[0].nbytes == model.w.numel() * 4
    assert "parameters only eager code reads, in the host tier" in str(rep)
    assert rep.to_dict()["glue_params"] == [
        {"module": "", "name": "w", "nbytes": 6 * 4 * 32 * 128 * 4}
    ]
    # On the CPU the glue's saved tensors go to the host only once a sampled iteration passes
    # the budget (CUDA: with the parameters): none reaches this one.
    assert not rep.glue.on and rep.glue.tensors == 0


def _hosting(make: type[nn.Module], **options: object) -> tuple:
    """A batch, the model, an eager copy of it and the model compiled with its parameters on
    the host (a budget nothing reaches)."""
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    model = make()
    eager = copy.deepcopy(model)
    compiled = memcompile.compile(model, budget=2**30, offload_params=True, **options)
    return x, model, eager, compiled


def test_a_glue_read_parameter_changed_before_its_backward_is_an_error() -> None:
    x, model, _, compiled = _hosting(_GlueMoE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EagerFallbackWarning)
        _train(model, compiled, x, 3)  # moved once a step with the regions compiled was seen
        assert is_host_placed(model.w)
        loss = compiled(x)
        with torch.no_grad():
            model.w.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


def test_evaluation_reads_glue_parameters_from_their_fetched_copies() -> None:
    x, model, eager, compiled = _hosting(_GlueMoE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EagerFallbackWarning)
        _train(model, compiled, x, 3)
        _train(eager, eager, x, 3)
        assert is_host_placed(model.w)
        with torch.no_grad():
            assert torch.equal(compiled(x), eager(x))
    assert model._parameters["w"] is model.w


class _Rec(nn.Module):
    """Its forward falls back (a data-dependent break in a loop) and calls itself."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(32, 32) / 6)
        self.host_reads: list[bool] = []
        self.copies: list[weakref.ref[torch.Tensor]] = []

    def forward(self, x: torch.Tensor, depth: int) -> torch.Tensor:
        for _ in range(2):
            x = torch.tanh(x @ self.w)
            if x.mean().item() > 1e9:
                break
        if depth > 0:
            x = x + self(x, depth - 1)
        # After the nested call returned: still the fetched copy, not the host parameter.
        self.host_reads.append(is_host_placed(self.w))
        self.copies.append(weakref.ref(self.w))
        return x @ self.w


class _RecModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rec = _Rec()
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rec(x, 2)).pow(2).mean()


def test_a_module_calling_itself_keeps_its_fetched_copy_until_its_own_forward_ends() -> None:
    x, model, eager, compiled = _hosting(_RecModel)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EagerFallbackWarning)
        got = _train(model, compiled, x, 5)
    want = _train(eager, eager, x, 5)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert_same_state(eager, model)
    rep = memcompile.report(compiled)
    assert [(g.module, g.name) for g in rep.glue_params] == [("rec", "w")]
    assert is_host_placed(model.rec.w) and model.rec._parameters["w"] is model.rec.w
    # Each of the last calls' three nested forwards read the device copy throughout.
    assert model.rec.host_reads[-6:] == [False] * 6


def _wrapping(fn):  # a decorator as Hugging Face's experts implementation is: functools.wraps
    @functools.wraps(fn)
    def forward(self, *args):
        return fn(self, *args)

    return forward


class _Wrapped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(2))
        self.inner = nn.Linear(2, 2)

    @_wrapping
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inner(x) * self.w
        return x


def test_eager_readers_are_the_modules_whose_own_forward_or_its_continuation_runs_eagerly() -> None:
    model = nn.Sequential(_Wrapped(), _GlueMoE())
    inner = _Wrapped.forward.__wrapped__.__code__
    first = inner.co_firstlineno
    resume = f"torch_dynamo_resume_in_forward_at_{first + 2} ({inner.co_filename}:{first + 2})"
    fallbacks = [
        Fallback(resume, "skipped_frame", "", "", ""),
        Fallback(forward_label(_GlueMoE()) or "", "failed_frame", "", "", ""),
    ]
    assert eager_readers(model, fallbacks) == ("0", "1")
    # Not a kind whose frame runs eagerly on every call; a line outside the function.
    assert eager_readers(model, [Fallback(fallbacks[1].code, "dispatch_mode", "", "", "")]) == ()
    outside = f"torch_dynamo_resume_in_forward_at_{first + 40} ({inner.co_filename}:{first + 40})"
    assert eager_readers(model, [Fallback(outside, "skipped_frame", "", "", "")]) == ()


@pytest.mark.parametrize("swap", [True, False])
def test_the_glues_saved_views_of_a_fetched_copy_do_not_keep_it_on_the_device(swap: bool) -> None:
    # mm saves w (the fetched copy) for x's gradient: kept as the parameter's view, so the copy
    # goes when its module's forward ends, before the backward. With the glue's saved tensors
    # going to the host (turned on here: the budget needs nothing) and with them on the device.
    x, model, _, compiled = _hosting(_RecModel)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EagerFallbackWarning)
        _train(model, compiled, x, 3)
        if swap:
            find_compiler(compiled)[0].glue.turn_on("a test")
        assert is_host_placed(model.rec.w)
        model.rec.copies.clear()
        loss = compiled(x)
        gc.collect()
        assert len(model.rec.copies) == 3
        assert all(ref() is None for ref in model.rec.copies)
        loss.backward()
    assert model.rec.w.grad is not None and is_host_placed(model.rec.w.grad)
    assert memcompile.report(compiled).glue.on is swap
