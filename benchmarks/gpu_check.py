"""The prepared GPU check: one command for a lent GPU, about 8 minutes, results in one folder.

    python benchmarks/gpu_check.py --out "$OUT"                      # on the lent GPU
    OMP_NUM_THREADS=1 python benchmarks/gpu_check.py --dry-run --out /tmp/gpu_check   # CPU, ~1 min

Run it through the device tool first thing in a session that is lent a GPU (``timeout_s`` 540
leaves room to rerun), then copy what comes back into ``benchmarks/results/gpu/`` and commit it:

    run(command="PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py --out $OUT", timeout_s=540)

With LightGBM's wheel in ``.whl`` (see the end of this docstring), name ``.whl`` in ``carry`` and
start the command with ``python3 -m pip install -q --no-index --no-deps --no-compile
--no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site;``. The first run
(H200, 2026-11-30: ``benchmarks/results/gpu/``) took 138 s for the tests, 12 s for the block
copies, 251 s for the anchors and 58 s for the MoE.

Four stages, in order of priority, each in its own process group under a deadline (its own
limit, and never past the whole check's ``--budget-s``), so one that hangs or runs long loses
only itself and what it measured so far is kept:

1. ``tests``: ``pytest tests/test_cuda.py`` (log: ``test_cuda.log``).
2. ``blocks``: ``block_copy.py --device cuda``: the host time of the pilot's prefetch of a
   block in one copy call against one by one (issue 40, item 2), ``block_copy_cuda.md``.
3. ``anchors``: ``cuda_anchors.py --size large`` (a GPT with 6 layers, d 1024, T 1024, B 8: a
   step takes >= 50 ms on an H100) with the configurations issue 42 compares: eager, per-block
   checkpointing, Inductor (plain and with ``activation_memory_budget`` 0.5 / 0.1), and memcompile
   with each inner compiler (``mc_`` eager kernels, ``mci_`` Inductor) at 0.5 / 0.25 of eager's
   step peak, with the host tier at 0.1, without a budget, and with Inductor's own measured peaks
   as budgets (``mci_amb50``, ``mci_amb10``), and last ``inner="auto"`` at 0.25 (``mca_r25``:
   eager kernels where no plan of Inductor's fits). Rows arrive one by one (JSON lines) and the most
   telling come first, so a deadline cuts the least telling.
4. ``moe``: ``dynamic_prefetch.py --device cuda`` on the pilot's MoE (parameters on the host;
   fetching on demand against the pilot's prefetches).

Written to ``--out``: ``gpu_check.md`` (machine, torch, date, commit; each stage's outcome and
time; the anchors table; the targets checked), ``gpu_check.json`` (everything), ``test_cuda.log``,
``stages.log`` (the stages' stderr), ``block_copy_cuda.{md,json}``,
``dynamic_prefetch_cuda.{md,json}``: eight files, the device tool's limit (a dry run keeps the
blocks stage's files in a temporary folder). CUDA peak = ``torch.cuda.max_memory_allocated``.

``--dry-run`` runs the same stages on the CPU at tiny sizes, without the Inductor rows (a first
Inductor compile takes ~45 s here): it checks the plumbing, and its numbers mean nothing. The
device machine has its own torch (2.11 with CUDA) and, as far as its package list says, no
LightGBM: the stages run memcompile from this checkout (``PYTHONPATH``), and without LightGBM the
MoE stage runs the Markov predictor instead of the pilot (``markov`` for ``pilot``; the report says
which). To run the pilot there, carry LightGBM's wheel as the device tool's README describes
(``.whl``, named in ``carry``, installed to ``/tmp/site`` before the command).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results" / "gpu"
# The report imports cuda_anchors, which imports memcompile: on the device machine memcompile is
# this checkout, not an installed package (the stages get it through PYTHONPATH).
sys.path[:0] = [p for p in (str(ROOT), str(HERE)) if p not in sys.path]

#: The anchors' configurations, most telling first (see the module docstring).
ANCHOR_CONFIGS = (
    "eager",
    "inductor",
    "inductor_amb50",
    "mci_amb50",
    "inductor_amb10",
    "mci_amb10",
    "mc_r25",
    "mci_r25",
    "mci_none",
    "mc_h10",
    "mci_h10",
    "checkpoint",
    "mc_r50",
    "mci_r50",
    "mca_r25",
)
#: The same without Inductor, for the dry run.
DRY_ANCHOR_CONFIGS = ("eager", "mc_r25", "mc_h10", "checkpoint", "mc_r50")
#: Per-stage limits in seconds (the whole check's budget caps each further).
LIMITS = {"tests": 200.0, "blocks": 45.0, "anchors": 300.0, "moe": 90.0}


def _stage_commands(args: argparse.Namespace, tmp: Path) -> dict[str, list[str]]:
    py = sys.executable
    configs = args.configs or ",".join(DRY_ANCHOR_CONFIGS if args.dry_run else ANCHOR_CONFIGS)
    device = "cpu" if args.dry_run else "cuda"
    return {
        "tests": [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_cuda.py"],
        "blocks": [
            py,
            str(HERE / "block_copy.py"),
            "--reps",
            "20" if args.dry_run else "1000",
            "--steps",
            "0",  # the host cost only (on CUDA there are no training rows anyway)
            "--device",
            device,
            "--out",
            str(args.out if not args.dry_run else tmp / "blocks"),
        ],
        "anchors": [
            py,
            str(HERE / "cuda_anchors.py"),
            "--size",
            "tiny" if args.dry_run else "large",
            "--models",
            "gpt",
            "--configs",
            configs,
            "--reps",
            "1" if args.dry_run else str(args.reps),
            "--device",
            device,
            "--out",
            str(tmp / "cuda_anchors"),
        ],
        "moe": [
            py,
            str(HERE / "dynamic_prefetch.py"),
            "--steps",
            "4" if args.dry_run else "20",
            "--warmup",
            "2" if args.dry_run else "8",
            "--size",
            "small",
            "--batch",
            "1",
            "--seq-len",
            "8",
            "--profile",
            "h100",
            "--device",
            device,
            "--kinds",
            "off;on_demand;pilot"
            if importlib.util.find_spec("lightgbm")
            else "off;on_demand;markov",
            "--out",
            str(args.out),
        ],
    }


def _run_stage(
    name: str, cmd: list[str], limit: float, stdout: Path, stderr_log: Path
) -> dict[str, Any]:
    """Run ``cmd`` in its own process group; kill the group at ``limit`` seconds."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    env.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.perf_counter()
    with stdout.open("w") as out, stderr_log.open("a") as err:
        err.write(f"\n===== {name}: {' '.join(cmd)}\n")
        err.flush()
        offset = err.tell()
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=out, stderr=err, start_new_session=True
        )
        try:
            rc: int | None = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # Inductor's compile workers too
            proc.wait()
            rc = None
    seconds = time.perf_counter() - t0
    status = "timed out" if rc is None else ("ok" if rc == 0 else f"exit {rc}")
    print(f"[gpu_check] {name}: {status} in {seconds:.0f} s", flush=True)
    if status != "ok":  # the device tool returns the output's tail: show why here
        with stderr_log.open() as err:
            err.seek(offset)
            tail = [ln for ln in err.read().splitlines() if "USDT" not in ln][-15:]
        print("\n".join(f"    {ln}" for ln in tail), flush=True)
    return {"stage": name, "status": status, "seconds": round(seconds, 1), "limit_s": limit}


def _json_lines(path: Path) -> list[dict[str, Any]]:
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        if line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by the deadline
                pass
    return rows


def targets(rows: list[dict[str, Any]]) -> list[str]:
    """Issue 42's targets, checked on the anchors' rows (one line each; ``-`` when a row is
    missing, ``n/a``)."""
    by = {r["config"]: r for r in rows if r.get("fits")}
    lines = []
    for r in rows:
        if r["config"].startswith("mc") and r.get("fits") and r.get("budget") is not None:
            ok = r["within_budget"] and abs(r["prediction_error"]) <= 0.03
            lines.append(
                f"{'PASS' if ok else 'FAIL'} {r['config']}: measured {r['peak'] / r['budget']:.3f}"
                f"× the budget (≤ 1.02), prediction {100 * r['prediction_error']:+.1f} % (± 3 %)"
            )
    for amb in ("amb50", "amb10"):
        a, m = by.get(f"inductor_{amb}"), by.get(f"mci_{amb}")
        if a and m:
            ok = m["step_ms"] <= a["step_ms"]
            lines.append(
                f"{'PASS' if ok else 'FAIL'} mci_{amb} {m['step_ms']:.1f} ms ≤ inductor_{amb} "
                f"{a['step_ms']:.1f} ms at its peak"
            )
        else:
            lines.append(f"n/a mci_{amb} vs inductor_{amb}: not both measured")
    a, m = by.get("inductor"), by.get("mci_none")
    if a and m:
        ratio = m["step_ms"] / a["step_ms"]
        lines.append(
            f"{'PASS' if ratio <= 1.05 else 'FAIL'} mci_none {ratio:.2f}× plain torch.compile's "
            "time (≤ 1.05)"
        )
    else:
        lines.append("n/a mci_none vs inductor: not both measured")
    return lines


def render(result: dict[str, Any]) -> str:
    """``gpu_check.md``."""
    from cuda_anchors import render as anchors_table

    lines = [
        "# GPU check"
        + (
            " (dry run on the CPU: plumbing only, numbers mean nothing)"
            if result["dry_run"]
            else ""
        ),
        "",
        f"- command: `{result['command']}`",
        f"- machine: {result['machine']}",
        f"- torch: {result['torch']}",
        f"- date: {result['date']}; commit {result['commit']}",
        "",
        "| stage | outcome | seconds | limit |",
        "|---|---|---|---|",
        *(
            f"| {s['stage']} | {s['status']}{' — ' + s['summary'] if s.get('summary') else ''} "
            f"| {s['seconds']} | {s['limit_s']:.0f} |"
            for s in result["stages"]
        ),
        "",
        "## Targets (issue 42)",
        "",
        *(f"- {t}" for t in result["targets"]),
        "",
    ]
    if result["anchors"]:
        table = anchors_table(
            {
                "command": result["command"],
                "machine": result["machine"],
                "date": result["date"],
                "rows": result["anchors"],
            }
        )
        lines += ["## Anchors: " + result["anchors_model"], "", *table.splitlines()[6:], ""]
    if result["not_run"]:
        lines += [f"Not run (the deadline came first): {', '.join(result['not_run'])}", ""]
    lines += [
        "The MoE's prefetch table: `dynamic_prefetch_cuda.md` (`dynamic_prefetch.md` in a dry "
        "run); a block's prefetch in one call: `block_copy_cuda.md`; the tests' log: "
        "`test_cuda.log`; the stages' stderr: `stages.log`.",
        "",
    ]
    return "\n".join(lines)


def _machine(dry_run: bool) -> tuple[str, str]:
    import platform

    import torch

    if dry_run or not torch.cuda.is_available():
        device = f"CPU ({os.cpu_count()} cores)"
    else:
        p = torch.cuda.get_device_properties(0)
        device = f"{p.name} ({p.total_memory / 2**30:.0f} GiB), {os.cpu_count()} CPUs"
    return f"{device}, {platform.platform()}, Python {platform.python_version()}", torch.__version__


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--dry-run", action="store_true", help="the CPU, tiny sizes, no Inductor")
    p.add_argument("--budget-s", type=float, default=500.0, help="the whole check's deadline")
    p.add_argument("--stages", default="tests,blocks,anchors,moe")
    p.add_argument("--configs", default=None, help="the anchors' configurations (comma-separated)")
    p.add_argument("--reps", type=int, default=3, help="timed steps per anchors configuration")
    args = p.parse_args(argv)
    args.command = "python benchmarks/gpu_check.py " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = [s for s in stages if s not in LIMITS]
    if unknown or not stages:
        p.error(f"--stages: any of {', '.join(LIMITS)}; got {args.stages!r}")
    if args.budget_s <= 0:
        p.error(f"--budget-s must be positive; got {args.budget_s}")
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        p.error("no CUDA device here: run it on a lent GPU, or with --dry-run on the CPU")
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        return _check(args, stages, Path(tmp))


def _check(args: argparse.Namespace, stages: list[str], tmp: Path) -> int:
    stderr_log = args.out / "stages.log"
    stderr_log.write_text("")
    machine, torch_version = _machine(args.dry_run)
    commands = _stage_commands(args, tmp)
    start = time.perf_counter()
    result: dict[str, Any] = {
        "command": args.command.strip(),
        "machine": machine,
        "torch": torch_version,
        "date": dt.date.today().isoformat(),
        "commit": _commit(),
        "dry_run": args.dry_run,
        "stages": [],
        "anchors": [],
        "anchors_model": "gpt, size "
        + ("tiny" if args.dry_run else "large (6 layers, d 1024, T 1024, B 8)"),
        "not_run": [],
        "targets": [],
    }
    for name in stages:
        left = args.budget_s - (time.perf_counter() - start)
        if left < 10:
            result["stages"].append(
                {"stage": name, "status": "skipped (no time left)", "seconds": 0, "limit_s": 0}
            )
            continue
        out_file = args.out / "test_cuda.log" if name == "tests" else tmp / f"{name}.out"
        stage = _run_stage(name, commands[name], min(LIMITS[name], left), out_file, stderr_log)
        if name == "tests":
            tail = [ln for ln in out_file.read_text().splitlines() if ln.strip()]
            stage["summary"] = tail[-1].strip("= ") if tail else ""
        if name == "moe":
            kinds = commands["moe"][commands["moe"].index("--kinds") + 1]
            stage["summary"] = f"predictors {kinds.replace(';', ', ')}"
        if name == "anchors":
            result["anchors"] = _json_lines(out_file)
            done = {r["config"] for r in result["anchors"]}
            configs = commands["anchors"][commands["anchors"].index("--configs") + 1].split(",")
            result["not_run"] = [c for c in configs if c not in done]
            stage["summary"] = f"{len(done)} of {len(configs)} configurations"
        result["stages"].append(stage)
        # Written after every stage: a check cut short by the device tool keeps what it had.
        result["targets"] = targets(result["anchors"])
        (args.out / "gpu_check.json").write_text(json.dumps(result, indent=1) + "\n")
        (args.out / "gpu_check.md").write_text(render(result))
    print((args.out / "gpu_check.md").read_text())
    failed = [s["stage"] for s in result["stages"] if s["status"] != "ok"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
