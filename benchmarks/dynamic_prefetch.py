"""Prefetch in training on the zoo MoE: hit rate, wasted bytes and stall time per predictor.

    OMP_NUM_THREADS=1 python benchmarks/dynamic_prefetch.py [--steps 40] [--size small]
        [--batch 1] [--seq-len 8] [--warmup 10] [--profile h100] [--out DIR]
        [--device cuda [--untimed]] [--kinds "off;markov;pilot;pilot, sync"]
        [--set d_model=1024 --set hidden=4096 ...]

Trains the zoo MoE (``moe_workload(size, batch=…, seq_len=…)``: the model's own router on the
zoo's structured topic stream; with few tokens per step some experts idle, so the block sequence
is not periodic) with every parameter on the host tier (``offload_params=True``) and Adam, once
per predictor, in one process:

* ``off``: fetch on demand (``pilot="off"``), the baseline;
* ``on_demand``: a predictor that never predicts (the ``pilot="markov"`` path otherwise): the
  same fetches as ``off``, counted, for its stall time;
* ``markov``: ``pilot="markov"``, the last-successor predictor;
* ``replay``: the block at the same position of the previous step's forward (injected as the
  prefetcher's predictor, the ``pilot="markov"`` path otherwise);
* ``pilot``: ``pilot="lightgbm"``, the online Pilot (LightGBM, Markov below its threshold),
  trained inline after ``--warmup`` steps and every 5 steps after (deterministic swap points).
* ``markov, tail`` and ``pilot, tail``: the same with the prediction at each fragment's tail
  (``features.pilot_in_graph`` off, as before the in-graph op): the same predictions and
  copies, issued after the graph instead of inside it.
* ``pilot, sync`` (``--device cuda`` only): the ``pilot`` run with the prefetches copied on the
  compute stream (``PrefetchCache(asynchronous=False)``): what the side stream buys.

``--device cuda`` trains on the GPU (parameters pinned on the host, runtime/pinned.py); steps
are timed with ``torch.cuda.synchronize`` and the report's **measured** GPU stall is added:
the compute stream's on-demand copies (misses) and its waits for late prefetches, read from
CUDA events (runtime/cache.py; ``--untimed``: no events, to see what timing costs the host).
``--set KEY=VALUE`` (repeatable) replaces one of the MoE's size settings (``moe_workload``:
``d_model``, ``hidden``, ``experts``, ``layers``, ...), e.g. larger experts, whose copies take
long enough on a GPU for the overlap to matter. ``--kinds`` runs a subset of the predictors
(``off`` first: the losses are compared with it). Results: ``dynamic_prefetch.{md,json}`` in
``--out`` (``dynamic_prefetch_cuda.*`` with ``--device cuda``).

Every run uses ``device_profile=--profile`` (``h100`` by default), which prices the in-graph
op's placement (rewrites/pilot_prefetch.py) and the **simulated stall** (``sim_stall_us``: a GPU
estimate from the profile, not a measurement; prefetch.py's module doc): the time a GPU's
compute stream would wait for the forward's parameter copies, split into waits for prefetched
copies issued too late to hide ("late") and on-demand copies of misses.

Figures come from ``memcompile.report(compiled).pilot``: accuracy (next block), k-ahead accuracy,
hit rate (prefetched bytes used / host-parameter bytes the forward fetched), wasted bytes, stall
(time the forward spent in on-demand fetches, **measured on this CPU**: what a GPU's compute
stream would wait for; on the CPU the prefetch copies are synchronous (inside the graphs), so
step time does not improve here) and the median step time, and the bytes prefetched / hit /
wasted per copy tag (``source@j``; ``@step``: the next step's first block, copied after the
optimizer step) with the 2-ahead predictions muted by the waste control (prefetch.py). Losses are
checked bit-identical to ``off``. Writes ``benchmarks/results/dynamic_prefetch.{md,json}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT))

from machine import describe_machine  # noqa: E402
from timing import timed_steps  # noqa: E402

import memcompile  # noqa: E402
from memcompile.dynamic import prefetch  # noqa: E402
from memcompile.dynamic.pilot import Prediction  # noqa: E402
from memcompile.pipeline import features  # noqa: E402
from memcompile.report import find_compiler  # noqa: E402
from memcompile.zoo.moe import moe_settings, moe_workload  # noqa: E402


class Never:
    """Predicts nothing: every fetch on demand, counted."""

    active = "none"

    def observe(self, block: str, fragment: str, sizes: Any = (), idioms: Any = None) -> None:
        pass

    def predict(self) -> Prediction:
        return Prediction((None, None), ("none", "none"), (math.nan, math.nan))

    def end_step(self) -> None:
        pass


class Replay:
    """Predicts the blocks that followed this position in the previous step's forward."""

    active = "replay"

    def __init__(self, horizon: int) -> None:
        self.horizon = horizon
        self.prev: list[str] = []
        self.cur: list[str] = []

    def observe(self, block: str, fragment: str, sizes: Any = (), idioms: Any = None) -> None:
        self.cur.append(block)

    def predict(self) -> Prediction:
        pos, prev = len(self.cur) - 1, self.prev
        blocks = tuple(
            prev[pos + j] if pos + j < len(prev) else None for j in range(1, self.horizon + 1)
        )
        return Prediction(blocks, ("replay",) * self.horizon, (math.nan,) * self.horizon)

    def end_step(self) -> None:
        self.prev, self.cur = self.cur, []


def run(kind: str, args: argparse.Namespace) -> tuple[dict[str, Any], list[float]]:
    # ", tail": the pilot predicts at the fragments' tails, not inside their graphs.
    with features.patch(pilot_in_graph=not kind.endswith(", tail")):
        return _run(kind, args)


def _run(kind: str, args: argparse.Namespace) -> tuple[dict[str, Any], list[float]]:
    torch._dynamo.reset()
    sizes = {"batch": args.batch, "seq_len": args.seq_len, **args.sizes}
    wl = moe_workload(args.size, 0, **sizes).to(args.device)
    base = kind.removesuffix(", tail").removesuffix(", sync")
    pilot = {"off": "off", "pilot": "lightgbm"}.get(base, "markov")
    # Eager kernels on every device: what is measured is the pilot's copies, beside the same
    # graphs fetching on demand (inner="auto" would pick Inductor on CUDA).
    compiled = memcompile.compile(
        wl.model, offload_params=True, pilot=pilot, device_profile=args.profile, inner="eager"
    )
    if kind in ("replay", "on_demand"):
        compiler = find_compiler(compiled)[0]
        assert compiler.prefetcher is not None
        compiler.prefetcher.predictor = Replay(2) if kind == "replay" else Never()
    prefetcher = find_compiler(compiled)[0].prefetcher
    if prefetcher is not None:
        prefetcher.cache.asynchronous = not kind.endswith(", sync")
        prefetcher.cache.time_gpu = not args.untimed
    opt = torch.optim.Adam(wl.model.parameters(), lr=1e-3)
    times, losses = timed_steps(wl, compiled, opt, args.steps, cuda=args.device == "cuda")
    rep = memcompile.report(compiled)
    row: dict[str, Any] = {"predictor": kind, "step_ms_p50": 1000 * statistics.median(times[2:])}
    if rep.pilot is not None:
        row.update(rep.pilot.to_dict())
        prefetcher = find_compiler(compiled)[0].prefetcher
        assert prefetcher is not None
        # Bytes per copy tag (source@blocks ahead; @step: after the optimizer step).
        row["by_tag"] = {
            tag: {"prefetched": c.prefetched, "hit": c.hit, "wasted": c.wasted}
            for tag, c in sorted(prefetcher.cache.by_tag.items())
        }
        row["muted_predictions"] = prefetcher.muted_predictions
        row["step_start_prefetches"] = prefetcher.step_start_prefetches
    return row, losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--size", default="small")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--profile", default="h100", help="device profile of the simulated stall")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--untimed", action="store_true", help="CUDA: no events timing the copies")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="replace one of the MoE's size settings (moe_workload), e.g. d_model=1024",
    )
    ap.add_argument(
        "--kinds",
        default=None,
        help="semicolon-separated predictors to run (default: all but 'pilot, sync'; 'off' first)",
    )
    args = ap.parse_args()
    known = ("off", "on_demand", "markov", "markov, tail", "replay", "pilot", "pilot, tail")
    kinds = known if args.kinds is None else tuple(k.strip() for k in args.kinds.split(";"))
    allowed = (*known, "pilot, sync") if args.device == "cuda" else known
    if not kinds or kinds[0] != "off" or any(k not in allowed for k in kinds):
        ap.error(f"--kinds: 'off' first, then any of {', '.join(allowed[1:])}; got {args.kinds!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device")
    args.sizes = {}
    for item in args.set:
        key, eq, value = item.partition("=")
        if not eq or not value.strip().lstrip("-").isdigit():
            ap.error(f"--set takes KEY=INTEGER; got {item!r}")
        args.sizes[key.strip()] = int(value)
    try:  # the workload's own checks (unknown keys, values < 1), before any run
        moe_settings(args.size, batch=args.batch, seq_len=args.seq_len, **args.sizes)
    except ValueError as e:
        ap.error(str(e))
    cuda = args.device == "cuda"
    prefetch.PILOT_KNOBS.update(warmup_steps=args.warmup, retrain_every=5, background=False, seed=0)
    rows, reference = [], None
    for kind in kinds:
        row, losses = run(kind, args)
        if reference is None:
            reference = losses
        row["bit_identical_losses"] = losses == reference
        rows.append(row)
        print(json.dumps(row), flush=True)

    def pct(x: Any) -> str:
        return "-" if x is None else f"{100 * x:.1f} %"

    def per_step(us: float | None) -> str:
        return "-" if us is None else f"{us / args.steps:.1f}"

    lines = [
        "# Prefetch in training: zoo MoE, parameters on the host",
        "",
        f"`OMP_NUM_THREADS=1 python benchmarks/dynamic_prefetch.py --steps {args.steps} "
        f"--size {args.size} --batch {args.batch} --seq-len {args.seq_len} "
        f"--warmup {args.warmup} --profile {args.profile}"
        + (f" --device {args.device}" if cuda else "")
        + (" --untimed" if args.untimed else "")
        + "".join(f" --set {item}" for item in args.set)
        + (f" --kinds {args.kinds!r}" if args.kinds is not None else "")
        + "`",
        "",
        f"{describe_machine()}; torch {torch.__version__}; "
        f"{datetime.date.today().isoformat()}. "
        + (
            "On the GPU: stall = host time in on-demand fetches (it only queues the copies); "
            "GPU stall = the compute stream's on-demand copies + its waits for late prefetches, "
            "measured with CUDA events (runtime/cache.py); step time synchronized."
            if cuda
            else "Stall: measured on this CPU (time in on-demand fetches of the forward); step "
            "time does not improve on the CPU (copies are synchronous)."
        ),
        "",
        "Wasted: copies freed unused, also as a share of the bytes prefetched. Muted: 2-ahead "
        "predictions not copied because their source wasted more than half its bytes over the "
        "last steps (prefetch.py, waste control).",
        "",
        f"Simulated stall: a **{args.profile} estimate** (device profile), not a measurement: "
        "the time a GPU's compute stream would wait for the forward's parameter copies, per "
        "step (mean over the run), and of it the waits for prefetched copies issued too late "
        "to hide (late; the rest is misses, copied on demand). `, tail`: the prediction at "
        "each fragment's tail, as before the in-graph op (`features.pilot_in_graph` off); the "
        "predictions and copies are the same, only where they are issued differs.",
        "",
        "| predictor | next-block acc. | 2-ahead acc. | hit rate | wasted | prefetched | "
        "stall (ms, total) | misses | muted | sim. stall / step (us) | of it late (us) | "
        "in-graph / tail predictions | predict p50 (us) | step p50 (ms) | losses = off |"
        + (" GPU stall / step (us) | of it late (us) |" if cuda else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
        + ("---|---|" if cuda else ""),
    ]
    for r in rows:
        if r["predictor"] == "off":
            lines.append(
                f"| off (fetch on demand) | - | - | 0 % | 0 | 0 | - | - | - | - | - | - | - | "
                f"{r['step_ms_p50']:.1f} | yes |" + (" - | - |" if cuda else "")
            )
            continue
        gpu = ""
        if cuda:
            miss, wait = r.get("gpu_miss_us"), r.get("gpu_wait_us")
            gpu = (
                " - | - |"
                if miss is None or wait is None
                else f" {per_step(miss + wait)} | {per_step(wait)} |"
            )
        p50 = "-" if r["predict_us_p50"] is None else f"{r['predict_us_p50']:.1f}"
        wasted = r["wasted_bytes"] / r["prefetched_bytes"] if r["prefetched_bytes"] else None
        lines.append(
            f"| {r['predictor']} ({r['active']}) | {pct(r['accuracy'])} | "
            f"{pct(r['k_ahead_accuracy'])} | {pct(r['hit_rate'])} | "
            f"{r['wasted_bytes'] / 1024:.0f} KiB ({pct(wasted)}) | "
            f"{r['prefetched_bytes'] / 1024:.0f} KiB | "
            f"{r['stall_us'] / 1000:.1f} | {r['misses']} | {r['muted_predictions']} | "
            f"{per_step(r['sim_stall_us'])} | {per_step(r['sim_late_us'])} | "
            f"{r['in_graph_predictions']} / {r['tail_predictions']} | {p50} | "
            f"{r['step_ms_p50']:.1f} | {'yes' if r['bit_identical_losses'] else 'NO'} |{gpu}"
        )
    lines += [
        "",
        "Bytes per copy tag (`source@j`: predicted j blocks ahead; a copy a later prediction "
        "keeps is counted under it; `@step`: copied after the optimizer step), KiB "
        "prefetched / hit / wasted:",
        "",
    ]
    for r in rows:
        if r.get("by_tag"):
            tags = ", ".join(
                f"{t} {c['prefetched'] // 1024}/{c['hit'] // 1024}/{c['wasted'] // 1024}"
                for t, c in r["by_tag"].items()
            )
            lines.append(f"* {r['predictor']}: {tags}")
    placed = next((r["placements"] for r in rows if r["predictor"] == "pilot"), [])
    if placed:
        lines += [
            "",
            f"Where each forward graph predicts (`pilot` run; times: {args.profile} estimate, "
            "example sizes; rewrites/pilot_prefetch.py):",
            "",
            "| fragment | before node | compute nodes before | observed | expected copy | "
            "copy (us) | graph (us) | overlap (us) | stall (us) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for p in placed:
            lines.append(
                f"| {p['fragment']} | `{p['before']}` | {p['position']} | "
                f"{', '.join(p['observed']) or '-'} | {p['copy_bytes'] // 1024} KiB in "
                f"{p['copy_tensors']} | {1e6 * p['copy_seconds']:.1f} | "
                f"{1e6 * p['graph_seconds']:.1f} | {1e6 * p['overlap_seconds']:.1f} | "
                f"{1e6 * p['stall_seconds']:.1f} |"
            )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "dynamic_prefetch_cuda" if cuda else "dynamic_prefetch"
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    (out / f"{stem}.json").write_text(json.dumps(rows, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
