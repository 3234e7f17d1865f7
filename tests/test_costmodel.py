"""Device profiles (analysis/costmodel.py): a GPU gets its own profile by its name, an unknown one
the H100's with a warning."""

from __future__ import annotations

import logging

import pytest
import torch

from memcompile.analysis import costmodel
from memcompile.analysis.costmodel import device_profile, resolve_profile_name


@pytest.mark.parametrize(
    ("gpu", "profile"),
    [
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H100 PCIe", "h100"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
    ],
)
def test_a_gpu_is_planned_with_its_own_profile(
    gpu: str, profile: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: gpu)
    caplog.set_level(logging.WARNING, logger=costmodel.__name__)
    assert resolve_profile_name("auto", torch.device("cuda", 0)) == profile
    assert not caplog.records


def test_an_unknown_gpu_is_planned_with_the_h100_profile_and_said(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA L4")
    caplog.set_level(logging.WARNING, logger=costmodel.__name__)
    assert resolve_profile_name("auto", torch.device("cuda", 0)) == "h100"
    assert "no cost profile for GPU 'nvidia l4'; planning with the h100 profile" in caplog.text


def test_the_h200_has_the_h100s_compute_and_faster_memory() -> None:
    h100, h200 = device_profile("h100"), device_profile("h200")
    assert h200.flops == h100.flops and h200.host_bandwidth == h100.host_bandwidth
    assert h200.memory_bandwidth == pytest.approx(h100.memory_bandwidth * 4.8 / 3.35)
    assert resolve_profile_name("h200", torch.device("cpu")) == "h200"
