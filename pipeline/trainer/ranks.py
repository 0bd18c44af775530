"""Trainer ranks (`trainer.devices`): one process each, one FSDP2 group; how they start, talk and are watched.

The pipeline talks to rank 0 as it talks to a one-device trainer process (`RankedTrainer` is a
ProcessTrainer: one request at a time, over a pipe). Rank 0 relays every request to the other
ranks (`LeaderChannel`); each rank runs a PolicyTrainer given the ranks' collectives
(`RankCollectives`), which shards its model (pipeline.trainer.fsdp). `python -m
pipeline.trainer.ranks` starts a rank on another host (docs/gpus.md#trainer-ranks).

Invariants:
- Ranks of one host meet at a FileStore in a fresh temporary directory (`file://`): no store
  listens on a port. gloo and NCCL then connect the ranks to each other over the loopback
  interface only (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME = lo, over what the environment says).
- With trainer.remote_ranks, ranks of other hosts join at trainer.rendezvous, a TCP store that
  rank 0 listens on, and the ranks' connections use any interface: the one documented exception
  to "nothing listens" (docs/fault-tolerance.md#security). Their processes are not this host's to
  watch: one that dies or hangs ends the call through the collective that waits on it (an error
  on rank 0, or trainer.step_timeout_s).
- Rank 0 leads: it alone talks to the pipeline (its pipe), hands each request on to the others
  (a broadcast on a gloo control group of its own) and answers once every rank has; an error on
  any rank is the answer, naming the rank.
- Waits inside a call (the training group's collectives) are bounded by trainer.step_timeout_s.
  Between calls ranks other than 0 wait on the control group without a bound (the pipeline may
  idle for hours); each exits when rank 0's connection or its own parent is gone.
- Every wait for an answer also watches every rank: a rank that dies ends the call at once with
  a TrainerError naming the rank, its device and its exit code, and every other rank is killed
  (none keeps its device). A call that gets no answer within its bound (trainer.step_timeout_s;
  setup: the start timeout) kills every rank too; its error names each rank's process state, so
  a stopped or hung rank can be told from those waiting on it in a collective.
- After either, every later call raises TrainerError; the run ends there, after its last
  checkpoint, which `--resume` continues onto the same number of ranks.
- `close()` stops rank 0, which stops the others; any rank still running after 10 s is killed,
  and the rendezvous directory is removed.
- NCCL's NVLink multicast stays off (NCCL_NVLS_ENABLE=0) unless the environment sets it.
- The pipeline's process imports this module without torch: torch is imported in the ranks' own.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import traceback
from dataclasses import dataclass, replace
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import structlog

from pipeline.config.schema import LossConfig, TrainerConfig
from pipeline.errors import TrainerError
from pipeline.trainer.process import (FLUSH_S, ProcessTrainer, TrainerProcess, child_start, priority_of, run_call,
                                      set_threads, start_child)

log = structlog.get_logger(__name__)

_STATES = {"R": "running", "S": "waiting", "D": "in I/O", "T": "stopped", "t": "stopped (traced)", "Z": "dead"}
_IDLE = timedelta(days=365)  # the control group's bound: ranks wait there between calls


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


# ---------------------------------------------------------------------- inside each rank


class RankCollectives:
    """pipeline.trainer.collectives.Collectives over torch.distributed: numbers over the training
    group (on the device with NCCL), objects and barriers over the control group (gloo)."""

    sharded = True

    def __init__(self, spec: RankSpec, control: Any) -> None:
        self.rank = spec.rank
        self.world_size = spec.world_size
        self.devices = spec.devices
        self.control = control
        self._device = spec.device if spec.backend == "nccl" else "cpu"

    def _all_reduce(self, values: list[float], op: Any) -> list[float]:
        import torch
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=self._device)
        dist.all_reduce(t, op=op)
        return t.tolist()

    def sum(self, values: list[float]) -> list[float]:
        import torch.distributed as dist

        return self._all_reduce(values, dist.ReduceOp.SUM)

    def max(self, values: list[float]) -> list[float]:
        import torch.distributed as dist

        return self._all_reduce(values, dist.ReduceOp.MAX)

    def gather(self, obj: Any) -> list[Any]:
        import torch.distributed as dist

        every: list[Any] = [None] * self.world_size
        dist.all_gather_object(every, obj, group=self.control)
        return every

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self.control)

    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0's `obj`, on every rank (the others pass nothing)."""
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def gather_to_leader(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj` in rank order, on rank 0 (None on the others)."""
        import torch.distributed as dist

        every: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, every, dst=0, group=self.control)
        return every


def join(spec: RankSpec) -> RankCollectives:
    """Join the process group (blocking until every rank has, up to spec.timeout_s) and make the
    control group: this rank's collectives."""
    import torch
    import torch.distributed as dist

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if spec.local:  # nothing but the other ranks of this host can connect, whatever the environment says
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        os.environ["NCCL_SOCKET_IFNAME"] = "lo"
    kwargs: dict[str, Any] = {}
    if spec.backend == "nccl":
        torch.cuda.set_device(spec.device)
        kwargs["device_id"] = torch.device(spec.device)
    dist.init_process_group(spec.backend, init_method=spec.init_method, rank=spec.rank, world_size=spec.world_size,
                            timeout=timedelta(seconds=spec.timeout_s), **kwargs)
    return RankCollectives(spec, dist.new_group(backend="gloo", timeout=_IDLE))


def _rank_trainer(start: tuple[str, TrainerConfig, LossConfig, dict[str, Any]], spec: RankSpec,
                  collectives: RankCollectives) -> Any:
    """This rank's PolicyTrainer, on its own device, from the trainer's arguments."""
    from pipeline.trainer.policy import PolicyTrainer

    model_path, cfg, loss_cfg, kwargs = start
    return PolicyTrainer(model_path, replace(cfg, device=spec.device), loss_cfg, collectives=collectives, **kwargs)


def leader(model_path: str, cfg: TrainerConfig, loss_cfg: LossConfig, *, ranks: RankSpec, **kwargs: Any) -> Any:
    """Rank 0's trainer, built in the pipeline's trainer process (ProcessTrainer's `trainer_cls`):
    join, hand the trainer's arguments to the other ranks, build its own."""
    collectives = join(ranks)
    start = (model_path, cfg, loss_cfg, kwargs)
    collectives.broadcast(start)
    return _rank_trainer(start, ranks, collectives)


class LeaderChannel:
    """Rank 0's side of the pipeline's pipe: each request is passed on to every rank before it is
    run, and each answer waits for theirs (the first error among them is the answer)."""

    def __init__(self, conn: Any, collectives: RankCollectives) -> None:
        self.conn = conn
        self.collectives = collectives
        self.method = ""

    def recv(self) -> Any:
        request = self.conn.recv()
        self.method = request[0]
        self.collectives.broadcast(request)
        return request

    def send(self, reply: tuple[str, Any]) -> None:
        if self.method != "stop":
            statuses = self.collectives.gather_to_leader(("ok", None))
            assert statuses is not None, "rank 0 gathers"
            for rank, (status, value) in enumerate(statuses):
                if reply[0] == "ok" and status == "error":
                    name, msg, tb = value
                    reply = ("error", (name, f"trainer rank {rank} ({self.collectives.devices[rank]}): {msg}", tb))
        self.conn.send(reply)

    def close(self) -> None:
        self.conn.close()


def leader_channel(conn: Any, trainer: Any) -> LeaderChannel:
    """What rank 0's trainer process reads its requests from and answers on (ProcessTrainer's `channel`)."""
    return LeaderChannel(conn, trainer.collectives)


def serve_follower(spec: RankSpec) -> None:
    """A rank other than 0: join, build the trainer from rank 0's arguments, then run each request
    rank 0 passes on until it says stop (or its connection goes)."""
    import torch.distributed as dist

    collectives = join(spec)
    trainer = _rank_trainer(collectives.broadcast(), spec, collectives)
    while True:
        try:
            request = collectives.broadcast()
        except (RuntimeError, dist.DistBackendError):  # rank 0 is gone
            log.warning("trainer_rank_lost_leader", rank=spec.rank)
            return
        method, margs = request
        if method == "stop":
            return
        status: tuple[str, Any]
        try:
            run_call(trainer, method, margs)
            status = ("ok", None)
        except Exception as e:  # the answer of this rank, which rank 0 reports
            status = ("error", (type(e).__name__, str(e), traceback.format_exc()))
        collectives.gather_to_leader(status)


def _follower_process(events: Connection, floor: int, spec: RankSpec, threads_cfg: TrainerConfig,
                      priority: tuple[int, bool]) -> None:
    """The process of a rank other than 0, started by RankedTrainer: it serves rank 0's requests, not a pipe."""
    shipper = child_start(events, floor, priority)
    shipper.tags["process"] = f"trainer-rank-{spec.rank}"  # rank 0 is "trainer", as a one-device trainer
    code = 0
    try:
        set_threads(threads_cfg)
        serve_follower(spec)
    except BaseException:
        log.exception("trainer_rank_failed", rank=spec.rank)
        code = 1
    shipper.flush(FLUSH_S)
    os._exit(code)  # as a stopped trainer process: nothing left for the interpreter's teardown


# ---------------------------------------------------------------------- the pipeline's side: start and watch


def _start_follower(spec: RankSpec, cfg: TrainerConfig) -> tuple[Any, threading.Thread]:
    """Start rank `spec.rank` (> 0): (its process, the thread forwarding its events)."""
    return start_child(_follower_process, lambda events, floor: (events, floor, spec, cfg, priority_of(cfg)),
                       f"pipeline-trainer-rank-{spec.rank}")


def early_process(cfg: TrainerConfig) -> TrainerProcess:
    """Rank 0's process, started before the model exists (as build.early_trainer_process does for one device)."""
    return TrainerProcess(cfg, trainer_cls=leader, channel=leader_channel)


def _process_state(pid: int | None) -> str:
    """A process's scheduler state from /proc ("gone" when it has exited)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, TypeError):
        return "gone"
    return _STATES.get(stat.rpartition(")")[2].split()[0], "unknown")


class RankedTrainer(ProcessTrainer):
    """A sharded trainer of len(trainer.devices) ranks (plus trainer.remote_ranks), with ProcessTrainer's interface."""

    def __init__(self, model_path: str | Path, cfg: TrainerConfig, loss_cfg: LossConfig, *,
                 process: TrainerProcess | None = None, **kwargs: Any) -> None:
        super().__init__(model_path, cfg, loss_cfg, trainer_cls=leader, channel=leader_channel, process=process,
                         **kwargs)
        self.cfg = cfg
        self.remote_ranks = cfg.remote_ranks
        self.devices = (*cfg.devices, *(["remote"] * cfg.remote_ranks))  # remote ranks report nothing here
        self.world_size = len(self.devices)
        self._followers: list[tuple[Any, threading.Thread]] = []  # ranks 1.. : (process, event reader)
        self._rendezvous: str | None = None

    @property
    def pids(self) -> list[int | None]:
        """Each rank's process id, rank 0 first (empty before setup and after close)."""
        if self.pid is None:
            return []
        return [self.pid, *(p.pid for p, _ in self._followers)]

    def setup(self) -> None:
        cfg = self.cfg
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
                     command=f"torchrun --standalone --nproc-per-node N -m pipeline.trainer.ranks --rendezvous {init} "
                             f"--first-rank {len(specs)} --world-size {self.world_size}")
        self._followers = [_start_follower(spec, cfg) for spec in specs[1:]]
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
            reader.join(FLUSH_S)

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


def main(argv: list[str] | None = None) -> None:
    """A rank on another host (under torchrun or alone): join the pipeline's group and serve it.

    rank = --first-rank + LOCAL_RANK (torchrun sets it; 0 alone), its device cuda:LOCAL_RANK, or cpu."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m pipeline.trainer.ranks", description=main.__doc__)
    p.add_argument("--rendezvous", required=True, help="tcp://HOST:PORT of the pipeline's trainer.rendezvous")
    p.add_argument("--first-rank", type=int, required=True, help="the rank of this host's first process")
    p.add_argument("--world-size", type=int, required=True, help="every rank of the trainer, on all hosts")
    p.add_argument("--device", default="", help='"cpu", or cuda:LOCAL_RANK when unset')
    p.add_argument("--timeout-s", type=float, default=3600.0, help="trainer.step_timeout_s of the run")
    a = p.parse_args(argv)
    from pipeline.observe.log import configure_logging

    configure_logging(None, "info")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    rank = a.first_rank + local_rank
    if not 0 < rank < a.world_size:
        p.error(f"rank {rank} (--first-rank {a.first_rank} + LOCAL_RANK {local_rank}) is not in 1..{a.world_size - 1}")
    device = a.device or f"cuda:{local_rank}"
    devices = tuple(device if r == rank else "remote" for r in range(a.world_size))
    log.info("trainer_rank_joining", rank=rank, world_size=a.world_size, device=device, rendezvous=a.rendezvous)
    serve_follower(RankSpec(rank, a.world_size, devices, a.rendezvous, a.timeout_s, local=False))


if __name__ == "__main__":
    main()
