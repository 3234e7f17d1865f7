"""The pilot in training on the natural models, with and without the numbers their Python reads.

    OMP_NUM_THREADS=1 python benchmarks/natural_pilot.py [--size small] [--steps 40] [--out DIR]

Each natural model (``moe_natural``, ``moe_natural_top2``, ``early_exit_natural``) is trained
for ``--steps`` Adam steps under ``memcompile.compile(pilot="lightgbm", offload_params=True)``
(its parameters in the host tier, fetched or prefetched per block), in a process of its own per
row, twice: with the reads (``int(probs.argmax())``, ``conf.item()``: runtime/scalar_reads.py)
shown to the pilot, and with ``MemCompiler._wants_reads`` switched off (the pilot as before).
The figures are ``report().pilot``'s, over every step: next-block accuracy, prefetch hit rate
(bytes fetched from the cache over bytes needed), bytes prefetched and wasted (copied, never
used), predictions made again after a read. The pilot trains on a background thread, so where
its models swap in may move a prediction or two between runs. Writes
``benchmarks/results/natural_pilot.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT))

from machine import write_results  # noqa: E402

MODELS = ("moe_natural", "moe_natural_top2", "early_exit_natural")


def run_one(name: str, size: str, steps: int, reads: bool) -> dict[str, Any]:
    """Train ``name`` in this process and return its pilot's figures."""
    import warnings

    import torch

    import memcompile
    from memcompile import zoo
    from memcompile.backends.compiler import MemCompiler

    torch.set_num_threads(1)
    if not reads:
        MemCompiler._wants_reads = lambda self: False  # type: ignore[method-assign]
    wl = zoo.build(name, size=size)
    compiled = memcompile.compile(wl.model, pilot="lightgbm", offload_params=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the eager frame's fallback warning: expected here
        wl.train(compiled, steps, optimizer="adam")
    p = memcompile.report(compiled).pilot
    assert p is not None
    return {
        "model": name,
        "reads": reads,
        "accuracy": p.accuracy,
        "hit_rate": p.hit_rate,
        "prefetched_bytes": p.prefetched_bytes,
        "wasted_bytes": p.wasted_bytes,
        "read_predictions": p.read_predictions,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="small")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--one", nargs=2, metavar=("MODEL", "READS"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.steps < 2:
        ap.error(f"--steps must be at least 2; got {args.steps}")
    if args.one:  # a child: one row, as JSON on stdout
        print(json.dumps(run_one(args.one[0], args.size, args.steps, args.one[1] == "1")))
        return 0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    rows = []
    for name in MODELS:
        for reads in (True, False):
            cmd = [sys.executable, __file__, "--size", args.size, "--steps", str(args.steps)]
            out = subprocess.run(
                [*cmd, "--one", name, "1" if reads else "0"],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"progress {len(rows)}/{2 * len(MODELS)} {name} reads={reads}", flush=True)
    mb = 1e6
    table = [
        "| model | reads | accuracy | hit rate | prefetched MB | wasted MB | read predictions |",
        "|---|---|---|---|---|---|---|",
        *(
            f"| {r['model']} | {'on' if r['reads'] else 'off'} | {r['accuracy']:.3f} | "
            f"{r['hit_rate']:.3f} | {r['prefetched_bytes'] / mb:.1f} | "
            f"{r['wasted_bytes'] / mb:.1f} | {r['read_predictions']} |"
            for r in rows
        ),
    ]
    path = write_results(
        args.out,
        "natural_pilot",
        title="The pilot in training on the natural models, with and without reads",
        argv=argv if argv is not None else sys.argv[1:],
        notes=[
            f"{args.size}, {args.steps} Adam steps, pilot='lightgbm', offload_params=True; "
            "each row its own process; figures over every step (report().pilot)",
            "reads off: MemCompiler._wants_reads switched off (the pilot before reads)",
        ],
        table=table,
        rows=rows,
    )
    print(path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
