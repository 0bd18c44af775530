"""Building a run's parts from its config: the model, the tokenizer, the engines, the trainer and the
prompt sets, each by kind.

Invariants:
- Bad input found here is a ConfigError naming the key (the preflight's first: a missing file or
  package, a CUDA device this machine lacks; then a model.path that gives no tokenizer, no eval
  prompts while eval.every is set).
- Nothing here starts anything but `start`: engines and the trainer are built, not started;
  `start` and `close` bound every wait by a timeout.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Sequence

import structlog

from pipeline.config.schema import RunConfig
from pipeline.devices import trainer_threads
from pipeline.engines.base import Engine
from pipeline.errors import ConfigError, EngineDeadError
from pipeline.models import model_json
from pipeline.data.tasks import PromptSource, build_task

log = structlog.get_logger(__name__)


def check_devices(cfg: RunConfig, *, builds_engines: bool, builds_trainer: bool) -> None:
    """The preflight, before anything is built: the files and packages the config names, and each CUDA
    device the pipeline builds an engine or the trainer on, exist (ConfigError naming its key)."""
    from pipeline.loop.preflight import preflight

    preflight(cfg, builds_engines=builds_engines, builds_trainer=builds_trainer)


def rewards(cfg: RunConfig, reward: Any, weights: Sequence[float] | None, own_prompts: bool,
            env: bool = False) -> tuple[Any, Sequence[float] | None]:
    """(reward, weights): the caller's, reward.functions imported (a bad entry fails before anything
    is written), or None for the built-in task's. Own prompts without a reward are refused, unless
    an environment rewards them (env.reward = "env")."""
    if reward is None and cfg.reward.functions:
        from pipeline.data.rewards import load_reward_function

        reward = [load_reward_function(e, f"reward.functions[{i}]") for i, e in enumerate(cfg.reward.functions)]
        weights = weights or cfg.reward.weights or None
    if reward is None and (own_prompts or cfg.data.train) and not (env and cfg.env.reward == "env"):
        raise ValueError("your own prompts need a reward: pass reward=..., or set reward.functions in the config")
    return reward, weights


def environment(cfg: RunConfig, own_prompts: bool) -> Any:
    """The factory of one environment per episode: env.factory imported (a bad entry is a ConfigError
    naming it), or the built-in task's own (task.name = "calculator"); None for single-turn runs."""
    if cfg.env.factory:
        from pipeline.envs.protocol import load_environment_factory

        return load_environment_factory(cfg.env.factory, "env.factory")
    if own_prompts or cfg.data.train:
        return None
    return build_task(cfg.task, cfg.sampling.max_new_tokens).environment


def prompt_sets(cfg: RunConfig, prompts: Sequence[Any] | None, eval_prompts: Sequence[Any] | None,
                reward: Any, env: bool = False) -> tuple[list[Any], list[Any], Any]:
    """(training items, eval items, reward) from the caller, the data files or the built-in task.
    Data files' rows must hold their prompts, unless an environment (`env`) writes them."""
    from pipeline.data.files import load_rows

    field = None if env else cfg.data.prompt_field

    task = None
    if (prompts is None and not cfg.data.train) or reward is None:  # the built-in task gives prompts or reward
        task = build_task(cfg.task, cfg.sampling.max_new_tokens)
    if prompts is not None:
        items = list(prompts)
    else:
        items = load_rows(cfg.data.train, "data.train", field) if cfg.data.train else task.prompts
    eval_items: list[Any] = []
    if eval_prompts is not None:
        eval_items = list(eval_prompts)
    elif cfg.data.eval:
        eval_items = load_rows(cfg.data.eval, "data.eval", field)
    elif cfg.eval.every and task is not None and prompts is None and not cfg.data.train:
        # the built-in task's held-out split, or prompts it draws with another seed
        eval_items = task.eval_prompts if task.eval_prompts is not None else \
            build_task(replace(cfg.task, seed=cfg.task.seed + 1), cfg.sampling.max_new_tokens).prompts
    if cfg.eval.every and not eval_items:
        raise ConfigError("eval.every is set but there are no eval prompts: set data.eval to a file "
                          "(or pass eval_prompts= to Pipeline)")
    return items, eval_items, reward or task.reward


def prompt_source(cfg: RunConfig, items: list[Any], *, own: bool, epochs: int | None) -> PromptSource:
    """The training prompts in epochs: data.train's in data.seed's order (data.shuffle), others by seed."""
    data = own and bool(cfg.data.train)
    return PromptSource(items, seed=cfg.data.seed if data else cfg.seed, epochs=epochs,
                        shuffle=cfg.data.shuffle if data else True)


def model_path(cfg: RunConfig, tokenizer: Any, *, engines: bool, trainer: bool) -> str | None:
    """The model directory when the pipeline builds engines or the trainer on it or needs its
    tokenizer (`tokenizer` None: a caller's tokenizer, or False for none, needs no model)."""
    weights = (engines and cfg.engine.kind != "simulated") or (trainer and cfg.trainer.kind == "peft")
    return model_dir(cfg, weights=weights) if weights or tokenizer is None else None


def tokenizer_of(cfg: RunConfig, tokenizer: Any, path: str | None) -> Any:
    """The run's tokenizer: a caller's (None for False: prompts carry token ids), else the model's."""
    if tokenizer is None:
        tokenizer = load_tokenizer(cfg, path)
    return tokenizer or None


def init_cuda(cfg: RunConfig) -> None:
    """Initialise CUDA here, seeing every GPU, where this process computes on one: before a vLLM
    engine narrows CUDA_VISIBLE_DEVICES to its own GPU while it starts (a trainer in this process
    loads in a thread meanwhile). Not otherwise: vLLM forks its engine core only from a process that
    has not (engine.vllm.start_method), and a trainer process or a vLLM engine core computes apart."""
    engines_here = cfg.engine.devices if cfg.engine.kind == "transformers" else ()
    if cfg.trainer.gpu_in_run_process or any(d.startswith("cuda") for d in engines_here):
        import torch

        torch.cuda.init()


def model_dir(cfg: RunConfig, weights: bool = True) -> str:
    """model.path (checked), or the built-in model, built once into model.cache_dir. Without
    `weights` (only the tokenizer and the context are read: simulated engines and trainer), a warm
    start's own random base, which has the same tokenizer and config, and is not fine-tuned for it."""
    if cfg.model.path:
        from pipeline.models.builtin import check_model_dir

        check_model_dir(cfg.model.path)
        return cfg.model.path
    if cfg.model.warm_start and weights:
        from pipeline.models.warm_start import warm_start

        return str(warm_start(cfg.model.shape, build_task(cfg.task, cfg.sampling.max_new_tokens), cfg.model.cache_dir,
                              seed=cfg.seed, target=cfg.model.warm_start_accuracy, progress=cfg.log.progress))
    from pipeline.models.builtin import build_model

    return str(build_model(cfg.model.shape, cfg.model.cache_dir, seed=cfg.seed))


def load_tokenizer(cfg: RunConfig, model_path: str | None) -> Any:
    """The model's tokenizer; one that model.path cannot give is bad input (ConfigError)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=cfg.model.trust_remote_code)
    except Exception as e:  # transformers raises OSError, ValueError, KeyError... for a folder it cannot read
        if not cfg.model.path:
            raise  # the built-in model's: our bug, not the input's
        raise ConfigError(f"model.path: no tokenizer could be loaded from {model_path!r}: "
                          f"{type(e).__name__}: {e}") from e
    if len(tokenizer) <= 1:  # a folder without tokenizer files gets an empty one from transformers, not an error
        raise ConfigError(f"model.path: no tokenizer could be loaded from {model_path!r}: it holds no tokenizer "
                          f"files (tokenizer.json, tokenizer_config.json, vocab.json...), and an empty one has "
                          f"{len(tokenizer)} token(s)")
    return tokenizer


def model_config_value(model_path: str | None, key: str) -> Any:
    """`key` of the model's config.json; None without a model, a readable config.json or the key."""
    return None if model_path is None else model_json(model_path, "config.json").get(key)


def max_context(model_path: str | None) -> int | None:
    """The longest prompt + completion the model takes (its max_position_embeddings), if it says
    (a model without a readable config.json gets no length check); each engine reports its own
    limit besides (`Engine.max_context`)."""
    return model_config_value(model_path, "max_position_embeddings")


def prompt_builder(cfg: RunConfig, tokenizer: Any, model_path: str | None, engines: Sequence[Engine]) -> Any:
    """Rows to Prompts, under the smallest context of the model and the started engines (a vLLM
    server reports its --max-model-len)."""
    from pipeline.data.prompts import PromptBuilder, read_chat_template

    contexts = [n for n in (max_context(model_path), *(e.max_context for e in engines)) if n is not None]
    dc = cfg.data
    return PromptBuilder(tokenizer, max_new_tokens=cfg.sampling.max_new_tokens,
                         max_context=min(contexts) if contexts else None, prompt_field=dc.prompt_field,
                         apply_chat_template=dc.apply_chat_template, system_prompt=dc.system_prompt,
                         chat_template=read_chat_template(dc.chat_template) if dc.chat_template else None)


def graph_sequences(cfg: RunConfig) -> int:
    """The largest batch a vLLM engine of this run captures as a CUDA graph:
    engine.vllm.max_cudagraph_capture_size, or (0, the default) the sequences one engine can have
    running at once in this run, on vLLM's capture grid and at most engine.vllm.max_num_seqs.

    The staleness bound keeps at most (max_staleness + 1) x batch_groups training groups of n
    sequences admitted and untrained (an episode's later turns are one request per live episode, so
    never more), shared by the engines; an evaluation round adds its prompts x eval.n, all of them
    at once. vLLM captures every size on its grid up to the largest, each twice, so capturing for
    batches the run can never form costs set-up time and buys nothing; a batch past the largest
    graph would run eagerly, correct but slower.
    """
    vc, pc = cfg.engine.vllm, cfg.pipeline
    if vc.max_cudagraph_capture_size:
        return vc.max_cudagraph_capture_size
    engines = max(1, len(cfg.engine.devices))
    seqs = -(-(pc.max_staleness + 1) * pc.batch_groups * cfg.sampling.n // engines)
    if cfg.eval.every:
        if not cfg.eval.max_prompts:  # every eval prompt at once: as many as the scheduler runs
            return vc.max_num_seqs
        seqs += cfg.eval.max_prompts * cfg.eval.n
    # vLLM's grid: 1, 2, 4, then multiples of 8 below 256 and of 16 from there; a largest size off
    # the grid would be cut down to the grid point below it
    if seqs <= 4:
        grid = 1 if seqs == 1 else 2 if seqs == 2 else 4
    else:
        stride = 8 if seqs < 256 else 16
        grid = -(-seqs // stride) * stride
    return min(grid, vc.max_num_seqs)


def vllm_config(cfg: RunConfig) -> Any:
    """engine.vllm with its CUDA-graph size resolved for this run (`graph_sequences`): what a vLLM
    engine of the run, or one a benchmark builds for it, is given."""
    return replace(cfg.engine.vllm, max_cudagraph_capture_size=graph_sequences(cfg))


def build_engines(cfg: RunConfig, model_path: str | None, start_step: int,
                  run_dir: str | Path | None = None) -> list[Engine]:
    """One engine per engine.devices entry (per vllm_server.urls entry for servers someone else
    started), of engine.kind. Launched servers write their logs under run_dir/servers/."""
    K = cfg.pipeline.max_staleness
    full = cfg.trainer.update == "full"
    in_flight = cfg.pipeline.full_weight_swap == "in_flight"  # the config refuses it without full weights
    offset = 1009 * start_step  # a resumed run samples afresh, not the first session's draws
    if cfg.engine.kind == "vllm_server" and cfg.engine.vllm_server.launch:
        return launched_servers(cfg, model_path, Path(run_dir or ".") / "servers", seed=cfg.engine.vllm.seed + offset)
    if cfg.engine.kind == "vllm_server":  # servers someone else started: one engine per URL
        from pipeline.engines.vllm_server import VLLMServerEngine

        return [VLLMServerEngine(url, sampling=cfg.sampling, cfg=cfg.engine.vllm_server, max_staleness=K,
                                 name=f"vllm-server-{i}") for i, url in enumerate(cfg.engine.vllm_server.urls)]
    make: Callable[[int, str], Engine]
    if cfg.engine.kind == "simulated":
        from pipeline.engines.simulated import SimulatedEngine

        make = lambda i, dev: SimulatedEngine(cfg.engine.simulated, seed=cfg.seed + offset + i,
                                                             name=f"simulated-{i}", full_weights=full,
                                                             in_flight=in_flight)
    elif cfg.engine.kind == "transformers":
        from pipeline.engines.transformers import TransformersEngine

        # deterministic: each group decoded alone, so no group's numbers depend on which others it met
        tcfg = replace(cfg.engine.transformers, max_batch_groups=1) if cfg.deterministic else cfg.engine.transformers
        make = lambda i, dev: TransformersEngine(
            model_path, sampling=cfg.sampling, cfg=tcfg, device=dev, dtype=cfg.model.dtype,
            max_loaded_adapters=cfg.engine.transformers.max_loaded_adapters or K + 1, seed=cfg.seed + offset + i,
            name=f"transformers-{i}", trust_remote_code=cfg.model.trust_remote_code, full_weights=full,
            deterministic=cfg.deterministic)
    else:
        from pipeline.engines.vllm import VLLMEngine

        vcfg = vllm_config(cfg)
        make = lambda i, dev: VLLMEngine(model_path, sampling=cfg.sampling, cfg=vcfg, device=dev,
                                                   max_staleness=K, name=f"vllm-{i}",
                                                   seed=cfg.engine.vllm.seed + offset + i, full_weights=full,
                                                   in_flight=in_flight)
    return [make(i, dev) for i, dev in enumerate(cfg.engine.devices)]


def launched_servers(cfg: RunConfig, model_path: str | None, log_dir: Path, seed: int) -> list[Engine]:
    """One `vllm serve` of the model per engine.devices entry, each the engine of its own server:
    started by the engine's start() and stopped by its close(), so an engine restart is a new server."""
    from pipeline.engines.vllm import compilation_config
    from pipeline.engines.vllm_launch import VLLM_SERVE, VLLMServeProcess
    from pipeline.engines.vllm_server import VLLMServerEngine

    vc, sc, K = cfg.engine.vllm, cfg.engine.vllm_server, cfg.pipeline.max_staleness
    engines: list[Engine] = []
    # servers of one GPU start one after another: vLLM sizes its KV cache from the memory it sees
    # free while profiling, which a second server starting beside it would be taking
    gates = {device: asyncio.Lock() for device in cfg.engine.devices}
    for i, device in enumerate(cfg.engine.devices):
        server = VLLMServeProcess(
            model_path, log_dir / f"vllm-server-{i}.log", device=device, host=sc.host,
            port=sc.port + i if sc.port else 0, gpu_memory_utilization=vc.gpu_memory_utilization, max_model_len=vc.max_model_len,
            max_num_seqs=vc.max_num_seqs, max_lora_rank=vc.max_lora_rank,
            max_loras=sc.max_loaded_adapters or K + 2, enforce_eager=vc.enforce_eager,
            max_cudagraph_capture_size=graph_sequences(cfg), compilation=compilation_config(vc, lora=True),
            extra=("--dtype", vc.dtype, "--seed", str(seed + i), *sc.extra_args), skip_tokenizer_init=True,
            program=sc.command or VLLM_SERVE)
        engines.append(VLLMServerEngine(server.url, sampling=cfg.sampling, cfg=sc, max_staleness=K,
                                        name=f"vllm-server-{i}", server=server,
                                        server_timeout_s=cfg.engine.start_timeout_s, server_gate=gates[device]))
    return engines


def early_trainer_process(cfg: RunConfig) -> Any:
    """The trainer's process, started at once to import its libraries while the model is built
    (None where the trainer runs in this process or is simulated)."""
    if cfg.trainer.kind == "simulated" or not cfg.trainer.separate_process:
        return None
    if cfg.trainer.devices:  # rank 0's; the other ranks start at setup
        from pipeline.trainer.ranks import early_process

        return early_process(cfg.trainer)
    from pipeline.trainer.process import TrainerProcess

    return TrainerProcess(cfg.trainer)


def build_trainer(cfg: RunConfig, model_path: str | None, process: Any = None) -> Any:
    """The trainer of trainer.kind: peft LoRA (or full weights) in its own process (`process`, when
    started early) or a thread, or simulated."""
    if cfg.trainer.kind == "simulated":
        from pipeline.trainer.simulated import SimulatedTrainer

        return SimulatedTrainer(cfg.trainer.step_s, update=cfg.trainer.update)
    from pipeline.trainer.policy import PolicyTrainer
    from pipeline.trainer.process import ProcessTrainer
    from pipeline.trainer.ranks import RankedTrainer

    tc = cfg.trainer
    if tc.separate_process and tc.rank_devices[0] == "cpu":  # its own process: its own thread count (devices.py)
        engine_on_cpu = cfg.engine.kind == "transformers" and "cpu" in cfg.engine.devices
        threads = trainer_threads(tc.threads, max_staleness=cfg.pipeline.max_staleness, engine_on_cpu=engine_on_cpu,
                                  hidden_size=_hidden_size(model_path))
        if tc.devices and not tc.threads:  # the trainer's share of the cores, split between its ranks
            threads = max(1, threads // len(tc.devices))
        tc = replace(tc, threads=threads)
    cls = RankedTrainer if tc.devices else ProcessTrainer if tc.separate_process else PolicyTrainer
    # aggregation = "constant" divides by sequences x norm_tokens; 0 there means the completion cap
    loss = replace(cfg.loss, norm_tokens=cfg.loss.norm_tokens or cfg.sampling.max_new_tokens)
    kwargs = {"process": process} if cls is not PolicyTrainer else {}
    return cls(model_path, tc, loss, seed=cfg.seed, trust_remote_code=cfg.model.trust_remote_code,
               keep_versions=cfg.pipeline.max_staleness + 2, deterministic=cfg.deterministic, **kwargs)


def _hidden_size(model_path: str | None) -> int | None:
    """The model's width from its config.json (None when it says none or cannot be read)."""
    value = model_config_value(model_path, "hidden_size")
    return value if isinstance(value, int) else None


def episodes(cfg: RunConfig, factory: Any, builder: Any, tokenizer: Any) -> Any:
    """The runner of each group's episodes with `factory`'s environments; None for single turns."""
    if factory is None:
        return None
    if tokenizer is None:
        raise ConfigError("an environment needs the model's tokenizer (its actions are text, its replies are "
                          "rendered to tokens); Pipeline(tokenizer=False) cannot run episodes")
    from pipeline.loop.episodes import Episodes

    return Episodes(factory, cfg=cfg.env, builder=builder, tokenizer=tokenizer,
                    max_new_tokens=cfg.sampling.max_new_tokens, request_timeout_s=cfg.engine.request_timeout_s)


async def start(engines: Sequence[Engine], trainer: Any, timeout: float) -> dict[str, float]:
    """Start the engines and the trainer concurrently (both are slow), under engine.start_timeout_s,
    each to its end: shutdown closing one still starting raced its start, and whichever failed first
    (engines, then the trainer) is the error. Returns how long each took (the slowest engine's)."""
    async def timed(aw: Any) -> float:
        t = time.monotonic()
        await aw
        return time.monotonic() - t

    try:
        async with asyncio.timeout(timeout):
            started = await asyncio.gather(*(timed(e.start()) for e in engines), timed(asyncio.to_thread(trainer.setup)),
                                           return_exceptions=True)
    except TimeoutError:
        raise EngineDeadError(f"engines and trainer did not start within engine.start_timeout_s = "
                              f"{timeout} s") from None
    for result in started:
        if isinstance(result, BaseException):
            raise result
    return {"engines_start_s": max(started[:-1], default=0.0), "trainer_start_s": started[-1]}


async def close(engines: Sequence[Engine], trainer: Any, timeout: float) -> None:
    """Close what the pipeline built: the trainer (if any), then the engines, each under `timeout`."""
    if trainer is not None:
        await asyncio.to_thread(trainer.close)
    results = await asyncio.gather(*(asyncio.wait_for(e.close(), timeout) for e in engines), return_exceptions=True)
    for e, r in zip(engines, results):
        if isinstance(r, BaseException):
            log.error("engine_close_failed", engine=e.name, error=repr(r))
