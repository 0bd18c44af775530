"""Snapshots: older versions' trainable weights, kept on the CPU so log-probs can be recomputed under them.

Invariants:
- At most `keep` versions are usable, the current one (the weights in place) included; a step
  prunes the copies older than that.
- A copy is taken only when asked, before a step changes the weights (`Batch.keep_version`).
- `weights_of` runs the model with an older version's weights and puts the current ones back
  exactly, whatever happens inside.
- A sharded trainer keeps, and restores, each rank's own shards.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from pipeline.trainer.fsdp import local


class Snapshots:
    """CPU copies of older versions' trainable weights, by version."""

    def __init__(self, keep: int, *, sharded: bool = False) -> None:
        self.keep = keep  # versions log-probs can be recomputed under, the current one included
        self.sharded = sharded  # FSDP2 owns its parameters' storage: copy into it, never swap it
        self._weights: dict[int, dict[str, torch.Tensor]] = {}

    def take(self, version: int, trainable: list[tuple[str, torch.nn.Parameter]]) -> None:
        """Copy `version`'s weights (those in place) to the CPU; nothing when only the current version is kept."""
        if self.keep > 1:
            self._weights[version] = {n: local(p).detach().to("cpu", copy=True) for n, p in trainable}

    def prune(self, current: int) -> None:
        """Drop the copies of versions that can no longer be asked for once `current` is the current one."""
        for v in [v for v in self._weights if v <= current - self.keep]:
            del self._weights[v]

    def clear(self) -> None:
        self._weights = {}

    def copies(self) -> list[int]:
        """The versions held as copies (the current one is never among them)."""
        return sorted(self._weights)

    def versions(self, current: int) -> list[int]:
        """The versions log-probs can be recomputed under: the copies, and `current`."""
        return sorted({*self._weights, current})

    @contextlib.contextmanager
    def weights_of(self, version: int, current: int,
                   trainable: list[tuple[str, torch.nn.Parameter]]) -> Iterator[None]:
        """Run the model with `version`'s weights in place, then put `current`'s back exactly.

        Swaps each parameter's storage rather than copying into it: the current weights stay
        where they are (no copy out and back), and a tied weight is one Parameter, swapped once.
        On a GPU the older version takes one more copy of the trainable weights while it runs
        (in full mode, one more model; the gradients, already freed, took that much in the step).
        Sharded parameters are copied into instead (their shards), and back after.
        """
        if version == current:
            yield
            return
        older = self._weights[version]
        if self.sharded:
            with self._copied(older, trainable):
                yield
            return
        held: dict[str, torch.Tensor] = {}
        try:
            for n, p in trainable:
                held[n] = p.data
                p.data = older[n].to(p.device)
            yield
        finally:
            for n, p in trainable:
                if n in held:
                    p.data = held[n]

    @staticmethod
    @contextlib.contextmanager
    def _copied(older: dict[str, torch.Tensor], trainable: list[tuple[str, torch.nn.Parameter]]) -> Iterator[None]:
        held = {n: local(p).clone() for n, p in trainable}
        try:
            with torch.no_grad():
                for n, p in trainable:
                    local(p).copy_(older[n])
            yield
        finally:
            with torch.no_grad():
                for n, p in trainable:
                    local(p).copy_(held[n])
