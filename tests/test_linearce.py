"""Linear cross-entropy by blocks (rewrites/linearce.py, runtime/linearce.py): the kernels give
aten's loss and gradients bit for bit, the probe refuses blocks that differ, the rewrite finds a
GPT's head and leaves other heads alone, training stays bit-identical, and a budget uses it only
where the plan does not fit without it, then measured as predicted and lower."""

from __future__ import annotations

import collections
import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from functorch.compile import make_boxed_func
from torch import nn
from torch._dynamo.backends.common import aot_autograd
from torch._functorch import partitioners as P

import memcompile
import memcompile.rewrites.linearce as linearce
import memcompile.runtime.linearce as kernels
from memcompile import zoo
from memcompile.analysis.workspace import PROBE_META
from memcompile.pipeline import features
from memcompile.planning.plan import FragmentPlan, MemoryPlan
from memcompile.rewrites.context import PassContext

from helpers import assert_same_state, capture_module, train_under_budget

aten = torch.ops.aten
mc = torch.ops.memcompile
CTX = PassContext(fragment="F0", graph="joint")


def _whole(h, wt, bias, target, reduction, ignore_index, go):
    """AOT's graph of ``cross_entropy(h @ wt + bias, target)``: loss, total weight, gradients."""
    x = aten.mm(h, wt) if bias is None else aten.addmm(bias, h, wt)
    lsm = aten._log_softmax(x, 1, False)
    loss, tw = aten.nll_loss_forward(lsm, target, None, reduction, ignore_index)
    g = aten.nll_loss_backward(go, lsm, target, None, reduction, ignore_index, tw)
    gl = aten._log_softmax_backward_data(g, lsm, 1, lsm.dtype)
    return loss, tw, aten.mm(gl, wt.t()), aten.mm(gl.t(), h), aten.sum(gl, [0], True)


def _head_inputs(rows=37, features=48, classes=1001, bias=True, ignore_index=-100):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(rows, features, generator=g)
    w = torch.randn(classes, features, generator=g)
    b = torch.randn(classes, generator=g) if bias else None
    target = torch.randint(0, classes, (rows,), generator=g)
    target[::5] = ignore_index
    return h, w.t(), b, target


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("reduction", [1, 2])  # mean, sum
@pytest.mark.parametrize("ignore_index", [-100, 7])
def test_kernels_equal_aten_bit_for_bit(bias, reduction, ignore_index):
    h, wt, b, target = _head_inputs(bias=bias, ignore_index=ignore_index)
    go = torch.tensor(0.7)
    whole = _whole(h, wt, b, target, reduction, ignore_index, go)
    # One block: the row statistics, the [N, 1] NLL and the extra gradient column, no BLAS
    # question; then the block count the probe measures exact on this machine.
    mask = (True, True, bias)
    chunks = linearce.exact_chunks(h, wt, b, target, reduction, ignore_index, mask)
    assert chunks is not None and chunks >= 2
    for n in (1, chunks):
        loss, tw, row_max, row_logsum = mc.linear_ce_forward(
            h, wt, b, target, reduction, ignore_index, n
        )
        grads = mc.linear_ce_backward(
            go, h, wt, b, target, reduction, ignore_index, tw, row_max, row_logsum, n, mask
        )
        assert torch.equal(loss, whole[0]) and torch.equal(tw, whole[1])
        assert torch.equal(grads[0], whole[2]) and torch.equal(grads[1], whole[3])
        if bias:
            assert torch.equal(grads[2], whole[4])
        else:
            assert grads[2].numel() == 0


@pytest.mark.parametrize("mask", [(False, True, True), (True, False, False), (False, False, True)])
def test_kernels_make_only_the_gradients_asked_for(mask):
    # A head whose input needs no gradient (its features are data), or whose weight is frozen.
    h, wt, b, target = _head_inputs(rows=64, features=32, classes=512)
    go = torch.tensor(0.7)
    whole = _whole(h, wt, b, target, 1, -100, go)[2:]
    _loss, tw, row_max, row_logsum = mc.linear_ce_forward(h, wt, b, target, 1, -100, 2)
    grads = mc.linear_ce_backward(go, h, wt, b, target, 1, -100, tw, row_max, row_logsum, 2, mask)
    for wanted, got, ref in zip(mask, grads, whole, strict=True):
        assert torch.equal(got, ref) if wanted else got.numel() == 0


def test_forward_keeps_each_rows_maximum_and_minus_log_sum():
    h, wt, b, target = _head_inputs()
    x = aten.addmm(b, h, wt)
    _loss, _tw, row_max, row_logsum = mc.linear_ce_forward(h, wt, b, target, 1, -100, 4)
    assert torch.equal(row_max, x.amax(1))
    # (x - max) - logsum is the log-softmax exactly: the backward rebuilds columns from it.
    assert torch.equal((x - row_max[:, None]) - row_logsum[:, None], aten._log_softmax(x, 1, False))


def test_an_out_of_range_target_raises():
    h, wt, b, target = _head_inputs()
    target[3] = 5000
    with pytest.raises((IndexError, RuntimeError), match=r"out of bounds"):
        mc.linear_ce_forward(h, wt, b, target, 1, -100, 4)


def test_probe_refuses_blocks_whose_results_differ(monkeypatch):
    h, wt, b, target = _head_inputs(rows=64, features=32, classes=512)
    real = kernels.backward_impl

    def off_by_one_ulp(*args):
        gh, gw, gb = real(*args)
        return torch.nextafter(gh, torch.full_like(gh, float("inf"))), gw, gb

    mask = (True, True, True)
    assert linearce.exact_chunks(h, wt, b, target, 1, -100, mask, candidates=(2,)) == 2
    monkeypatch.setattr(kernels, "backward_impl", off_by_one_ulp)
    # Another candidate tuple: not the cached answer.
    assert linearce.exact_chunks(h, wt, b, target, 1, -100, mask, candidates=(2, 1)) is None


def _targets(gm) -> list[object]:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_pass_rewrites_the_zoo_gpts_head_forward_and_backward():
    wl = zoo.build("gpt", size="tiny")
    joint = capture_module(wl.model, *wl.batch(0))["joint"]
    out = linearce.linear_ce_pass(joint, CTX)
    (head,) = out.meta["memcompile_linear_ce"]
    targets = _targets(out)
    assert targets.count(mc.linear_ce_forward.default) == 1
    assert targets.count(mc.linear_ce_backward.default) == 1
    for op in (
        aten._log_softmax.default,
        aten._log_softmax_backward_data.default,
        aten.nll_loss_forward.default,
        aten.nll_loss_backward.default,
    ):
        assert op not in targets
    assert head.grad_bias and head.chunks in linearce.CHUNKS
    # Their scratch (blocks of logits, row-sized temporaries) is measured like aten's.
    probed = [n.target for n in out.graph.nodes if n.meta.get(PROBE_META)]
    assert probed == [mc.linear_ce_forward.default, mc.linear_ce_backward.default]
    assert out.meta.get("memcompile_linear_ce") and linearce.linear_ce_pass(out, CTX) is out


class _Classifier(nn.Module):
    """An MLP classifier with a big class count: the loss head dominates its step."""

    def __init__(self, head_bias=True, **loss_kwargs) -> None:
        super().__init__()
        self.body = nn.Linear(16, 32)
        self.head = nn.Linear(32, 512, bias=head_bias)
        self.loss_kwargs = loss_kwargs
        self.returns_logits = loss_kwargs.pop("returns_logits", False)

    def forward(self, x, y):
        logits = self.head(torch.tanh(self.body(x)))
        loss = F.cross_entropy(logits, y, **self.loss_kwargs)
        return loss + 0 * logits.sum() if self.returns_logits else loss


def _batch(n: int = 64, step: int = 0, ignore_index: int = -100):
    g = torch.Generator().manual_seed(1 + step)
    y = torch.randint(0, 512, (n,), generator=g)
    y[::9] = ignore_index  # padding
    return torch.randn(n, 16, generator=g), y


@pytest.mark.parametrize(
    "kwargs",
    [
        {"returns_logits": True},  # the logits have another reader
        {"weight": torch.rand(512)},  # class weights
        {"ignore_index": 0},  # class 0 is the [N, 1] loss's own class
        {"reduction": "none"},
        {"label_smoothing": 0.1},
    ],
)
def test_pass_leaves_other_heads_alone(kwargs):
    torch.manual_seed(0)
    module = _Classifier(**kwargs)
    if kwargs.get("reduction") == "none":
        inner = module.forward
        module.forward = lambda x, y: inner(x, y).sum()  # capture_module wants a scalar
    joint = capture_module(module, *_batch(ignore_index=kwargs.get("ignore_index", -100)))["joint"]
    assert linearce.find_linear_ce(joint, CTX) == ()
    assert linearce.linear_ce_pass(joint, CTX) is joint


def _train_with_pass(model: nn.Module, steps: int = 3) -> list[torch.Tensor]:
    """Train ``model`` (Adam) through AOTAutograd with every joint graph made by blocks."""
    seen = []

    def partition(joint, inputs, **kw):
        out = linearce.linear_ce_pass(joint, CTX)
        seen.append(out.meta.get("memcompile_linear_ce", ()))
        return P.default_partition(out, inputs, **kw)

    torch._dynamo.reset()
    boxed = aot_autograd(
        fw_compiler=lambda g, _: make_boxed_func(g),
        bw_compiler=lambda g, _: make_boxed_func(g),
        partition_fn=partition,
    )
    compiled = torch.compile(model, backend=boxed)
    losses = _train(model, compiled, steps)
    assert seen and all(seen), "the head was not rewritten"
    return losses


def _train(model: nn.Module, fn, steps: int) -> list[torch.Tensor]:
    # Plain SGD: its step holds nothing beyond parameters and gradients, so a budget at the
    # forward and backward's floor is the iteration's too (Adam's step needs more: its state,
    # and temporaries the size of the largest parameter; tests/test_iteration.py).
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = fn(*_batch(step=step))
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


@pytest.mark.parametrize("head_bias", [True, False])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_training_with_the_head_by_blocks_is_bit_identical(head_bias, reduction):
    torch.manual_seed(0)
    model = _Classifier(head_bias=head_bias, reduction=reduction)
    ref = _Classifier(head_bias=head_bias, reduction=reduction)
    ref.load_state_dict(model.state_dict())
    losses = _train_with_pass(model)
    ref_losses = _train(ref, ref, 3)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses, strict=True))
    assert_same_state(model, ref)


def _compile_and_train(budget, blocks: bool, **options):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, ref = _Classifier(), _Classifier()
    ref.load_state_dict(model.state_dict())
    old = features.FEATURES
    features.FEATURES = old.replace(linear_ce_blocks=blocks, fast_no=False)
    try:
        compiled = memcompile.compile(model, budget=budget, on_infeasible="error", **options)
        losses = _train(model, compiled, 3)
        assert all(torch.equal(a, b) for a, b in zip(losses, _train(ref, ref, 3), strict=True))
        assert_same_state(model, ref)
        batch = _batch(step=5)
        model.zero_grad(set_to_none=True)
        peak = memcompile.measure_peak(lambda: compiled(*batch).backward(), resident=[model, batch])
        return compiled, peak, head_op_calls(compiled, model)
    finally:
        features.FEATURES = old


def head_op_calls(compiled, model) -> collections.Counter[str]:
    """The loss-head ops one training step of ``compiled`` runs (forward and backward), as the
    profiler records them (a dispatch mode would make Dynamo run the frame eagerly)."""
    model.zero_grad(set_to_none=True)
    batch = _batch(step=6)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        compiled(*batch).backward()
    names = [e.name for e in prof.events() if e.name.startswith("memcompile::linear_ce")]
    return collections.Counter(name.removeprefix("memcompile::") for name in names)


def _smallest(blocks: bool, **options) -> int:
    # The searched floor: no fast "no" (its bound would come first at a 1-byte budget).
    with features.patch(fast_no=False), pytest.raises(memcompile.MemoryBudgetError) as info:
        _compile_and_train(1, blocks, **options)
    return info.value.min_feasible


@pytest.mark.parametrize("options", [{"offload_params": False, "swap": False}, {}])
def test_a_budget_only_the_blocks_fit_uses_them_measured_as_predicted(options, monkeypatch):
    # The logits made again (test_linearce_host.py: the log-softmax kept on the host, which
    # the CPU's profile may pick for this head).
    monkeypatch.setattr(linearce, "keeps_on_host", lambda *args: False)
    whole = _smallest(False, **options)
    smallest = _smallest(True, **options)
    assert smallest < whole
    if options:  # parameters on the device: the head's 128 KiB of logits were the floor
        assert smallest <= whole - 64 * 512 * 4 // 2
    compiled, peak, calls = _compile_and_train(smallest, True, **options)
    rep = memcompile.report(compiled)
    (plan,) = [f.plan for f in rep.fragments if f.plan is not None]
    assert plan.linear_ce and plan.linear_ce[0].endswith("blocks")
    assert peak <= smallest and rep.predicted_peak == peak
    assert "F0: loss head made by blocks (_log_softmax: " in str(rep)
    # Each op once a step: the backward reads the total weight the forward kept (it was made
    # again there, by the whole forward op again, when it came after the loss).
    assert calls == {"linear_ce_forward": 1, "linear_ce_backward": 1}
    # The plan's record survives its JSON round trip.
    text = MemoryPlan(budget=smallest, device_profile="cpu", fragments=(plan,)).to_json()
    assert MemoryPlan.from_json(text).fragments[0].linear_ce == plan.linear_ce
    assert FragmentPlan.from_dict(json.loads(json.dumps(dataclasses.asdict(plan)))) == plan


def test_a_budget_that_fits_without_blocks_does_not_pay_for_them():
    whole = _smallest(False, offload_params=False, swap=False)
    compiled, peak, calls = _compile_and_train(whole, True, offload_params=False, swap=False)
    (plan,) = [f.plan for f in memcompile.report(compiled).fragments if f.plan is not None]
    assert plan.linear_ce == () and not calls  # two more head matmuls a step, for nothing
    assert "made by blocks" not in str(memcompile.report(compiled))
    assert peak <= whole


def _zoo_floor(name: str, blocks: bool, **options) -> int:
    torch._dynamo.reset()
    wl = zoo.build(name, size="tiny")
    old = features.FEATURES
    features.FEATURES = old.replace(linear_ce_blocks=blocks, fast_no=False)
    try:
        compiled = memcompile.compile(wl.model, budget=1, on_infeasible="error", **options)
        with pytest.raises(memcompile.MemoryBudgetError) as info:
            compiled(*wl.batch(0)).backward()
    finally:
        features.FEATURES = old
    return info.value.min_feasible


def test_zoo_gpt_trains_bit_identically_at_a_floor_only_the_blocks_reach():
    # Recompute only: the tiny GPT's smallest plan drops by about a block of its 128 KiB head
    # (measured 1,297,288 -> 1,263,496 B on this VM); at that budget it trains as eager does.
    options = {"swap": False, "offload_params": False}
    whole, smallest = _zoo_floor("gpt", False, **options), _zoo_floor("gpt", True, **options)
    assert smallest < whole
    compiled, _wl, measured = train_under_budget("gpt", "adam", smallest, **options)
    rep = memcompile.report(compiled)
    (plan,) = [f.plan for f in rep.fragments if f.plan is not None]
    assert plan.linear_ce
    assert measured <= smallest and rep.predicted_peak == measured
