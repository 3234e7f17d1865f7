"""memcompile under DistributedDataParallel: peak, prediction and time beside eager DDP.

    OMP_NUM_THREADS=1 python benchmarks/ddp.py [--models mlp,gpt] [--budgets 0.6,0.3]
        [--steps 3] [--timed 4] [--out DIR]

Two CPU ranks over gloo (``torch.multiprocessing`` spawn), one process pair per row, each
model wrapped in ``DistributedDataParallel(bucket_cap_mb=1)``: Dynamo's DDP graph splitter
then compiles one piece per gradient bucket (``backends/fakes.py``). Rows:

* ``eager``: eager DDP;
* ``checkpoint``: eager DDP with ``torch.utils.checkpoint`` around every GPT block (GPT only);
* ``mc_none``: ``torch.compile(ddp, backend="memcompile")``, no budget;
* ``mc_rF``: a budget of ``F`` x eager's measured peak, parameters kept on the device;
* ``mc_hF``: the same budget with ``offload_params=True``.

Each rank trains the row's copy and an eager DDP copy side by side (Adam, ``--steps`` steps,
the same dropout masks), times ``--timed`` more steps of each (process CPU time, interleaved:
the ratio is paired), then measures one step of the row's copy with ``memcompile.measure_peak``
(CPU profiler; resident: the parameters and the batch. DDP's bucket buffers and Adam's state
are allocated before it and are not counted, as in every CPU benchmark here). Rank 0's figures
are reported; ``params = eager DDP`` compares every parameter after the last step, bit for bit.

Models: ``mlp`` (16 -> 512 -> 512 -> 512 -> 5, batch 64 per rank: three pieces) and the zoo
``gpt`` at size ``small`` (four pieces). Results go to ``benchmarks/results/ddp.{md,json}``
with the command, the machine and the date.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"
MODELS = ("mlp", "gpt")
WORLD = 2


class MLP(torch.nn.Module):
    """``forward(x, y)`` returns the cross-entropy loss of a 4-layer GELU MLP."""

    def __init__(self) -> None:
        super().__init__()
        widths = (16, 512, 512, 512, 5)
        self.layers = torch.nn.ModuleList(
            torch.nn.Linear(a, b) for a, b in itertools.pairwise(widths)
        )

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.nn.functional.gelu(x)
        return torch.nn.functional.cross_entropy(x, y)


def _build(model: str) -> tuple[torch.nn.Module, Any]:
    """The model (seeded) and its batch factory ``batch(step, rank)``."""
    torch.manual_seed(0)
    if model == "mlp":

        def batch(step: int, rank: int) -> tuple[torch.Tensor, ...]:
            g = torch.Generator().manual_seed(10 * step + rank)
            return torch.randn(64, 16, generator=g), torch.randint(0, 5, (64,), generator=g)

        return MLP(), batch
    from memcompile import zoo

    wl = zoo.build(model, size="small")
    return wl.model, lambda step, rank: wl.batch(WORLD * step + rank)


def _options(config: str, budget: int | None) -> dict[str, Any] | None:
    """memcompile's options for ``config`` (``None``: not a memcompile row)."""
    if not config.startswith("mc_"):
        return None
    if config == "mc_none":
        return {}
    return {
        "budget": budget,
        "offload_params": config.startswith("mc_h"),
        "on_infeasible": "best_effort",
    }


def _rank(rank: int, model_name: str, config: str, budget: int | None, args: Any) -> None:
    import torch.distributed as dist

    import memcompile

    store, steps, timed, out = args
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=300),
    )
    try:
        torch.set_num_threads(1)
        model, batch = _build(model_name)
        ref_model = copy.deepcopy(model)
        if config == "checkpoint":
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from anchors import _checkpoint_blocks

            _checkpoint_blocks(model, None)
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1)
        ref = torch.nn.parallel.DistributedDataParallel(ref_model, bucket_cap_mb=1)
        options = _options(config, budget)
        fn = ddp if options is None else torch.compile(ddp, backend="memcompile", options=options)
        opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)
        opt_ref = torch.optim.Adam(ref.parameters(), lr=1e-3)

        def step(f: Any, o: Any, k: int) -> float:
            o.zero_grad(set_to_none=True)
            torch.manual_seed(1000 + k)  # the same dropout masks for both copies
            start = time.process_time()
            f(*batch(k, rank)).backward()
            o.step()
            return time.process_time() - start

        ratios = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for k in range(steps + timed):
                mine, theirs = step(fn, opt, k), step(ref, opt_ref, k)
                if k >= steps:
                    ratios.append(mine / theirs)
            k = steps + timed
            b = batch(k, rank)
            opt.zero_grad(set_to_none=True)
            torch.manual_seed(1000 + k)
            peak = memcompile.measure_peak(lambda: fn(*b).backward(), resident=[model, b])
            opt.step()
            step(ref, opt_ref, k)
        row: dict[str, Any] = {
            "model": model_name,
            "config": config,
            "budget": budget,
            "measured": peak,
            "time_vs_eager_ddp": statistics.median(ratios) if ratios else None,
            "params_equal": all(
                torch.equal(a, c) for a, c in zip(model.parameters(), ref.parameters(), strict=True)
            ),
            "budget_warnings": sum(
                issubclass(w.category, memcompile.MemoryBudgetWarning) for w in caught
            ),
        }
        if options is not None:
            rep = memcompile.report(fn)
            row.update(
                predicted=rep.predicted_peak,
                pieces=len(rep.fragments),
                eager_frames=len(rep.fallbacks),
                host_param_bytes=rep.host_param_bytes,
            )
        Path(out, f"rank{rank}.json").write_text(json.dumps(row))
    finally:
        dist.destroy_process_group()
    # Skip DDP's destructors: the reducer's process group joins gloo's worker thread holding the
    # GIL, which that thread may still need (a PyTorch deadlock, pytorch/pytorch#56297).
    os._exit(0)


def run_row(model: str, config: str, budget: int | None, steps: int, timed: int) -> dict:
    """One row: two spawned ranks; rank 0's figures."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        args = (str(Path(tmp, "store")), steps, timed, tmp)
        mp.spawn(_rank, args=(model, config, budget, args), nprocs=WORLD)
        return json.loads(Path(tmp, "rank0.json").read_text())


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def _table(rows: list[dict[str, Any]]) -> list[str]:
    out = [
        "| model | config | budget MiB | measured MiB | predicted MiB | within budget | pieces "
        "| params on host MiB | CPU time vs eager DDP | params = eager DDP | budget warnings |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        budget = r["budget"]
        within = "-" if budget is None else ("yes" if r["measured"] <= budget else "**no**")
        ratio = r["time_vs_eager_ddp"]
        out.append(
            f"| {r['model']} | {r['config']} | {_mib(budget)} | {_mib(r['measured'])} "
            f"| {_mib(r.get('predicted'))} | {within} | {r.get('pieces', '-')} "
            f"| {_mib(r.get('host_param_bytes'))} | "
            f"{'-' if ratio is None else f'{ratio:.2f}x'} "
            f"| {'yes' if r['params_equal'] else '**no**'} | {r['budget_warnings']} |"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--budgets", default="0.6,0.3")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timed", type=int, default=4)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    if not models or set(models) - set(MODELS):
        parser.error(f"--models: choose from {', '.join(MODELS)}; got {args.models!r}")
    try:
        fractions = [float(f) for f in args.budgets.split(",") if f]
    except ValueError:
        parser.error(f"--budgets: fractions such as 0.6,0.3; got {args.budgets!r}")
    if not fractions or any(not 0 < f <= 1 for f in fractions):
        parser.error(f"--budgets: fractions in (0, 1]; got {args.budgets!r}")
    if args.steps < 1 or args.timed < 1:
        parser.error("--steps and --timed must be >= 1")
    if os.environ.get("OMP_NUM_THREADS") != "1":
        print("warning: set OMP_NUM_THREADS=1 (shared machines)", file=sys.stderr)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from machine import write_results

    rows = []
    for model in models:
        eager = run_row(model, "eager", None, args.steps, args.timed)
        configs: list[tuple[str, int | None]] = [("mc_none", None)]
        if model == "gpt":
            configs.insert(0, ("checkpoint", None))
        for f in fractions:
            budget = int(f * eager["measured"])
            configs += [(f"mc_r{round(f * 100)}", budget), (f"mc_h{round(f * 100)}", budget)]
        rows.append(eager)
        print(_table(rows[-1:])[-1], flush=True)
        for config, budget in configs:
            rows.append(run_row(model, config, budget, args.steps, args.timed))
            print(_table(rows[-1:])[-1], flush=True)
    write_results(
        args.out,
        "ddp",
        title="memcompile under DistributedDataParallel (2 CPU ranks, gloo)",
        argv=argv if argv is not None else sys.argv[1:],
        notes=[
            "rows: one spawned pair of ranks each; rank 0's figures; `DistributedDataParallel("
            "bucket_cap_mb=1)`, so Dynamo's DDP graph splitter compiles one piece per bucket",
            "measured: CPU profiler (`memcompile.measure_peak`), absolute: the parameters and the "
            "batch plus the step's peak above them (DDP's bucket buffers and Adam's state are "
            "allocated before and not counted); budgets: a fraction of eager DDP's measured peak",
            f"time: median over {args.timed} steps of the row's copy's process CPU time over an "
            "eager DDP copy's, interleaved in the same process (Adam steps included)",
            "`mc_rF`: budget F, parameters on the device; `mc_hF`: the same budget with "
            "`offload_params=True`",
        ],
        table=_table(rows),
        rows=rows,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
