"""pipeline.devices: a CUDA device the machine does not have is a ConfigError naming its key."""

from __future__ import annotations

import pytest

from pipeline.devices import check_cuda_devices
from pipeline.errors import ConfigError


@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch):
    """Sets how many CUDA devices torch reports (0: none, and CUDA unavailable)."""
    import torch

    def have(count: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)

    return have


def test_cpu_devices_need_no_cuda(gpus) -> None:
    gpus(0)
    check_cuda_devices([("trainer.device", "cpu"), ("engine.devices[0]", "cpu")])


def test_a_cuda_device_without_cuda_names_the_key(gpus) -> None:
    gpus(0)
    with pytest.raises(ConfigError, match=r'^trainer.device = "cuda:0" but this machine has no CUDA device$'):
        check_cuda_devices([("engine.devices[0]", "cpu"), ("trainer.device", "cuda:0")])


def test_a_device_index_past_the_last_gpu_names_the_key_and_the_count(gpus) -> None:
    gpus(2)
    check_cuda_devices([("engine.devices[0]", "cuda:0"), ("trainer.device", "cuda:1")])
    with pytest.raises(ConfigError, match=r'engine.devices\[1\] = "cuda:2" but this machine has 2 CUDA devices '
                                          r'\(cuda:0 to cuda:1\)'):
        check_cuda_devices([("engine.devices[0]", "cuda:0"), ("engine.devices[1]", "cuda:2")])
