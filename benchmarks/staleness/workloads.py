"""Workloads of the throughput-vs-staleness sweep: the engine and trainer every max_staleness K runs.

A workload gives, for each K, the run's config and what the Pipeline is handed (prompts, a
reward, a shared engine, a stand-in trainer), and measures its engine and trainer alone before
the sweep (the standalone rates the analysis compares the runs with). Invariants:
- Every K of one workload runs the same engine, trainer, seed and model; whatever a run leaves
  behind in what runs share (the vLLM engine's adapters) is undone by `after_run`.
- Standalone requests use group ids from STANDALONE_IDS on, far from any run's.

SimWorkload: the simulated engine (B groups at once, each gen_ratio x the trainer's step) and
the sleeping trainer. ModelWorkload: a built-in model on the char_class task with the LoRA
trainer (or ReplayTrainer, --trainer sim); TransformersWorkload runs it on the CPU,
VLLMWorkload on one vLLM engine started once for the whole sweep, VLLMServerWorkload on one
`vllm serve` started once (with the in-process engine's settings) and one HTTP engine on it.
The engine alone is measured by the same client code for every engine (`engine_alone`).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.util
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from pipeline.store.weights import MANIFEST, AdapterStore
from pipeline.config.schema import RunConfig
from pipeline.config.io import load_config
from pipeline.trainer.simulated import SimulatedTrainer
from pipeline.types import AdapterRef, Batch, Generation, GroupRequest, Prompt, RolloutGroup

STANDALONE_IDS = 10**9  # group ids of standalone requests, far from any run's
RATIO_NAMES = {3.0: "gen3x-slower", 1.0: "balanced", 0.33: "gen3x-faster"}


def vllm_missing(engine_device: str, trainer_device: str) -> str | None:
    """Why --engine vllm cannot run here, or None."""
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (pip install 'pipeline[vllm]'; it needs a CUDA GPU)"
    import torch

    if not torch.cuda.is_available():
        return "vLLM needs a CUDA GPU and torch sees none"
    count = torch.cuda.device_count()
    for dev in (engine_device, trainer_device):
        if not dev.startswith("cuda:") or not dev[5:].isdigit() or int(dev[5:]) >= count:
            return f"device {dev!r} is not one of the {count} CUDA GPUs here (cuda:0..cuda:{count - 1})"
    return None


# ====================================================================== measurements shared by every engine


async def sample_batch(engine: Any, prompts: Sequence[Prompt], n: int, max_new_tokens: int,
                       adapters: Sequence[AdapterRef] = ()) -> tuple[float, list[Generation]]:
    """Submit one group per prompt at once, group i on adapters[i % len(adapters)] (the base model
    without adapters); seconds until the last finishes, and the generations."""
    on = list(adapters) or [AdapterRef.base()]
    t0 = time.perf_counter()
    tasks = [asyncio.ensure_future(engine.generate(GroupRequest(STANDALONE_IDS + i, p, n, max_new_tokens),
                                                   on[i % len(on)])) for i, p in enumerate(prompts)]
    try:
        gens = await asyncio.gather(*tasks)
    except BaseException:  # one group failed (or the caller cancelled): the others stop too
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    return time.perf_counter() - t0, list(gens)


async def engine_alone(engine: Any, prompts: Sequence[Prompt], n: int, max_new_tokens: int,
                       adapters: Sequence[AdapterRef] = ()) -> dict[str, float]:
    """The engine alone on one group per prompt, all at once, round-robin over `adapters` (loaded
    first, not timed): {"groups", "tokens", "seconds", "tokens_per_s"}. The same client code times
    every engine, in process or behind HTTP, so their rates compare."""
    for adapter in adapters:
        await engine.load_adapter(adapter)
    seconds, gens = await sample_batch(engine, prompts, n, max_new_tokens, adapters)
    tokens = sum(g.num_tokens for g in gens)
    return {"groups": len(gens), "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def time_trainer(trainer: Any, groups: Sequence[RolloutGroup], store_root: Path, repeats: int,
                 update: str = "lora", publish: str = "files") -> dict[str, float]:
    """Median seconds of one trainer step and of publishing its adapter (blocking; after one warm-up).

    publish: trainer.publish; with "memory" the publish timed is the version's share in GPU memory,
    and the last version is also written to the store untimed (what --trainer sim replays)."""
    trainer.setup()
    store = AdapterStore(store_root, kind=update)
    steps, publishes = [], []
    for i in range(repeats + 1):
        # as most of the pipeline's steps: no copy of the old version kept for a log-prob check
        batch = Batch(step=i + 1, version=trainer.version, groups=tuple(groups), keep_version=False)
        t0 = time.perf_counter()
        stats = trainer.step(batch)
        t1 = time.perf_counter()
        if publish == "memory":
            trainer.share_weights(stats.version)
        else:
            store.publish(stats.version, trainer.save_adapter)
        t2 = time.perf_counter()
        if publish == "memory" and i == repeats:
            store.publish(stats.version, trainer.save_adapter)
        if i > 0:
            steps.append(t1 - t0)
            publishes.append(t2 - t1)
    step, pub = statistics.median(steps), statistics.median(publishes)
    return {"t_train_step_s": step, "t_publish_s": pub, "t_train_s": step + pub,
            "t_train_all_s": [a + b for a, b in zip(steps, publishes)]}


class ReplayTrainer(SimulatedTrainer):
    """--trainer sim: trains nothing, and publishes a real trainer's adapter as every version.

    Each step sleeps `step_s` (the real trainer's step, timed in the standalone measurement); each
    version's files are copied from `template`, a version directory that trainer published, so
    the store hashes and fsyncs as many bytes as a real publish and engines load real weights of
    the real shapes from disk."""

    def __init__(self, step_s: float, template: Path, update: str = "lora") -> None:
        super().__init__(step_s, update=update)
        self.template = Path(template)
        self.files = sorted(e.name for e in os.scandir(self.template) if e.name != MANIFEST)

    def save_adapter(self, directory: Path) -> None:
        for name in self.files:
            shutil.copyfile(self.template / name, Path(directory) / name)



def free_memory() -> None:
    """Drop what a finished run or measurement held (GPU memory too), before the next one starts."""
    gc.collect()
    try:
        import torch
    except ImportError:  # nothing else to free without torch
        return
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()



# ====================================================================== workloads


class Workload:
    """One engine kind's workload: its config per K, its standalone rates, what the Pipeline is given."""

    learns = False  # a trainer that learns: its reward and its log-prob check are figures of the run
    kind = ""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    @property
    def shape(self) -> str:
        return self.args.model_shape

    def overrides(self, K: int, run_dir: Path) -> dict[str, Any]:
        a = self.args
        return {"out": str(run_dir), "seed": a.seed, "trainer.update": a.update,
                "pipeline.steps": a.steps, "pipeline.batch_groups": a.batch_groups,
                "pipeline.max_staleness": K, "pipeline.checkpoint_every": 0, "sampling.n": a.group_size,
                "sampling.max_new_tokens": a.max_new_tokens,
                "log.progress": False, "log.level": "warning"}

    def config(self, K: int, run_dir: Path) -> RunConfig:
        return load_config(None, {**self.overrides(K, run_dir), **self.args.set_overrides})

    def settings(self) -> dict[str, Any]:
        return {}

    def describe(self) -> str:
        """One line saying what this workload runs: the head of the printed report and the plot's title."""
        raise NotImplementedError

    def checks(self, standalone: dict[str, Any], results: list[dict[str, Any]]) -> dict[str, Any] | None:
        """Whether the workload came out shaped as asked (None: nothing to check for this engine)."""
        return None

    def pipeline_kwargs(self) -> dict[str, Any]:
        return {}

    async def prepare(self, scratch: Path) -> None:
        """Build what every run shares (a model, an engine) before the standalone measurements;
        `scratch` is the sweep's directory for what it writes (a server's log)."""
        return None

    async def standalone(self, scratch: Path) -> dict[str, Any]:
        raise NotImplementedError

    async def alone_at_depth(self, K: int) -> dict[str, Any] | None:
        """The engine alone under the run's load at max_staleness K (None: not measured for this engine)."""
        return None

    async def after_run(self) -> None:
        """Bring what the next run shares with this one back to its starting state."""
        return None

    async def close(self) -> None:
        return None


class SimWorkload(Workload):
    """The simulated engine (concurrency B, latency gen_ratio * step) and the sleeping trainer."""

    kind = "sim"

    def __init__(self, args: argparse.Namespace, ratio: float) -> None:
        super().__init__(args)
        self.ratio = ratio
        self.latency_s = ratio * args.train_step_s
        self.prompts = [{"id": f"sim-{i}", "prompt": "", "token_ids": [1 + i % 97, 2, 3, 4]} for i in range(1024)]

    @property
    def shape(self) -> str:
        return RATIO_NAMES.get(round(self.ratio, 2), f"ratio{self.ratio:g}")

    def overrides(self, K: int, run_dir: Path) -> dict[str, Any]:
        a = self.args
        o = super().overrides(K, run_dir)
        o.update({"engine.kind": "simulated", "trainer.kind": "simulated", "trainer.step_s": a.train_step_s,
                  "engine.simulated.latency_s": self.latency_s, "engine.simulated.concurrency": a.batch_groups,
                  "engine.simulated.completion_tokens": a.max_new_tokens})
        return o

    def settings(self) -> dict[str, Any]:
        return {"gen_ratio": self.ratio, "train_step_s": self.args.train_step_s, "latency_s": self.latency_s,
                "concurrency": self.args.batch_groups}

    def describe(self) -> str:
        return (f"sim: gen/train ratio {self.ratio:g} ({self.shape}), trainer step {self.args.train_step_s:g} s, "
                f"engine latency {self.latency_s:g} s x concurrency {self.args.batch_groups}")

    @staticmethod
    def reward(prompts: list[str], completions: list[str], completion_ids: list[list[int]], **kw: Any) -> list[float]:
        return [float(sum(ids) % 7) / 7.0 for ids in completion_ids]

    def pipeline_kwargs(self) -> dict[str, Any]:
        return {"prompts": self.prompts, "reward": self.reward, "tokenizer": False}

    async def standalone(self, scratch: Path) -> dict[str, Any]:
        from pipeline.engines.simulated import SimulatedEngine

        a = self.args
        cfg = self.config(0, scratch / "cfg")
        engine = SimulatedEngine(cfg.engine.simulated, seed=a.seed, name="standalone")
        prompts = [Prompt(p["id"], "", tuple(p["token_ids"])) for p in self.prompts[: 2 * a.batch_groups]]
        B = a.batch_groups
        times = []
        for _ in range(a.repeats + 1):
            t, gens = await sample_batch(engine, prompts[:B], a.group_size, a.max_new_tokens)
            times.append(t)
        t_gen = statistics.median(times[1:])
        t_two, _ = await sample_batch(engine, prompts, a.group_size, a.max_new_tokens)
        rng = np.random.default_rng(a.seed)
        groups = [RolloutGroup(g, rng.random(a.group_size), time.monotonic()) for g in gens]
        tr = await asyncio.to_thread(time_trainer, SimulatedTrainer(a.train_step_s, update=a.update), groups,
                                     scratch / "store", a.repeats, a.update,
                                     a.set_overrides.get("trainer.publish", "files"))
        tokens = sum(g.num_tokens for g in gens)
        return {"t_gen_s": t_gen, "t_gen_all_s": times[1:], "gen_tokens_per_s": tokens / t_gen,
                "groups": B, "two_batches_s": t_two, **tr}

    def checks(self, standalone: dict[str, Any], results: list[dict[str, Any]]) -> dict[str, Any]:
        """Is the simulated workload shaped as asked? At the largest K the slower tier must be the busy one."""
        last = max(results, key=lambda r: r["max_staleness"])
        gen, train = last["busy_generator"], last["busy_trainer"]
        t_ratio = standalone["t_gen_s"] / standalone["t_train_s"]
        if t_ratio > 1.25:
            expected, shaped = "generator", gen >= 0.9 and gen > train + 0.2
        elif t_ratio < 0.8:
            expected, shaped = "trainer", train > gen + 0.2
        else:  # either tier may bind; both must be kept busy
            expected, shaped = "either", min(gen, train) >= 0.6
        batch_over_latency = standalone["t_gen_s"] / self.latency_s
        two_over_one = standalone["two_batches_s"] / standalone["t_gen_s"]
        return {
            "measured_gen_over_train": t_ratio,
            "batch_s_over_latency_s": batch_over_latency,  # ~1: B groups at once take one latency
            "two_batches_over_one": two_over_one,  # ~2: the concurrency cap of B binds
            "expected_limit": expected,
            "busy_generator_at_max_staleness": gen,
            "busy_trainer_at_max_staleness": train,
            "ok": shaped and 0.9 < batch_over_latency < 1.5 and 1.7 < two_over_one < 2.5,
        }


class ModelWorkload(Workload):
    """A real engine and the LoRA trainer (or, with --trainer sim, its replay) on the built-in char_class task.

    trainer_from: another workload of this invocation, swept before this one on the same trainer
    device, whose trainer timing (step time, adapters) this one takes instead of timing the
    trainer again: two engines compared side by side then replay the same step."""

    def __init__(self, args: argparse.Namespace, trainer_from: ModelWorkload | None = None) -> None:
        super().__init__(args)
        self.trainer_from = trainer_from
        self.trainer_timing: dict[str, Any] | None = None  # what time_lora_trainer measured or took
        self.trainer_timed_in: str | None = None  # the kind of the workload that timed it
        self.model_path: Path | None = None
        self.tokenizer: Any = None
        self.store_root: Path | None = None  # the versions the real trainer published while it was timed
        self.template: Path | None = None  # the newest of them: what --trainer sim publishes
        self.replay_step_s = 0.0  # the real trainer's step: what --trainer sim sleeps

    @property
    def learns(self) -> bool:
        """The LoRA trainer learns; --trainer sim replays one adapter, so neither the reward nor a
        log-prob check (it hands the engine's log-probs back) is a figure."""
        return self.args.trainer == "peft"

    async def prepare(self, scratch: Path) -> None:
        from pipeline.models.builtin import build_model, load_tokenizer

        self.model_path = await asyncio.to_thread(build_model, self.args.model_shape, self.args.model_cache, 0)
        self.tokenizer = load_tokenizer(self.model_path)

    def overrides(self, K: int, run_dir: Path) -> dict[str, Any]:
        a = self.args
        o = super().overrides(K, run_dir)
        o.update({"model.path": str(self.model_path), "task.name": "char_class", "trainer.kind": "peft",
                  "trainer.lora_rank": a.lora_rank, "trainer.lora_alpha": a.lora_alpha,
                  "trainer.separate_process": a.trainer_process != "no"})
        if a.lr is not None:
            o["trainer.lr"] = a.lr
        if a.trainer == "sim":  # the run's config records what trained (pipeline_kwargs passes the trainer)
            o.update({"trainer.kind": "simulated", "trainer.step_s": self.replay_step_s})
        return o

    def pipeline_kwargs(self) -> dict[str, Any]:
        if self.args.trainer == "peft":
            return {}
        return {"trainer": ReplayTrainer(self.replay_step_s, self.template, update=self.args.update)}

    def settings(self) -> dict[str, Any]:
        cfg = self.config(0, Path("unused"))
        return {"model_shape": self.args.model_shape, "model_path": str(self.model_path), "task": cfg.task.name,
                "lr": cfg.trainer.lr, "lora_rank": cfg.trainer.lora_rank, "lora_alpha": cfg.trainer.lora_alpha,
                "target_modules": list(cfg.trainer.target_modules), "loss": cfg.loss.correction,
                "trainer_device": cfg.trainer.device, "trainer_dtype": cfg.trainer.dtype,
                "trainer": self.args.trainer,
                "replayed_step_s": self.replay_step_s if self.args.trainer == "sim" else None,
                "trainer_timed_in": self.trainer_timed_in}

    def describe(self) -> str:
        a = self.args
        what = f"{self.kind}: model {a.model_shape}, " + ("full-weight updates" if a.update == "full" else
                                                           f"LoRA rank {a.lora_rank}")
        if a.trainer == "sim":
            what += f", trainer simulated (sleeps the real step, {self.replay_step_s:.3f} s, publishes its adapter)"
        return what

    def task_prompts(self, count: int) -> list[Prompt]:
        from pipeline.data.tasks import build_task

        cfg = self.config(0, Path("unused"))
        task = build_task(cfg.task, cfg.sampling.max_new_tokens)
        self.task_reward = task.reward
        out = []
        for item in task.prompts[:count]:
            ids = tuple(self.tokenizer(item["prompt"], add_special_tokens=False)["input_ids"])
            out.append(Prompt(item["id"], item["prompt"], ids, {k: v for k, v in item.items()
                                                                if k not in ("id", "prompt")}))
        return out

    def score(self, gens: Sequence[Generation]) -> list[RolloutGroup]:
        groups = []
        for g in gens:
            ids = [c.token_ids.tolist() for c in g.completions]
            texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
            n = len(ids)
            meta = {k: [v] * n for k, v in g.request.prompt.meta.items()}
            rewards = self.task_reward([g.request.prompt.text] * n, texts, completion_ids=ids, **meta)
            groups.append(RolloutGroup(g, np.asarray(rewards, dtype=np.float64), time.monotonic()))
        return groups

    async def time_lora_trainer(self, groups: list[RolloutGroup], scratch: Path) -> dict[str, Any]:
        if (src := self.trainer_from) is not None and src.trainer_timing is not None:
            self.store_root, self.template, self.replay_step_s = src.store_root, src.template, src.replay_step_s
            self.trainer_timing, self.trainer_timed_in = src.trainer_timing, src.trainer_timed_in
            return dict(src.trainer_timing)
        from pipeline.trainer.policy import PolicyTrainer

        cfg = self.config(0, scratch / "cfg")
        # the real trainer is timed with either --trainer: --trainer sim replays its step time and adapter
        trainer = PolicyTrainer(self.model_path, cfg.trainer, cfg.loss, seed=self.args.seed, keep_versions=2)
        self.store_root = scratch / "store"
        try:
            tr = await asyncio.to_thread(time_trainer, trainer, groups, self.store_root, self.args.repeats,
                                         self.args.update, cfg.trainer.publish)
        finally:
            del trainer
            free_memory()
        self.template = Path(AdapterStore(self.store_root, kind=self.args.update).latest().path)
        # --replay-step-s: a set step instead (a stand-in quicker than the real trainer keeps the engine busy)
        self.replay_step_s = self.args.replay_step_s or tr["t_train_step_s"]
        self.trainer_timing, self.trainer_timed_in = tr, self.kind
        return tr


class TransformersWorkload(ModelWorkload):
    """The transformers engine and the LoRA trainer on the CPU; each Pipeline builds its own (same seed)."""

    kind = "transformers"

    def overrides(self, K: int, run_dir: Path) -> dict[str, Any]:
        o = super().overrides(K, run_dir)
        o.update({"engine.kind": "transformers", "engine.devices": ["cpu"], "trainer.device": "cpu"})
        return o

    async def standalone(self, scratch: Path) -> dict[str, Any]:
        from pipeline.engines.transformers import TransformersEngine

        a = self.args
        cfg = self.config(0, scratch / "cfg")
        G = a.standalone_groups or a.batch_groups
        prompts = self.task_prompts(G)
        engine = TransformersEngine(self.model_path, sampling=cfg.sampling, cfg=cfg.engine.transformers,
                                    device="cpu", dtype=cfg.model.dtype, max_loaded_adapters=1, seed=a.seed,
                                    name="standalone")
        await engine.start()
        try:
            times, tokens = [], []
            for _ in range(a.repeats + 1):
                t, gens = await sample_batch(engine, prompts, a.group_size, a.max_new_tokens)
                times.append(t)
                tokens.append(sum(g.num_tokens for g in gens))
        finally:
            await engine.close()
        rates = [k / t for k, t in zip(tokens[1:], times[1:])]
        tr = await self.time_lora_trainer(self.score(gens[: a.batch_groups]), scratch)
        import torch

        return {"t_gen_s": statistics.median(times[1:]) * a.batch_groups / G, "t_gen_all_s": times[1:],
                "gen_tokens_per_s": statistics.median(rates), "groups": G, "torch_threads": torch.get_num_threads(),
                **tr}


class VLLMWorkload(ModelWorkload):
    """One vLLM engine, started once and passed to every Pipeline of the sweep; the trainer on its own GPU."""

    kind = "vllm"

    def __init__(self, args: argparse.Namespace, trainer_from: ModelWorkload | None = None) -> None:
        super().__init__(args, trainer_from)
        self.engine: Any = None
        self.engine_start_s: float | None = None
        self.max_loras: int | None = None  # adapters the engine keeps on the GPU, once it is built

    def overrides(self, K: int, run_dir: Path) -> dict[str, Any]:
        a = self.args
        o = super().overrides(K, run_dir)
        o.update({"trainer.device": a.trainer_device, "trainer.dtype": a.trainer_dtype, "model.dtype": "bfloat16",
                  "engine.vllm.gpu_memory_utilization": a.gpu_memory_utilization,
                  "engine.vllm.max_model_len": a.max_model_len, "engine.vllm.enforce_eager": a.enforce_eager,
                  "engine.vllm.max_lora_rank": a.lora_rank, "engine.vllm.seed": a.seed, **self.engine_overrides()})
        if a.max_num_seqs is not None:
            o["engine.vllm.max_num_seqs"] = a.max_num_seqs
        return o

    def engine_overrides(self) -> dict[str, Any]:
        """engine.kind and where the engine runs: what each run's config records of the engine it is handed."""
        return {"engine.kind": "vllm", "engine.devices": [self.args.engine_device]}

    def settings(self) -> dict[str, Any]:
        v = self.config(0, Path("unused")).engine.vllm
        return {**super().settings(), "engine_device": self.args.engine_device,
                "gpu_memory_utilization": v.gpu_memory_utilization, "max_model_len": v.max_model_len,
                "enforce_eager": v.enforce_eager, "max_num_seqs": v.max_num_seqs, "max_loras": self.max_loras}

    async def prepare(self, scratch: Path) -> None:
        await super().prepare(scratch)
        t0 = time.perf_counter()
        await self.start_engine(scratch)
        self.engine_start_s = time.perf_counter() - t0
        print(f"{self.kind} started on {self.args.engine_device} in {self.engine_start_s:.1f} s", flush=True)

    async def start_engine(self, scratch: Path) -> None:
        """Build and start `self.engine`, sized for the sweep's largest K (`self.engine` is set before
        it starts, so `close()` ends a start that failed half way)."""
        from pipeline.engines.vllm import VLLMEngine
        from pipeline.loop.build import vllm_config

        a = self.args
        K = max(a.staleness_list)
        cfg = self.config(K, Path("unused"))
        # max_staleness sizes the adapters the engine keeps: the largest K of the sweep serves them all
        self.engine = VLLMEngine(self.model_path, sampling=cfg.sampling, cfg=vllm_config(cfg), device=a.engine_device,
                                 max_staleness=K, name="vllm-0", seed=cfg.engine.vllm.seed,
                                 full_weights=a.update == "full")
        self.max_loras = self.engine.max_loras
        await self.engine.start()

    def engine_facts(self) -> dict[str, Any]:
        """What the started engine says of itself, for the standalone record."""
        return {"graph_batch_max": self.engine.graph_batch_max}

    def pipeline_kwargs(self) -> dict[str, Any]:
        return {**super().pipeline_kwargs(), "engines": [self.engine]}

    async def standalone(self, scratch: Path) -> dict[str, Any]:
        a = self.args
        G = a.standalone_groups or a.batch_groups
        prompts = self.task_prompts(max(G, a.batch_groups))
        # warm-up, and the batch the trainer is timed on
        _, gens = await sample_batch(self.engine, prompts[: a.batch_groups], a.group_size, a.max_new_tokens)
        runs = []
        for _ in range(a.repeats):
            runs.append(await engine_alone(self.engine, prompts[:G], a.group_size, a.max_new_tokens))
        tr = await self.time_lora_trainer(self.score(gens), scratch)
        seconds = statistics.median(r["seconds"] for r in runs)
        return {"t_gen_s": seconds * a.batch_groups / G, "t_gen_all_s": [r["seconds"] for r in runs],
                "gen_tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
                "gen_tokens_per_s_all": [r["tokens_per_s"] for r in runs], "groups": G,
                "engine_start_s": self.engine_start_s, **self.engine_facts(), **tr}

    async def alone_at_depth(self, K: int) -> dict[str, Any]:
        """The engine alone under the load the pipeline gives it at max_staleness K, just before that run.

        The pipeline keeps up to (K + 1) * B groups in flight on up to K + 1 adapter versions, and
        vLLM is faster with more sequences per batch: the engine alone with as many groups, spread
        round-robin over as many of the real trainer's adapters (full weights: the one version an
        engine holds, here the base), is the fair limit. Measured --repeats times, right before the
        run: this engine's rate drifts by 10-20% over minutes, more than the gap being measured."""
        a = self.args
        n = (K + 1) * a.batch_groups
        prompts = self.task_prompts(n)
        adapters = await asyncio.to_thread(self.versions_for_depth, K + 1) if a.update == "lora" else []
        runs = []
        try:
            for _ in range(a.repeats):
                runs.append(await engine_alone(self.engine, prompts, a.group_size, a.max_new_tokens, adapters))
        finally:
            await self.after_run()  # the run starts from the base model, as every run does
        rates = [r["tokens_per_s"] for r in runs]
        return {"groups": n, "adapters": len(adapters), "tokens_per_s": statistics.median(rates),
                "tokens_per_s_all": rates, "seconds": [r["seconds"] for r in runs]}

    def versions_for_depth(self, count: int) -> list[AdapterRef]:
        """`count` adapter versions of the trainer's timing store (blocking): the newest ones it
        published, topped up with copies of the newest when it published fewer."""
        store = AdapterStore(self.store_root, kind="lora")
        while len(store.versions()) < count:
            store.publish(store.versions()[-1] + 1, ReplayTrainer(0.0, self.template).save_adapter)
        return [store.ref(v) for v in store.versions()[-count:]]

    async def after_run(self) -> None:
        """Unload the finished run's adapters, so every run starts from the base model alone.

        Runs publish under names `v{version:06d}-{hash8}`: two runs whose training left identical
        weights (zero advantages everywhere, as a random model's zero rewards give) publish the same
        name from different directories, which the engine refuses while the first is loaded.
        """
        if self.args.update == "full":  # back to the base weights
            await self.engine.load_adapter(AdapterRef.base())
            return
        for name in self.engine.loaded_adapters:
            version = int(name[1:].split("-", 1)[0])
            await self.engine.unload_adapter(AdapterRef(version=version, name=name, path=None))

    async def close(self) -> None:
        if self.engine is not None:
            await self.engine.close()


class VLLMServerWorkload(VLLMWorkload):
    """One `vllm serve` on --engine-device, started once, and one HTTP engine on it passed to every Pipeline.

    The server gets the in-process engine's settings (engine.vllm.*, kept in every run's config as
    the record of them) and its adapter slots: max_loras = max_staleness + 2 at the sweep's largest
    K (engine.vllm.max_loras if set), max_cpu_loras two more, and the same log-prob mode, CUDA
    graph sizes, prefix caching and seed. A side-by-side sweep then compares where the engine runs,
    not how it is set up. The engine registers at most max_staleness + 2 adapters at once (its
    default bound), so the server's slots hold every version a run has in use."""

    kind = "vllm_server"

    def __init__(self, args: argparse.Namespace, trainer_from: ModelWorkload | None = None) -> None:
        super().__init__(args, trainer_from)
        self.server: Any = None  # pipeline.engines.vllm_launch.VLLMServeProcess, once prepared
        self.url = ""  # the server's, chosen by prepare()

    def engine_overrides(self) -> dict[str, Any]:
        return {"engine.kind": "vllm_server", "engine.vllm_server.urls": [self.url]}

    def settings(self) -> dict[str, Any]:
        return {**super().settings(), "server_url": self.url,
                "server_argv": self.server.argv if self.server is not None else None,
                "max_loaded_adapters": self.engine.max_loaded if self.engine is not None else None}

    def describe(self) -> str:
        return super().describe() + ", over HTTP to `vllm serve`"

    async def start_engine(self, scratch: Path) -> None:
        from pipeline.engines.vllm_launch import VLLMServeProcess, free_port
        from pipeline.engines.vllm_server import VLLMServerEngine

        a = self.args
        K = max(a.staleness_list)
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"  # before the config: every run's names the server
        cfg = self.config(K, Path("unused"))
        v = cfg.engine.vllm
        self.max_loras = v.max_loras or K + 2
        on_policy = not cfg.sampling.off_policy_settings()  # as VLLMEngine picks its log-prob mode
        self.server = VLLMServeProcess(
            self.model_path, scratch / "vllm-serve.log", device=a.engine_device, port=port,
            gpu_memory_utilization=v.gpu_memory_utilization, max_model_len=v.max_model_len,
            max_num_seqs=v.max_num_seqs, max_lora_rank=v.max_lora_rank, max_loras=self.max_loras,
            enforce_eager=v.enforce_eager,
            extra=["--dtype", v.dtype, "--seed", str(v.seed), "--max-cpu-loras", str(self.max_loras + 2),
                   "--max-cudagraph-capture-size", str(v.max_cudagraph_capture_size or v.max_num_seqs),
                   "--logprobs-mode", "raw_logprobs" if on_policy else "processed_logprobs",
                   "--enable-prefix-caching", "--disable-log-stats", "--disable-uvicorn-access-log"])
        await self.server.start()
        self.engine = VLLMServerEngine(self.url, sampling=cfg.sampling, cfg=cfg.engine.vllm_server, max_staleness=K,
                                       name="vllm-server-0")
        await self.engine.start()

    def engine_facts(self) -> dict[str, Any]:
        return {"server_log": str(self.server.log_path)}  # its CUDA graph sizes are in there

    async def after_run(self) -> None:
        """Leave no adapter of the finished run registered, so every run starts from the base model alone.

        The Pipeline unregisters its versions at its end and alone_at_depth's go here; one still
        registered (an unregistration that failed) would refuse the next run's same-named version
        from another directory (see VLLMWorkload.after_run). The engine lists versions, not names:
        a restart of the engine object unregisters all it holds and leaves the server up."""
        if self.engine.loaded_versions:
            await self.engine.close()
            await self.engine.start()

    async def close(self) -> None:
        try:
            await super().close()  # the engine: its requests end, its adapters are unregistered
        finally:
            if self.server is not None:
                await self.server.stop()
