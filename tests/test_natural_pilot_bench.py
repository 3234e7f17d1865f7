"""benchmarks/natural_pilot.py: the pilot in training on the natural models, reads on and off."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import natural_pilot  # noqa: E402


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_row_reports_the_pilots_figures_with_reads_on() -> None:
    row = natural_pilot.run_one("early_exit_natural", "tiny", 3, reads=True)
    assert row["model"] == "early_exit_natural" and row["reads"] is True
    assert row["read_predictions"] > 0  # the exits' conf.item() reached the pilot
    assert 0.0 <= row["accuracy"] <= 1.0 and row["prefetched_bytes"] > 0


def test_too_few_steps_are_refused_with_their_count(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        natural_pilot.main(["--steps", "1"])
    assert "--steps must be at least 2; got 1" in capsys.readouterr().err
