"""Host time of each CUDA call on the pilot's prefetch path (runtime/cache.py), on a GPU.

    python benchmarks/cuda_prefetch_costs.py [--out DIR]

On a GPU machine the host issues every copy; in a step the host cannot keep ahead of (small
kernels, the eager inner compiler), the host time per copy is what the step pays. This times,
for a ~30 KiB pinned tensor (an expert weight of the zoo MoE, size ``small``), the median of
``time.perf_counter_ns`` around each call (2,000 calls after 50 warm-ups; 1,000 for the cache's
cycles), the GPU synchronized after each row:

* the single CUDA calls: event creation and ``record``, ``is_pinned``, a device allocation, a
  ``non_blocking`` copy, ``wait_stream``, entering ``torch.cuda.stream``, ``record_stream``,
  ``wait_event``, ``torch.cuda.current_stream``;
* the cache's own cycles, with and without the side stream (``asynchronous``) and the events
  that time the copies (``time_gpu``): a prefetch followed by its hit, and a miss (an
  on-demand copy on the compute stream).

Writes ``cuda_prefetch_costs.{md,json}`` in ``--out`` (``benchmarks/results`` by default).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from machine import write_results

from memcompile.runtime.cache import PrefetchCache

RESULTS = Path(__file__).parent / "results"


def _median_us(fn: Callable[[], object], reps: int) -> float:
    for _ in range(50):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) / 1e3


def measure() -> list[tuple[str, float]]:
    """(call, median host microseconds) per row."""
    dev = torch.device("cuda")
    h = torch.randn(96, 80).pin_memory()  # ~30 KiB
    plain = torch.randn(96, 80)
    side = torch.cuda.Stream()
    compute = torch.cuda.current_stream()
    ev = torch.cuda.Event(enable_timing=True)
    y = torch.empty_like(h, device=dev)

    def enter_side() -> None:
        with torch.cuda.stream(side):
            pass

    rows: list[tuple[str, Callable[[], object], int]] = [
        ("Event(enable_timing=True)", lambda: torch.cuda.Event(enable_timing=True), 2000),
        ("Event()", lambda: torch.cuda.Event(), 2000),
        ("event.record()", lambda: ev.record(), 2000),
        ("h.is_pinned() pinned", lambda: h.is_pinned(), 2000),
        ("h.is_pinned() pageable", lambda: plain.is_pinned(), 2000),
        (
            "empty_strided cuda",
            lambda: torch.empty_strided(h.shape, h.stride(), dtype=h.dtype, device=dev),
            2000,
        ),
        ("copy_ non_blocking (compute)", lambda: y.copy_(h, non_blocking=True), 2000),
        ("side.wait_stream(compute)", lambda: side.wait_stream(compute), 2000),
        ("with torch.cuda.stream(side)", enter_side, 2000),
        ("y.record_stream(side)", lambda: y.record_stream(side), 2000),
        ("compute.wait_event(ev)", lambda: compute.wait_event(ev), 2000),
        ("torch.cuda.current_stream(dev)", lambda: torch.cuda.current_stream(dev), 2000),
    ]
    out = [(name, _median_us(fn, reps)) for name, fn, reps in rows]
    for timed in (True, False):
        for asynchronous in (True, False):
            cache = PrefetchCache(asynchronous=asynchronous, time_gpu=timed)
            cache.watch([h])
            cache.counting = True

            def cycle(c: PrefetchCache = cache) -> None:
                c.prefetch(h, dev, "b", "t")
                c.fetch(h, lambda: None)

            def miss(c: PrefetchCache = cache) -> None:
                c.fetch(h, lambda: h.to(dev, non_blocking=True))

            name = f"prefetch+hit async={asynchronous} timed={timed}"
            out.append((name, _median_us(cycle, 1000)))
            cache.counters()
            out.append((f"miss timed={timed}", _median_us(miss, 1000)))
            cache.counters()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    rows = measure()
    for name, us in rows:
        print(f"{name:40s} {us:8.2f} us", flush=True)
    write_results(
        Path(args.out),
        "cuda_prefetch_costs",
        title="Host time per CUDA call on the pilot's prefetch path",
        argv=[],
        notes=[f"GPU: {torch.cuda.get_device_name()}", "median of perf_counter_ns per call"],
        table=["| call | host us |", "|---|---|", *(f"| {n} | {us:.2f} |" for n, us in rows)],
        rows=[{"call": n, "host_us": us} for n, us in rows],
    )


if __name__ == "__main__":
    main()
