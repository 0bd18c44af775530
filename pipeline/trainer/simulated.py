"""The simulated trainer: a step that only waits, for tests and benchmarks of the orchestration itself.

Invariants:
- Each step takes `step_s` and counts the version up by one; nothing is learnt.
- A version is a minimal valid directory of its update mode ("lora": an adapter, "full": a
  model), so the adapter store and engines of either kind exercise their real publish and load paths.
- With trainer.publish = "memory" a version is a payload naming it (`share_weights`), kept the
  way PolicyTrainer keeps its buffers, so the loop's hand-over and its lifetimes are exercised.
- Its state is trainer.json alone (pipeline.trainer.state's simulated format); a real trainer's
  state is refused, as it refuses this one.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from pipeline.errors import ConfigError
from pipeline.trainer.state import UPDATE_MODES, read_simulated_state, write_simulated_state
from pipeline.types import Batch, RolloutGroup, TrainStats


class SimulatedTrainer:
    """A trainer that only waits `step_s` per step (see the module's invariants)."""

    def __init__(self, step_s: float = 0.0, update: str = "lora") -> None:
        if update not in UPDATE_MODES:
            raise ConfigError(f"trainer.update must be one of {', '.join(UPDATE_MODES)}, got {update!r}")
        self.step_s = step_s
        self.update = update
        self.version = 0
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self.shared: dict[int, dict] = {}  # trainer.publish = "memory": version -> payload kept for the engines

    def setup(self) -> None:
        return None

    def step(self, batch: Batch) -> TrainStats:
        t0 = time.monotonic()
        if self.step_s > 0:
            time.sleep(self.step_s)
        self.version += 1
        rewards = np.concatenate([g.rewards for g in batch.groups]) if batch.groups else np.zeros(0)
        return TrainStats(step=batch.step, version=self.version,
                          metrics={"train/reward_mean": float(rewards.mean()) if rewards.size else float("nan")},
                          t_start=t0, t_end=time.monotonic())

    def recompute_logprobs(self, groups: Sequence[RolloutGroup]) -> list[list[np.ndarray]]:
        return [[c.logprobs for c in g.completions] for g in groups]

    def close(self) -> None:
        return None

    def save_adapter(self, directory: Path) -> None:
        """A minimal valid version directory (adapter_config.json + adapter_model.safetensors, or
        config.json + model.safetensors), so the store and engines exercise the real path."""
        from safetensors.numpy import save_file

        weights, config = ("model.safetensors", "config.json") if self.update == "full" else \
            ("adapter_model.safetensors", "adapter_config.json")
        save_file({"version": np.array([self.version], dtype=np.int64)}, str(Path(directory) / weights))
        (Path(directory) / config).write_bytes(self._config())

    def share_weights(self, keep_from: int) -> dict:
        """trainer.publish = "memory": the version's payload as PolicyTrainer.share_weights gives it.
        Full weights: no buffer, a checksum naming the version, kept until a later `keep_from` passes
        it. LoRA: what `save_adapter` writes, as plain data (`shared_weights.adapter_payload`)."""
        if self.update == "lora":
            import torch

            from pipeline.engines.shared_weights import adapter_payload

            return adapter_payload(self.version, {"version": torch.tensor([self.version])}, self._config())
        for version in [v for v in self.shared if v < keep_from]:
            del self.shared[version]
        payload = self.shared.setdefault(self.version, {"version": self.version, "checksum": f"{self.version:032x}",
                                                        "simulated": True})
        return dict(payload)

    def _config(self) -> bytes:
        """The config file of a version of this trainer (adapter_config.json or config.json)."""
        return json.dumps({"simulated": True, "version": self.version}).encode()

    def save_state(self, directory: Path) -> None:
        """trainer.json with the version (and step_s), fsynced: all the state this trainer has."""
        write_simulated_state(Path(directory), self.update, self.version, self.step_s)

    def load_state(self, directory: Path) -> None:
        self.version = read_simulated_state(Path(directory), self.update)
