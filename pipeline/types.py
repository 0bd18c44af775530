"""The data that flows through the pipeline: prompts, group requests, rollout groups, batches.

Invariants:
- The group is the unit of work: one prompt, n completions, one engine call, one version.
- `Generation.version` is the adapter version the engine actually sampled with (0 = base model).
  With in-flight full-weight swaps (pipeline.full_weight_swap = "in_flight") it is the version the
  group started with and `last_version` the newest whose weights may have sampled any of its tokens;
  a group whose `last_version` differs is not one version's sample (`spans_versions`).
- For every completion, `len(token_ids) == len(logprobs)`; `logprobs[t]` is the log-probability
  of `token_ids[t]` under the distribution the engine sampled it from.
- These objects are immutable by convention: arrays are never written after construction.
  The per-group ones (requests, completions, generations, outcomes) are not `frozen`: a frozen
  dataclass sets each field through object.__setattr__, which doubled the cost of building
  the n completions of a group, on the event loop, for every group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any, Mapping

import numpy as np


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt of a data source."""

    id: str  # unique within the data source; the ledger key across resumes
    text: str
    token_ids: tuple[int, ...]
    meta: Mapping[str, Any] = field(default_factory=dict)  # extra columns, passed to rewards as kwargs


@dataclass(frozen=True, slots=True)
class AdapterRef:
    """A published policy version as an engine loads it."""

    version: int  # 0 is the base model (no adapter)
    name: str  # unique, never reused: "v000007-1a2b3c4d"; "base" for version 0
    path: str | None  # directory with adapter_config.json + adapter_model.safetensors; None for base and in memory
    sha256: str = ""  # content hash over the adapter files ("" for base); the payload's checksum in memory
    # trainer.publish = "memory": the version as plain data (pipeline.engines.shared_weights: full
    # weights' CUDA IPC payload, `share`; a LoRA adapter's tensors, `adapter_payload`); None on disk
    shared: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)

    @staticmethod
    def base() -> AdapterRef:
        return AdapterRef(version=0, name="base", path=None)

    @staticmethod
    def in_memory(version: int, shared: Mapping[str, Any]) -> AdapterRef:
        """A version handed over in memory (`shared`: its payload, with its checksum)."""
        checksum = str(shared["checksum"])
        return AdapterRef(version=version, name=f"v{version:06d}-mem{checksum[:8]}", path=None, sha256=checksum,
                          shared=shared)


@dataclass(slots=True)
class GroupRequest:
    """Ask an engine for n completions of one prompt (the adapter is passed beside it)."""

    group_id: int  # unique within a run, assigned at admission
    prompt: Prompt
    n: int
    max_new_tokens: int
    seed: int | None = None  # per-request seed; None uses the engine's own seeded generator
    turn: int = 0  # 0: the first turn (of every episode, or the only one); k: an episode's turn k + 1, n = 1


@dataclass(slots=True)
class Completion:
    """One sampled continuation."""

    token_ids: np.ndarray  # [T] int64
    logprobs: np.ndarray  # [T] float32, sampling log-prob of each token
    # "stop" (end-of-sequence token; an episode: its environment was done), "length" (max_new_tokens;
    # an episode: its token budget) or "max_turns" (an episode's turns ran out first)
    finish_reason: str
    text: str = ""
    # Multi-turn episodes: the policy's turns and the environment's replies, as one token sequence
    # after the prompt. mask[t] is True where the policy sampled token t (logprobs[t] is the
    # engine's); False on environment and template tokens (logprobs[t] is 0 and never used).
    mask: np.ndarray | None = None  # [T] bool; None: every token was sampled (a single turn)
    turns: int = 1  # policy turns in the episode
    env_reward: float | None = None  # the environment's reward summed over its steps; None: no environment

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(
                f"completion has {len(self.token_ids)} token ids but {len(self.logprobs)} log-probs"
            )
        if self.mask is not None and len(self.mask) != len(self.token_ids):
            raise ValueError(f"completion has {len(self.token_ids)} token ids but a mask of {len(self.mask)}")

    @property
    def sampled(self) -> np.ndarray:
        """The mask of policy-sampled tokens, all True for a single turn."""
        return np.ones(len(self.token_ids), dtype=bool) if self.mask is None else self.mask


_TOKEN_IDS = attrgetter("token_ids")


@dataclass(slots=True)
class Generation:
    """What an engine returns for one GroupRequest."""

    request: GroupRequest
    completions: tuple[Completion, ...]  # exactly request.n
    version: int  # adapter version actually used; must equal the version asked for
    engine: str  # which engine produced it
    t_start: float  # time.monotonic() when the engine started the request
    t_end: float
    # in-flight swaps: the newest version whose weights the engine took while the group ran (or held
    # when it started); None: every token was sampled with `version` (engines that drain first)
    last_version: int | None = None

    @property
    def spans_versions(self) -> bool:
        """Whether weights other than `version`'s may have sampled some of the tokens (an in-flight swap)."""
        return self.last_version is not None and self.last_version != self.version

    @property
    def num_tokens(self) -> int:
        """Tokens the engine sampled (an episode's environment tokens are not counted)."""
        comps = self.completions
        if not comps or comps[0].mask is None:  # single turns (every completion of a group alike)
            return sum(map(len, map(_TOKEN_IDS, comps)))
        return sum(int(c.mask.sum()) for c in comps)


@dataclass(slots=True)
class RolloutGroup:
    """A scored generation, ready for the buffer."""

    generation: Generation
    rewards: np.ndarray  # [n] float64, finite: the weighted sum of the reward functions
    t_scored: float
    reward_parts: np.ndarray | None = None  # [F, n] float64: each reward function's own values

    @property
    def group_id(self) -> int:
        return self.generation.request.group_id

    @property
    def prompt(self) -> Prompt:
        return self.generation.request.prompt

    @property
    def version(self) -> int:
        return self.generation.version

    @property
    def completions(self) -> tuple[Completion, ...]:
        return self.generation.completions

    @property
    def num_tokens(self) -> int:
        return self.generation.num_tokens


@dataclass(slots=True)
class GroupOutcome:
    """What became of one admitted group when it left the system (one RolloutLog entry)."""

    group_id: int
    prompt: Prompt
    version: int  # version it was (or was to be) sampled with
    fate: str  # "trained", "dropped" or "failed"
    reason: str  # "" when trained; otherwise why it was dropped or failed
    step: int  # training step that consumed it; -1 when none did
    generation: Generation | None  # None when generation itself failed
    rewards: np.ndarray | None  # [n] float64; None when scoring failed or never ran
    t_admitted: float  # time.monotonic() at admission
    t_done: float  # time.monotonic() when it left the system


@dataclass(slots=True)
class Batch:
    """B groups consumed by one training step."""

    step: int  # 1-based index of the step that trains this batch
    version: int  # trainer's policy version when the step starts (= step - 1)
    groups: tuple[RolloutGroup, ...]
    # the trainer keeps `version`'s weights after the step (a CPU copy; in full mode the whole
    # model), for a later log-prob check of groups sampled with it; False when none will need it
    keep_version: bool = True

    @property
    def staleness(self) -> list[int]:
        return [self.version - g.version for g in self.groups]

    @property
    def num_tokens(self) -> int:
        return sum(g.num_tokens for g in self.groups)


@dataclass(frozen=True, slots=True)
class TrainStats:
    """What one trainer step reports (scalar floats, keyed like `train/ratio_mean`)."""

    step: int
    version: int  # version published by this step
    metrics: Mapping[str, float]
    t_start: float
    t_end: float
