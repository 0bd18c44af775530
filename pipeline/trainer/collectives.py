"""Collectives: what the policy trainer asks of its other ranks, and the no-op set of one process.

The trainer takes a `Collectives` and calls it the same way whether it runs alone (`Local`) or as
one of trainer ranks (pipeline.trainer.ranks makes theirs over torch.distributed).

Invariants:
- Every rank makes the same calls in the same order (each is a collective); the trainer's code
  decides them from the batch and its config alone, which every rank shares.
- `Local` returns its arguments as they are: the one-process trainer's numbers are untouched.
"""

from __future__ import annotations

from typing import Any, Protocol


class Collectives(Protocol):
    """The ranks a trainer is one of."""

    rank: int
    world_size: int
    devices: tuple[str, ...]  # every rank's device, rank 0 first ("remote" for one another host runs)
    sharded: bool  # FSDP2 ranks (even a single one): the model is sharded, and each rank saves its own state

    def sum(self, values: list[float]) -> list[float]:
        """Each value summed over the ranks."""
        ...

    def max(self, values: list[float]) -> list[float]:
        """Each value's maximum over the ranks."""
        ...

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj` (picklable), in rank order, on every rank."""
        ...

    def barrier(self) -> None:
        """Return once every rank has called it."""
        ...


class Local:
    """One process: no other rank, so every collective returns what it was given."""

    rank = 0
    world_size = 1
    sharded = False

    def __init__(self, device: str = "cpu") -> None:
        self.devices = (device,)

    def sum(self, values: list[float]) -> list[float]:
        return values

    def max(self, values: list[float]) -> list[float]:
        return values

    def gather(self, obj: Any) -> list[Any]:
        return [obj]

    def barrier(self) -> None:
        return None
