"""A version handed from the trainer to the engines in memory, not through files.

Full weights: from the trainer's GPU memory to a vLLM worker on the same GPU (CUDA IPC). LoRA:
the adapter's tensors as plain bytes in the step's reply, for engines in the orchestrator's
process (`adapter_payload`, `adapter_tensors`).

trainer.publish = "memory" (docs/full-weights.md): the trainer packs and shares each version
(`PolicyTrainer.share_weights`, which keeps the buffer while an engine may load it), the vLLM
engine has its worker load it (`pipeline.engines.vllm`). `benchmarks/probes/full_weight_sync_probe.py`
measures this way beside the filesystem's.

The producer packs a version into one flat byte buffer of its own (`pack`) and shares it as one
CUDA IPC handle (`share`); vLLM's worker, extended with `SharedWeightsWorker` (vLLM's
`worker_extension_cls`), opens the handle, checks the bytes it sees against the checksum taken at
packing, and reloads its model from them through the same layerwise reload vLLM runs for a
directory (`reload_weights`, checkpoint format: tensor names as the trainer's model has them).

Invariants:
- A packed version is a copy: the producer's later steps do not change it. CUDA IPC memory stays
  the producer's, so the producer keeps the `Packed` until the worker's load has returned.
- Each tensor starts at a multiple of `ALIGN` bytes; the padding between tensors is zero.
- `checksum` depends on every byte and on its position: a buffer overwritten, cut short or
  shifted does not match the producer's.
- The worker reloads nothing unless the bytes it opened have the producer's checksum and every
  tensor of the layout lies inside them.
- A LoRA payload is read back (`adapter_tensors`) only if its sha256 (over the config and every
  tensor's name, dtype, shape and bytes) is the trainer's, into new tensors of its own.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Mapping

import torch

ALIGN = 16  # bytes: every dtype's alignment, and the int64 words `checksum` reads
_CHUNK_WORDS = 1 << 24  # `checksum` weighs 128 MiB at a time: its scratch stays that small
_U64 = (1 << 64) - 1  # a wrapped int64 sum as the unsigned 64-bit number it stands for


@dataclass(frozen=True)
class Layout:
    """Where each tensor of a packed version lies in its flat buffer."""

    names: tuple[str, ...]
    dtypes: tuple[str, ...]  # torch dtype names ("bfloat16")
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]  # bytes into the buffer
    nbytes: int  # the buffer's size

    @classmethod
    def of(cls, d: dict[str, Any]) -> Layout:
        """From `asdict(layout)` after a trip through msgpack (lists for tuples)."""
        return cls(names=tuple(d["names"]), dtypes=tuple(d["dtypes"]), shapes=tuple(tuple(s) for s in d["shapes"]),
                   offsets=tuple(d["offsets"]), nbytes=int(d["nbytes"]))


@dataclass
class Packed:
    """One version's weights in a buffer nothing else writes."""

    version: int
    flat: torch.Tensor  # uint8, on the producer's device
    layout: Layout
    checksum: str


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * dtype.itemsize


def tensor_at(flat: torch.Tensor, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor of `dtype` and `shape` at byte `offset` of `flat` (a view, no copy)."""
    return flat[offset:offset + _nbytes(dtype, shape)].view(dtype).view(shape)


def pack(version: int, named: Iterable[tuple[str, torch.Tensor]]) -> Packed:
    """Copy `named` tensors (all on one device) into one new flat buffer on that device."""
    named = [(name, t.detach()) for name, t in named]
    if not named:
        raise ValueError("pack: no tensors")
    offsets, end = [], 0
    for _, t in named:
        offsets.append(end)
        end += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    flat = torch.zeros(max(end, ALIGN), dtype=torch.uint8, device=named[0][1].device)
    for (_, t), offset in zip(named, offsets):
        tensor_at(flat, offset, t.dtype, tuple(t.shape)).copy_(t)
    layout = Layout(names=tuple(n for n, _ in named), dtypes=tuple(str(t.dtype).removeprefix("torch.") for _, t in named),
                    shapes=tuple(tuple(t.shape) for _, t in named), offsets=tuple(offsets), nbytes=flat.numel())
    return Packed(version=version, flat=flat, layout=layout, checksum=checksum(flat))


def unpack(flat: torch.Tensor, layout: Layout) -> list[tuple[str, torch.Tensor]]:
    """(name, view into `flat`) for every tensor of `layout`; ValueError if one lies outside `flat`."""
    if flat.dtype != torch.uint8 or flat.numel() != layout.nbytes:
        raise ValueError(f"the buffer holds {flat.numel()} {flat.dtype} elements; the layout says {layout.nbytes} bytes")
    out = []
    for name, dtype_name, shape, offset in zip(layout.names, layout.dtypes, layout.shapes, layout.offsets, strict=True):
        dtype = getattr(torch, dtype_name)
        if offset % ALIGN or offset < 0 or offset + _nbytes(dtype, shape) > layout.nbytes:
            raise ValueError(f"tensor {name} at byte {offset} ({dtype_name}, {list(shape)}) lies outside the buffer")
        out.append((name, tensor_at(flat, offset, dtype, shape)))
    return out


def checksum(flat: torch.Tensor) -> str:
    """Two sums over the buffer's int64 words, on its device: the words, and each word times its
    position (both wrapping at 2^64, so the order of the additions does not matter)."""
    words = flat.view(torch.int64)
    plain = torch.zeros((), dtype=torch.int64, device=flat.device)
    weighted = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, words.numel(), _CHUNK_WORDS):
        chunk = words[start:start + _CHUNK_WORDS]
        position = torch.arange(start + 1, start + 1 + chunk.numel(), dtype=torch.int64, device=flat.device)
        plain += chunk.sum()
        weighted += (chunk * position).sum()
    return f"{int(plain) & _U64:016x}{int(weighted) & _U64:016x}"


def adapter_payload(version: int, tensors: dict[str, torch.Tensor], config: bytes) -> dict[str, Any]:
    """A LoRA version as plain data (trainer.publish = "memory" with LoRA): each tensor's dtype,
    shape and bytes (a host copy), the adapter_config.json bytes, and a sha256 over all of them."""
    plain = {name: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                    "data": t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()}
             for name, t in tensors.items()}
    return {"version": version, "config": bytes(config), "tensors": plain, "checksum": _adapter_digest(config, plain)}


def adapter_tensors(payload: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], bytes]:
    """`adapter_payload`'s tensors (new CPU tensors) and config bytes; ValueError unless they hash
    to its checksum and each tensor's bytes fit its dtype and shape."""
    plain, config = payload["tensors"], payload["config"]
    seen = _adapter_digest(config, plain)
    if seen != payload["checksum"]:
        raise ValueError(f"version {payload['version']}: the adapter's sha256 is {seen}, the trainer's "
                         f"{payload['checksum']}: it changed on its way")
    out = {}
    for name, t in plain.items():
        dtype = getattr(torch, t["dtype"])
        if len(t["data"]) != _nbytes(dtype, tuple(t["shape"])):
            raise ValueError(f"version {payload['version']}: tensor {name} holds {len(t['data'])} bytes, "
                             f"not those of {t['dtype']} {t['shape']}")
        out[name] = torch.frombuffer(bytearray(t["data"]), dtype=torch.uint8).view(dtype).reshape(t["shape"])
    return out, config


def _adapter_digest(config: bytes, plain: dict[str, dict[str, Any]]) -> str:
    h = hashlib.sha256(config)
    for name in sorted(plain):
        t = plain[name]
        h.update(f"\0{name}\0{t['dtype']}\0{t['shape']}\0{len(t['data'])}\0".encode())
        h.update(t["data"])
    return h.hexdigest()


# reduce_tensor's arguments for rebuild_cuda_tensor (torch.multiprocessing.reductions), in order
_IPC_FIELDS = ("tensor_cls", "size", "stride", "tensor_offset", "storage_cls", "dtype", "device", "handle",
               "storage_size_bytes", "storage_offset_bytes", "requires_grad", "ref_counter_handle",
               "ref_counter_offset", "event_handle", "event_sync_required")
# the classes a plain CUDA buffer's arguments name, by name: the payload carries no Python objects
_CLASSES = {"Tensor": torch.Tensor, "TypedStorage": torch.TypedStorage, "UntypedStorage": torch.UntypedStorage}


def ipc_fields(args: tuple[Any, ...]) -> dict[str, Any]:
    """reduce_tensor's arguments as plain data (names, ints, bytes): what vLLM's RPC carries, and
    what the worker rebuilds without unpickling anything."""
    fields = dict(zip(_IPC_FIELDS, args, strict=True))
    for key in ("tensor_cls", "storage_cls"):
        name = fields[key].__name__
        if _CLASSES.get(name) is not fields[key]:
            raise ValueError(f"share: a buffer whose {key} is {fields[key]!r} cannot be sent as plain data")
        fields[key] = name
    fields["dtype"] = str(fields["dtype"]).removeprefix("torch.")
    fields["size"], fields["stride"] = list(fields["size"]), list(fields["stride"])
    return fields


def ipc_args(fields: dict[str, Any], device: int) -> tuple[Any, ...]:
    """`ipc_fields`' inverse, for `device` (this process's index of the producer's GPU)."""
    plain = {**fields, "tensor_cls": _CLASSES[fields["tensor_cls"]], "storage_cls": _CLASSES[fields["storage_cls"]],
             "dtype": getattr(torch, fields["dtype"]), "size": torch.Size(fields["size"]),
             "stride": tuple(fields["stride"]), "device": device}
    return tuple(plain[k] for k in _IPC_FIELDS)


def share(packed: Packed) -> dict[str, Any]:
    """What the worker needs, as plain data vLLM's RPC carries: the version, the layout, the
    checksum and the buffer's CUDA IPC handle."""
    from torch.multiprocessing.reductions import reduce_tensor

    if packed.flat.device.type != "cuda":
        raise ValueError(f"share: CUDA IPC needs a CUDA buffer, got one on {packed.flat.device}")
    _, args = reduce_tensor(packed.flat)
    return {"version": packed.version, "layout": asdict(packed.layout), "checksum": packed.checksum,
            "ipc": ipc_fields(args)}


def open_shared(payload: dict[str, Any]) -> torch.Tensor:
    """The producer's buffer, opened on this process's current CUDA device (the same GPU)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(*ipc_args(payload["ipc"], torch.cuda.current_device()))


# vLLM 0.24's layerwise reload (`reload_weights`, from a directory or from memory) warns
# "RotaryEmbedding: Failed to load weights" at every version: that layer's only tensor is its cos/sin
# cache, a buffer no checkpoint holds, which vLLM puts back as it was. The same warning for any other
# layer (weights a version did not replace) is kept. Installed where vLLM's worker imports this module.
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
_ROTARY_NOTE = "RotaryEmbedding: Failed to load weights"


class _NoRotaryReloadNote(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != _ROTARY_NOTE


logging.getLogger(RELOAD_LOGGER).addFilter(_NoRotaryReloadNote())


class SharedWeightsWorker:
    """Mixed into vLLM's GPU worker (`worker_extension_cls="pipeline.engines.shared_weights.SharedWeightsWorker"`);
    called as `collective_rpc("load_shared_weights", args=(share(packed),))` while generation is paused."""

    model_runner: Any  # vLLM's GPUModelRunner, set by the worker this class is mixed into

    def load_shared_weights(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Reload the model from the shared buffer; refuse (ValueError) bytes that do not check out.

        Whatever happens, this process lets go of the buffer before returning or raising (a refusal's
        traceback keeps this frame, and so would keep the producer's memory mapped)."""
        t0 = time.perf_counter()
        flat = open_shared(payload)
        weights = unpack(flat, Layout.of(payload["layout"]))
        try:
            seen = checksum(flat)
            if seen != payload["checksum"]:
                raise ValueError(f"version {payload['version']}: the shared buffer's checksum is {seen}, "
                                 f"the producer's {payload['checksum']}: its memory changed after packing")
            t_checked = time.perf_counter()
            self.model_runner.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
            if flat.is_cuda:
                torch.cuda.synchronize()
        finally:
            del weights, flat
        return {"version": payload["version"], "checksum": seen, "open_check_s": t_checked - t0,
                "reload_s": time.perf_counter() - t_checked}
