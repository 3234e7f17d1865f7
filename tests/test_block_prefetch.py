"""A block's prefetch in one copy call (``PrefetchCache.prefetch_many``): one ``_foreach_copy_``
and one event or copy-thread job for the block, an allocation per tensor (each freed on its
own, so the plans' and the step's predictions hold), the same hits, waste and limits as one by
one."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memcompile
from memcompile import OffloadError, zoo
from memcompile.runtime import copy_engine
from memcompile.runtime.cache import PrefetchCache
from memcompile.runtime.store import place_on_host

from helpers import assert_same_state

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

CPU = torch.device("cpu")


def _block() -> list[nn.Parameter]:
    # Two dtypes and a transposed layout, on the host tier as the graphs fetch them.
    ps = [
        nn.Parameter(torch.randn(7, 5)),
        nn.Parameter(torch.randn(3)),
        nn.Parameter(torch.randn(6, 4).t()),
        nn.Parameter(torch.randn(9, dtype=torch.float64)),
    ]
    for p in ps:
        place_on_host(p)
    return ps


def _cache(ps: list[nn.Parameter], *, batched: bool = True) -> PrefetchCache:
    cache = PrefetchCache()
    cache.batched = batched
    cache.watch(ps)
    cache.counting = True
    return cache


def _counting(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    # Calls of the one-by-one prefetch and of the copy call, per kind.
    calls = {"prefetch": 0, "foreach": 0}
    real_prefetch, real_foreach = PrefetchCache.prefetch, torch._foreach_copy_

    def prefetch(self: PrefetchCache, *a: object, **k: object) -> int:
        calls["prefetch"] += 1
        return real_prefetch(self, *a, **k)  # type: ignore[arg-type]

    def foreach(*a: object, **k: object) -> None:
        calls["foreach"] += 1
        real_foreach(*a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(PrefetchCache, "prefetch", prefetch)
    monkeypatch.setattr(torch, "_foreach_copy_", foreach)
    return calls


def test_a_block_is_one_copy_call_into_an_allocation_per_tensor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ps = _block()
    cache = _cache(ps)
    calls = _counting(monkeypatch)
    nbytes = sum(p.nbytes for p in ps)
    assert cache.prefetch_many([*ps, ps[0]], CPU, "b", "t") == nbytes == cache.bytes
    assert calls == {"prefetch": 0, "foreach": 1}
    got = [cache.fetch(p, lambda: pytest.fail("a hit was expected")) for p in ps]
    assert all(
        torch.equal(g, p)
        and g.stride() == p.stride()
        and g.dtype == p.dtype
        and not g.requires_grad
        for g, p in zip(got, ps, strict=True)
    )
    assert len({g.untyped_storage().data_ptr() for g in got}) == len(ps)  # each its own
    c = cache.counters()
    assert c.hit == c.needed == nbytes and c.misses == 0 and cache.bytes == 0
    assert cache.by_tag["t"].prefetched == cache.by_tag["t"].hit == nbytes


def test_unbatched_the_block_is_copied_one_by_one(monkeypatch: pytest.MonkeyPatch) -> None:
    ps = _block()
    cache = _cache(ps, batched=False)
    calls = _counting(monkeypatch)
    cache.prefetch_many(ps, CPU, "b", "t")
    assert calls == {"prefetch": len(ps), "foreach": 0} and all(cache.has(p) for p in ps)


def test_a_block_over_the_limit_is_copied_as_far_as_it_fits() -> None:
    ps = _block()
    cache = _cache(ps)
    cache.prefetch(ps[1], CPU, "b", "t")  # cached already: neither copied nor counted again
    limit = ps[0].nbytes + ps[1].nbytes + ps[2].nbytes
    assert cache.prefetch_many(ps, CPU, "b", "t", limit=limit) == ps[0].nbytes + ps[2].nbytes
    assert [cache.has(p) for p in ps] == [True, True, True, False] and cache.bytes == limit


def test_a_copy_of_the_block_leaves_the_cache_on_its_own() -> None:
    ps = _block()
    cache = _cache(ps)
    cache.prefetch_many(ps, CPU, "b", "t")
    keep = {PrefetchCache.key(p) for p in ps[1:]}
    assert cache.evict(keep=keep) == ps[0].nbytes  # the others stay, and are served
    assert cache.bytes == sum(p.nbytes for p in ps[1:])
    # A stale copy: its parameter changed after the prefetch; its fetch copies afresh, the
    # block's other copies are still served.
    with torch.no_grad():
        ps[1].add_(1)
    fresh = cache.fetch(ps[1], lambda: ps[1].detach().clone())
    assert torch.equal(fresh, ps[1]) and cache.counters().stale == ps[1].nbytes
    assert torch.equal(cache.fetch(ps[2], lambda: pytest.fail("a hit was expected")), ps[2])


def test_a_block_on_the_copy_thread_is_one_job_that_its_hits_wait_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ps = _block()
    cache = _cache(ps)
    jobs: list[copy_engine.CopyJob] = []
    real = copy_engine.submit_many
    monkeypatch.setattr(copy_engine, "MIN_BYTES", 0)
    monkeypatch.setattr(
        copy_engine, "submit_many", lambda d, s: jobs.append(real(d, s)) or jobs[-1]
    )
    with copy_engine.using(True):
        cache.prefetch_many(ps, CPU, "b", "t")
        entries = [cache._entries[PrefetchCache.key(p)] for p in ps]
        assert len(jobs) == 1 and all(e.done is jobs[0] for e in entries)
        first = cache.fetch(ps[0], lambda: pytest.fail("a hit was expected"))
        # Waited for once: the block's other copies need no wait of their own.
        assert jobs[0].done and all(e.done is None for e in entries[1:])
        got = [first] + [cache.fetch(p, lambda: pytest.fail("a hit")) for p in ps[1:]]
    assert all(torch.equal(g, p) for g, p in zip(got, ps, strict=True))


def test_a_block_job_that_fails_raises_at_its_first_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    ps = _block()
    cache = _cache(ps)

    def broken(self: copy_engine.CopyJob) -> None:
        self._error = RuntimeError("simulated copy failure")
        self._dst = self._src = None
        self._done.set()

    monkeypatch.setattr(copy_engine, "MIN_BYTES", 0)
    monkeypatch.setattr(copy_engine.CopyJob, "_run", broken)
    with copy_engine.using(True):
        cache.prefetch_many(ps, CPU, "b", "t")
        with pytest.raises(OffloadError, match="the prefetch of b failed: simulated copy failure"):
            cache.fetch(ps[0], lambda: pytest.fail("a hit was expected"))


def test_moe_prefetches_blocks_in_one_call_and_trains_bit_identically(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sizes: list[int] = []
    real = PrefetchCache._prefetch_batch
    monkeypatch.setattr(
        PrefetchCache,
        "_prefetch_batch",
        lambda self, todo, *a: sizes.append(len(todo)) or real(self, todo, *a),
    )
    eager, comp = zoo.build("moe", size="tiny"), zoo.build("moe", size="tiny")
    expected = eager.train(eager.model, 6, optimizer="adam")
    compiled = memcompile.compile(comp.model, offload_params=True, pilot="markov")
    losses = comp.train(compiled, 6, optimizer="adam")
    assert all(torch.equal(a, b) for a, b in zip(expected, losses, strict=True))
    assert_same_state(eager.model, comp.model)
    assert sizes and max(sizes) >= 4  # an expert's four parameters at least
    p = memcompile.report(compiled).pilot
    assert p is not None and p.hit_bytes > 0
