"""The simulated engine: no model, a set speed, synthetic tokens and log-probabilities.

It keeps the Engine contract (n completions, equal-length token ids and log-probs, the version
asked for, abort on cancel) so the orchestrator, tests and benchmarks can run without a model.
Speed: each group takes `latency_s`; at most `concurrency` groups run at once (0 = unlimited),
so `concurrency / latency_s` groups per second is the generator's standalone rate.
Tokens are deterministic in (seed, group id, version, request seed): a test can tell versions apart.
Fault injection: a share `fail_rate` of calls raises GenerationError and a share `hang_rate`
never returns (until cancelled), drawn from the engine's own seeded generator.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

from pipeline.config import SimulatedEngineConfig
from pipeline.errors import EngineDeadError, GenerationError
from pipeline.metrics import BusyMeter
from pipeline.types import AdapterRef, Completion, Generation, GroupRequest


class SimulatedEngine:
    """An engine that waits instead of computing."""

    def __init__(self, cfg: SimulatedEngineConfig | None = None, *, seed: int = 0, name: str = "simulated-0",
                 eos_token_id: int = 0) -> None:
        self.cfg = cfg or SimulatedEngineConfig()
        self.name = name
        self.seed = seed
        self.eos_token_id = eos_token_id
        self.loaded_versions: set[int] = {0}
        self.busy = BusyMeter()
        self.stats = {"requests": 0, "cancelled": 0, "tokens": 0}
        self._slots = asyncio.Semaphore(self.cfg.concurrency) if self.cfg.concurrency else None
        self._closed = False
        self._tokens: np.ndarray | None = None
        self._logprobs: np.ndarray | None = None
        self._faults = np.random.default_rng([seed, 0xFA17])
        self.stats.update({"injected_failures": 0, "injected_hangs": 0})

    async def start(self) -> None:
        return None

    _POOL = 1 << 18  # synthetic values drawn once; groups take slices (a fresh RNG per group costs ~50 us)

    def _synthesize(self, request: GroupRequest, version: int) -> tuple[Completion, ...]:
        if self._tokens is None:
            rng = np.random.default_rng(self.seed)
            self._tokens = rng.integers(1, self.cfg.vocab_size, size=self._POOL, dtype=np.int64)
            # log-probs of a peaked-but-random policy: negative and finite
            self._logprobs = (-rng.exponential(1.0, size=self._POOL)).astype(np.float32)
        T = min(self.cfg.completion_tokens, request.max_new_tokens)
        size = request.n * T
        if size > self._POOL:
            raise ValueError(f"simulated groups hold at most {self._POOL} tokens, asked for {size}")
        key = request.group_id * 2654435761 + version * 40503 + (request.seed or 0) * 977
        off = key % (self._POOL - size + 1)
        tokens = self._tokens[off:off + size].reshape(request.n, T)
        logprobs = (self._logprobs[off:off + size] - np.float32(0.01 * version)).reshape(request.n, T)
        return tuple(Completion(tokens[i], logprobs[i], "length") for i in range(request.n))

    async def generate(self, request: GroupRequest, adapter: AdapterRef) -> Generation:
        if self._closed:
            raise EngineDeadError(f"engine {self.name} is closed")
        if adapter.version not in self.loaded_versions:
            await self.load_adapter(adapter)
        self.stats["requests"] += 1
        t_start = time.monotonic()
        if self.cfg.fail_rate or self.cfg.hang_rate:
            u = self._faults.random()
            if u < self.cfg.fail_rate:
                self.stats["injected_failures"] += 1
                raise GenerationError(f"engine {self.name}: injected failure (group {request.group_id})")
            if u < self.cfg.fail_rate + self.cfg.hang_rate:
                self.stats["injected_hangs"] += 1
                await asyncio.get_running_loop().create_future()  # hangs until the caller's timeout cancels it
        try:
            if self._slots is not None:
                await self._slots.acquire()
            try:
                with self.busy:
                    if self.cfg.latency_s > 0:
                        await asyncio.sleep(self.cfg.latency_s)
                    completions = self._synthesize(request, adapter.version)
            finally:
                if self._slots is not None:
                    self._slots.release()
        except asyncio.CancelledError:
            self.stats["cancelled"] += 1
            raise
        self.stats["tokens"] += sum(len(c.token_ids) for c in completions)
        return Generation(request, completions, version=adapter.version, engine=self.name,
                          t_start=t_start, t_end=time.monotonic())

    async def load_adapter(self, adapter: AdapterRef) -> None:
        if self._closed:
            raise EngineDeadError(f"engine {self.name} is closed")
        self.loaded_versions.add(adapter.version)

    async def unload_adapter(self, adapter: AdapterRef) -> None:
        if adapter.version != 0:
            self.loaded_versions.discard(adapter.version)

    async def close(self) -> None:
        self._closed = True
