"""A trainer rank: one process of a sharded trainer, FSDP2 (`fully_shard`) over torch.distributed.

`trainer.devices = ["cuda:1", "cuda:2"]` (or `["cpu", "cpu"]`) runs one rank per entry as one
process group: NCCL on GPUs, gloo on the CPU. pipeline.trainer.ranks starts and watches the
ranks; this module is what runs inside each, and `python -m pipeline.trainer.fsdp` starts a rank
on another host (docs/gpus.md#trainer-ranks).

Invariants:
- The model is sharded per decoder layer and at its root, for LoRA and for full weights, and so
  is AdamW's state; gradients are summed over the ranks (divide factor 1).
- Every rank holds the whole batch. The rows of each optimizer step are split into contiguous
  shares, one per rank; each micro-batch's loss is weighed by its share of the whole step's
  tokens (or sequences), so the summed gradient, the loss and every train/* statistic equal the
  one-process trainer's up to float rounding. Every rank makes the same number of forward and
  backward passes (a rank whose share is used up runs one that weighs nothing), because each
  pass's all-gathers and reduce-scatters are collectives. Log-probs computed without grad
  (proximal, reference, `recompute_logprobs`) are computed for every row on every rank.
- Rank 0 leads: it alone talks to the pipeline (its pipe), hands each request on to the others
  (a broadcast on a gloo group of its own) and answers once every rank has; an error on any
  rank is the answer, naming the rank.
- A version is gathered by every rank and written by rank 0 only, as the one-process trainer
  writes it. A checkpoint holds one `rank-NNNNN/` directory per rank (its shards, its AdamW
  state, its RNG: pipeline.trainer.state's files) and `ranks.json`; it loads only onto the same
  world size, where each rank gets back its own shards bit for bit. A state that any rank
  refuses changes no rank.
- Waits inside a call (the training group's collectives) are bounded by trainer.step_timeout_s.
  Between calls ranks other than 0 wait on the control group without a bound (the pipeline may
  idle for hours); each exits when rank 0's connection or its own parent is gone.
- NCCL's NVLink multicast stays off (NCCL_NVLS_ENABLE=0) unless the environment sets it. Ranks
  that are all on one host connect over the loopback interface only (GLOO_SOCKET_IFNAME and
  NCCL_SOCKET_IFNAME = lo, set over the environment's).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import traceback
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator

import structlog
import torch
import torch.distributed as dist

from pipeline.store.durable import fsync_dir, write_synced
from pipeline.errors import TrainerError
from pipeline.models.builtin import quiet_progress
from pipeline.trainer.policy import LoRATrainer, _Rows
from pipeline.trainer.ranks import RankSpec

log = structlog.get_logger(__name__)

RANKS_FILE = "ranks.json"  # in a sharded trainer's state: the world size and devices that wrote it
_IDLE = timedelta(days=365)  # the control group's bound: ranks wait there between calls
_group: Any = None  # the control group of this process (gloo), once joined


def join(spec: RankSpec) -> None:
    """Join the process group (blocking until every rank has, up to spec.timeout_s) and make the
    control group."""
    global _group
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
    _group = dist.new_group(backend="gloo", timeout=_IDLE)


def leader(model_path: str, cfg: Any, loss_cfg: Any, *, ranks: RankSpec, **kwargs: Any) -> "FSDPTrainer":
    """Rank 0 (built in the pipeline's trainer process): join, hand the trainer's arguments to the
    other ranks, build its own trainer."""
    join(ranks)
    dist.broadcast_object_list([(model_path, cfg, loss_cfg, kwargs)], src=0, group=_group)
    return FSDPTrainer(model_path, cfg, loss_cfg, ranks=ranks, **kwargs)


def serve_follower(spec: RankSpec) -> None:
    """A rank other than 0: join, build the trainer from rank 0's arguments, then run each request
    rank 0 passes on until it says stop (or its connection goes)."""
    from pipeline.trainer.process import run_call

    join(spec)
    start: list[Any] = [None]
    dist.broadcast_object_list(start, src=0, group=_group)
    model_path, cfg, loss_cfg, kwargs = start[0]
    trainer = FSDPTrainer(model_path, cfg, loss_cfg, ranks=spec, **kwargs)
    while True:
        request: list[Any] = [None]
        try:
            dist.broadcast_object_list(request, src=0, group=_group)
        except (RuntimeError, dist.DistBackendError):  # rank 0 is gone
            log.warning("trainer_rank_lost_leader", rank=spec.rank)
            return
        method, margs = request[0]
        if method == "stop":
            return
        status: tuple[str, Any]
        try:
            run_call(trainer, method, margs)
            status = ("ok", None)
        except Exception as e:
            status = ("error", (type(e).__name__, str(e), traceback.format_exc()))
        dist.gather_object(status, None, dst=0, group=_group)


class _LeaderChannel:
    """Rank 0's side of the pipeline's pipe: each request is passed on to every rank before it is
    run, and each answer waits for theirs (the first error among them is the answer)."""

    def __init__(self, conn: Any, spec: RankSpec) -> None:
        self.conn = conn
        self.spec = spec
        self.method = ""

    def recv(self) -> Any:
        request = self.conn.recv()
        self.method = request[0]
        dist.broadcast_object_list([request], src=0, group=_group)
        return request

    def send(self, reply: tuple[str, Any]) -> None:
        if self.method != "stop":
            statuses: list[Any] = [None] * self.spec.world_size
            dist.gather_object(("ok", None), statuses, dst=0, group=_group)
            for rank, (status, value) in enumerate(statuses):
                if reply[0] == "ok" and status == "error":
                    name, msg, tb = value
                    reply = ("error", (name, f"trainer rank {rank} ({self.spec.devices[rank]}): {msg}", tb))
        self.conn.send(reply)

    def close(self) -> None:
        self.conn.close()


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded tensor (sharing its storage); a plain tensor itself."""
    t = t.detach()
    return t.to_local() if hasattr(t, "to_local") else t


class FSDPTrainer(LoRATrainer):
    """LoRATrainer as one rank of an FSDP2 group (see the module's invariants)."""

    def __init__(self, model_path: str, cfg: Any, loss_cfg: Any, *, ranks: RankSpec, **kwargs: Any) -> None:
        super().__init__(model_path, replace(cfg, device=ranks.device), loss_cfg, **kwargs)
        self.spec = ranks
        self.rank = ranks.rank
        self.world = ranks.world_size
        self._writes_versions = ranks.rank == 0

    def channel(self, conn: Any) -> Any:
        """What the trainer process's request loop reads and answers on (rank 0 only)."""
        return _LeaderChannel(conn, self.spec)

    # ------------------------------------------------------------------ building

    def _load_device(self) -> str:
        return "cpu"  # each rank's device holds only its shard, once _place has sharded the model

    def _place(self) -> None:
        """Shard the model (and the KL reference) per decoder layer and at the root; fully_shard moves
        each rank's shards to its device, so the optimizer LoRATrainer.setup builds next holds
        (and steps) this rank's shard of every parameter."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if not self.full:
            self._lora_layout()  # from the unsharded adapter: the names peft saves
        mesh = init_device_mesh(self.cfg.device.split(":")[0], (self.world,))
        for model in (self.model, self.reference):
            if model is None:
                continue
            layers = set(getattr(model, "_no_split_modules", None) or [])
            for m in list(model.modules()):
                if type(m).__name__ in layers:
                    fully_shard(m, mesh=mesh)
            fully_shard(model, mesh=mesh)
        for m in self.model.modules():
            if isinstance(m, FSDPModule):
                # a sum over ranks (each rank's loss is weighed by the whole step's), in plain SUM
                # reductions: gloo has no PREMUL_SUM
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)
        log.info("trainer_rank_ready", rank=self.rank, world_size=self.world, device=self.cfg.device,
                 backend=self.spec.backend,
                 shard_params=sum(_local(p).numel() for p in self.model.parameters() if p.requires_grad))

    # ------------------------------------------------------------------ the step, split

    def _share(self, part: list[int], rank: int) -> list[int]:
        return part[rank * len(part) // self.world:(rank + 1) * len(part) // self.world]

    def _passes(self, part: list[int]) -> list[list[int]]:
        m = self.cfg.micro_batch_sequences
        most = max(-(-len(self._share(part, r)) // m) for r in range(self.world))
        mine = self._micro_batches(self._share(part, self.rank))
        return mine + [[] for _ in range(most - len(mine))]

    def _before_pass(self, last: bool) -> None:
        """LoRA: the adapter's gradients accumulate unsharded over an optimizer step's passes and are
        reduced over the ranks after its last (one reduce-scatter a step, not one a pass; the
        adapter is small). Full weights reduce after every pass: their gradients stay sharded."""
        if not self.full:
            self.model.set_requires_gradient_sync(last)

    def _empty_pass(self, rows: _Rows, part: list[int]) -> None:
        """A forward and backward that weighs nothing, so this rank meets the others' collectives."""
        lp, _, _ = self._forward(rows, part[:1])
        (lp.sum() * 0.0).backward()

    def _sum(self, values: list[float], op: Any = None) -> list[float]:
        device = self.cfg.device if self.spec.backend == "nccl" else "cpu"
        t = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
        return t.tolist()

    def _backward(self, *args: Any, **kwargs: Any) -> float:
        """The rank's share of one optimizer step's loss, summed over ranks: every rank sees the same
        loss, so all take the same decision on a non-finite one."""
        return self._sum([super()._backward(*args, **kwargs)])[0]

    def _pool_stats(self, acc: dict[str, float], weights: list[float]) -> None:
        every: list[Any] = [None] * self.world
        dist.all_gather_object(every, (acc, weights), group=_group)
        acc.clear()
        for rank_acc, _ in every:
            for k, v in rank_acc.items():
                acc[k] = max(acc.get(k, v), v) if k == "ratio_max" else acc.get(k, 0.0) + v
        weights[:] = [sum(w[i] for _, w in every) for i in range(len(weights))]

    def step(self, batch: Any) -> Any:
        t0 = time.monotonic()
        stats = super().step(batch)
        slowest = self._sum([time.monotonic() - t0], op=dist.ReduceOp.MAX)[0]
        stats.metrics["train/rank_step_max_s"] = slowest
        return stats

    # ------------------------------------------------------------------ older versions, kept as local shards

    @contextlib.contextmanager
    def _weights_of(self, version: int) -> Iterator[None]:
        """Copy an older version's shards into place and the current ones back after (FSDP2 owns
        its parameters' storage, so they are copied, not swapped)."""
        if version == self.version:
            yield
            return
        trainable = self._trainable()
        older = self._snapshots[version]
        current = {n: _local(p).clone() for n, p in trainable}
        try:
            with torch.no_grad():
                for n, p in trainable:
                    _local(p).copy_(older[n])
            yield
        finally:
            with torch.no_grad():
                for n, p in trainable:
                    _local(p).copy_(current[n])

    # ------------------------------------------------------------------ versions, gathered

    def _whole(self, p: torch.nn.Parameter) -> torch.Tensor:
        return p.detach().full_tensor().to("cpu")  # an all-gather: every rank calls it, in the same order

    def save_adapter(self, directory: Path) -> None:
        if not self.full:
            super().save_adapter(directory)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank == 0:
            tied = getattr(self.model.config, "tie_word_embeddings", False)
            out = self.model.get_output_embeddings()
            if tied and out is not None:  # written once, as the unsharded model writes it
                name = next(n for n, m in self.model.named_modules() if m is out)
                state.pop(f"{name}.weight", None)
            with quiet_progress():
                self.model.save_pretrained(str(directory), state_dict=state)

    # ------------------------------------------------------------------ state: each rank its shards

    def _state_view(self, p: torch.nn.Parameter) -> torch.Tensor:
        return _local(p)

    def _as_moment(self, p: torch.nn.Parameter, t: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(t.to(_local(p).device), p.device_mesh, p.placements, run_check=False,
                                  shape=p.shape, stride=p.stride())

    def _rank_dir(self, directory: Path) -> Path:
        return Path(directory) / f"rank-{self.rank:05d}"

    def save_state(self, directory: Path) -> None:
        """Each rank writes rank-NNNNN/ (its shards); rank 0 then ranks.json, once every rank has."""
        d = self._rank_dir(directory)
        d.mkdir(exist_ok=True)
        super().save_state(d)
        dist.barrier(group=_group)
        if self.rank == 0:
            meta = {"format": 1, "world_size": self.world, "devices": list(self.spec.devices)}
            write_synced(Path(directory) / RANKS_FILE, json.dumps(meta).encode())
            fsync_dir(Path(directory))

    def _state_extra(self) -> dict[str, Any]:
        return {"rank": self.rank, "world_size": self.world}

    def load_state(self, directory: Path) -> None:
        """Every rank checks the state first; only when all accept it does any load its shards."""
        error = None
        try:
            self._check_world(Path(directory))
            saved = self._read_state(self._rank_dir(directory))
        except TrainerError as e:
            error = str(e)
        every: list[Any] = [None] * self.world
        dist.all_gather_object(every, error, group=_group)
        refused = [(r, e) for r, e in enumerate(every) if e is not None]
        if refused:
            rank, why = refused[0]
            raise TrainerError(f"trainer rank {rank} ({self.spec.devices[rank]}) refused the state, so no rank "
                               f"loaded it: {why}")
        self._apply_state(saved, self._rank_dir(directory))

    def _check_world(self, directory: Path) -> None:
        path = directory / RANKS_FILE
        try:
            meta = json.loads(path.read_bytes())
        except FileNotFoundError:
            raise TrainerError(f"{path} is missing: this state was not written by trainer ranks "
                               f"(trainer.devices), and {self.world} ranks cannot resume it") from None
        except (OSError, ValueError) as e:
            raise TrainerError(f"{path} cannot be read as JSON: {e}") from None
        saved = meta.get("world_size") if isinstance(meta, dict) else None
        if saved != self.world:
            raise TrainerError(f"{path}: the state was written by {saved!r} trainer ranks, this run has {self.world} "
                               f"(trainer.devices); a sharded state resumes onto the same number of ranks")


def main(argv: list[str] | None = None) -> None:
    """A rank on another host (under torchrun or alone): join the pipeline's group and serve it.

    rank = --first-rank + LOCAL_RANK (torchrun sets it; 0 alone), its device cuda:LOCAL_RANK, or cpu."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m pipeline.trainer.fsdp", description=main.__doc__)
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
