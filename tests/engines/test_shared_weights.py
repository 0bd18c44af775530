"""pipeline.engines.shared_weights: packing a version, its checksum, and the worker's checks.

The CUDA IPC handle itself is exercised by benchmarks/probes/full_weight_sync_probe.py on a GPU;
here the worker opens a CPU buffer in its place.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline.engines import shared_weights as sw


def _named() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [("embed.weight", torch.randn(7, 5, generator=g).to(torch.bfloat16)),  # 70 bytes: padded
            ("layer.bias", torch.randn(3, generator=g)),
            ("layer.scale", torch.randn(1, generator=g).to(torch.float16)),
            ("head.weight", torch.randn(4, 9, generator=g))]


def test_a_packed_version_is_a_bitwise_copy_at_aligned_offsets() -> None:
    named = _named()
    packed = sw.pack(3, named)
    assert packed.version == 3 and all(o % sw.ALIGN == 0 for o in packed.layout.offsets)
    for (name, t), (got_name, got) in zip(named, sw.unpack(packed.flat, packed.layout), strict=True):
        assert got_name == name and got.dtype == t.dtype and got.shape == t.shape
        assert torch.equal(got.view(torch.uint8), t.view(torch.uint8))
    before = packed.flat.clone()
    for _, t in named:
        t.add_(1)  # the trainer's next step
    assert torch.equal(packed.flat, before) and sw.checksum(packed.flat) == packed.checksum


def test_the_checksum_sees_every_byte_and_where_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    packed = sw.pack(1, _named())
    flat = packed.flat
    for i in range(0, flat.numel(), 7):  # a byte changed anywhere, padding included
        changed = flat.clone()
        changed[i] ^= 0x01
        assert sw.checksum(changed) != packed.checksum, i
    words = flat.clone().view(torch.int64)
    words[[0, 1]] = words[[1, 0]]  # the same bytes, two words swapped
    assert not torch.equal(words.view(torch.uint8), flat) and sw.checksum(words.view(torch.uint8)) != packed.checksum
    monkeypatch.setattr(sw, "_CHUNK_WORDS", 3)  # weighed in small chunks: the same figure
    assert sw.checksum(flat) == packed.checksum


class _Runner:
    def __init__(self) -> None:
        self.loads: list[list[tuple[str, torch.Tensor]]] = []

    def reload_weights(self, weights_iterator: Any = None, weights_path: str | None = None,
                       is_checkpoint_format: bool = True) -> None:
        assert weights_path is None and is_checkpoint_format
        self.loads.append([(n, t.clone()) for n, t in weights_iterator])


def _worker(monkeypatch: pytest.MonkeyPatch, flat: torch.Tensor) -> sw.SharedWeightsWorker:
    monkeypatch.setattr(sw, "open_shared", lambda payload: flat)  # a CPU buffer in the GPU's place
    worker = sw.SharedWeightsWorker()
    worker.model_runner = _Runner()
    return worker


def _payload(packed: sw.Packed) -> dict[str, Any]:
    # as vLLM's RPC carries it: the layout as JSON-like lists
    return {"version": packed.version, "layout": json.loads(json.dumps(asdict(packed.layout))),
            "checksum": packed.checksum, "ipc": {}}


def test_the_worker_reloads_the_model_from_exactly_the_packed_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    named = _named()
    packed = sw.pack(4, named)
    worker = _worker(monkeypatch, packed.flat)
    reply = worker.load_shared_weights(_payload(packed))
    assert reply["version"] == 4 and reply["checksum"] == packed.checksum
    [loaded] = worker.model_runner.loads
    assert [n for n, _ in loaded] == [n for n, _ in named]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(loaded, named))


def test_the_worker_refuses_a_buffer_changed_after_packing_and_reloads_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    packed = sw.pack(5, _named())
    payload = _payload(packed)
    packed.flat[20] ^= 0xFF  # the producer's memory reused before the load
    worker = _worker(monkeypatch, packed.flat)
    with pytest.raises(ValueError, match=r"^version 5: the shared buffer's checksum is .*, the producer's .*changed"):
        worker.load_shared_weights(payload)
    assert worker.model_runner.loads == []


@pytest.mark.parametrize("failure", ["checksum", "reload"])
def test_a_failed_load_lets_go_of_the_buffer_it_opened(monkeypatch: pytest.MonkeyPatch, failure: str) -> None:
    """The exception's traceback (kept by whoever handles it) holds no view of the producer's memory:
    with CUDA IPC the producer's memory stays mapped while any tensor on its storage lives."""
    from torch.multiprocessing.reductions import StorageWeakRef

    packed = sw.pack(7, _named())
    payload = _payload(packed)
    opened: list[StorageWeakRef] = []

    def open_copy(payload: dict[str, Any]) -> torch.Tensor:
        flat = packed.flat.clone()
        opened.append(StorageWeakRef(flat.untyped_storage()))
        return flat

    worker = _worker(monkeypatch, packed.flat)
    monkeypatch.setattr(sw, "open_shared", open_copy)
    if failure == "checksum":
        payload["checksum"] = "0" * 32
    else:
        def broken(**kwargs: Any) -> None:
            next(kwargs.pop("weights_iterator"))  # a loader that read one tensor and let go, then failed
            raise RuntimeError("vLLM failed halfway")
        worker.model_runner.reload_weights = broken
    with pytest.raises((ValueError, RuntimeError)) as caught:
        worker.load_shared_weights(payload)
    assert caught.value.__traceback__ is not None and opened and opened[0].expired()


def test_a_layout_that_leaves_the_buffer_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    packed = sw.pack(6, _named())
    payload = _payload(packed)
    payload["layout"]["offsets"][-1] = packed.layout.nbytes - sw.ALIGN  # the last tensor runs past the end
    worker = _worker(monkeypatch, packed.flat)
    with pytest.raises(ValueError, match=r"^tensor head\.weight at byte \d+ \(float32, \[4, 9\]\) lies outside"):
        worker.load_shared_weights(payload)
    short = _payload(packed)
    short["layout"]["nbytes"] += sw.ALIGN
    with pytest.raises(ValueError, match="the layout says"):
        worker.load_shared_weights(short)
    assert worker.model_runner.loads == []


def test_the_ipc_handle_travels_as_plain_data_and_rebuilds_the_same_arguments() -> None:
    # reduce_tensor's arguments for a CUDA buffer, as torch hands them out; the payload holds no
    # Python objects (nothing to unpickle), and the worker rebuilds them for its own device index
    args = (torch.Tensor, torch.Size([4096]), (1,), 0, torch.TypedStorage, torch.uint8, 0, b"\x01cuda-handle",
            4096, 512, False, b"ref-counter", 7, b"\x02event", True)
    fields = sw.ipc_fields(args)
    assert all(isinstance(v, (str, int, bytes, list)) for v in fields.values()), fields
    assert fields["tensor_cls"] == "Tensor" and fields["storage_cls"] == "TypedStorage" and fields["dtype"] == "uint8"
    rebuilt = sw.ipc_args(json_round_trip(fields), device=3)
    assert rebuilt == args[:6] + (3,) + args[7:]
    assert rebuilt[0] is torch.Tensor and rebuilt[4] is torch.TypedStorage and rebuilt[5] is torch.uint8
    with pytest.raises(ValueError, match="whose tensor_cls is .*Parameter.* cannot be sent as plain data"):
        sw.ipc_fields((torch.nn.Parameter,) + args[1:])


def json_round_trip(fields: dict[str, Any]) -> dict[str, Any]:
    """Through a format without tuples or bytes objects of its own (as vLLM's msgpack has none of torch's)."""
    text = json.dumps({k: v.hex() if isinstance(v, bytes) else v for k, v in fields.items()})
    return {k: bytes.fromhex(v) if isinstance(fields[k], bytes) else v for k, v in json.loads(text).items()}


def test_share_needs_a_cuda_buffer() -> None:
    with pytest.raises(ValueError, match="CUDA IPC needs a CUDA buffer, got one on cpu"):
        sw.share(sw.pack(1, _named()))


def test_a_full_weight_trainer_packs_the_tensors_it_publishes(tmp_path: Path) -> None:
    # the memory way hands vLLM what the files' way writes: the same names (a tied head once), values
    from safetensors.torch import load_file

    from pipeline.config.schema import LossConfig, TrainerConfig
    from pipeline.models import builtin as models
    from pipeline.trainer.policy import PolicyTrainer

    trainer = PolicyTrainer(models.build_model("tiny", tmp_path / "models"), TrainerConfig(update="full", device="cpu"),
                            LossConfig(), keep_versions=1)
    trainer.setup()
    trainer.save_adapter(tmp_path / "v1")
    published = {k: v for f in sorted((tmp_path / "v1").glob("*.safetensors")) for k, v in load_file(f).items()}
    version = sw.pack(1, trainer.model.named_parameters())
    packed = dict(sw.unpack(version.flat, version.layout))
    assert set(packed) == set(published) and len(packed) > 10
    assert all(torch.equal(packed[k], published[k]) for k in published)
    trainer.close()


def test_a_lora_payload_reads_back_exactly_and_refuses_any_change() -> None:
    tensors = {"a.lora_A.weight": torch.randn(4, 8), "a.lora_B.weight": torch.randn(8, 4).to(torch.bfloat16)}
    payload = sw.adapter_payload(3, tensors, b'{"r": 4}')
    back, config = sw.adapter_tensors(payload)
    assert config == b'{"r": 4}' and back.keys() == tensors.keys()
    assert all(torch.equal(back[k], tensors[k]) and back[k].dtype == tensors[k].dtype for k in tensors)
    for change in ("data", "shape", "dtype", "config"):
        bad = {**payload, "tensors": {k: dict(v) for k, v in payload["tensors"].items()}}
        t = bad["tensors"]["a.lora_A.weight"]
        if change == "data":
            t["data"] = bytes([t["data"][0] ^ 1]) + t["data"][1:]
        elif change == "shape":
            t["shape"] = [8, 4]
        elif change == "dtype":
            t["dtype"] = "int32"
        else:
            bad["config"] = b'{"r": 8}'
        with pytest.raises(ValueError, match="the adapter's sha256 is .* it changed on its way"):
            sw.adapter_tensors(bad)


def test_the_reloads_rotary_note_is_dropped_and_every_other_layers_warning_kept(
        caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's layerwise reload warns for the rotary embedding at every version (its cos/sin cache is no
    checkpoint tensor and is put back as it was): dropped where the worker imports this module. The
    same warning for another layer means weights a version did not replace, and is kept."""
    import logging

    reload_log = logging.getLogger(sw.RELOAD_LOGGER)
    with caplog.at_level(logging.WARNING, logger=sw.RELOAD_LOGGER):
        reload_log.warning("%s: Failed to load weights", "RotaryEmbedding")
        reload_log.warning("%s: Failed to load weights", "QKVParallelLinear")
    assert [r.getMessage() for r in caplog.records] == ["QKVParallelLinear: Failed to load weights"]
