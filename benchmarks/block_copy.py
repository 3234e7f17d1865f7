"""One copy call per block (issue 40, item 2): the pilot's prefetch of a block's host-placed
parameters in one ``_foreach_copy_`` with one event or job, against a copy per parameter.

    OMP_NUM_THREADS=1 python benchmarks/block_copy.py [--reps 3000] [--steps 40] [--rounds 2]
                                                      [--out DIR]
    python benchmarks/block_copy.py --device cuda     # on a GPU: the host cost only

Two measurements, the two ways side by side in one process (``PrefetchCache.batched``):

* **host cost per fetched block** (microbenchmark): two blocks of the zoo MoE (small), its first
  layer without the experts (9 parameters) and one expert (4), on the host tier, prefetched into
  the pilot's cache and taken by one fetch per parameter, as a forward's prefetch and reads do;
  and the same fetched on demand, as without the pilot. The time is the computing thread's: the
  prefetch call, the fetches (hits), and the on-demand fetches, median of ``--reps`` per way,
  the two ways alternating. With copies on the computing thread (the CPU's default) and on the
  copy thread (``MIN_BYTES = 0``: a block is one job in one call, a job per parameter one by
  one; the hits then include the waits).
* **training**: zoo MoE (small), 1 x 8 tokens (sparse routing), parameters on the host, Adam,
  ``pilot="lightgbm"`` with a block's copies in one call and one by one, and ``"off"``; step
  time median over the steps after 10 warm-up steps, ``--rounds`` rounds of the three runs (one
  compile each, the order reversed every other round), the median of the rounds' medians; the
  losses of every run are compared with the first's.

With ``--device cuda`` (``gpu_check.py``'s ``blocks`` stage) only the host cost is measured:
the parameters are pinned host tensors (``place_on_host`` of CUDA parameters), the prefetch
copies on the cache's side stream with its events (one per block in one call), a miss on the
compute stream; the GPU is synchronized after each repetition, outside the timed calls.

Writes ``block_copy.{md,json}`` (``block_copy_cuda.{md,json}`` with ``--device cuda``) in
``--out`` (``benchmarks/results`` by default).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT))

from machine import write_results  # noqa: E402
from timing import timed_steps  # noqa: E402

import memcompile  # noqa: E402
from memcompile.report import find_compiler  # noqa: E402
from memcompile.runtime import copy_engine  # noqa: E402
from memcompile.runtime.cache import PrefetchCache  # noqa: E402
from memcompile.runtime.store import TieredStore, place_on_host  # noqa: E402
from memcompile.zoo.moe import moe_workload  # noqa: E402

#: The two ways of copying a block: ``PrefetchCache.batched`` off and on.
WAYS = ("one by one", "one call")


#: The blocks measured: the zoo MoE (small)'s first layer without its experts (attention, norms
#: and router: one fragment call) and its first expert.
BLOCKS = {
    "attention": lambda name: name.startswith("blocks.0.") and ".experts." not in name,
    "expert": lambda name: name.startswith("blocks.0.experts.0."),
}


def _block(kind: str, device: str = "cpu") -> list[torch.Tensor]:
    """A copy of one block's parameters (:data:`BLOCKS`) made on ``device``, placed on the host
    tier (pinned for a CUDA device)."""
    model = moe_workload("small", 0).model
    take = BLOCKS[kind]
    ps = [
        torch.nn.Parameter(p.detach().clone().to(device))
        for name, p in model.named_parameters()
        if take(name)
    ]
    for p in ps:
        place_on_host(p)
    return ps


def micro(reps: int, kind: str, threaded: bool, device: str = "cpu") -> list[dict[str, Any]]:
    """Host microseconds per fetched block ``kind`` for each way, copies to ``device`` (see the
    module doc)."""
    cuda = device == "cuda"
    dev = torch.device(device)
    setups = {}
    for way in WAYS:
        ps = _block(kind, device)
        store, cache = TieredStore(), PrefetchCache()
        cache.batched = way == "one call"
        store.prefetched = cache
        cache.watch(ps)
        setups[way] = (ps, store, cache)
    times: dict[str, dict[str, list[int]]] = {
        k: {"prefetch": [], "hits": [], "on_demand": []} for k in WAYS
    }
    old = copy_engine.MIN_BYTES
    copy_engine.MIN_BYTES = 0
    try:
        with copy_engine.using(threaded):
            for i in range(reps + reps // 10):
                for way in WAYS:
                    ps, store, cache = setups[way]
                    cache.counting = True  # hits, as in a forward
                    a = time.perf_counter_ns()
                    cache.prefetch_many(ps, dev, "b", "t")
                    b = time.perf_counter_ns()
                    outs = [store.get(p, dev, "host") for p in ps]
                    c = time.perf_counter_ns()
                    del outs
                    cache.counting = False  # a miss copies at once, uncounted
                    d = time.perf_counter_ns()
                    outs = [store.get(p, dev, "host") for p in ps]
                    e = time.perf_counter_ns()
                    del outs
                    if cuda:  # the copies done before the next repetition, untimed
                        torch.cuda.synchronize()
                    if i >= reps // 10:  # warm-up left out
                        t = times[way]
                        t["prefetch"].append(b - a)
                        t["hits"].append(c - b)
                        t["on_demand"].append(e - d)
    finally:
        copy_engine.MIN_BYTES = old
    rows = []
    for way in WAYS:
        ps = setups[way][0]
        med = {k: statistics.median(v) / 1e3 for k, v in times[way].items()}
        rows.append(
            {
                "block": kind,
                "copies": "side stream"
                if cuda
                else ("copy thread" if threaded else "computing thread"),
                "way": way,
                "tensors": len(ps),
                "block_kib": sum(p.untyped_storage().nbytes() for p in ps) / 1024,
                "prefetch_us": med["prefetch"],
                "hits_us": med["hits"],
                "block_us": med["prefetch"] + med["hits"],
                "on_demand_us": med["on_demand"],
            }
        )
    return rows


def _train(pilot: str, batched: bool, steps: int) -> dict[str, Any]:
    torch._dynamo.reset()
    wl = moe_workload("small", 0, batch=1, seq_len=8)
    compiled = memcompile.compile(wl.model, offload_params=True, pilot=pilot, inner="eager")
    prefetcher = find_compiler(compiled)[0].prefetcher
    if prefetcher is not None:
        prefetcher.cache.batched = batched
    opt = torch.optim.Adam(wl.model.parameters(), lr=1e-3)
    times, losses = timed_steps(wl, compiled, opt, steps)
    p = memcompile.report(compiled).pilot
    return {
        "step_ms_p50": 1e3 * statistics.median(times[10:]),
        "hit_rate": None if p is None else p.hit_rate,
        "losses": losses,
    }


def training(steps: int, rounds: int) -> list[dict[str, Any]]:
    """Step times of the MoE with the pilot's block copies in one call and one by one, and
    without the pilot (see the module doc)."""
    runs: list[tuple[str, str, bool]] = [
        ("pilot, one call per block", "lightgbm", True),
        ("pilot, one by one", "lightgbm", False),
        ("off (fetch on demand)", "off", True),
    ]
    got: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in runs}
    for r in range(rounds):
        order = runs if r % 2 == 0 else runs[::-1]
        for label, pilot, batched in order:
            got[label].append(_train(pilot, batched, steps))
    base = got[runs[0][0]][0]["losses"]
    rows = []
    for label, pilot, batched in runs:
        results = got[label]
        rows.append(
            {
                "run": label,
                "pilot": pilot,
                "batched": batched,
                "step_ms_p50": statistics.median(x["step_ms_p50"] for x in results),
                "step_ms_rounds": [x["step_ms_p50"] for x in results],
                "hit_rate": results[-1]["hit_rate"],
                "same_losses": all(x["losses"] == base for x in results),
            }
        )
    return rows


def _table(micro_rows: list[dict[str, Any]], train_rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "## Host cost per fetched block",
        "",
        "Blocks of the zoo MoE (small): its first layer without the experts (attention, norms, "
        "router) and its first expert.",
        "",
        "Microseconds on the computing thread, median: the prefetch call, the fetches that take "
        "its copies (hits, waits included), their sum (the block with the pilot), and the same "
        "fetches on demand (no pilot). Copies on the CPU's computing thread are part of these "
        "figures; on a side stream (CUDA) or the copy thread, only issuing and waiting are.",
        "",
        "| block | copies | block's copies | prefetch (us) | hits (us) | "
        "block with the pilot (us) | on demand (us) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in micro_rows:
        lines.append(
            f"| {r['block']} ({r['tensors']} tensors, {r['block_kib']:.1f} KiB) | {r['copies']} | "
            f"{r['way']} | {r['prefetch_us']:.1f} | {r['hits_us']:.1f} | "
            f"{r['block_us']:.1f} | {r['on_demand_us']:.1f} |"
        )
    if not train_rows:
        return lines
    lines += [
        "",
        "## Zoo MoE (small), 1 x 8 tokens, parameters on the host, Adam",
        "",
        "| run | step p50 (ms) | per round | hit rate | losses = first run's |",
        "|---|---|---|---|---|",
    ]
    for r in train_rows:
        rounds = ", ".join(f"{x:.1f}" for x in r["step_ms_rounds"])
        hit = "-" if r["hit_rate"] is None else f"{100 * r['hit_rate']:.1f} %"
        lines.append(
            f"| {r['run']} | {r['step_ms_p50']:.1f} | {rounds} | {hit} | "
            f"{'yes' if r['same_losses'] else 'NO'} |"
        )
    return lines


def main(argv: list[str] | None = None, *, train: Callable[..., Any] = training) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3000, help="microbenchmark repetitions")
    ap.add_argument(
        "--steps", type=int, default=40, help="training steps per run (0: no training rows)"
    )
    ap.add_argument("--rounds", type=int, default=2, help="rounds of the three training runs")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    torch.set_num_threads(1)
    micro_rows = [
        r
        for kind in BLOCKS
        for threaded in ((False,) if cuda else (False, True))
        for r in micro(args.reps, kind, threaded=threaded, device=args.device)
    ]
    copy_engine.shutdown()
    train_rows = [] if cuda or args.steps == 0 else train(args.steps, args.rounds)
    note = (
        "CUDA device: host time of the calls, the copies on the cache's side stream; no training "
        "rows"
        if cuda
        else "CPU device; the copy thread uses the second core (`OMP_NUM_THREADS=1`: compute has "
        "one), as a GPU's copy engine is its own hardware"
    )
    return write_results(
        Path(args.out),
        "block_copy_cuda" if cuda else "block_copy",
        title="One copy call per block: the pilot's prefetch of a block, against a copy per tensor",
        argv=argv if argv is not None else sys.argv[1:],
        script="block_copy",
        notes=[note],
        table=_table(micro_rows, train_rows),
        rows=[
            *({"measure": "host_cost", **r} for r in micro_rows),
            *({"measure": "training", **r} for r in train_rows),
        ],
    )


if __name__ == "__main__":
    main()
