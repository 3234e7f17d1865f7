"""The loss head by blocks with its log-softmax kept on the host (``runtime/linearce.py``'s
``linear_ce_forward_host`` / ``linear_ce_backward_host``): aten's loss and gradients bit for
bit, the log-softmax in host-tier memory and never written, the choice made by the cost model
(a CPU keeps it there, a GPU makes the logits again), the analyses counting it off the device,
and training under a budget bit-identical and measured as predicted."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_linearce import CTX, _compile_and_train, _head_inputs, _smallest, _whole
from torch.utils.flop_counter import FlopCounterMode

import memcompile
import memcompile.rewrites.linearce as linearce
import memcompile.runtime.linearce as kernels
from memcompile import zoo
from memcompile.analysis.costmodel import device_profile
from memcompile.analysis.graph import StorageIds, is_host_value, profile_graph
from memcompile.analysis.workspace import probe_workspaces
from memcompile.runtime.store import is_host_placed

from helpers import capture_module

mc = torch.ops.memcompile
aten = torch.ops.aten


def _host_grads(h, wt, b, target, reduction, ignore_index, go, chunks, mask):
    loss, tw, saved = mc.linear_ce_forward_host(h, wt, b, target, reduction, ignore_index, chunks)
    grads = mc.linear_ce_backward_host(
        go, h, wt, target, reduction, ignore_index, tw, saved, chunks, mask
    )
    return loss, tw, saved, grads


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("reduction", [1, 2])  # mean, sum
@pytest.mark.parametrize("ignore_index", [-100, 7])
def test_host_kernels_equal_aten_bit_for_bit(bias, reduction, ignore_index):
    h, wt, b, target = _head_inputs(bias=bias, ignore_index=ignore_index)
    go = torch.tensor(0.7)
    whole = _whole(h, wt, b, target, reduction, ignore_index, go)
    mask = (True, True, bias)
    chunks = linearce.exact_chunks(h, wt, b, target, reduction, ignore_index, mask, host=True)
    assert chunks is not None and chunks >= 2
    for n in (1, chunks):
        loss, tw, _saved, grads = _host_grads(
            h, wt, b, target, reduction, ignore_index, go, n, mask
        )
        assert torch.equal(loss, whole[0]) and torch.equal(tw, whole[1])
        assert torch.equal(grads[0], whole[2]) and torch.equal(grads[1], whole[3])
        if bias:
            assert torch.equal(grads[2], whole[4])
        else:
            assert grads[2].numel() == 0


@pytest.mark.parametrize("mask", [(False, True, True), (True, False, False), (False, False, True)])
def test_host_kernels_make_only_the_gradients_asked_for(mask):
    h, wt, b, target = _head_inputs(rows=64, features=32, classes=512)
    go = torch.tensor(0.7)
    whole = _whole(h, wt, b, target, 1, -100, go)[2:]
    *_, grads = _host_grads(h, wt, b, target, 1, -100, go, 2, mask)
    for wanted, got, ref in zip(mask, grads, whole, strict=True):
        assert torch.equal(got, ref) if wanted else got.numel() == 0


def test_the_log_softmax_is_host_memory_the_backward_only_reads():
    h, wt, b, target = _head_inputs(rows=256, features=32, classes=1024)
    go = torch.tensor(1.0)
    mask = (True, True, True)
    _loss, tw, saved, first = _host_grads(h, wt, b, target, 1, -100, go, 4, mask)
    assert is_host_placed(saved)
    assert torch.equal(saved, aten._log_softmax(aten.addmm(b, h, wt), 1, False))
    before = saved.clone()
    # A second backward (retain_graph) reads the same values: the first wrote nowhere in them.
    again = mc.linear_ce_backward_host(go, h, wt, target, 1, -100, tw, saved, 4, mask)
    assert torch.equal(saved, before)
    assert all(torch.equal(a, c) for a, c in zip(first, again, strict=True))
    # The profiler does not see it: the forward's device peak is a block of logits, not 1 MiB.
    m = memcompile.measure(
        lambda: mc.linear_ce_forward_host(h, wt, b, target, 1, -100, 4), device="cpu"
    )
    assert m.peak - m.resident_bytes < 256 * 1024 * 4 // 2


def test_host_ops_refuse_a_device_other_than_the_cpu():
    h, wt, b, target = _head_inputs(rows=8, features=4, classes=16)
    meta = [t.to("meta") for t in (h, wt, b, target)]
    with pytest.raises(NotImplementedError, match="CPU tensors only; got meta"):
        kernels.forward_host_impl(*meta, 1, -100, 2)


def test_the_cost_model_keeps_the_log_softmax_on_the_host_where_copies_cost_less():
    gpt = (torch.empty(2048, 256), torch.empty(256, 2048))  # the bench GPT's head
    slim = (torch.empty(2048, 8), torch.empty(8, 2048))  # 8 features: matmuls cost less
    cpu_like = dataclasses.replace(
        device_profile("h100"),
        flops={"float32": 1.7e11},
        memory_bandwidth=2.7e10,
        host_bandwidth=1.25e10,
    )
    assert linearce.keeps_on_host(*gpt, cpu_like)
    assert not linearce.keeps_on_host(*slim, cpu_like)
    # On an H100 the two matmuls cost 0.1 ms, the three copies over PCIe 1.0 ms.
    assert not linearce.keeps_on_host(*gpt, device_profile("h100"))
    # The host variant's kernels are the CPU's only.
    assert not linearce.keeps_on_host(*(t.to("meta") for t in gpt), cpu_like)


def _forced(monkeypatch):
    monkeypatch.setattr(linearce, "keeps_on_host", lambda *args: True)


def test_pass_keeps_the_zoo_gpts_log_softmax_on_the_host(monkeypatch):
    _forced(monkeypatch)
    wl = zoo.build("gpt", size="tiny")
    joint = capture_module(wl.model, *wl.batch(0))["joint"]
    (head,) = linearce.find_linear_ce(joint, CTX, host_profile=device_profile("cpu"))
    assert head.host and head.describe().endswith(" blocks, log-softmax on the host")
    out = linearce.linear_ce_pass(joint, CTX, decided=(head,))
    targets = [n.target for n in out.graph.nodes if n.op == "call_function"]
    assert targets.count(mc.linear_ce_forward_host.default) == 1
    assert targets.count(mc.linear_ce_backward_host.default) == 1
    assert mc.linear_ce_forward.default not in targets
    (saved,) = [n for n in out.graph.nodes if n.name.endswith("_saved")]
    assert is_host_value(saved) and [u.target for u in saved.users] == [
        mc.linear_ce_backward_host.default
    ]
    rows, classes = saved.meta["val"].shape
    # The analysis holds it off the device, as a swapped-out copy: never a tracked storage.
    ids = StorageIds()
    inputs = range(len(out.graph.find_nodes(op="placeholder")))
    prof = profile_graph(out, kind="inference", persistent_inputs=inputs, ids=ids)
    sid = ids.id_of(saved.meta["val"])
    assert sid in prof.persistent and prof.storage_bytes([sid]) == 0
    # Its scratch is measured (a block of rows), not taken as the N x V result it returns.
    (fwd,) = [n for n in out.graph.nodes if n.target is mc.linear_ce_forward_host.default]
    workspace = probe_workspaces(out)
    assert workspace is not None and 0 < workspace[fwd.name] < rows * classes * 4


def test_a_budget_only_the_blocks_fit_keeps_the_log_softmax_on_the_host(monkeypatch):
    _forced(monkeypatch)
    whole = _smallest(False)
    smallest = _smallest(True)
    assert smallest < whole
    compiled, peak, calls = _compile_and_train(smallest, True)  # bit-identical, asserted
    rep = memcompile.report(compiled)
    (plan,) = [f.plan for f in rep.fragments if f.plan is not None]
    assert plan.linear_ce and plan.linear_ce[0].endswith("log-softmax on the host")
    assert peak <= smallest and rep.predicted_peak == peak
    assert calls == {"linear_ce_forward_host": 1, "linear_ce_backward_host": 1}
    line = "blocks, log-softmax on the host), its log-softmax copied to the host and back"
    assert line in str(rep)


def test_a_head_the_host_blocks_do_not_match_makes_its_logits_again(monkeypatch):
    _forced(monkeypatch)
    real = kernels.backward_host_impl

    def off_by_one_ulp(*args):
        gh, gw, gb = real(*args)
        return gh, torch.nextafter(gw, torch.full_like(gw, float("inf"))), gb

    monkeypatch.setattr(kernels, "backward_host_impl", off_by_one_ulp)
    monkeypatch.setattr(linearce, "_exact_cache", {})
    wl = zoo.build("gpt", size="tiny")
    joint = capture_module(wl.model, *wl.batch(0))["joint"]
    (head,) = linearce.find_linear_ce(joint, CTX, host_profile=device_profile("cpu"))
    assert not head.host and head.chunks in linearce.CHUNKS


def test_flop_counts_price_the_matmuls_each_variant_runs():
    h, wt, b, target = _head_inputs(rows=64, features=32, classes=128)
    go, head = torch.tensor(1.0), 2 * 64 * 32 * 128
    mask = [True, True, True]
    with FlopCounterMode(display=False) as made_again:
        _, tw, row_max, row_logsum = mc.linear_ce_forward(h, wt, b, target, 1, -100, 2)
        mc.linear_ce_backward(go, h, wt, b, target, 1, -100, tw, row_max, row_logsum, 2, mask)
    with FlopCounterMode(display=False) as on_host:
        _host_grads(h, wt, b, target, 1, -100, go, 2, mask)
    # The forward one matmul; the backward two, and two more where it makes the logits again.
    assert made_again.get_total_flops() == 5 * head
    assert on_host.get_total_flops() == 3 * head
