"""Options: parsing sizes, validating every key, and refusing what has not landed yet."""

from __future__ import annotations

import os
import stat

import pytest
import torch

import memcompile
from memcompile.config import MemConfig, parse_bytes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (4096, 4096),
        ("512MiB", 512 * 2**20),
        ("6GB", 6 * 10**9),
        ("6GiB", 6 * 2**30),
        ("1.5 GiB", 3 * 2**29),
        ("100kb", 100_000),
        ("7b", 7),
        ("123", 123),
        ("2TiB", 2 * 2**40),
        ("1.1MiB", 1_153_433),  # 1153433.6 bytes, rounded down: still within the budget
        ("0.3GB", 300_000_000),  # exact, where float arithmetic gives 299999999.99999994
        ("2.0B", 2),
    ],
)
def test_parse_bytes_reads_ints_and_units(text: int | str, expected: int) -> None:
    assert parse_bytes(text) == expected


def test_defaults_match_design_table() -> None:
    cfg = MemConfig.from_options(None)
    assert cfg == MemConfig()
    assert cfg.budget is None and cfg.inner == "auto" and cfg.offload_to == "host"
    assert cfg.offload_params == "auto" and cfg.pilot == "auto" and cfg.prefetch_depth == 2
    assert cfg.offload_optimizer == "auto"
    assert cfg.on_infeasible == "error" and cfg.device_profile == "auto"
    assert set(cfg.to_dict()) == {
        "budget", "budget_fraction", "recompute", "swap", "reorder", "offload_to", "disk_path",
        "offload_params", "offload_optimizer", "pilot", "prefetch_depth", "inner", "device_profile",
        "on_infeasible", "trace_path", "split_param_reads", "check_ranks",
    }  # fmt: skip
    assert cfg.split_param_reads is False and cfg.check_ranks is False


def test_config_is_frozen() -> None:
    cfg = MemConfig.from_options({"inner": "eager"})
    with pytest.raises(AttributeError):
        cfg.inner = "inductor"  # type: ignore[misc]


BAD = [
    # (options, exception, regex the message must match)
    (
        {"budjet": "1GiB"},
        ValueError,
        r"unknown memcompile option 'budjet'; did you mean 'budget'\?",
    ),
    ({"zzz": 1}, ValueError, r"unknown memcompile option 'zzz'; valid options: budget, recompute"),
    ({"budget": "lots"}, ValueError, r"option 'budget': cannot read 'lots' as a size"),
    ({"budget": "12 parsecs"}, ValueError, r"option 'budget': cannot read '12 parsecs'"),
    ({"budget": -5}, ValueError, r"option 'budget' must be a positive size; got -5"),
    ({"budget": 0}, ValueError, r"option 'budget' must be a positive size; got 0"),
    ({"budget": "0.5B"}, ValueError, r"option 'budget': '0.5B' is not a whole number of bytes"),
    ({"budget": 1.5e9}, TypeError, r"option 'budget' must be an int number of bytes or a string"),
    ({"budget": True}, TypeError, r"option 'budget' must be an int number of bytes .* got bool"),
    ({"recompute": "yes"}, TypeError, r"option 'recompute' must be True or False; got 'yes'"),
    ({"swap": 1}, TypeError, r"option 'swap' must be True or False; got 1"),
    ({"reorder": None}, TypeError, r"option 'reorder' must be True or False; got None"),
    (
        {"split_param_reads": "yes"},
        TypeError,
        r"option 'split_param_reads' must be True or False; got 'yes'",
    ),
    ({"check_ranks": 1}, TypeError, r"option 'check_ranks' must be True or False; got 1"),
    (
        {"offload_to": "nvme"},
        ValueError,
        r"option 'offload_to' must be one of 'host', 'disk'; got 'nvme'",
    ),
    (
        {"offload_params": "always"},
        ValueError,
        r"option 'offload_params' must be one of 'auto', True, False",
    ),
    (
        {"offload_params": 1},
        ValueError,
        r"option 'offload_params' must be one of 'auto', True, False; got 1",
    ),
    (
        {"pilot": "xgboost"},
        ValueError,
        r"option 'pilot' must be one of 'auto', 'lightgbm', 'markov', 'off'",
    ),
    ({"prefetch_depth": 0}, ValueError, r"option 'prefetch_depth' must be >= 1; got 0"),
    ({"prefetch_depth": 2.0}, TypeError, r"option 'prefetch_depth' must be an int; got 2.0"),
    (
        {"inner": "tvm"},
        ValueError,
        r"option 'inner' must be one of 'auto', 'eager', 'inductor'; got 'tvm'",
    ),
    (
        {"device_profile": "tpu"},
        ValueError,
        r"option 'device_profile' must be one of 'auto', 'cpu', 'h100'",
    ),
    ({"device_profile": 3}, TypeError, r"option 'device_profile' must be a string; got 3"),
    (
        {"on_infeasible": "ignore"},
        ValueError,
        r"option 'on_infeasible' must be one of 'error', 'best_effort'",
    ),
    (
        {"disk_path": 42},
        TypeError,
        r"option 'disk_path' must be a path \(str or os.PathLike\) or None",
    ),
    ({"disk_path": ""}, ValueError, r"option 'disk_path' must not be an empty path"),
    ({"trace_path": 3.0}, TypeError, r"option 'trace_path' must be a path"),
]


@pytest.mark.parametrize(("options", "exc", "message"), BAD, ids=[str(b[0]) for b in BAD])
def test_bad_option_raises_naming_the_key(options: dict, exc: type, message: str) -> None:
    with pytest.raises(exc, match=message):
        MemConfig.from_options(options)


def test_options_must_be_a_mapping() -> None:
    with pytest.raises(TypeError, match="memcompile options must be a dict; got list"):
        MemConfig.from_options([("budget", 1)])  # type: ignore[arg-type]


def test_disk_path_that_is_a_file_is_rejected(tmp_path) -> None:
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(
        ValueError, match=r"option 'disk_path': .*afile' exists and is not a directory"
    ):
        MemConfig.from_options({"disk_path": str(f)})


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_unwritable_disk_path_is_rejected(tmp_path) -> None:
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(stat.S_IRUSR | stat.S_IXUSR)
    with pytest.raises(ValueError, match=r"option 'disk_path': .*ro' is not writable"):
        MemConfig.from_options({"disk_path": str(d)})


def test_disk_path_under_a_file_is_rejected(tmp_path) -> None:
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(
        ValueError, match=r"option 'disk_path': .*afile' \(parent of .*\) is not a directory"
    ):
        MemConfig.from_options({"disk_path": str(f / "sub")})


@pytest.mark.parametrize("pilot", ["auto", "lightgbm", "markov", "off"])
def test_every_pilot_value_is_accepted(pilot: str) -> None:
    # Landed with the dynamic issue (tests/test_dynamic_run.py runs each in training).
    assert MemConfig.from_options({"pilot": pilot}).pilot == pilot


def test_memcompile_compile_validates_before_any_call() -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="unknown memcompile option 'inerr'; did you mean 'inner'"):
        memcompile.compile(model, inerr="eager")


def test_torch_compile_reports_bad_options_at_first_call() -> None:
    torch._dynamo.reset()
    compiled = torch.compile(torch.nn.Linear(2, 2), backend="memcompile", options={"inner": "tvm"})
    with pytest.raises(
        Exception, match="option 'inner' must be one of 'auto', 'eager', 'inductor'; got 'tvm'"
    ):
        compiled(torch.randn(3, 2))


def test_torch_compile_mode_is_refused() -> None:
    torch._dynamo.reset()
    compiled = torch.compile(torch.nn.Linear(2, 2), backend="memcompile", mode="max-autotune")
    with pytest.raises(Exception, match=r"memcompile does not use torch.compile\(mode=...\)"):
        compiled(torch.randn(3, 2))


def test_unwritable_disk_path_message_even_as_root(tmp_path, monkeypatch) -> None:
    # Root passes every permission check; simulate the refusal to test the message.
    import memcompile.config as config

    monkeypatch.setattr(config.os, "access", lambda *_: False)
    with pytest.raises(ValueError, match=r"option 'disk_path': .* is not writable"):
        MemConfig.from_options({"disk_path": str(tmp_path)})
    with pytest.raises(ValueError, match=r"option 'trace_path': .*trace.jsonl' is not writable"):
        MemConfig.from_options({"trace_path": str(tmp_path / "trace.jsonl")})
