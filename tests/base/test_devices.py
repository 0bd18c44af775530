"""pipeline.devices: a CUDA device the machine does not have is a ConfigError naming its key."""

from __future__ import annotations

import pytest

from pipeline.devices import check_cuda_devices
from pipeline.errors import ConfigError


@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch):
    """Sets how many CUDA devices torch counts (0: none). The check may not ask is_available(), which
    initialises the CUDA driver (cudaGetDeviceCount) and so spoils a later fork of this process."""
    import torch

    def initialises_cuda() -> bool:
        raise AssertionError("torch.cuda.is_available() initialises the CUDA driver")

    def have(count: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", initialises_cuda)
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


@pytest.mark.parametrize("kw, cores, expected", [
    ({"max_staleness": 0, "engine_on_cpu": True, "hidden_size": 896}, 8, 8),  # phases take turns: all
    ({"max_staleness": 2, "engine_on_cpu": True, "hidden_size": 896}, 8, 4),  # beside the engine's half
    ({"max_staleness": 2, "engine_on_cpu": True, "hidden_size": 896}, 3, 2),
    ({"max_staleness": 2, "engine_on_cpu": False, "hidden_size": 896}, 8, 8),  # the engine is on a GPU
    ({"max_staleness": 0, "engine_on_cpu": True, "hidden_size": 64}, 8, 1),  # too narrow to split
    ({"max_staleness": 1, "engine_on_cpu": True, "hidden_size": None}, 2, 1),
])
def test_a_cpu_trainer_process_takes_the_threads_that_pay(kw: dict, cores: int, expected: int) -> None:
    from pipeline.devices import trainer_threads

    assert trainer_threads(0, cores=cores, **kw) == expected
    assert trainer_threads(3, cores=cores, **kw) == 3  # trainer.threads set: taken as it is


def test_the_trainer_process_runs_on_the_threads_build_chose(tmp_path) -> None:
    """The built-in tiny model at max_staleness 0: one thread (too narrow to split), in the child
    itself; trainer.threads = 2 gives it two."""
    import torch

    from pipeline.loop.build import build_trainer
    from pipeline.config.io import load_config
    from pipeline.models.builtin import build_model

    model = build_model("tiny", tmp_path / "models")
    for overrides, expected in (({}, 1), ({"trainer.threads": 2}, 2)):
        cfg = load_config(None, {"out": str(tmp_path / "run"), "pipeline.max_staleness": 0, **overrides})
        trainer = build_trainer(cfg, str(model))
        assert trainer._args[1].threads == expected
        trainer.setup()
        try:
            assert trainer.torch_threads() == expected
        finally:
            trainer.close()
    assert torch.get_num_threads() >= 1  # the parent's own count is not the child's business
