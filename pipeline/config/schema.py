"""The config schema: one frozen dataclass per component, validated as it is built.

Reading and writing it (TOML files, `--set` overrides, the reference table) is pipeline.config.io.

Invariants:
- Every field has a type, a default and a one-line comment; `__post_init__` refuses values
  out of range with a `ConfigError` naming the field and what is allowed.
- A RunConfig that exists is valid as a whole: the checks across sections (sampling against
  loss.correction, engine.kind against trainer.update, ...) run in `RunConfig.__post_init__`.
- The checks are of the values alone: building a config touches no file, package or device, so
  one naming a path that does not exist (yet) builds. What the values name on this machine (a
  model directory, a data file, a tracker's package, a CUDA device) is pipeline.loop.preflight's,
  run before anything is made.
- Importing this module imports no torch: run.py reports a bad config before torch loads.
"""

from __future__ import annotations

import math
import re
import reprlib
from dataclasses import dataclass, field
from typing import Any, Literal

from pipeline.errors import ConfigError


# Seeds reach numpy (which wants [0, 2**32)) after engines add their index, so leave headroom.
_SEED_MAX = 2**31 - 1
_DEVICE = re.compile(r"cpu|cuda:[0-9]{1,3}")  # ASCII digits only: int() and torch read nothing else

_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = _repr.maxlong = 80  # a huge or deeply nested value stays one short line
_repr.maxlevel = 3


def _show(value: Any) -> str:
    return _repr.repr(value)


def _check(ok: bool, key: str, allowed: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"{key} must be {allowed}, got {_show(value)}")


def _check_device(key: str, value: str) -> None:
    _check(_DEVICE.fullmatch(value) is not None, key, '"cpu" or "cuda:N"', value)


def _check_path(key: str, value: str) -> None:
    _check("\x00" not in value, key, "a path without NUL characters", value)


def _check_seed(key: str, value: int) -> None:
    _check(0 <= value <= _SEED_MAX, key, f"in [0, {_SEED_MAX}]", value)


@dataclass(frozen=True)
class ModelConfig:
    """The base model every engine and the trainer start from."""

    path: str = ""  # a local transformers model directory; "" builds the built-in model offline
    shape: Literal["tiny", "small", "qwen2.5-0.5b", "qwen2.5-1.5b"] = "tiny"  # shape of the built-in model (path = "")
    cache_dir: str = ".cache/models"  # where built-in models are built once and reused
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # weights of engines built on transformers
    trust_remote_code: bool = False  # run code shipped with the model; off unless you trust it
    warm_start: bool = False  # the built-in model (path = "") first fine-tuned on the built-in task's worked problems until partly competent (pipeline.models.warm_start; cached)
    warm_start_accuracy: float = 0.3  # ... until its exact-match accuracy on held-out problems, sampled at temperature 1, reaches this

    def __post_init__(self) -> None:
        _check(0 < self.warm_start_accuracy < 1, "model.warm_start_accuracy", "in (0, 1)", self.warm_start_accuracy)
        _check_path("model.path", self.path)
        _check_path("model.cache_dir", self.cache_dir)


WARM_START_TASKS = ("addition",)  # the built-in tasks with worked problems (pipeline.data.tasks.Task.demonstrate)


@dataclass(frozen=True)
class TaskConfig:
    """The built-in task, used when data.train is empty (research code may pass its own prompts and reward)."""

    name: Literal["char_class", "copy", "calculator", "addition"] = "char_class"  # see pipeline.data.tasks; calculator is multi-turn
    num_prompts: int = 512  # size of the prompt set; the source cycles through it in epochs
    seed: int = 0  # which prompts are drawn
    digits: int = 2  # addition: digits of each of the two numbers added
    num_eval_prompts: int = 512  # addition: held-out problems offered to [eval] (its own split, never trained on)

    def __post_init__(self) -> None:
        _check(self.num_prompts >= 1, "task.num_prompts", ">= 1", self.num_prompts)
        _check_seed("task.seed", self.seed)
        _check(1 <= self.digits <= 9, "task.digits", "in [1, 9]", self.digits)
        _check(self.num_eval_prompts >= 1, "task.num_eval_prompts", ">= 1", self.num_eval_prompts)


@dataclass(frozen=True)
class DataConfig:
    """Your own prompts from files; a row is {"prompt": text or [{role, content}, ...], "id"?, **columns for the reward}."""

    train: str = ""  # training prompts: .jsonl, .json, .parquet, .csv or a save_to_disk directory; "" = the built-in [task]
    eval: str = ""  # held-out prompts for [eval], same formats; "" = none (a built-in task holds out prompts of its own)
    prompt_field: str = "prompt"  # the column holding each row's prompt
    shuffle: bool = True  # reshuffle the training prompts every epoch
    seed: int = 0  # seed of that shuffle
    apply_chat_template: bool = False  # string prompts go through the chat template too (message lists always do)
    chat_template: str = ""  # a jinja file replacing the tokenizer's chat template; "" = the tokenizer's own
    system_prompt: str = ""  # a system message put first in every chat prompt that has none; "" = none

    def __post_init__(self) -> None:
        _check_path("data.train", self.train)
        _check_path("data.eval", self.eval)
        _check(self.prompt_field.strip() != "", "data.prompt_field", "a column name", self.prompt_field)
        _check_seed("data.seed", self.seed)
        _check_path("data.chat_template", self.chat_template)


_REWARD_ENTRY = re.compile(r"[^:\s][^:]*:[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class RewardConfig:
    """Reward functions by import path, each `fn(prompts, completions, **kwargs) -> list[float]` (TRL's)."""

    functions: tuple[str, ...] = ()  # "package.module:fn" or "path/to/file.py:fn"; () = the built-in task's reward
    weights: tuple[float, ...] = ()  # one per function; () = 1 each; the reward is the weighted sum
    timeout_s: float = 300.0  # a reward call taking longer fails the groups it scores (reward_error); the run goes on

    def __post_init__(self) -> None:
        for i, entry in enumerate(self.functions):
            _check(_REWARD_ENTRY.fullmatch(entry) is not None, f"reward.functions[{i}]",
                   '"package.module:function" or "path/to/file.py:function"', entry)
        _check(len(set(self.functions)) == len(self.functions), "reward.functions", "distinct entries", self.functions)
        _check(self.timeout_s > 0, "reward.timeout_s", "> 0", self.timeout_s)
        if self.weights and len(self.weights) != len(self.functions):
            raise ConfigError(f"reward.weights has {len(self.weights)} entries for {len(self.functions)} "
                              "reward.functions; give one weight per function, or none")


@dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation on the generating engines at the current version; never trained."""

    every: int = 0  # steps between evaluations, which also run before the first step and after the last; 0 = off
    n: int = 4  # samples per eval prompt: pass@1 and pass@n are estimated from them
    max_prompts: int = 64  # eval prompts per evaluation (the first of the eval set); 0 = all
    pass_threshold: float = 1.0  # a sample passes when its reward is >= this

    def __post_init__(self) -> None:
        _check(self.every >= 0, "eval.every", ">= 0 (0 = off)", self.every)
        _check(self.n >= 1, "eval.n", ">= 1", self.n)
        _check(self.max_prompts >= 0, "eval.max_prompts", ">= 0 (0 = all)", self.max_prompts)


@dataclass(frozen=True)
class EnvConfig:
    """Multi-turn episodes: each of a group's n completions is one episode of an environment."""

    factory: str = ""  # "package.module:Class" or "path/to/file.py:Class" (any callable making one environment); "" = single-turn, or task.name's own
    max_turns: int = 4  # policy turns per episode at most; the episode ends after the last
    max_episode_tokens: int = 0  # prompt + every turn + every reply, at most; 0 = the engine's context. Reaching it ends the episode, finish reason "length"
    step_timeout_s: float = 60.0  # an environment's reset or step taking longer fails its group
    reward: Literal["env", "functions", "sum"] = "env"  # the environment's summed reward, the reward functions on the transcript, or both added

    def __post_init__(self) -> None:
        _check(not self.factory or _REWARD_ENTRY.fullmatch(self.factory) is not None, "env.factory",
               '"package.module:Class" or "path/to/file.py:Class"', self.factory)
        _check(self.max_turns >= 1, "env.max_turns", ">= 1", self.max_turns)
        _check(self.max_episode_tokens >= 0, "env.max_episode_tokens", ">= 0 (0 = the engine's context)",
               self.max_episode_tokens)
        _check(self.step_timeout_s > 0, "env.step_timeout_s", "> 0", self.step_timeout_s)


@dataclass(frozen=True)
class SamplingConfig:
    """How completions are sampled. Defaults are the on-policy contract: temperature 1, no truncation."""

    n: int = 8  # completions per prompt (the GRPO group size)
    max_new_tokens: int = 16  # completion length cap
    temperature: float = 1.0  # != 1 needs loss.correction = "none"
    top_p: float = 1.0  # != 1 needs loss.correction = "none"
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    presence_penalty: float = 0.0  # 0 = off (vLLM only)
    frequency_penalty: float = 0.0  # 0 = off (vLLM only)
    per_request_seed: bool = False  # seed every group from (run seed, group id); costs vLLM throughput

    def __post_init__(self) -> None:
        _check(self.n >= 1, "sampling.n", ">= 1", self.n)
        _check(self.max_new_tokens >= 1, "sampling.max_new_tokens", ">= 1", self.max_new_tokens)
        _check(self.temperature > 0, "sampling.temperature", "> 0", self.temperature)
        _check(0 < self.top_p <= 1, "sampling.top_p", "in (0, 1]", self.top_p)
        _check(self.top_k >= 0, "sampling.top_k", ">= 0 (0 = off)", self.top_k)
        _check(0 <= self.min_p < 1, "sampling.min_p", "in [0, 1)", self.min_p)
        _check(self.repetition_penalty > 0, "sampling.repetition_penalty", "> 0", self.repetition_penalty)

    def off_policy_settings(self) -> list[str]:
        """The settings that make sampled log-probs differ from the policy's own."""
        bad = []
        if self.temperature != 1.0:
            bad.append(f"temperature={self.temperature}")
        if self.top_p != 1.0:
            bad.append(f"top_p={self.top_p}")
        if self.top_k != 0:
            bad.append(f"top_k={self.top_k}")
        if self.min_p != 0.0:
            bad.append(f"min_p={self.min_p}")
        if self.repetition_penalty != 1.0:
            bad.append(f"repetition_penalty={self.repetition_penalty}")
        if self.presence_penalty != 0.0:
            bad.append(f"presence_penalty={self.presence_penalty}")
        if self.frequency_penalty != 0.0:
            bad.append(f"frequency_penalty={self.frequency_penalty}")
        return bad


@dataclass(frozen=True)
class TransformersEngineConfig:
    """The transformers engine: batches concurrent group requests into one forward loop."""

    max_batch_groups: int = 16  # most groups sampled together in one decoding loop
    max_loaded_adapters: int = 0  # 0 = max_staleness + 1
    sched_idle: bool = False  # on the CPU, run its torch thread under Linux SCHED_IDLE: less loop lag, less throughput (docs/results.md)

    def __post_init__(self) -> None:
        _check(self.max_batch_groups >= 1, "engine.transformers.max_batch_groups", ">= 1", self.max_batch_groups)
        _check(self.max_loaded_adapters >= 0, "engine.transformers.max_loaded_adapters", ">= 0", self.max_loaded_adapters)


@dataclass(frozen=True)
class VLLMEngineConfig:
    """The vLLM engine (one AsyncLLM per entry of engine.devices)."""

    gpu_memory_utilization: float = 0.85  # per engine; two engines on one GPU need <= 0.45 each
    enforce_eager: bool = False  # skip torch.compile and CUDA graphs: starts faster, runs slower
    torch_compile: bool = True  # vLLM's torch.compile of the model, run as piecewise and whole-batch CUDA graphs; false: no compile, whole-batch graphs only (starts faster; docs/results.md measures both)
    start_method: Literal["auto", "fork", "spawn"] = "auto"  # how an engine's core process starts: fork skips its imports of torch and vLLM (15 s of a start on an H100), and needs a process that has not initialised CUDA; auto = fork where this one has not, spawn where it has (a trainer in this process on a GPU, a built-in model just built on one)
    max_model_len: int = 2048  # prompt + completion tokens per sequence
    max_num_seqs: int = 1024  # sequences the scheduler runs at once
    # larger batches run eagerly, which halved a 0.5B model's tokens/s beyond 512 sequences
    # (benchmarks/vllm_depth.py); every size captured costs set-up time (pipeline.loop.build.graph_sequences)
    max_cudagraph_capture_size: int = 0  # the largest batch run as a CUDA graph; 0 = the sequences the run can have in flight on one engine ((max_staleness + 1) x batch_groups x n, plus an eval round's), at most max_num_seqs
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"  # engine weights
    max_lora_rank: int = 16  # must be >= trainer.lora_rank
    max_loras: int = 0  # adapters resident on the GPU; 0 = max_staleness + 2
    seed: int = 0  # the engine's own seed (used when sampling.per_request_seed is off)

    def __post_init__(self) -> None:
        _check(0 < self.gpu_memory_utilization <= 1, "engine.vllm.gpu_memory_utilization", "in (0, 1]",
               self.gpu_memory_utilization)
        _check(self.max_model_len >= 16, "engine.vllm.max_model_len", ">= 16", self.max_model_len)
        _check(self.max_num_seqs >= 1, "engine.vllm.max_num_seqs", ">= 1", self.max_num_seqs)
        _check(self.max_cudagraph_capture_size >= 0, "engine.vllm.max_cudagraph_capture_size", ">= 0 (0 = sized to the run)",
               self.max_cudagraph_capture_size)
        _check(self.max_lora_rank in (8, 16, 32, 64, 128, 256, 320, 512), "engine.vllm.max_lora_rank",
               "one of 8, 16, 32, 64, 128, 256, 320, 512 (vLLM's choices)", self.max_lora_rank)
        _check(self.max_loras >= 0, "engine.vllm.max_loras", ">= 0", self.max_loras)
        _check_seed("engine.vllm.seed", self.seed)


@dataclass(frozen=True)
class VLLMServerEngineConfig:
    """vLLM servers (`vllm serve`, OpenAI-compatible HTTP): started by you, on this or other hosts, or
    launched here by the pipeline (`launch`)."""

    urls: tuple[str, ...] = ()  # one engine per server, e.g. ["http://gpu-host-1:8000"]
    launch: bool = False  # start one `vllm serve` here per engine.devices entry (flags from engine.vllm), stopped at exit
    host: str = "127.0.0.1"  # launched servers listen here ("0.0.0.0": every interface; they serve anyone who reaches them)
    port: int = 0  # launched servers: server i listens on port + i; 0 = free ports
    extra_args: tuple[str, ...] = ()  # launched servers: more `vllm serve` flags, as given
    command: tuple[str, ...] = ()  # launched servers: the command the model path and flags follow; () = this Python's `vllm serve`
    model: str = ""  # the base model's name on the servers; "" = the one each server lists
    api_key_env: str = ""  # name of an environment variable holding the servers' --api-key; "" = none
    max_loaded_adapters: int = 0  # adapters registered on a server at once; 0 = max_staleness + 2

    def __post_init__(self) -> None:
        for i, url in enumerate(self.urls):
            _check(url.startswith(("http://", "https://")) and len(url) > len("https://"),
                   f"engine.vllm_server.urls[{i}]", 'a server URL like "http://host:8000"', url)
        _check(len(set(self.urls)) == len(self.urls), "engine.vllm_server.urls", "distinct servers", self.urls)
        _check(self.max_loaded_adapters >= 0, "engine.vllm_server.max_loaded_adapters", ">= 0", self.max_loaded_adapters)
        _check(0 <= self.port <= 65535, "engine.vllm_server.port", "in [0, 65535] (0 = free ports)", self.port)
        _check(bool(self.host), "engine.vllm_server.host", "an address to listen on", self.host)
        if self.launch and self.urls:
            raise ConfigError("engine.vllm_server.launch starts the servers itself, one per engine.devices entry; "
                              "leave engine.vllm_server.urls out (or set launch = false to use yours)")


@dataclass(frozen=True)
class SimulatedEngineConfig:
    """A model-free engine with a set speed, for tests and benchmarks."""

    latency_s: float = 0.0  # seconds per group
    turn_latency_s: float = 0.0  # seconds per later turn of an episode (one request per live episode, n = 1)
    concurrency: int = 0  # groups it works on at once; 0 = unlimited
    completion_tokens: int = 16  # tokens per completion
    vocab_size: int = 128  # synthetic token ids are drawn below this
    fail_rate: float = 0.0  # fault injection: share of generate calls that raise
    hang_rate: float = 0.0  # fault injection: share of generate calls that never return
    die_after: int = 0  # fault injection: after this many groups the engine is dead until restarted; 0 = never
    failed_restarts: int = 0  # fault injection: this many restarts (start after close) fail before one works

    def __post_init__(self) -> None:
        _check(0 <= self.fail_rate <= 1, "engine.simulated.fail_rate", "in [0, 1]", self.fail_rate)
        _check(0 <= self.hang_rate <= 1, "engine.simulated.hang_rate", "in [0, 1]", self.hang_rate)
        _check(self.latency_s >= 0, "engine.simulated.latency_s", ">= 0", self.latency_s)
        _check(self.turn_latency_s >= 0, "engine.simulated.turn_latency_s", ">= 0", self.turn_latency_s)
        _check(self.concurrency >= 0, "engine.simulated.concurrency", ">= 0 (0 = unlimited)", self.concurrency)
        _check(self.completion_tokens >= 1, "engine.simulated.completion_tokens", ">= 1", self.completion_tokens)
        _check(self.vocab_size >= 2, "engine.simulated.vocab_size", ">= 2", self.vocab_size)
        _check(self.die_after >= 0, "engine.simulated.die_after", ">= 0 (0 = never)", self.die_after)
        _check(self.failed_restarts >= 0, "engine.simulated.failed_restarts", ">= 0", self.failed_restarts)


@dataclass(frozen=True)
class EngineConfig:
    """Which engines generate, and where."""

    kind: Literal["transformers", "vllm", "vllm_server", "simulated"] = "transformers"  # which engine generates
    devices: tuple[str, ...] = ("cpu",)  # one engine per entry; repeat a GPU to put two engines on it (not vllm_server)
    request_timeout_s: float = 600.0  # a generate call that takes longer is cancelled and retried
    retries: int = 2  # a generate call that raises or times out is retried this many times, then failed
    retry_backoff_s: float = 0.5  # wait before retry r: retry_backoff_s * 2**r
    max_consecutive_errors: int = 5  # an engine whose calls fail this many times in a row is taken out
    restarts: int = 3  # times the pipeline may restart one engine it built after it left the rotation; 0 = never
    restart_backoff_s: float = 5.0  # wait between closing a failed engine and starting it again
    start_timeout_s: float = 900.0  # an engine that has not started by then is an error
    load_timeout_s: float = 120.0  # an adapter load that takes longer is an error
    transformers: TransformersEngineConfig = field(default_factory=TransformersEngineConfig)
    vllm: VLLMEngineConfig = field(default_factory=VLLMEngineConfig)
    vllm_server: VLLMServerEngineConfig = field(default_factory=VLLMServerEngineConfig)
    simulated: SimulatedEngineConfig = field(default_factory=SimulatedEngineConfig)

    def __post_init__(self) -> None:
        _check(len(self.devices) >= 1, "engine.devices", "a non-empty list like [\"cuda:0\"]", self.devices)
        for i, d in enumerate(self.devices):
            _check_device(f"engine.devices[{i}]", d)
        _check(self.request_timeout_s > 0, "engine.request_timeout_s", "> 0", self.request_timeout_s)
        _check(self.retries >= 0, "engine.retries", ">= 0", self.retries)
        _check(self.retry_backoff_s >= 0, "engine.retry_backoff_s", ">= 0", self.retry_backoff_s)
        _check(self.max_consecutive_errors >= 1, "engine.max_consecutive_errors", ">= 1", self.max_consecutive_errors)
        _check(self.restarts >= 0, "engine.restarts", ">= 0 (0 = never restart)", self.restarts)
        _check(self.restart_backoff_s >= 0, "engine.restart_backoff_s", ">= 0", self.restart_backoff_s)
        _check(self.start_timeout_s > 0, "engine.start_timeout_s", "> 0", self.start_timeout_s)
        _check(self.load_timeout_s > 0, "engine.load_timeout_s", "> 0", self.load_timeout_s)
        if self.kind == "vllm":
            for i, d in enumerate(self.devices):
                _check(d.startswith("cuda:"), f"engine.devices[{i}]", 'a GPU ("cuda:N") for the vLLM engine', d)
        if self.kind == "vllm_server" and self.vllm_server.launch:
            for i, d in enumerate(self.devices):
                _check(d.startswith("cuda:"), f"engine.devices[{i}]", 'a GPU ("cuda:N") for a launched vllm serve', d)
        elif self.kind == "vllm_server" and self.devices != ("cpu",):
            raise ConfigError('engine.devices does not apply to engine.kind = "vllm_server": each server runs on the '
                              "GPUs it was started on, one engine per engine.vllm_server.urls entry; leave it out "
                              "(or set engine.vllm_server.launch = true to start one server per entry)")
        if self.kind == "vllm_server" and not self.vllm_server.urls and not self.vllm_server.launch:
            raise ConfigError('engine.kind = "vllm_server" needs engine.vllm_server.urls: the servers to use, '
                              'e.g. ["http://gpu-host-1:8000"] (start each with `vllm serve MODEL --enable-lora` '
                              "and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True), or engine.vllm_server.launch = true")


@dataclass(frozen=True)
class TrainerConfig:
    """The LoRA trainer on its own device."""

    kind: Literal["peft", "simulated"] = "peft"  # simulated: a trainer that only waits (benchmarks)
    update: Literal["lora", "full"] = "lora"  # publish a LoRA adapter per version, or the full weights (lora_* unused)
    device: str = "cpu"  # "cpu" or "cuda:N"
    devices: tuple[str, ...] = ()  # trainer ranks, one process each, FSDP2 over torch.distributed (gloo on "cpu", NCCL on "cuda:N"); empty = trainer.device alone
    remote_ranks: int = 0  # more ranks, started on other hosts (`python -m pipeline.trainer.ranks`, e.g. under torchrun; docs/gpus.md#trainer-ranks)
    rendezvous: str = ""  # with remote_ranks: "tcp://THIS_HOST:PORT", where rank 0's store listens for them
    lr: float = 1e-2  # for the CPU demo's tiny random model; real models want ~1e-5 to 1e-4
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    betas: tuple[float, ...] = (0.9, 0.99)  # AdamW betas
    grad_clip: float = 1.0  # max global gradient norm; 0 = off
    lora_rank: int = 8  # LoRA r
    lora_alpha: float = 16.0  # LoRA scale is alpha / r
    lora_dropout: float = 0.0  # dropout on the LoRA path while training
    target_modules: tuple[str, ...] = ("all-linear",)  # module names, or "all-linear"
    micro_batch_sequences: int = 64  # sequences per forward/backward (gradient accumulation)
    dtype: Literal["float32", "bfloat16"] = "float32"  # base weights (LoRA's are always float32); update = full trains in it
    publish: Literal["files", "memory"] = "files"  # each version as a directory, or in memory: full weights to vLLM on the trainer's GPU, LoRA to transformers engines in the step's reply (docs/full-weights.md)
    step_s: float = 0.0  # simulated trainer only: seconds per step
    separate_process: bool = True  # train in a child process, so steps never hold the event loop's GIL
    nice: int = 10  # niceness of that process (0-19): when cores are short, the event loop and engines go first
    sched_idle: bool = False  # on the CPU, run that process under Linux SCHED_IDLE: less loop lag, less throughput (docs/results.md)
    threads: int = 0  # that process's (each rank's) torch threads on the CPU; 0 = where they pay (docs/benchmarks.md#threads)
    max_consecutive_skips: int = 3  # this many non-finite steps in a row stop the run (after a checkpoint)
    step_timeout_s: float = 3600.0  # a training step or publish that takes longer is an error
    minibatches: int = 1  # optimizer steps per batch per epoch (the batch split in this many parts); > 1 makes ppo's clip act
    epochs: int = 1  # passes over the batch per step; minibatches x epochs optimizer steps publish one version

    @property
    def rank_devices(self) -> tuple[str, ...]:
        """The device of each trainer process: trainer.devices, or trainer.device alone."""
        return self.devices or (self.device,)

    @property
    def gpu_in_run_process(self) -> bool:
        """Whether the trainer computes on a GPU in the run's own process (a thread, not a process of its own)."""
        return self.kind == "peft" and not self.separate_process and self.device.startswith("cuda")

    def __post_init__(self) -> None:
        _check_device("trainer.device", self.device)
        for i, d in enumerate(self.devices):
            _check_device(f"trainer.devices[{i}]", d)
        if self.devices:
            kinds = {d.split(":")[0] for d in self.devices}
            _check(len(kinds) == 1, "trainer.devices", 'all "cpu" (gloo) or all "cuda:N" (NCCL), not both', self.devices)
            gpus = [d for d in self.devices if d != "cpu"]
            _check(len(set(gpus)) == len(gpus), "trainer.devices", "each GPU once (one rank per GPU)", self.devices)
            _check(self.kind == "peft", "trainer.devices", 'unset for trainer.kind = "simulated" (it has no ranks)',
                   self.devices)
            _check(self.separate_process, "trainer.devices",
                   "unset with trainer.separate_process = false (each rank is a process of its own)", self.devices)
        _check(self.remote_ranks >= 0, "trainer.remote_ranks", ">= 0", self.remote_ranks)
        if self.remote_ranks:
            _check(bool(self.devices), "trainer.devices", "set when trainer.remote_ranks is (this host's ranks, "
                   "rank 0 first)", self.devices)
            _check(re.fullmatch(r"tcp://[^:/\s]+:\d{1,5}", self.rendezvous) is not None, "trainer.rendezvous",
                   '"tcp://HOST:PORT" (this host\'s address, where the remote ranks connect) with trainer.remote_ranks',
                   self.rendezvous)
        else:
            _check(not self.rendezvous, "trainer.rendezvous", "unset without trainer.remote_ranks (ranks on this host "
                   "meet through a file)", self.rendezvous)
        _check(self.minibatches >= 1, "trainer.minibatches", ">= 1", self.minibatches)
        _check(self.epochs >= 1, "trainer.epochs", ">= 1", self.epochs)
        _check(self.lr >= 0 and math.isfinite(self.lr), "trainer.lr", ">= 0", self.lr)
        _check(self.weight_decay >= 0, "trainer.weight_decay", ">= 0", self.weight_decay)
        _check(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "trainer.betas",
               "two numbers in [0, 1)", self.betas)
        _check(self.grad_clip >= 0, "trainer.grad_clip", ">= 0 (0 = off)", self.grad_clip)
        _check(self.lora_rank >= 1, "trainer.lora_rank", ">= 1", self.lora_rank)
        _check(self.lora_alpha > 0, "trainer.lora_alpha", "> 0", self.lora_alpha)
        _check(0 <= self.lora_dropout < 1, "trainer.lora_dropout", "in [0, 1)", self.lora_dropout)
        _check(len(self.target_modules) >= 1 and all(self.target_modules), "trainer.target_modules",
               "a non-empty list of module names", self.target_modules)
        _check(self.micro_batch_sequences >= 1, "trainer.micro_batch_sequences", ">= 1", self.micro_batch_sequences)
        _check(self.step_s >= 0, "trainer.step_s", ">= 0", self.step_s)
        _check(0 <= self.nice <= 19, "trainer.nice", "in [0, 19]", self.nice)
        _check(self.threads >= 0, "trainer.threads", ">= 0 (0 = chosen by the workload)", self.threads)
        _check(self.max_consecutive_skips >= 1, "trainer.max_consecutive_skips", ">= 1", self.max_consecutive_skips)
        _check(self.step_timeout_s > 0, "trainer.step_timeout_s", "> 0", self.step_timeout_s)


@dataclass(frozen=True)
class LossConfig:
    """GRPO advantages and the importance-corrected policy loss; the family and its recipes: docs/learning.md."""

    correction: Literal["tis", "ppo", "none"] = "tis"  # tis: truncated IS; ppo: decoupled PPO (clips from trainer.minibatches/epochs > 1); none: plain
    is_cap: float = 2.0  # C: cap of the behaviour importance weight (tis and ppo)
    is_mode: Literal["truncate", "mask"] = "truncate"  # above the cap: weigh the token C (truncate), or drop it (mask, AReaL's filter)
    ratio_level: Literal["token", "sequence"] = "token"  # sequence: one ratio per sequence, the geometric mean of its tokens' (GSPO); needs aggregation = "seq_mean"
    clip_eps: float = 0.2  # ppo: clip of the ratio to the proximal policy (GSPO uses ~3e-4 with ratio_level = "sequence")
    scale_rewards: bool = True  # divide group-centred rewards by the group's std (false for Dr.GRPO)
    std: Literal["population", "sample"] = "population"  # that std: divide by n (GRPO's paper) or n - 1 (Bessel, TRL's)
    aggregation: Literal["token_mean", "seq_mean", "constant"] = "token_mean"  # tokens / count (DAPO), per sequence first (GRPO), or tokens / (sequences x norm_tokens) (Dr.GRPO)
    norm_tokens: int = 0  # aggregation = "constant": the constant; 0 = sampling.max_new_tokens
    kl_coef: float = 0.0  # weight of a k3 KL penalty to the reference policy (LoRA: the base model, adapter off; full: a frozen copy); 0 = off
    logratio_clamp: float = 20.0  # |log-ratio| cap before exp, so a large mismatch cannot overflow

    def __post_init__(self) -> None:
        _check(self.is_cap >= 1, "loss.is_cap", ">= 1", self.is_cap)
        _check(0 < self.clip_eps < 1, "loss.clip_eps", "in (0, 1)", self.clip_eps)
        _check(self.norm_tokens >= 0, "loss.norm_tokens", ">= 0 (0 = sampling.max_new_tokens)", self.norm_tokens)
        _check(self.kl_coef >= 0 and math.isfinite(self.kl_coef), "loss.kl_coef", ">= 0 (0 = off)", self.kl_coef)
        # above ~80, exp(clamp) * advantage overflows float32 in the ppo objective
        _check(0 < self.logratio_clamp <= 50, "loss.logratio_clamp", "in (0, 50]", self.logratio_clamp)
        if self.ratio_level == "sequence" and self.aggregation != "seq_mean":
            raise ConfigError(f'loss.ratio_level = "sequence" weighs each sequence by one ratio, so its loss is a mean '
                              f'over sequences: set loss.aggregation = "seq_mean" (got {self.aggregation!r})')
        if self.is_mode == "mask" and self.correction == "none":
            raise ConfigError('loss.is_mode = "mask" drops tokens whose importance weight exceeds loss.is_cap, but '
                              'loss.correction = "none" computes no weight; use correction = "tis" or "ppo"')


@dataclass(frozen=True)
class PipelineConfig:
    """The orchestration: how many steps, how big a batch, how stale a group may be."""

    steps: int = 300  # training steps (= versions published)
    batch_groups: int = 8  # B: groups per training step
    max_staleness: int = 1  # K: a group sampled at version k trains at version <= k + K; 0 = synchronous
    buffer_capacity: int = 0  # completed groups held at most; 0 = (max_staleness + 1) * batch_groups
    full_weight_swap: Literal["drain", "in_flight"] = "drain"  # trainer.update = "full": drain = groups in flight finish on the old weights before a load (a group is one version's sample); in_flight = they go on with the new ones at once (vLLM recomputes their KV cache), labelled with the version they started with (docs/full-weights.md)
    filter_zero_advantage: bool = False  # drop groups whose rewards are all equal (no learning signal)
    logprob_check_every: int = 50  # steps between checks of engine vs trainer log-probs; 0 = only at start
    logprob_check_groups: int = 2  # groups recomputed per check
    logprob_warn_mean_abs: float = 0.1  # warn when mean |engine - trainer| log-prob exceeds this
    shutdown_timeout_s: float = 30.0  # how long shutdown waits for tasks before giving up
    checkpoint_every: int = 10  # steps between checkpoints (also one at the end and on SIGINT/SIGTERM); 0 = those only
    keep_checkpoints: int = 2  # newest checkpoints kept on disk
    checkpoint_behind: bool = True  # the trainer writes a checkpoint's state while the next steps run (a copy in host memory meanwhile); false = the loop waits for it
    switch_interval_ms: float = 0.25  # Python's GIL switch interval during a run (0 = leave it): the loop waits less for a worker thread
    gc_threshold: int = 100_000  # allocations between young-generation GC passes during a run (0 = leave Python's 700)

    def __post_init__(self) -> None:
        _check(self.steps >= 1, "pipeline.steps", ">= 1", self.steps)
        _check(self.batch_groups >= 1, "pipeline.batch_groups", ">= 1", self.batch_groups)
        _check(self.max_staleness >= 0, "pipeline.max_staleness", ">= 0", self.max_staleness)
        _check(self.buffer_capacity == 0 or self.buffer_capacity >= (self.max_staleness + 1) * self.batch_groups,
               "pipeline.buffer_capacity", f"0 (auto) or >= (max_staleness + 1) * batch_groups = "
               f"{(self.max_staleness + 1) * self.batch_groups}", self.buffer_capacity)
        _check(self.logprob_check_every >= 0, "pipeline.logprob_check_every", ">= 0", self.logprob_check_every)
        _check(self.logprob_check_groups >= 0, "pipeline.logprob_check_groups", ">= 0", self.logprob_check_groups)
        _check(self.shutdown_timeout_s > 0, "pipeline.shutdown_timeout_s", "> 0", self.shutdown_timeout_s)
        _check(self.checkpoint_every >= 0, "pipeline.checkpoint_every", ">= 0", self.checkpoint_every)
        _check(self.keep_checkpoints >= 1, "pipeline.keep_checkpoints", ">= 1", self.keep_checkpoints)
        _check(self.gc_threshold >= 0, "pipeline.gc_threshold", ">= 0", self.gc_threshold)
        _check(0 <= self.switch_interval_ms <= 1000, "pipeline.switch_interval_ms", "in [0, 1000]",
               self.switch_interval_ms)

    @property
    def capacity(self) -> int:
        return self.buffer_capacity or (self.max_staleness + 1) * self.batch_groups


@dataclass(frozen=True)
class StoreConfig:
    """The adapter store on a (shared) filesystem."""

    root: str = ""  # "" = <run dir>/adapters
    keep_last: int = 2  # versions kept beyond those engines may still use; 0 = none
    # resume never needs it (it publishes the checkpoint's version again): only a store other
    # programs rely on across a power loss does
    sync: bool = False  # fsync each version before engines load it (a torn one never loads either way)

    def __post_init__(self) -> None:
        _check_path("store.root", self.root)
        _check(self.keep_last >= 0, "store.keep_last", ">= 0", self.keep_last)


@dataclass(frozen=True)
class LogConfig:
    """Console and file logging."""

    level: Literal["debug", "info", "warning", "error"] = "info"  # console level; files get everything
    progress: bool = True  # progress bar on the console (only when it is a terminal)
    trackers: tuple[Literal["tensorboard", "wandb"], ...] = ()  # send metrics rows to "tensorboard", "wandb" too (extras)

    def __post_init__(self) -> None:
        _check(len(set(self.trackers)) == len(self.trackers), "log.trackers", "distinct trackers", self.trackers)


@dataclass(frozen=True)
class RunConfig:
    """A whole run."""

    seed: int = 0  # seeds prompts order, engines, trainer init and the built-in model
    deterministic: bool = False  # same seed, same run: identical per-step rewards and weights (transformers or simulated engines; slower: docs/learning.md#determinism)
    out: str = ""  # run directory; "" = runs/<timestamp>
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def __post_init__(self) -> None:
        _check_seed("seed", self.seed)
        _check_path("out", self.out)
        if self.data.train and not self.reward.functions and not (self.env.factory and self.env.reward == "env"):
            raise ConfigError(f"data.train = {_show(self.data.train)} needs reward.functions: the reward of your "
                              'prompts, e.g. functions = ["my_rewards.py:correct"] under [reward]')
        bad = self.sampling.off_policy_settings()
        if self.loss.correction != "none" and bad:
            raise ConfigError(
                f"sampling settings {', '.join(bad)} break the on-policy sampling contract that "
                f"loss.correction = {self.loss.correction!r} relies on (the stored log-probs would not be "
                "the policy's own); use temperature = 1, top_p = 1, top_k = 0, min_p = 0 and no penalties, "
                'or set loss.correction = "none"'
            )
        if self.model.warm_start and not self.model.path and self.task.name not in WARM_START_TASKS:
            raise ConfigError(f"model.warm_start learns from the built-in task's worked problems; task.name = "
                              f"{self.task.name!r} has none (tasks that have: {', '.join(WARM_START_TASKS)}): "
                              "set model.warm_start = false for it")
        if self.deterministic:
            _check_deterministic(self)
        if self.engine.kind == "vllm_server" and self.trainer.update == "full":
            raise ConfigError('trainer.update = "full" is not supported by engine.kind = "vllm_server" (a server '
                              'reloads LoRA adapters at run time, not whole weights); use engine.kind = "vllm"')
        if self.pipeline.full_weight_swap == "in_flight":
            _check_in_flight_swaps(self)
        if self.engine.kind == "vllm" and self.engine.vllm.start_method == "fork" and self.trainer.gpu_in_run_process:
            raise ConfigError(f'engine.vllm.start_method = "fork" needs trainer.separate_process = true: a trainer '
                              f'on {self.trainer.device} in this process initialises CUDA, and vLLM then cannot '
                              'fork its engine core (it spawns one)')
        if self.engine.kind == "vllm" and self.engine.vllm.max_lora_rank < self.trainer.lora_rank:
            raise ConfigError(f"engine.vllm.max_lora_rank ({self.engine.vllm.max_lora_rank}) must be >= "
                              f"trainer.lora_rank ({self.trainer.lora_rank}), or vLLM cannot load the adapters")
        if self.engine.kind == "transformers" and (
            self.sampling.repetition_penalty != 1.0
            or self.sampling.presence_penalty != 0.0
            or self.sampling.frequency_penalty != 0.0
        ):
            raise ConfigError("sampling penalties are not supported by engine.kind = \"transformers\"; "
                              "use engine.kind = \"vllm\" or leave them off")


def _check_in_flight_swaps(cfg: RunConfig) -> None:
    """pipeline.full_weight_swap = "in_flight": full weights, on engines that take a version mid-group."""
    if cfg.trainer.update != "full":
        raise ConfigError('pipeline.full_weight_swap = "in_flight" is how full-weight versions replace the last '
                          'one; with trainer.update = "lora" every version loads beside the others and nothing '
                          'drains: set trainer.update = "full" or leave full_weight_swap = "drain"')
    if cfg.engine.kind not in ("vllm", "simulated"):
        raise ConfigError(f'pipeline.full_weight_swap = "in_flight" needs engine.kind = "vllm" (its scheduler '
                          f'pauses the groups in flight and recomputes their KV cache with the new weights), got '
                          f'{cfg.engine.kind!r}; use full_weight_swap = "drain"')


def _check_deterministic(cfg: RunConfig) -> None:
    """What `deterministic = true` cannot make repeatable is refused, naming the setting."""
    if cfg.engine.kind not in ("transformers", "simulated"):
        raise ConfigError(f'deterministic = true needs engine.kind = "transformers" or "simulated", got '
                          f'{cfg.engine.kind!r}: vLLM\'s batched kernels give results that depend on what else '
                          "is in the batch")
    if cfg.pipeline.full_weight_swap == "in_flight":
        raise ConfigError('deterministic = true cannot be combined with pipeline.full_weight_swap = "in_flight": '
                          "where a group's version changes depends on timing")
    if cfg.pipeline.filter_zero_advantage:
        raise ConfigError("deterministic = true cannot be combined with pipeline.filter_zero_advantage = true: "
                          "which later group fills a dropped group's slot depends on timing")
    sim = cfg.engine.simulated
    if cfg.engine.kind == "simulated" and (sim.fail_rate or sim.hang_rate or sim.die_after):
        raise ConfigError("deterministic = true cannot be combined with injected engine faults "
                          "(engine.simulated.fail_rate, hang_rate, die_after): a group that fails for good gives "
                          "its place to a later one, and which one depends on timing")
