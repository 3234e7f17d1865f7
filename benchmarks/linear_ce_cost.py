"""Time and memory of a loss head made by blocks (runtime/linearce.py) against the whole head.

    python benchmarks/linear_ce_cost.py [--reps N] [--device cpu|cuda] [--out DIR]

For each head size (rows ``N``, features ``d``, classes ``V``; the bench GPT's head first), this
runs a forward and backward of ``cross_entropy(h @ W.t() + b, target)`` as AOT's graph has it
(aten's ops: the logits, their log-softmax, the NLL, then the three gradients) and as the two ops
of ``rewrites/linearce.py`` with the block count its probe picks (on a CPU also the two that keep
the log-softmax in host-tier memory instead of making the logits again), on values like a trained
head's
(weights ~N(0, 0.05²): random logits of a wide spread make the softmax's gradient denormal, which
slows every matmul that reads it ~10x on a CPU). It reports the median time of ``--reps`` runs
after two warm-ups, and the peak memory each holds above its inputs (the CPU profiler, or CUDA's
peak statistics), with whether both gave the same bits.

Writes ``linear_ce_cost.{md,json}`` in ``--out`` (``benchmarks/results`` by default).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from machine import write_results

import memcompile
import memcompile.runtime.linearce as kernels
from memcompile.rewrites.linearce import exact_chunks

RESULTS = Path(__file__).parent / "results"
VARIANTS = {"blocks": "by blocks, logits made again", "host": "by blocks, log-softmax on the host"}
#: (rows, features, classes): the bench GPT's head (8 x 256 tokens, d 256, 2048 classes), then
#: a small language model's (2048 tokens, d 512, 32,000 classes).
SIZES = ((2048, 256, 2048), (2048, 512, 32000))


def _whole(h, wt, b, target, go):
    loss, _, grads = kernels.run_whole(go, h, wt, b, target, 1, -100)
    return loss, *grads


def _blocks(h, wt, b, target, go, chunks, host=False):
    loss, _, grads = kernels.run_blocks(
        go, h, wt, b, target, 1, -100, chunks, (True, True, True), host=host
    )
    return loss, *grads


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time_ms(fn: Callable[[], object], reps: int, device: torch.device) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def measure(sizes: tuple[tuple[int, int, int], ...], reps: int, device: str) -> list[dict]:
    """One row per head size: times, peaks and the block count."""
    dev = torch.device(device)
    rows = []
    for n, d, v in sizes:
        g = torch.Generator().manual_seed(0)
        h = torch.randn(n, d, generator=g).to(dev)
        w = (torch.randn(v, d, generator=g) * 0.05).to(dev)
        b = (torch.randn(v, generator=g) * 0.01).to(dev)
        target = torch.randint(0, v, (n,), generator=g).to(dev)
        target[::9] = -100
        go = torch.tensor(1.0, device=dev)
        wt = w.t()
        chunks = exact_chunks(h, wt, b, target, 1, -100, (True, True, True))
        row: dict[str, Any] = {"rows": n, "features": d, "classes": v, "chunks": chunks}
        runs: dict[str, Callable[[], object]] = {
            "whole": functools.partial(_whole, h, wt, b, target, go)
        }
        if chunks is not None:
            runs["blocks"] = functools.partial(_blocks, h, wt, b, target, go, chunks)
        host = (
            exact_chunks(h, wt, b, target, 1, -100, (True, True, True), host=True)
            if dev.type == "cpu"
            else None
        )
        row["host_chunks"] = host
        if host is not None:
            runs["host"] = functools.partial(_blocks, h, wt, b, target, go, host, host=True)
        results = {}
        for name, fn in runs.items():
            row[f"{name}_ms"] = _time_ms(fn, reps, dev)
            m = memcompile.measure(fn, device=dev)
            row[f"{name}_peak"] = m.peak - m.resident_bytes  # above the inputs
            results[name] = fn()
        for name in ("blocks", "host"):
            if name in results:
                row[f"{name}_same_bits"] = all(
                    torch.equal(a, c) for a, c in zip(results["whole"], results[name], strict=True)
                )
        rows.append(row)
        print(row, flush=True)
    return rows


def _mib(x: float | None) -> str:
    return "-" if x is None else f"{x / 2**20:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    if args.reps < 1:
        ap.error(f"--reps must be >= 1; got {args.reps}")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device")
    torch.set_num_threads(1)
    rows = measure(SIZES, args.reps, args.device)
    table = [
        "| N x d x V | variant | blocks | ms | time x | peak MiB | same bits |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        size = f"{r['rows']} x {r['features']} x {r['classes']}"
        table.append(
            f"| {size} | whole | - | {r['whole_ms']:.1f} | 1.00x | {_mib(r['whole_peak'])} | - |"
        )
        for name, chunks in (("blocks", r["chunks"]), ("host", r["host_chunks"])):
            if f"{name}_ms" not in r:
                continue
            table.append(
                f"| {size} | {VARIANTS[name]} | {chunks} | {r[f'{name}_ms']:.1f} | "
                f"{r[f'{name}_ms'] / r['whole_ms']:.2f}x | {_mib(r[f'{name}_peak'])} | "
                f"{r[f'{name}_same_bits']} |"
            )
    argv = [f"--reps {args.reps}"] + ([f"--device {args.device}"] if args.device != "cpu" else [])
    if args.out != str(RESULTS):
        argv.append(f"--out {args.out}")
    write_results(
        Path(args.out),
        "linear_ce_cost",
        title="A loss head made by blocks against the whole head (forward and backward)",
        argv=argv,
        notes=[
            f"device: {args.device}, 1 thread; median of {args.reps} runs after 2 warm-ups",
            "peak: memory held above the inputs during one forward and backward (outputs included)",
            "blocks: the count the probe found bitwise equal (rewrites/linearce.exact_chunks); "
            "none listed: no count was",
            "logits made again: linear_ce_forward/backward (two more matmuls of the head's "
            "size); log-softmax on the host: linear_ce_forward_host/backward_host (three N x V "
            "copies to and from host-tier memory, which the peak does not count: CPU only)",
        ],
        table=table,
        rows=rows,
    )


if __name__ == "__main__":
    main()
