"""The simulated engine: no model, a set speed, tokens drawn from a fixed synthetic policy.

It keeps the Engine contract (n completions, equal-length token ids and log-probs, the version
asked for, abort on cancel) so the orchestrator, tests and benchmarks can run without a model.
Speed: each group takes `latency_s`; at most `concurrency` groups run at once (0 = unlimited),
so `concurrency / latency_s` groups per second is the generator's standalone rate.
An episode's later turn (`request.turn` > 0) takes `turn_latency_s` instead.
Sampling: one categorical distribution over the ids [1, vocab_size), the same for every prompt,
version and position (`policy_logprobs`: the softmax of Gaussian logits seeded by the engine
seed; id 0, the default end-of-sequence id, is never drawn, so completions end by length). A
pool of tokens is drawn from it i.i.d. once, each with its log-probability under it; a group's
completions are a slice of that pool, so every reported log-prob is log p(token) under the
distribution the token was drawn from, as a real engine's is. Which slice is deterministic in
(seed, group id, version, request seed, turn): a test tells versions apart by the tokens that
come (one token's log-prob is the same in every version). Two groups' slices may overlap:
samples are independent within a group, not always across groups.
Fault injection: a share `fail_rate` of calls raises GenerationError and a share `hang_rate`
never returns (until cancelled), drawn from the engine's own seeded generator. With `die_after`
the engine dies (every call raises EngineDeadError) once it has taken that many groups since it
started; `start()` after `close()` revives it, except that the first `failed_restarts` restarts
raise EngineDeadError (a machine that does not come back).
Full-weight updates (`full_weights=True`): the engine holds one version, as a GPU engine holds
one copy of the weights. A call for any other version raises GenerationError, and loading
another version while any call runs raises GenerationError too: the orchestrator drains before
it loads, so a test that sees this error has found a group that would straddle two versions.
With `in_flight=True` (pipeline.full_weight_swap = "in_flight") a load is taken while calls run, as
vLLM takes one mid-generation: a call may ask for the version held or an older one, and each
Generation's `last_version` is the version held when it finished (the tokens come from the
version asked for: the synthetic policy is the same in every version).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Iterator, Sequence

import numpy as np

from pipeline.config.schema import SimulatedEngineConfig
from pipeline.engines.base import same_version
from pipeline.errors import EngineDeadError, GenerationError
from pipeline.observe.metrics import BusyMeter
from pipeline.types import AdapterRef, Completion, Generation, GroupRequest


class SimulatedEngine:
    """An engine that waits instead of computing."""

    def __init__(self, cfg: SimulatedEngineConfig | None = None, *, seed: int = 0, name: str = "simulated-0",
                 eos_token_id: int = 0, full_weights: bool = False, in_flight: bool = False) -> None:
        self.cfg = cfg or SimulatedEngineConfig()
        self.name = name
        self.seed = seed
        self.eos_token_id = eos_token_id
        self.loaded_versions: set[int] = {0}
        self.busy = BusyMeter()
        self.stats = {"requests": 0, "cancelled": 0, "tokens": 0}
        self._slots = asyncio.Semaphore(self.cfg.concurrency) if self.cfg.concurrency else None
        self._taking_slots = asyncio.Lock()
        self._closed = False
        self._closes = 0  # close() calls so far: a call that spans one raises EngineDeadError
        self._started = False
        self._restarts = 0  # start() calls after a close()
        self._groups_since_start = 0  # groups asked for since the last start (die_after counts these)
        self._tokens: np.ndarray | None = None
        self._logprobs: np.ndarray | None = None
        self._faults = np.random.default_rng([seed, 0xFA17])
        # injected hangs count calls; hung_groups the groups those calls held
        self.stats.update({"injected_failures": 0, "injected_hangs": 0, "hung_groups": 0})
        self.full_weights = full_weights
        self._weights = AdapterRef.base()  # full-weight mode: the one version held
        self._calls = 0  # full-weight mode: generate / generate_many calls running
        self.in_flight = in_flight  # full-weight mode: a load is taken while calls run

    @property
    def max_context(self) -> int | None:
        """None: no model, so no context limit of its own."""
        return None

    async def start(self) -> None:
        """Start; after `close()`, start afresh (no adapter loaded, `die_after` counts from zero)."""
        if self._started and not self._closed:
            return
        if self._closed:
            self._restarts += 1
            if self._restarts <= self.cfg.failed_restarts:
                raise EngineDeadError(f"engine {self.name}: injected failed restart {self._restarts} "
                                      f"(engine.simulated.failed_restarts = {self.cfg.failed_restarts})")
            self.loaded_versions = {0}
        self._closed = False
        self._started = True
        self._groups_since_start = 0

    _POOL = 1 << 18  # synthetic values drawn once; groups take slices (a fresh RNG per group costs more than a group's slice)
    # std of the policy's logits: a peaked-but-random policy (at 128 ids, seeds 0-4: entropy 2.6-3.6
    # nats, the most likely id 0.12-0.42), so rewards of token ids still vary within a group
    _LOGIT_STD = 2.0

    def policy_logprobs(self) -> np.ndarray:
        """[vocab_size] float64: log p of each id under the policy pool tokens are drawn from
        (-inf at id 0, which is never drawn)."""
        logits = np.random.default_rng([self.seed, 0x9011C7]).normal(0.0, self._LOGIT_STD, self.cfg.vocab_size)
        logits[0] = -np.inf
        return logits - np.logaddexp.reduce(logits)

    def _pool(self) -> tuple[np.ndarray, np.ndarray]:
        """(tokens [POOL] int64, their log-probs [POOL] float32): i.i.d. draws from the policy."""
        if self._tokens is None or self._logprobs is None:
            logp = self.policy_logprobs()
            rng = np.random.default_rng(self.seed)
            self._tokens = rng.choice(self.cfg.vocab_size, size=self._POOL, p=np.exp(logp)).astype(np.int64)
            self._logprobs = logp.astype(np.float32)[self._tokens]
        return self._tokens, self._logprobs

    def _shape(self, request: GroupRequest) -> tuple[int, int, int]:
        """(n, tokens per completion, tokens in all) of a request."""
        T = min(self.cfg.completion_tokens, request.max_new_tokens)
        size = request.n * T
        if size > self._POOL:
            raise ValueError(f"simulated groups hold at most {self._POOL} tokens, asked for {size}")
        return request.n, T, size

    @staticmethod
    def _key(request: GroupRequest, version: int) -> int:
        """What a group's place in the pool is drawn from: its id, the version and its seed."""
        return request.group_id * 2654435761 + version * 40503 + (request.seed or 0) * 977 + request.turn * 7919

    def _synthesize(self, request: GroupRequest, version: int) -> tuple[Completion, ...]:
        """One request's completions: views of a slice of the pool."""
        pool_tokens, pool_logprobs = self._pool()
        n, T, size = self._shape(request)
        off = self._key(request, version) % (self._POOL - size + 1)
        tokens = pool_tokens[off:off + size].reshape(n, T)
        logprobs = pool_logprobs[off:off + size].reshape(n, T)
        return tuple(Completion(tokens[i], logprobs[i], "length") for i in range(n))

    def _synthesize_many(self, requests: Sequence[GroupRequest], version: int) -> list[tuple[Completion, ...]]:
        """`_synthesize` for each request. Requests of one shape are gathered from the pool with one
        indexing operation: per group, the numpy calls cost more than the orchestration the
        overhead benchmark measures."""
        if len(requests) < 2 or len({(r.n, r.max_new_tokens) for r in requests}) > 1:
            return [self._synthesize(r, version) for r in requests]
        n, T, size = self._shape(requests[0])
        pool_tokens, pool_logprobs = self._pool()
        span = self._POOL - size + 1
        offsets = np.array([self._key(r, version) % span for r in requests], dtype=np.int64)
        at = offsets[:, None] + np.arange(size)  # [G, n * T] pool positions
        tokens = pool_tokens[at].reshape(-1, T)  # [G * n, T]
        logprobs = pool_logprobs[at].reshape(-1, T)
        rows = list(map(Completion, tokens, logprobs, ["length"] * len(tokens)))
        return [tuple(rows[i:i + n]) for i in range(0, len(rows), n)]

    def _latency(self, request: GroupRequest) -> float:
        """Seconds a request takes: latency_s for a group, turn_latency_s for an episode's later turn."""
        return self.cfg.turn_latency_s if request.turn else self.cfg.latency_s

    def _check_ready(self, adapter: AdapterRef, groups: int = 0) -> None:
        """Refuse calls on a closed or dead engine; count `groups` towards `die_after`."""
        if self._closed:
            raise EngineDeadError(f"engine {self.name} is closed")
        # at most die_after groups a life: a wave that would pass the limit is refused whole
        if self.cfg.die_after and (self._groups_since_start >= self.cfg.die_after
                                   or self._groups_since_start + groups > self.cfg.die_after):
            raise EngineDeadError(f"engine {self.name} died (injected: engine.simulated.die_after = "
                                  f"{self.cfg.die_after} groups)")
        self._groups_since_start += groups
        self.loaded_versions.add(adapter.version)  # loading costs nothing here

    def _fault(self, request: GroupRequest) -> str | None:
        """The injected fault of one call ("fail", "hang") or None, drawn from the engine's generator."""
        if not (self.cfg.fail_rate or self.cfg.hang_rate):
            return None
        u = self._faults.random()
        if u < self.cfg.fail_rate:
            return "fail"
        if u < self.cfg.fail_rate + self.cfg.hang_rate:
            return "hang"
        return None

    async def _hang(self, groups: int) -> None:
        """Never return (until the caller's timeout cancels the call), with `groups` groups in it."""
        self.stats["injected_hangs"] += 1
        self.stats["hung_groups"] += groups
        await asyncio.get_running_loop().create_future()

    async def generate(self, request: GroupRequest, adapter: AdapterRef) -> Generation:
        with self._sampling_with(adapter, [request]):
            return await self._generate(request, adapter)

    async def _generate(self, request: GroupRequest, adapter: AdapterRef) -> Generation:
        self._check_ready(adapter, 1)
        closes = self._closes
        self.stats["requests"] += 1
        t_start = time.monotonic()
        fault = self._fault(request)
        if fault == "fail":
            self.stats["injected_failures"] += 1
            raise GenerationError(f"engine {self.name}: injected failure (group {request.group_id})")
        if fault == "hang":
            await self._hang(1)
        try:
            if self._slots is not None:
                await self._slots.acquire()
            try:
                with self.busy:
                    if (latency := self._latency(request)) > 0:
                        await asyncio.sleep(latency)
                    completions = self._synthesize(request, adapter.version)
            finally:
                if self._slots is not None:
                    self._slots.release()
        except asyncio.CancelledError:
            self.stats["cancelled"] += 1
            raise
        self._check_not_closed_since(closes, request.group_id)
        self.stats["tokens"] += sum(len(c.token_ids) for c in completions)
        return Generation(request, completions, version=adapter.version, engine=self.name,
                          t_start=t_start, t_end=time.monotonic(), last_version=self._last_version())

    async def generate_many(self, requests: Sequence[GroupRequest],
                            adapter: AdapterRef) -> list[Generation | Exception]:
        """See `_generate_many`; in full-weight mode only for the version held."""
        with self._sampling_with(adapter, requests):
            return await self._generate_many(requests, adapter)

    async def _generate_many(self, requests: Sequence[GroupRequest],
                             adapter: AdapterRef) -> list[Generation | Exception]:
        """The groups of one batch call, in order; a group's injected failure is its entry.

        The same speed as one `generate` per group started together: the call takes one
        latency per `concurrency` groups (all of it holds the slots it needs). An injected hang
        hangs the whole call, as a stuck engine would.
        """
        self._check_ready(adapter, len(requests))
        closes = self._closes
        self.stats["requests"] += len(requests)
        t_start = time.monotonic()
        faults = [self._fault(r) for r in requests]
        if "hang" in faults:
            await self._hang(len(requests))
        self.stats["injected_failures"] += faults.count("fail")
        slots = min(len(requests), self.cfg.concurrency) if self._slots is not None else 0
        held = 0
        try:
            if slots:
                # all or nothing: two calls that each held part of the slots would wait on each other
                async with self._taking_slots:
                    for _ in range(slots):
                        await self._slots.acquire()
                        held += 1
            with self.busy:
                if (latency := max(map(self._latency, requests), default=0.0)) > 0:
                    rounds = -(-len(requests) // self.cfg.concurrency) if self.cfg.concurrency else 1
                    await asyncio.sleep(latency * rounds)
                t_end = time.monotonic()
                ok = [r for r, fault in zip(requests, faults) if fault != "fail"]
                made = iter(self._synthesize_many(ok, adapter.version))
                out: list[Generation | Exception] = []
                for r, fault in zip(requests, faults):
                    if fault == "fail":
                        out.append(GenerationError(f"engine {self.name}: injected failure (group {r.group_id})"))
                        continue
                    completions = next(made)
                    self.stats["tokens"] += len(completions) * len(completions[0].token_ids) if completions else 0
                    out.append(Generation(r, completions, adapter.version, self.name, t_start, t_end,
                                          last_version=self._last_version()))
        except asyncio.CancelledError:
            self.stats["cancelled"] += len(requests)
            raise
        finally:
            for _ in range(held):
                self._slots.release()
        self._check_not_closed_since(closes, requests[0].group_id if requests else -1)
        return out

    async def load_adapter(self, adapter: AdapterRef) -> None:
        if self.full_weights:
            self._swap_weights(adapter)
            return
        self._check_ready(adapter)

    async def unload_adapter(self, adapter: AdapterRef) -> None:
        if self.full_weights:
            return  # one version at a time: the next load replaces it
        if adapter.version != 0:
            self.loaded_versions.discard(adapter.version)

    def _check_not_closed_since(self, closes: int, group_id: int) -> None:
        """A call the engine was closed under (even if started again since) fails, as a real one would."""
        if self._closes != closes:
            raise EngineDeadError(f"engine {self.name} closed during group {group_id}")

    async def close(self) -> None:
        if not self._closed:
            self._closes += 1
        self._closed = True

    @contextlib.contextmanager
    def _sampling_with(self, adapter: AdapterRef, requests: Sequence[GroupRequest]) -> Iterator[None]:
        """Full-weight mode: refuse a call for any version but the one held (in flight: or an older one),
        and count it while it runs."""
        if not self.full_weights:
            yield
            return
        if self._closed:
            raise EngineDeadError(f"engine {self.name} is closed")
        held = self._weights
        if not (same_version(held, adapter) or self.in_flight and adapter.version <= held.version):
            raise GenerationError(f"engine {self.name} holds the full weights of version {held.version} "
                                  f"({held.name}); groups {[r.group_id for r in requests]} asked for version "
                                  f"{adapter.version} ({adapter.name})")
        self._calls += 1
        try:
            yield
        finally:
            self._calls -= 1

    def _last_version(self) -> int | None:
        """In-flight swaps: the version held as a call finishes (None otherwise: the call's own)."""
        return self._weights.version if self.full_weights and self.in_flight else None

    def _swap_weights(self, adapter: AdapterRef) -> None:
        """Full-weight mode: hold `adapter`'s version from now on; refused while any call runs (unless in flight)."""
        if self._closed:
            raise EngineDeadError(f"engine {self.name} is closed")
        held = self._weights
        if same_version(held, adapter):
            return
        if self._calls and not self.in_flight:
            raise GenerationError(f"engine {self.name}: load of version {adapter.version} while {self._calls} "
                                  f"call(s) still sample with version {held.version}; a full-weight engine "
                                  "holds one version, so its calls must finish (drain) before another loads")
        self._weights = adapter
        self.loaded_versions = {adapter.version}
