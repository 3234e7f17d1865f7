"""``memcompile bench``: run the benchmark harness of a source checkout, with progress.

    memcompile bench                                  # --suite anchors: benchmarks/anchors.py
    memcompile bench --quick                          # anchors --quick (fewer configs, 3 reps)
    memcompile bench --models branchy --configs eager --reps 1 --no-sweep --out /tmp/r

The harness scripts live in ``benchmarks/`` beside the package in a checkout (they are not
installed), and write ``benchmarks/results/`` (or ``--out``). Each suite runs as a child process
(``OMP_NUM_THREADS=1``, as the harness requires); its per-row lines on stderr drive the progress
bar. Suites: ``anchors`` (memcompile beside PyTorch's memory features); ``dynamic`` does not exist
yet (it comes with the dynamic-network pilot): asking for it alone is an error, ``all`` runs what
exists and says what it skipped.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from memcompile.cli_output import Reporter

log = logging.getLogger(__name__)

__all__ = ["SUITES", "BenchError", "BenchRun", "benchmarks_dir", "run_suite", "suites_for"]

#: suite -> harness script in benchmarks/ (None: not written yet).
SUITES: dict[str, str | None] = {"anchors": "anchors.py", "dynamic": None}

_TOTAL = re.compile(r"anchor table: (\d+) models x (\d+) configs")
_ROW = re.compile(r"^  (\S+)\s+(\S+)\s+(.*)$")


class BenchError(RuntimeError):
    """A suite that cannot run (missing, not written yet, failed); one-line message."""


@dataclass(frozen=True)
class BenchRun:
    """One suite's run: its command, exit status, rows seen and the results folder."""

    suite: str
    command: tuple[str, ...]
    returncode: int
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


def suites_for(choice: str) -> tuple[list[str], list[str]]:
    """(suites to run, suites skipped because they do not exist yet) for ``--suite``.

    Raises:
        BenchError: ``choice`` names only a suite that does not exist yet, or no suite at all.
    """
    names = list(SUITES) if choice == "all" else [choice]
    unknown = [n for n in names if n not in SUITES]
    if unknown:
        raise BenchError(f"unknown suite {unknown[0]!r}; choose from {', '.join([*SUITES, 'all'])}")
    missing = [n for n in names if SUITES[n] is None]
    run = [n for n in names if SUITES[n] is not None]
    if not run:
        raise BenchError(
            f"the {missing[0]!r} suite does not exist yet (it comes with the dynamic-network "
            "pilot); available: " + ", ".join(n for n, s in SUITES.items() if s is not None)
        )
    return run, missing


def run_suite(suite: str, args: Sequence[str], out: Path | None, reporter: Reporter) -> BenchRun:
    """Run ``suite``'s harness with ``args`` (its own flags), streaming its rows to ``reporter``.

    Raises:
        BenchError: the harness is missing.
    """
    script = SUITES[suite]
    assert script is not None
    path = benchmarks_dir() / script
    if not path.is_file():
        raise BenchError(f"benchmark harness {path} is missing")
    results = out if out is not None else path.parent / "results"
    cmd = (sys.executable, str(path), *args, "--out", str(results))
    log.info("running %s", " ".join(cmd))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    rows: list[str] = []
    tail: list[str] = []
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    ) as proc:
        assert proc.stderr is not None and proc.stdout is not None
        for raw in proc.stderr:
            line = raw.rstrip("\n")
            if "USDT" in line or not line.strip():  # the profiler's start/stop chatter
                continue
            if m := _TOTAL.search(line):
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
        raise BenchError(f"{suite} failed: {last}")
    return BenchRun(suite, cmd, proc.returncode, tuple(rows), str(results), report)
