"""Trainer ranks: `trainer.devices` starts one trainer process per entry, one FSDP2 group.

The pipeline talks to rank 0 as it talks to a one-device trainer process (ProcessTrainer: one
request at a time, over a pipe); rank 0 hands every request on to the other ranks
(pipeline.trainer.fsdp). This side starts the ranks and watches them.

Invariants:
- Ranks of one host meet at a FileStore in a fresh temporary directory (`file://`): no store
  listens on a port. gloo and NCCL then connect the ranks to each other over the loopback
  interface only (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME = lo, over what the environment says).
- With trainer.remote_ranks, ranks of other hosts (`python -m pipeline.trainer.fsdp`) join at
  trainer.rendezvous, a TCP store that rank 0 listens on, and the ranks' connections use any
  interface: the one documented exception to "nothing listens" (docs/fault-tolerance.md#security).
  Their processes are not this host's to watch: one that dies or hangs ends the call through the
  collective that waits on it (an error on rank 0, or trainer.step_timeout_s).
- Every wait for an answer also watches every rank: a rank that dies ends the call at once with
  a TrainerError naming the rank, its device and its exit code, and every other rank is killed
  (none keeps its device). A call that gets no answer within its bound (trainer.step_timeout_s;
  setup: the start timeout) kills every rank too; its error names each rank's process state, so
  a stopped or hung rank can be told from those waiting on it in a collective.
- After either, every later call raises TrainerError; the run ends there, after its last
  checkpoint, which `--resume` continues onto the same number of ranks.
- `close()` stops rank 0, which stops the others; any rank still running after 10 s is killed,
  and the rendezvous directory is removed.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import structlog

from pipeline.config.schema import LossConfig, TrainerConfig
from pipeline.errors import TrainerError
from pipeline.trainer.process import _FLUSH_S, ProcessTrainer, TrainerProcess, spawn_follower

log = structlog.get_logger(__name__)

_STATES = {"R": "running", "S": "waiting", "D": "in I/O", "T": "stopped", "t": "stopped (traced)", "Z": "dead"}


@dataclass(frozen=True)
class RankSpec:
    """Where one rank stands in the group, sent to it when it starts."""

    rank: int
    world_size: int
    devices: tuple[str, ...]  # the device of every rank ("remote" for one this host does not know)
    init_method: str  # torch.distributed's rendezvous: file:// on one host, tcp:// across hosts
    timeout_s: float  # trainer.step_timeout_s: the bound of every collective inside a call
    local: bool = True  # every rank on this host: gloo and NCCL talk over the loopback interface only

    @property
    def device(self) -> str:
        return self.devices[self.rank]

    @property
    def backend(self) -> str:
        return "nccl" if self.device.startswith("cuda") else "gloo"


def leader(*args: Any, **kwargs: Any) -> Any:
    """Rank 0's trainer (pipeline.trainer.fsdp.leader), named here so that the pipeline's process
    does not import torch: sent by reference, resolved in rank 0's process."""
    from pipeline.trainer.fsdp import leader as build

    return build(*args, **kwargs)


def early_process(cfg: TrainerConfig) -> TrainerProcess:
    """Rank 0's process, started before the model exists (as build.early_trainer_process does for one device)."""
    return TrainerProcess(cfg, trainer_cls=leader)


def _process_state(pid: int | None) -> str:
    """A process's scheduler state from /proc ("gone" when it has exited)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, TypeError):
        return "gone"
    return _STATES.get(stat.rpartition(")")[2].split()[0], "unknown")


class RankedTrainer(ProcessTrainer):
    """A sharded trainer of len(trainer.devices) ranks, with ProcessTrainer's interface."""

    def __init__(self, model_path: str | Path, cfg: TrainerConfig, loss_cfg: LossConfig, *,
                 process: TrainerProcess | None = None, **kwargs: Any) -> None:
        super().__init__(model_path, cfg, loss_cfg, trainer_cls=leader, process=process, **kwargs)
        self.remote_ranks = cfg.remote_ranks
        self.devices = (*cfg.devices, *(["remote"] * cfg.remote_ranks))  # remote ranks report nothing here
        self.world_size = len(self.devices)
        self._followers: list[tuple[Any, threading.Thread]] = []  # ranks 1.. : (process, event reader)
        self._rendezvous: str | None = None

    @property
    def pids(self) -> list[int | None]:
        """Each rank's process id, rank 0 first (empty before setup and after close)."""
        if self._proc is None:
            return []
        return [self._proc.pid, *(p.pid for p, _ in self._followers)]

    def setup(self) -> None:
        cfg = self._args[1]
        if self.remote_ranks:  # rank 0's TCP store listens there for the ranks of other hosts
            init = cfg.rendezvous
        else:
            self._rendezvous = tempfile.mkdtemp(prefix="pipeline-ranks-")
            init = f"file://{self._rendezvous}/store"
        local = not self.remote_ranks
        specs = [RankSpec(r, self.world_size, self.devices, init, self.step_timeout_s, local=local)
                 for r in range(len(cfg.devices))]
        log.info("trainer_ranks", world_size=self.world_size, devices=list(self.devices), backend=specs[0].backend,
                 rendezvous=init, remote_ranks=self.remote_ranks)
        if self.remote_ranks:
            log.info("trainer_ranks_waiting", rendezvous=init, first_remote_rank=len(specs), world_size=self.world_size,
                     command=f"torchrun --standalone --nproc-per-node N -m pipeline.trainer.fsdp --rendezvous {init} "
                             f"--first-rank {len(specs)} --world-size {self.world_size}")
        self._followers = [spawn_follower(spec, cfg) for spec in specs[1:]]
        self._kwargs["ranks"] = specs[0]
        super().setup()

    def _answered(self, conn: Connection, timeout: float, method: str) -> bool:
        sentinels = {p.sentinel: (rank, p) for rank, (p, _) in enumerate(self._followers, start=1)}
        ready = wait([conn, *sentinels], timeout)
        # a rank other than 0 that died is the news, even beside rank 0's answer: that answer may
        # only be the end of its pipe (rank 0 failed in the collective that waited on the dead rank)
        for s in (s for s in ready if s is not conn):
            rank, proc = sentinels[s]
            proc.join(1)
            code = proc.exitcode
            self._kill()
            raise TrainerError(f"trainer rank {rank} ({self.devices[rank]}) died (exit code {code}) during "
                               f"{method}; every rank was stopped. `--resume` continues from the last checkpoint")
        return conn in ready

    def _no_answer(self, method: str, limit: str) -> str:
        pids = self.pids
        states = ", ".join(f"rank {r} on {self.devices[r]}: {_process_state(pid)}" for r, pid in enumerate(pids))
        return f"trainer ranks did not answer {method} within {limit} ({states}); every rank was killed"

    def _dead(self, method: str) -> TrainerError:
        e = super()._dead(method)
        return TrainerError(f"trainer rank 0 ({self.devices[0]}): {e}")

    def _kill(self) -> None:
        for proc, _ in self._followers:
            if proc.is_alive():
                proc.kill()
        super()._kill()
        self._reap_followers(5)

    def _reap_followers(self, wait_s: float) -> None:
        for proc, reader in self._followers:
            proc.join(wait_s)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
            reader.join(_FLUSH_S)

    def close(self) -> None:
        """Stop rank 0 (which stops the others), then make sure every rank has ended."""
        try:
            super().close()
        finally:
            self._reap_followers(10)
            self._followers = []
            if self._rendezvous is not None:
                shutil.rmtree(self._rendezvous, ignore_errors=True)
                self._rendezvous = None
