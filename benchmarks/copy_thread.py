"""The CPU's copy thread (runtime/copy_engine.py) against copying on the computing thread.

    OMP_NUM_THREADS=1 python benchmarks/copy_thread.py [--reps 9] [--steps 30] [--out DIR]

Two workloads, each in one process, the copy thread on and off alternating step by step on the
same compiled model (``copy_engine.using``; the thread is off by default), so load from other
jobs falls on both:

* **bench GPT, host tier**: zoo ``gpt`` (size ``bench``) under ``resident + 0.10 x`` eager's step
  peak (parameters and swapped activations in the host tier; ``anchors.py``'s ``mc_h10``), one
  forward and backward per step. Columns: the step time, and the computing thread's time per step
  in the store's ``put`` (offloads: synchronous either way), ``get`` (reloads: a swapped tensor's
  copy goes to the thread when at least ``MIN_BYTES``; a parameter's fetch copies at once) and
  ``wait`` (blocked until the thread's copy is done), with the bytes each moved.
* **zoo MoE (small), pilot**: parameters on the host, Adam, ``pilot="lightgbm"``; the pilot's
  prefetches (9 tensors of ~29 KiB a block) are under ``MIN_BYTES``, so the thread is forced
  (``MIN_BYTES = 0``) to show what it would cost them; plus ``pilot="off"``. Columns: step time
  (median of the steps after 10 warm-up steps), hit rate, stall (time the forwards spent in
  on-demand fetches and in waits for the thread's copies).

The thread uses the machine's second core (``OMP_NUM_THREADS=1``: compute has one), as a GPU's
copy engine is its own hardware. Writes ``copy_thread.{md,json}`` in ``--out``
(``benchmarks/results`` by default).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT))

from machine import write_results  # noqa: E402
from timing import timed_steps  # noqa: E402

import memcompile  # noqa: E402
from memcompile import zoo  # noqa: E402
from memcompile.runtime import copy_engine  # noqa: E402
from memcompile.runtime import store as store_module  # noqa: E402
from memcompile.runtime.measure import measure  # noqa: E402
from memcompile.zoo.moe import moe_workload  # noqa: E402

MODES = ("thread", "sync")


def _mode(mode: str) -> contextlib.AbstractContextManager[None]:
    return copy_engine.using(mode == "thread")


class StoreTimer:
    """Time (ns), calls and bytes of the store's put / get / wait on the computing thread."""

    def __init__(self) -> None:
        self.acc: dict[str, list[int]] = {k: [0, 0, 0] for k in ("put", "get", "wait")}

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        cls = store_module.TieredStore
        originals = {name: getattr(cls, attr) for name, attr in self._methods().items()}
        try:
            for name, attr in self._methods().items():
                setattr(cls, attr, self._wrap(name, originals[name]))
            yield
        finally:
            for name, attr in self._methods().items():
                setattr(cls, attr, originals[name])

    @staticmethod
    def _methods() -> dict[str, str]:
        return {"put": "put", "get": "_get", "wait": "wait"}

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        acc = self.acc[name]

        def timed(store: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter_ns()
            out = fn(store, x, *args, **kwargs)
            acc[0] += time.perf_counter_ns() - start
            acc[1] += 1
            acc[2] += x.numel() * x.element_size()
            return out

        return timed

    def take(self) -> dict[str, list[int]]:
        out = {k: list(v) for k, v in self.acc.items()}
        for v in self.acc.values():
            v[:] = [0, 0, 0]
        return out


def gpt_host(reps: int) -> dict[str, Any]:
    """The bench GPT at 0.10 with the host tier, the thread on and off step by step."""
    warnings.simplefilter("ignore")
    torch._dynamo.reset()
    torch.manual_seed(0)
    wl = zoo.build("gpt", size="bench")
    eager = copy.deepcopy(wl.model)

    def step(model: Any) -> None:
        wl.loss(model, 0).backward()
        for p in model.parameters():
            p.grad = None

    for _ in range(2):
        step(eager)
    m = measure(lambda: step(eager), resident=[eager])
    budget = int(m.resident_bytes + 0.10 * (m.peak - m.resident_bytes))
    compiled = memcompile.compile(wl.model, budget=budget)
    for _ in range(2):
        step(compiled)
    timer = StoreTimer()
    times: dict[str, list[float]] = {k: [] for k in MODES}
    store: dict[str, dict[str, list[int]]] = {k: {} for k in MODES}
    with timer.installed():
        for rep in range(reps):
            for mode in MODES if rep % 2 == 0 else MODES[::-1]:
                with _mode(mode):
                    start = time.perf_counter()
                    step(compiled)
                    times[mode].append(time.perf_counter() - start)
                for k, (ns, n, nbytes) in timer.take().items():
                    total = store[mode].setdefault(k, [0, 0, 0])
                    total[0] += ns
                    total[1] += n
                    total[2] += nbytes
    rows = []
    for mode in MODES:
        row: dict[str, Any] = {"mode": mode, "step_ms_p50": 1e3 * statistics.median(times[mode])}
        for k, (ns, n, nbytes) in store[mode].items():
            row[f"{k}_ms"] = ns / reps / 1e6
            row[f"{k}_calls"] = n // reps
            row[f"{k}_mib"] = nbytes / reps / 2**20
        rows.append(row)
    return {"budget": budget, "eager_peak": m.peak, "rows": rows}


def moe_pilot(steps: int) -> list[dict[str, Any]]:
    """The MoE with its parameters on the host: pilot with the thread forced, pilot on the
    computing thread, no pilot."""
    rows = []
    for label, pilot, forced in (
        ("pilot, thread (forced)", "lightgbm", True),
        ("pilot, sync", "lightgbm", False),
        ("off (fetch on demand)", "off", False),
    ):
        torch._dynamo.reset()
        wl = moe_workload("small", 0, batch=1, seq_len=8)
        compiled = memcompile.compile(
            wl.model, offload_params=True, pilot=pilot, device_profile="h100", inner="eager"
        )
        opt = torch.optim.Adam(wl.model.parameters(), lr=1e-3)
        old = copy_engine.MIN_BYTES
        copy_engine.MIN_BYTES = 0 if forced else old
        try:
            with _mode("thread" if forced else "sync"):
                times, losses = timed_steps(wl, compiled, opt, steps)
        finally:
            copy_engine.MIN_BYTES = old
        p = memcompile.report(compiled).pilot
        rows.append(
            {
                "run": label,
                "step_ms_p50": 1e3 * statistics.median(times[10:]),
                "hit_rate": None if p is None else p.hit_rate,
                "stall_ms": None if p is None else p.stall_us / 1e3,
                "losses": losses,
            }
        )
    return rows


def _table(gpt: dict[str, Any], moe: list[dict[str, Any]]) -> list[str]:
    lines = [
        f"## Bench GPT, host tier (budget {gpt['budget']:,} B: resident + 0.10 x eager's step "
        "peak), thread and sync alternating on one compiled model",
        "",
        "Per step on the computing thread: time in the store's put (offloads), get (reloads and "
        "parameter fetches) and wait (blocked on the thread's copy), with calls and MiB moved.",
        "",
        "| copies | step p50 (ms) | put ms (calls, MiB) | get ms (calls, MiB) | wait ms (calls) |",
        "|---|---|---|---|---|",
    ]
    for r in gpt["rows"]:
        lines.append(
            f"| {r['mode']} | {r['step_ms_p50']:.1f} | {r['put_ms']:.1f} ({r['put_calls']}, "
            f"{r['put_mib']:.1f}) | {r['get_ms']:.1f} ({r['get_calls']}, {r['get_mib']:.1f}) | "
            f"{r['wait_ms']:.2f} ({r['wait_calls']}) |"
        )
    lines += [
        "",
        "## Zoo MoE (small), parameters on the host, Adam: the pilot's prefetches",
        "",
        "| run | step p50 (ms) | hit rate | stall (ms, all steps) | losses = off |",
        "|---|---|---|---|---|",
    ]
    base = moe[-1]["losses"]
    for r in moe:
        hit = "-" if r["hit_rate"] is None else f"{100 * r['hit_rate']:.1f} %"
        stall = "-" if r["stall_ms"] is None else f"{r['stall_ms']:.1f}"
        same = "yes" if r["losses"] == base else "NO"
        lines.append(f"| {r['run']} | {r['step_ms_p50']:.1f} | {hit} | {stall} | {same} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=9, help="GPT steps per mode")
    ap.add_argument("--steps", type=int, default=30, help="MoE steps per run")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    gpt = gpt_host(args.reps)
    moe = moe_pilot(args.steps)
    write_results(
        Path(args.out),
        "copy_thread",
        title="The CPU's copy thread against copying on the computing thread",
        argv=argv if argv is not None else sys.argv[1:],
        notes=[
            "the copy thread uses the second core (`OMP_NUM_THREADS=1`: compute has one), as a "
            "GPU's copy engine is its own hardware"
        ],
        table=_table(gpt, moe),
        rows=[
            *({"workload": "gpt_host", "budget": gpt["budget"], **r} for r in gpt["rows"]),
            *({"workload": "moe_pilot", **r} for r in moe),
        ],
    )


if __name__ == "__main__":
    main()
