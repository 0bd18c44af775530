"""Trainer state on disk: what a checkpoint holds of the trainer, as safetensors + JSON, never pickle.

A state directory holds three tensor files (`state_files(update)`) and `trainer.json`:
- lora.safetensors (LoRA) or model.safetensors (full): each trainable parameter by name, in its
  own dtype (LoRA: float32; full: trainer.dtype); a tied weight once, under its first name.
- optimizer.safetensors: "<name>.exp_avg", "<name>.exp_avg_sq", "<name>.step" for each
  parameter AdamW has stepped.
- rng.safetensors: "cpu" (and "cuda" on a cuda device) RNG state as uint8.
- trainer.json: format, update mode, version, counters, lr, lora_rank (LoRA), dtype, device,
  parameter shapes and each tensor file's sha256.
The simulated trainer's state is trainer.json alone, marked `"simulated": true`.
Trainer ranks (trainer.devices) write one `rank-NNNNN/` directory per rank, each such a state of
that rank's shards (its trainer.json adds "rank" and "world_size"), and `ranks.json` (the world
size and devices), written by rank 0 once every rank has written its own.

Invariants:
- `trainer.json` holds the sha256 of each tensor file, because safetensors checks no data
  bytes; a file whose bytes do not match is refused as corrupt.
- `read_state` checks everything before it returns and changes nothing: a missing or corrupt
  file, another format, a state of the other update mode (trainer.json without "update" was
  written in LoRA mode) or of the other trainer kind, other parameter names, shapes or dtypes,
  an incomplete AdamW state or another lora_rank raise TrainerError naming the file or parameter.
- Every file is fsynced, then the directory; while writing, one file's tensors are in memory
  at a time (a full model's state is large), except for a state written behind the steps
  (`StateWriter`): a copy of the whole state taken at `begin`, so the files hold that moment's
  state whatever steps follow, and `STATE_WRITTEN` appears only once every file is in place.
- A sharded state loads only onto the same world size; a one-process trainer refuses it, and
  trainer ranks refuse a state that is not theirs (no ranks.json).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from pipeline.config.schema import TrainerConfig
from pipeline.store.checkpoint import STATE_WRITTEN
from pipeline.store.durable import fsync_dir, sha256_file, write_synced
from pipeline.errors import TrainerError

# Bump when what save_state writes changes; load_state refuses any other format. (The update
# mode was added to trainer.json within format 1: a state without it was written in LoRA mode.)
STATE_FORMAT = 1
STATE_FILES = ("lora.safetensors", "optimizer.safetensors", "rng.safetensors")  # LoRA mode; hashed in trainer.json
FULL_STATE_FILES = ("model.safetensors", "optimizer.safetensors", "rng.safetensors")  # full mode: every weight
UPDATE_MODES = ("lora", "full")
ADAM_STATE_KEYS = ("exp_avg", "exp_avg_sq", "step")  # what AdamW keeps per parameter once stepped
RANKS_FILE = "ranks.json"  # in a sharded trainer's state: the world size and devices that wrote it


def state_files(update: str) -> tuple[str, str, str]:
    """The tensor files save_state writes in an update mode: weights, optimizer moments, RNG state."""
    return FULL_STATE_FILES if update == "full" else STATE_FILES


@dataclass(frozen=True)
class Counters:
    """The trainer's counters, saved with its tensors."""

    version: int
    skipped_steps: int
    consecutive_skips: int


@dataclass(frozen=True)
class SavedState:
    """A state read back and checked against the trainer that will load it."""

    weights: dict[str, torch.Tensor]  # parameter name -> its saved weight (shape and dtype checked)
    optimizer: dict[str, dict[str, torch.Tensor]]  # parameter name -> its complete AdamW state
    rng: dict[str, torch.Tensor]  # "cpu" (checked: uint8), and "cuda" when it was saved on a GPU
    counters: Counters
    lr: Any  # the lr it was saved with (a resumed run may change it)


def write_state(directory: Path, cfg: TrainerConfig, trainable: list[tuple[str, torch.Tensor]],
                moments: dict[str, dict[str, Any]], counters: Counters, extra: dict[str, Any] | None = None) -> dict[str, str]:
    """Write the state of a trainer into the existing `directory` (blocking, fsynced): its trainable
    weights by name, each one's AdamW state (`moments`, empty before its first step), its counters,
    and `extra` fields for trainer.json (a sharded trainer's rank and world size). Returns the
    sha256 of every file written, by name."""
    shapes = {n: list(p.shape) for n, p in trainable}
    return _write_files(directory, cfg, _state_tensors(trainable, moments, cfg.device), shapes, counters, extra)


def _write_files(directory: Path, cfg: TrainerConfig, files: Iterable[dict[str, torch.Tensor]],
                 shapes: dict[str, list[int]], counters: Counters, extra: dict[str, Any] | None,
                 behind: bool = False) -> dict[str, str]:
    """`behind`: written beside the steps, by a path that leaves them the GIL (safetensors' save into
    memory holds it; its save_file and reading the file back to hash it do not)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise TrainerError(f"trainer state directory {str(directory)!r} does not exist")
    from safetensors.torch import save, save_file

    digests = {}
    for name, tensors in zip(state_files(cfg.update), files):
        if behind:
            save_file(tensors, str(directory / name))
            digests[name] = sha256_file(directory / name, sync=True)
        else:
            data = save(tensors)
            write_synced(directory / name, data)
            digests[name] = hashlib.sha256(data).hexdigest()
            del data
        del tensors  # before the next file's tensors are gathered: a full model's state is large
    meta = {
        "format": STATE_FORMAT, "update": cfg.update, "version": counters.version,
        "skipped_steps": counters.skipped_steps, "consecutive_skips": counters.consecutive_skips, "lr": cfg.lr,
        "lora_rank": None if cfg.update == "full" else cfg.lora_rank, "dtype": cfg.dtype,
        "device": cfg.device, "parameters": shapes, "sha256": digests,
        **(extra or {}),
    }
    data = json.dumps(meta, indent=1).encode()
    write_synced(directory / "trainer.json", data)
    fsync_dir(directory)
    return {**digests, "trainer.json": hashlib.sha256(data).hexdigest()}


def _state_tensors(trainable: list[tuple[str, torch.Tensor]], moments: dict[str, dict[str, Any]],
                   device: str, copy: bool = False) -> Iterator[dict[str, torch.Tensor]]:
    """The weights, optimizer and RNG files' tensors, one file at a time (`copy`: never the trainer's own
    tensors, even on the CPU, so later steps cannot change them)."""
    yield {n: p.detach().to("cpu", copy=copy).contiguous() for n, p in trainable}
    yield {f"{n}.{k}": torch.as_tensor(v).detach().to("cpu", copy=copy).contiguous()
           for n, _ in trainable for k, v in moments.get(n, {}).items()}
    rng = {"cpu": torch.get_rng_state()}  # get_rng_state returns a new tensor
    if device.startswith("cuda"):
        rng["cuda"] = torch.cuda.get_rng_state(device)
    yield rng


class StateWriter:
    """A trainer's state written behind its steps (`begin`): the tensors are copied to host memory at
    once (the next step changes the originals), then written into the directory by a thread, one
    state at a time. When the files are in place, or the write failed, `STATE_WRITTEN` appears in the
    directory (renamed into place whole): JSON {"error": null or the error's text, "sha256": the
    digest of every file written, by name}. `join` waits for the write under way, if any."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None

    def begin(self, directory: Path, cfg: TrainerConfig, trainable: list[tuple[str, torch.Tensor]],
              moments: dict[str, dict[str, Any]], counters: Counters) -> None:
        self.join()
        files = list(_state_tensors(trainable, moments, cfg.device, copy=True))
        shapes = {n: list(p.shape) for n, p in trainable}
        self._thread = threading.Thread(target=self._write, args=(Path(directory), cfg, files, shapes, counters),
                                        name="trainer-state-writer", daemon=True)
        self._thread.start()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    @staticmethod
    def _write(directory: Path, cfg: TrainerConfig, files: list[dict[str, torch.Tensor]],
               shapes: dict[str, list[int]], counters: Counters) -> None:
        try:
            done = {"error": None, "sha256": _write_files(directory, cfg, files, shapes, counters, None, behind=True)}
        except Exception as e:  # the checkpoint reads it from the marker and fails naming it
            done = {"error": f"{type(e).__name__}: {e}", "sha256": {}}
        del files
        mark_written(directory, done)


def mark_written(directory: Path, done: dict[str, Any]) -> None:
    """Put `STATE_WRITTEN` into `directory` whole (written aside, then renamed); a directory removed
    meanwhile (the checkpoint abandoned) is left alone."""
    tmp = Path(directory) / f"{STATE_WRITTEN}.tmp"
    with contextlib.suppress(FileNotFoundError):
        write_synced(tmp, json.dumps(done).encode())
        os.rename(tmp, Path(directory) / STATE_WRITTEN)


def read_state(directory: Path, cfg: TrainerConfig, trainable: dict[str, torch.nn.Parameter]) -> SavedState:
    """Read a state written by `write_state` and check it fits a trainer of `cfg` with these
    trainable parameters; raises TrainerError, and changes nothing, when it does not."""
    directory = Path(directory)
    full = cfg.update == "full"
    meta_path = directory / "trainer.json"
    meta = _read_meta(meta_path)
    if meta.get("format") != STATE_FORMAT:
        raise TrainerError(f"{meta_path}: format {meta.get('format')!r}, this trainer reads {STATE_FORMAT}")
    if meta.get("simulated"):
        raise TrainerError(f"{meta_path} was written by the simulated trainer, which has no weights to restore")
    _check_update(meta_path, meta, cfg.update)
    if not full and meta.get("lora_rank") != cfg.lora_rank:
        raise TrainerError(f"{meta_path}: saved with lora_rank {meta.get('lora_rank')!r}, "
                           f"this trainer has lora_rank {cfg.lora_rank}")
    if full and meta.get("dtype") != cfg.dtype:
        raise TrainerError(f"{meta_path}: full weights saved in dtype {meta.get('dtype')!r}, "
                           f"this trainer has trainer.dtype {cfg.dtype!r}")
    counters = Counters(*(_counter(meta_path, meta, k) for k in ("version", "skipped_steps", "consecutive_skips")))
    shapes = {n: list(p.shape) for n, p in trainable.items()}
    saved_shapes = meta.get("parameters")
    if not isinstance(saved_shapes, dict):
        raise TrainerError(f"{meta_path}: 'parameters' must map parameter names to shapes")
    _check_same_parameters(meta_path, saved_shapes, shapes)
    digests = meta.get("sha256")
    if not isinstance(digests, dict):
        raise TrainerError(f"{meta_path}: 'sha256' must map file names to digests")
    files = state_files(cfg.update)
    weights, optim, rng = (_read_tensors(directory / f, digests.get(f)) for f in files)

    weights_path = directory / files[0]
    _check_same_parameters(weights_path, {n: list(t.shape) for n, t in weights.items()}, shapes)
    for n, t in weights.items():
        if t.dtype != trainable[n].dtype:
            raise TrainerError(f"{weights_path}: parameter {n!r} is {t.dtype}, expected {trainable[n].dtype}")
    optim_state = _optimizer_state(directory / files[1], optim, trainable)
    rng_path = directory / files[2]
    if "cpu" not in rng or rng["cpu"].dtype != torch.uint8:
        raise TrainerError(f"{rng_path}: no uint8 'cpu' RNG state")
    return SavedState(weights=weights, optimizer=optim_state, rng=rng, counters=counters, lr=meta.get("lr"))


def rank_dir(directory: Path, rank: int) -> Path:
    """Where trainer rank `rank` keeps its part of a sharded state in `directory`."""
    return Path(directory) / f"rank-{rank:05d}"


def write_ranks_file(directory: Path, devices: tuple[str, ...]) -> None:
    """ranks.json of a sharded state (rank 0, once every rank has written its directory), fsynced."""
    meta = {"format": 1, "world_size": len(devices), "devices": list(devices)}
    write_synced(Path(directory) / RANKS_FILE, json.dumps(meta).encode())
    fsync_dir(Path(directory))


def check_ranks_file(directory: Path, world_size: int) -> None:
    """Refuse a state that `world_size` trainer ranks cannot resume: not theirs, or of another world size."""
    path = Path(directory) / RANKS_FILE
    try:
        meta = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise TrainerError(f"{path} is missing: this state was not written by trainer ranks "
                           f"(trainer.devices), and {world_size} ranks cannot resume it") from None
    except (OSError, ValueError) as e:
        raise TrainerError(f"{path} cannot be read as JSON: {e}") from None
    saved = meta.get("world_size") if isinstance(meta, dict) else None
    if saved != world_size:
        raise TrainerError(f"{path}: the state was written by {saved!r} trainer ranks, this run has {world_size} "
                           f"(trainer.devices); a sharded state resumes onto the same number of ranks")


def refuse_ranks_state(directory: Path) -> None:
    """Refuse, in a one-process trainer, a state that trainer ranks wrote (one directory per rank)."""
    ranks = Path(directory) / RANKS_FILE
    if ranks.is_file() and not (Path(directory) / "trainer.json").exists():
        try:
            n = json.loads(ranks.read_bytes()).get("world_size")
        except (OSError, ValueError, AttributeError):
            n = "several"
        raise TrainerError(f"{directory} was written by {n} trainer ranks (trainer.devices); this trainer is one "
                           "process: a sharded state resumes onto the same number of ranks")


def write_simulated_state(directory: Path, update: str, version: int, step_s: float) -> None:
    """trainer.json with the version (and step_s), fsynced: all the state the simulated trainer has."""
    directory = Path(directory)
    if not directory.is_dir():
        raise TrainerError(f"trainer state directory {str(directory)!r} does not exist")
    meta = {"format": STATE_FORMAT, "simulated": True, "update": update, "version": version, "step_s": step_s}
    write_synced(directory / "trainer.json", json.dumps(meta).encode())
    fsync_dir(directory)


def read_simulated_state(directory: Path, update: str) -> int:
    """The version in a state written by `write_simulated_state` (refusing any other trainer's, or mode's)."""
    path = Path(directory) / "trainer.json"
    meta = _read_meta(path)
    if not meta.get("simulated"):
        raise TrainerError(f"{path} was not written by the simulated trainer")
    _check_update(path, meta, update)
    return _counter(path, meta, "version")


def _read_meta(path: Path) -> dict[str, Any]:
    try:
        meta = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise TrainerError(f"trainer state file {path} is missing") from None
    except (OSError, ValueError) as e:  # ValueError: not JSON, or not UTF-8
        raise TrainerError(f"trainer state file {path} cannot be read as JSON: {e}") from None
    if not isinstance(meta, dict):
        raise TrainerError(f"trainer state file {path} must hold a JSON object, got {type(meta).__name__}")
    return meta


def _check_update(path: Path, meta: dict[str, Any], update: str) -> None:
    """Refuse a state written in the other update mode (no "update" field: written in LoRA mode)."""
    saved = meta.get("update", "lora")
    if saved not in UPDATE_MODES:
        raise TrainerError(f"{path}: update must be one of {', '.join(UPDATE_MODES)}, got {saved!r}")
    if saved != update:
        what = {"lora": "LoRA adapter weights", "full": "all model weights"}
        raise TrainerError(f"{path} was written by a trainer with trainer.update = {saved!r} ({what[saved]}); "
                           f"this trainer has trainer.update = {update!r} ({what[update]}): a state resumes "
                           "only in the mode that wrote it")


def _counter(path: Path, meta: dict[str, Any], key: str) -> int:
    v = meta.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise TrainerError(f"{path}: {key} must be an integer >= 0, got {v!r}")
    return v


def _read_tensors(path: Path, sha256: Any) -> dict[str, torch.Tensor]:
    """The tensors of one state file, after checking its bytes against the digest in trainer.json."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise TrainerError(f"trainer state file {path} is missing") from None
    except OSError as e:
        raise TrainerError(f"trainer state file {path} cannot be read: {e}") from None
    if not isinstance(sha256, str):
        raise TrainerError(f"trainer.json has no sha256 for {path.name}")
    if hashlib.sha256(data).hexdigest() != sha256:
        raise TrainerError(f"trainer state file {path} is corrupt: its sha256 does not match trainer.json")
    try:
        return load(data)
    except (SafetensorError, ValueError, RuntimeError) as e:  # the digest matched a file that is not safetensors
        raise TrainerError(f"trainer state file {path} is not valid safetensors: {e}") from None


def _check_same_parameters(path: Path, saved: dict[str, Any], expected: dict[str, list[int]]) -> None:
    """Raise TrainerError naming the first parameter missing, unexpected or of another shape."""
    missing = [n for n in expected if n not in saved]
    if missing:
        raise TrainerError(f"{path}: no parameter {missing[0]!r} ({len(missing)} of this trainer's "
                           f"{len(expected)} missing; other target_modules?)")
    extra = [n for n in saved if n not in expected]
    if extra:
        raise TrainerError(f"{path}: parameter {extra[0]!r} is not in this trainer ({len(extra)} unknown; "
                           f"other target_modules?)")
    for n, shape in expected.items():
        if saved[n] != shape:
            raise TrainerError(f"{path}: parameter {n!r} has shape {saved[n]}, this trainer's is {shape}")


def _optimizer_state(path: Path, tensors: dict[str, torch.Tensor],
                     params: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """Group "<name>.<key>" tensors by parameter and check each is a complete AdamW state
    (moments of the parameter's shape and dtype)."""
    state: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        name, _, field = key.rpartition(".")
        if name not in params:
            raise TrainerError(f"{path}: {key!r} is for parameter {name!r}, which is not in this trainer")
        state.setdefault(name, {})[field] = t
    for name, st in state.items():
        absent = [k for k in ADAM_STATE_KEYS if k not in st]
        if absent:
            raise TrainerError(f"{path}: parameter {name!r} has no {absent[0]!r}")
        p = params[name]
        for k in ("exp_avg", "exp_avg_sq"):
            if st[k].shape != p.shape or st[k].dtype != p.dtype:
                raise TrainerError(f"{path}: {name}.{k} is {st[k].dtype} {list(st[k].shape)}, "
                                   f"expected {p.dtype} {list(p.shape)}")
        if st["step"].numel() != 1:
            raise TrainerError(f"{path}: {name}.step must be a scalar, got shape {list(st['step'].shape)}")
    return state
