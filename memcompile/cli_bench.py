"""``memcompile bench``: run the benchmark harness of a source checkout, with progress.

    memcompile bench                                  # --suite anchors: benchmarks/anchors.py
    memcompile bench --quick                          # anchors --quick (fewer configs, 3 reps)
    memcompile bench --models branchy --configs eager --reps 1 --no-sweep --out /tmp/r
    memcompile bench --suite dynamic                  # dynamic.py (300 steps), pilot_latency.py
    memcompile bench --suite dynamic --steps 40 --size tiny
    memcompile bench --suite all --dry-run            # the commands, not run

The harness scripts live in ``benchmarks/`` beside the package in a checkout (they are not
installed), and write ``benchmarks/results/`` (or ``--out``). Each script runs as a child process
(``OMP_NUM_THREADS=1``, as the harness requires); its progress lines on stderr drive the progress
bar. Suites (:data:`SUITES`):

* ``anchors``: ``anchors.py``, memcompile beside PyTorch's memory features (peak, time, the
  largest model in a budget); one progress line per (model, configuration) row.
* ``dynamic``: ``dynamic.py`` (pilot accuracy on the zoo MoE's block traces: LightGBM pilot,
  Markov, replay) then ``pilot_latency.py`` (per-prediction latency of the pilot's C fast path);
  their ``progress I/N TEXT`` lines drive the bar.
* ``all``: both, in that order.

Flags that belong to one suite (``--models`` to anchors, ``--steps`` to dynamic) are refused
when no suite that takes them runs.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

from memcompile.cli_output import Reporter

log = logging.getLogger(__name__)

__all__ = [
    "SUITES",
    "BenchError",
    "BenchOptions",
    "BenchRun",
    "benchmarks_dir",
    "harness_commands",
    "run_suite",
    "suites_for",
]

#: suite -> the harness scripts in benchmarks/ it runs, in order.
SUITES: dict[str, tuple[str, ...]] = {
    "anchors": ("anchors.py",),
    "dynamic": ("dynamic.py", "pilot_latency.py"),
}

_TOTAL = re.compile(r"anchor table: (\d+) models x (\d+) configs")
_ROW = re.compile(r"^  (\S+)\s+(\S+)\s+(.*)$")
#: the generic progress line of the dynamic suite's scripts: ``progress 3/12 trained 30 steps``
_PROGRESS = re.compile(r"^progress (\d+)/(\d+) (.*)$")


#: each suite-specific flag (a BenchOptions field) -> the suite that takes it
_FLAG_SUITE: dict[str, str] = {
    "models": "anchors",
    "configs": "anchors",
    "reps": "anchors",
    "no_sweep": "anchors",
    "steps": "dynamic",
    "size": "dynamic",
}


class BenchError(RuntimeError):
    """A suite that cannot run (unknown, missing, bad flags, failed); one-line message."""


@dataclass(frozen=True)
class BenchOptions:
    """The ``memcompile bench`` flags, each passed to the scripts that take it.

    Attributes:
        quick: each harness's quick mode (anchors ``--quick``; dynamic: 60 steps, 1000 calls).
        models, configs, reps, no_sweep: anchors only.
        steps, size: dynamic only (training steps of the MoE trace; zoo size, default small).
    """

    quick: bool = False
    models: str | None = None
    configs: str | None = None
    reps: int | None = None
    no_sweep: bool = False
    steps: int | None = None
    size: str | None = None

    def check(self, suites: Sequence[str]) -> None:
        """Refuse a flag no suite in ``suites`` takes, or a bad value.

        Raises:
            BenchError: naming the flag and the suite it belongs to.
        """
        for name, suite in _FLAG_SUITE.items():
            value = getattr(self, name)
            if value not in (None, False) and suite not in suites:
                flag = "--" + name.replace("_", "-")
                raise BenchError(f"{flag} applies to the {suite!r} suite, which is not running")
        if self.reps is not None and self.reps < 1:
            raise BenchError(f"--reps must be >= 1; got {self.reps}")
        if self.steps is not None and self.steps < 1:
            raise BenchError(f"--steps must be >= 1; got {self.steps}")


@dataclass(frozen=True)
class BenchRun:
    """One suite's run: its commands, rows seen, the results folder and the scripts' reports."""

    suite: str
    commands: tuple[tuple[str, ...], ...]
    rows: tuple[str, ...]
    out: str
    report: str


def benchmarks_dir() -> Path:
    """``benchmarks/`` of the checkout this package is imported from.

    Raises:
        BenchError: the package is installed without its source tree.
    """
    import memcompile

    d = Path(memcompile.__file__).resolve().parent.parent / "benchmarks"
    if not d.is_dir():
        raise BenchError(
            f"no benchmarks/ folder next to the memcompile package ({d.parent}): "
            "bench runs from a source checkout (pip install -e .)"
        )
    return d


def suites_for(choice: str) -> list[str]:
    """The suites ``--suite choice`` runs, in order.

    Raises:
        BenchError: an unknown suite.
    """
    names = list(SUITES) if choice == "all" else [choice]
    unknown = [n for n in names if n not in SUITES]
    if unknown:
        raise BenchError(f"unknown suite {unknown[0]!r}; choose from {', '.join([*SUITES, 'all'])}")
    return names


def _script_args(script: str, opts: BenchOptions) -> list[str]:
    args: list[str] = []
    if script == "anchors.py":
        if opts.quick:
            args.append("--quick")
        for flag in ("models", "configs", "reps"):
            value = getattr(opts, flag)
            if value is not None:
                args += [f"--{flag}", str(value)]
        if opts.no_sweep:
            args.append("--no-sweep")
    else:  # dynamic.py, pilot_latency.py
        steps = opts.steps if opts.steps is not None else (60 if opts.quick else None)
        if steps is not None:
            args += ["--steps", str(steps)]
            if script == "dynamic.py":  # the early-exit, TreeLSTM, natural MoE traces: as many
                args += ["--extra-steps", str(steps), "--natural-steps", str(steps)]
        if opts.size is not None:
            args += ["--size", opts.size]
        if script == "pilot_latency.py" and (opts.quick or opts.steps is not None):
            args += ["--calls", "1000"]
    return args


def harness_commands(suite: str, opts: BenchOptions, out: Path | None) -> list[tuple[str, ...]]:
    """The child-process commands of ``suite`` (scripts, their flags, ``--out``).

    Raises:
        BenchError: the checkout has no benchmarks/ folder or lacks a script.
    """
    d = benchmarks_dir()
    results = out if out is not None else d / "results"
    cmds = []
    for script in SUITES[suite]:
        path = d / script
        if not path.is_file():
            raise BenchError(f"benchmark harness {path} is missing")
        args = _script_args(script, opts)
        cmds.append((sys.executable, str(path), *args, "--out", str(results)))
    return cmds


def _run_one(cmd: tuple[str, ...], label: str, reporter: Reporter, rows: list[str]) -> str:
    log.info("running %s", " ".join(cmd))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    tail: list[str] = []
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    ) as proc:
        assert proc.stderr is not None and proc.stdout is not None
        for raw in proc.stderr:
            line = raw.rstrip("\n")
            if "USDT" in line or not line.strip():  # the profiler's start/stop chatter
                continue
            if m := _PROGRESS.match(line):
                reporter.set_total(int(m.group(2)))
                rows.append(f"{label}: {m.group(3)}")
                reporter.step(m.group(3))
            elif m := _TOTAL.search(line):
                # (eager runs once per model even when not listed: then a row more per model)
                reporter.set_total(int(m.group(1)) * int(m.group(2)))
            elif _ROW.match(line):
                rows.append(line.strip())
                reporter.step(" ".join(line.split()))
            else:
                tail = [*tail[-4:], line]
                reporter.note(line)
        report = proc.stdout.read()
    if proc.returncode != 0:
        last = tail[-1] if tail else f"exit status {proc.returncode}"
        raise BenchError(f"{label} failed: {last}")
    return report


def run_suite(
    suite: str,
    opts: BenchOptions,
    out: Path | None,
    reporter_for: Callable[[str], AbstractContextManager[Reporter]],
) -> BenchRun:
    """Run ``suite``'s scripts in order, streaming their progress to reporters.

    ``reporter_for(description)`` is a context manager yielding a :class:`Reporter`
    (``memcompile.cli_output.progress`` with a total of ``None``): one bar per script.

    Raises:
        BenchError: a script is missing or fails (its last stderr line in the message).
    """
    results = out if out is not None else benchmarks_dir() / "results"
    rows: list[str] = []
    reports: list[str] = []
    cmds = harness_commands(suite, opts, out)
    for cmd in cmds:
        label = suite if len(cmds) == 1 else Path(cmd[1]).stem
        with reporter_for(label) as reporter:
            reports.append(_run_one(cmd, label, reporter, rows))
    return BenchRun(suite, tuple(cmds), tuple(rows), str(results), "".join(reports))
