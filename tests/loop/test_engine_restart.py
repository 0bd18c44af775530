"""Engines that leave the rotation come back: the pipeline restarts the engines it built.

A simulated engine with `die_after` dies after that many groups each time it starts (every later
call raises EngineDeadError until it is closed and started again); `failed_restarts` makes its
first restarts fail. One engine makes the hard case: while it restarts, nothing is in rotation,
so groups must wait for it rather than fail, and the accounting must stay exact.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
import threading
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_faults import PROMPTS, assert_accounted, reward, sim_config

from pipeline.config.schema import SimulatedEngineConfig
from pipeline.engines.simulated import SimulatedEngine
from pipeline.errors import EngineDeadError
from pipeline.observe.metrics import read_jsonl
from pipeline.loop.orchestrator import Pipeline

STEPS, B = 20, 4  # 80 groups (sim_config: max_staleness 1, n = 2)
BACKOFF_S = 0.05
RESTARTS = {"engine.restarts": 3, "engine.restart_backoff_s": BACKOFF_S, "pipeline.steps": STEPS}


def events(p: Pipeline, *names: str) -> list[dict]:
    return [e for e in read_jsonl(p.run_dir / "events.jsonl") if e["event"] in names]


def run_expecting(cfg, error: type[BaseException], match: str) -> Pipeline:
    p = Pipeline(cfg, prompts=PROMPTS, reward=reward, tokenizer=False, console=False)
    with pytest.raises(error, match=match):
        p.run_sync()
    return p


def test_a_dead_engine_is_restarted_and_the_run_finishes(tmp_path: Path) -> None:
    # the only engine dies after 30 groups each time it starts: 80 groups need it back twice
    cfg = sim_config(tmp_path, **{**RESTARTS, "engine.simulated.die_after": 30})
    p = Pipeline(cfg, prompts=PROMPTS, reward=reward, tokenizer=False, console=False)
    s = p.run_sync()
    assert s["error"] is None and s["steps"] == STEPS
    assert_accounted(p, s)
    out = events(p, "engine_out_of_rotation")
    back = events(p, "engine_restarted")
    assert len(out) == len(back) == s["engine_restarts"]["simulated-0"] >= 2
    assert s["engine_restart_failures"] == {} and s["engines_out_of_rotation"] == []
    # while it restarted nothing could generate: its groups waited, none failed or used a retry
    assert s["groups_failed"] == {} and s["generation_retries"] == 0
    assert s["groups_trained"] == STEPS * B
    assert s["staleness_max"] <= cfg.pipeline.max_staleness
    # each restart waited the backoff and loaded the version being served before taking groups
    served = 0
    for e in events(p, "adapter_serving", "engine_restarted"):
        if e["event"] == "adapter_serving":
            served = e["version"]
        else:
            assert e["seconds"] >= BACKOFF_S - 0.002  # uvloop's timers run on a millisecond clock
            assert served == 0 or max(e["versions"]) >= served, (served, e)
    rows = read_jsonl(p.run_dir / "metrics.jsonl")
    assert all(r["engine/in_rotation"] in (0, 1) for r in rows)


def test_restarts_zero_keeps_the_old_behaviour(tmp_path: Path) -> None:
    cfg = sim_config(tmp_path, **{**RESTARTS, "engine.simulated.die_after": 30, "engine.restarts": 0})
    p = run_expecting(cfg, EngineDeadError, r"no engine is left in rotation \(simulated-0 .*engine\.restarts = 0")
    s = p.summary
    assert 1 <= s["steps"] <= 30 // B  # what the engine produced before it died was trained
    assert_accounted(p, s)
    assert s["engine_restarts"] == {} and s["engines_out_of_rotation"] == ["simulated-0"]
    assert events(p, "engine_restarting") == []
    assert [e["reason"] for e in events(p, "engine_not_restarted")] == ["restarts_off"]


@pytest.mark.parametrize("die_after, failed_restarts, restarted, failed", [
    (30, 100, 0, 2),  # it never comes back: both attempts fail
    (24, 0, 2, 0),  # it comes back and dies again: 3 lives of 24 groups are fewer than 80
])
def test_spent_restarts_end_the_run_with_a_clear_error(tmp_path: Path, die_after: int, failed_restarts: int,
                                                       restarted: int, failed: int) -> None:
    cfg = sim_config(tmp_path, **{**RESTARTS, "engine.restarts": 2, "engine.simulated.die_after": die_after,
                                              "engine.simulated.failed_restarts": failed_restarts})
    p = run_expecting(cfg, EngineDeadError, rf"restarts are spent \(engine\.restarts = 2; "
                                            rf"simulated-0: {restarted} restarted, {failed} failed\)")
    s = p.summary
    assert s["engine_restarts"] == ({"simulated-0": restarted} if restarted else {})
    assert s["engine_restart_failures"] == ({"simulated-0": failed} if failed else {})
    assert len(events(p, "engine_restarting")) == 2
    assert [e["reason"] for e in events(p, "engine_not_restarted")] == ["restarts_spent"]
    lives = 1 + restarted
    assert 1 <= s["steps"] < STEPS and s["groups_trained"] <= lives * (die_after + B)
    # only the call that found nothing left to generate with fails its groups (as without restarts)
    assert sum(s["groups_failed"].values()) <= B
    assert_accounted(p, s)


def test_a_failed_restart_is_retried_after_the_backoff(tmp_path: Path) -> None:
    cfg = sim_config(tmp_path, **{**RESTARTS, "pipeline.steps": 12, "engine.simulated.die_after": 30,
                                              "engine.simulated.failed_restarts": 1})
    p = Pipeline(cfg, prompts=PROMPTS, reward=reward, tokenizer=False, console=False)
    s = p.run_sync()
    assert s["error"] is None and s["steps"] == 12
    assert s["engine_restarts"] == {"simulated-0": 1} and s["engine_restart_failures"] == {"simulated-0": 1}
    story = [(e["event"], e.get("attempt")) for e in
             events(p, "engine_restarting", "engine_restart_failed", "engine_restarted")]
    assert story == [("engine_restarting", 1), ("engine_restart_failed", 1),
                     ("engine_restarting", 2), ("engine_restarted", 2)]
    assert_accounted(p, s)


class CountingEngine(SimulatedEngine):
    """Counts the Pipeline's start and close calls."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.starts = self.closes = 0

    async def start(self) -> None:
        self.starts += 1
        await super().start()

    async def close(self) -> None:
        self.closes += 1
        await super().close()


def test_a_callers_engine_is_neither_restarted_nor_closed(tmp_path: Path) -> None:
    cfg = sim_config(tmp_path, **RESTARTS)
    engine = CountingEngine(SimulatedEngineConfig(latency_s=0.002, completion_tokens=4, die_after=30), name="callers")
    p = Pipeline(cfg, prompts=PROMPTS, reward=reward, tokenizer=False, console=False, engines=[engine])
    with pytest.raises(EngineDeadError, match=r"are the caller's and are not restarted"):
        p.run_sync()
    assert engine.starts == 1 and engine.closes == 0
    assert [e["reason"] for e in events(p, "engine_not_restarted")] == ["caller_owned"]
    assert events(p, "engine_restarting") == [] and p.summary["engine_restarts"] == {}
    assert_accounted(p, p.summary)


def test_a_call_sent_before_the_restart_does_not_count_against_the_restarted_engine(tmp_path: Path) -> None:
    """Two engines; one is found dead while a call of its is still running, and restarts at once
    (no backoff). That call fails late, after the engine is back: it must not count against the
    restarted engine (which would take it out of rotation a second time)."""
    cfg = sim_config(tmp_path, **{**RESTARTS, "pipeline.steps": 8, "engine.devices": ["cpu", "cpu"],
                                              "engine.simulated.latency_s": 0.1, "engine.restart_backoff_s": 0.0})
    seen: dict[str, int] = {}

    async def main() -> Pipeline:
        p = Pipeline(cfg, prompts=PROMPTS, reward=reward, tokenizer=False, console=False)
        async for res in p.steps():
            if res.step == 2:
                victim = p.engines[1]
                while p.rotation.slot(victim).load == 0:  # until a call of its runs
                    await asyncio.sleep(0.005)
                seen["requests"] = victim.stats["requests"]
                await victim.close()  # the running call raises EngineDeadError when its 0.1 s are up
                # what a failed call does when it finds the engine dead
                p.rotation.failed(victim, EngineDeadError("found dead by the test"), p.rotation.slot(victim).epoch)
        return p

    p = asyncio.run(main())
    s = p.summary
    assert s["error"] is None and s["steps"] == 8
    assert s["engine_restarts"] == {"simulated-1": 1} and s["engines_out_of_rotation"] == []
    assert len(events(p, "engine_out_of_rotation")) == 1  # the late failure was not counted
    assert p.engines[1].stats["requests"] > seen["requests"]  # back in rotation, it sampled again
    assert s["groups_failed"] == {}
    assert_accounted(p, s)


# --------------------------------------------------------------------------- vLLM, on a stand-in


class StandInAsyncLLM:
    """Just enough of vLLM's AsyncLLM for VLLMEngine's start, adapters, generate, abort and close."""

    instances: list[StandInAsyncLLM] = []
    gate: threading.Event | None = None  # set: the constructor waits for it (a slow start)

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        self.model_config = SimpleNamespace(max_model_len=64, get_vocab_size=lambda: 100)
        self.vllm_config = SimpleNamespace(compilation_config=SimpleNamespace(max_cudagraph_capture_size=0))
        self.errored = False
        self.shut_down = False
        self.loras: list[tuple[str, int]] = []
        self.hold = False  # generate waits until aborted
        self._aborted = asyncio.Event()

    @classmethod
    def from_engine_args(cls, args: object) -> StandInAsyncLLM:
        if cls.gate is not None:
            cls.gate.wait(10)
        llm = cls()
        cls.instances.append(llm)
        return llm

    async def add_lora(self, lora: SimpleNamespace) -> bool:
        self.loras.append((lora.lora_name, lora.lora_int_id))
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        return True

    async def abort(self, request_ids: object) -> None:
        self._aborted.set()

    async def generate(self, prompt: dict, params: SimpleNamespace, request_id: str, lora_request=None):
        if self.hold:
            await self._aborted.wait()
        reason = "abort" if self.hold else "length"
        tokens = [1, 2, 3]
        outputs = [SimpleNamespace(index=i, token_ids=tokens, finish_reason=reason,
                                   logprobs=[{t: SimpleNamespace(logprob=-0.5)} for t in tokens])
                   for i in range(params.n)]
        yield SimpleNamespace(finished=True, outputs=outputs, lora_request=lora_request)

    def shutdown(self) -> None:
        self.shut_down = True


def _stand_in_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    """Put a stand-in `vllm` package into sys.modules, with the names VLLMEngine imports."""
    names = {
        "vllm.engine.arg_utils": {"AsyncEngineArgs": lambda **kw: SimpleNamespace(**kw)},
        "vllm.inputs": {"TokensPrompt": dict},
        "vllm.lora.request": {"LoRARequest": lambda **kw: SimpleNamespace(**kw)},
        "vllm.sampling_params": {"RequestOutputKind": SimpleNamespace(FINAL_ONLY="final_only"),
                                 "SamplingParams": lambda **kw: SimpleNamespace(**kw)},
        "vllm.v1.engine.async_llm": {"AsyncLLM": StandInAsyncLLM},
        "vllm.v1.engine.exceptions": {"EngineDeadError": type("EngineDeadError", (Exception,), {}),
                                      "EngineGenerateError": type("EngineGenerateError", (Exception,), {})},
    }
    for dotted, attrs in names.items():
        parts = dotted.split(".")
        for i in range(1, len(parts) + 1):
            name = ".".join(parts[:i])
            if name not in sys.modules or not isinstance(sys.modules[name], StandInModule):
                monkeypatch.setitem(sys.modules, name, StandInModule(name))
        for key, value in attrs.items():
            setattr(sys.modules[dotted], key, value)
    monkeypatch.setattr(StandInAsyncLLM, "instances", [])
    monkeypatch.setattr(StandInAsyncLLM, "gate", None)


class StandInModule(types.ModuleType):
    pass


def test_vllm_engine_start_after_close_builds_a_new_asyncllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a stand-in AsyncLLM (the real one needs a GPU; tests/engines/test_engine_contract.py runs the
    same restart on vLLM with -m gpu): the AsyncLLM is built in a worker thread with only the
    engine's GPU visible; close() fails the call in flight with EngineDeadError and shuts it
    down; start() builds a new one and forgets the old adapters; a start abandoned while vLLM
    comes up shuts down what it built."""
    from pipeline.config.schema import SamplingConfig, VLLMEngineConfig
    from pipeline.engines.vllm import VLLMEngine
    from pipeline.types import AdapterRef, GroupRequest, Prompt

    _stand_in_vllm(monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    (tmp_path / "model").mkdir()
    adapter_dir = tmp_path / "v1"
    adapter_dir.mkdir()
    (adapter_dir / "adapter_config.json").write_text('{"r": 8}')
    (adapter_dir / "adapter_model.safetensors").write_bytes(b"")
    v1 = AdapterRef(1, "v000001-standin", str(adapter_dir))
    engine = VLLMEngine(tmp_path / "model", sampling=SamplingConfig(), cfg=VLLMEngineConfig(), device="cuda:1",
                        max_staleness=1, name="vllm-standin")

    def request(i: int) -> GroupRequest:
        return GroupRequest(i, Prompt(f"p{i}", "", (4, 5, 6)), n=2, max_new_tokens=8)

    async def main() -> None:
        await engine.start()
        first = StandInAsyncLLM.instances[-1]
        assert first.thread != threading.get_ident() and first.visible == "5"
        assert (await engine.generate(request(1), v1)).version == 1 and engine.loaded_versions == (1,)
        first.hold = True
        running = asyncio.get_running_loop().create_task(engine.generate(request(2), v1))
        await asyncio.sleep(0.01)
        await engine.close()
        with pytest.raises(EngineDeadError, match="closed during group 2"):
            await running
        assert first.shut_down

        await engine.start()
        second = StandInAsyncLLM.instances[-1]
        assert second is not first and engine.loaded_versions == ()
        assert (await engine.generate(request(3), v1)).version == 1 and engine.loaded_versions == (1,)
        (name1, id1), = first.loras
        (name2, id2), = second.loras
        assert name1 == name2 == v1.name and id2 > id1  # loaded anew, under an id never used before

        await engine.close()
        StandInAsyncLLM.gate = threading.Event()
        starting = asyncio.get_running_loop().create_task(engine.start())
        await asyncio.sleep(0.05)
        starting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await starting
        StandInAsyncLLM.gate.set()
        for _ in range(200):
            if len(StandInAsyncLLM.instances) == 3 and StandInAsyncLLM.instances[-1].shut_down:
                break
            await asyncio.sleep(0.01)
        assert len(StandInAsyncLLM.instances) == 3 and StandInAsyncLLM.instances[-1].shut_down
        await engine.close()

    asyncio.run(main())
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3,5"  # narrowed only while each AsyncLLM was built


class LoadedOnly(SimulatedEngine):
    """A simulated engine that samples only versions loaded since its last start, like a real one:
    a call for any other version is recorded in `violations` (and served, so the run goes on)."""

    def __init__(self, cfg, **kw) -> None:
        super().__init__(cfg, **kw)
        self.loaded: set[int] = {0}  # versions loaded since the last start
        self.loads: list[tuple[int, int]] = []  # (restarts so far, version) of every load
        self.violations: list[str] = []

    async def start(self) -> None:
        await super().start()
        self.loaded = {0}

    async def load_adapter(self, adapter) -> None:
        await super().load_adapter(adapter)
        self.loaded.add(adapter.version)
        self.loads.append((self._restarts, adapter.version))

    def _check_loaded(self, adapter) -> None:
        if adapter.version not in self.loaded and not self._closed:
            self.violations.append(f"{self.name} asked for version {adapter.version}, loaded {sorted(self.loaded)}")

    async def generate_many(self, requests, adapter):
        self._check_loaded(adapter)
        return await super().generate_many(requests, adapter)

    async def generate(self, request, adapter):
        self._check_loaded(adapter)
        return await super().generate(request, adapter)


class RejoinGate:
    """What the two engines of the rejoin test share: engine 0, the version whose load on engine 1
    was held back, and the event that releases it (engine 0 started again)."""

    def __init__(self) -> None:
        self.engine0: LoadedOnly | None = None
        self.version: int | None = None
        self.engine0_back = asyncio.Event()


class RejoinsDuringLoad(LoadedOnly):
    """"simulated-0" dies after DIE_AFTER groups each time it starts. On "simulated-1", the first
    load of a version after engine 0 died waits until engine 0 has started again: the restarted
    engine rejoins while the others are loading a version that its rejoining list does not hold."""

    DIE_AFTER = 6

    def __init__(self, cfg, gate: RejoinGate, **kw) -> None:
        if kw["name"] == "simulated-0":
            cfg = dataclasses.replace(cfg, die_after=self.DIE_AFTER)
        super().__init__(cfg, **kw)
        self.gate = gate

    async def start(self) -> None:
        await super().start()
        if self.name == "simulated-0" and self._restarts:
            self.gate.engine0_back.set()

    async def load_adapter(self, adapter) -> None:
        g = self.gate
        if self.name == "simulated-1" and g.version is None and g.engine0 is not None and g.engine0._closed:
            g.version = adapter.version
            await asyncio.wait_for(g.engine0_back.wait(), timeout=10)
        await super().load_adapter(adapter)


def test_an_engine_that_rejoins_while_a_version_loads_gets_that_version_too(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import pipeline.engines.simulated

    gate = RejoinGate()
    built: list[RejoinsDuringLoad] = []

    def build(cfg, **kw):
        built.append(RejoinsDuringLoad(cfg, gate, **kw))
        if kw["name"] == "simulated-0":
            gate.engine0 = built[-1]
        return built[-1]

    monkeypatch.setattr(pipeline.engines.simulated, "SimulatedEngine", build)
    cfg = sim_config(tmp_path, **{**RESTARTS, "pipeline.steps": 12, "engine.devices": ["cpu", "cpu"]})
    p = Pipeline(cfg, prompts=PROMPTS, reward=reward, tokenizer=False, console=False)
    s = p.run_sync()
    assert s["error"] is None and s["steps"] == 12
    assert_accounted(p, s)
    e0, e1 = built
    # the interleaving happened: engine 1's load of `gate.version` waited for engine 0 to start again
    assert gate.version is not None and gate.engine0_back.is_set()
    assert s["engine_restarts"].get("simulated-0", 0) >= 1
    # engine 0 loaded that version after its restart (from _load_on_engines, not its rejoin list),
    # and no engine was ever asked to sample a version it had not loaded since its last start
    assert (1, gate.version) in e0.loads
    assert e0.violations == e1.violations == []


class DiesAtFirstLoad(LoadedOnly):
    """Once `armed`, dies at its first adapter load: an engine lost right after it started, while
    a resumed run's set-up loads the checkpoint's version on it."""

    armed = False

    async def load_adapter(self, adapter) -> None:
        if self.armed and adapter.version:
            self.armed = False
            self._closed = True  # what a dead engine looks like from here: every call refused
            raise EngineDeadError(f"engine {self.name} died while loading {adapter.name}")
        await super().load_adapter(adapter)


def test_an_engine_lost_during_a_resumed_runs_set_up_is_restarted_with_the_checkpoints_version(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pipeline.engines.simulated

    built: list[DiesAtFirstLoad] = []
    arm = False

    def build(cfg, **kw):
        built.append(DiesAtFirstLoad(cfg, **kw))
        built[-1].armed = arm
        return built[-1]

    monkeypatch.setattr(pipeline.engines.simulated, "SimulatedEngine", build)
    first = Pipeline(sim_config(tmp_path, **{**RESTARTS, "pipeline.steps": 4}), prompts=PROMPTS, reward=reward,
                     tokenizer=False, console=False)
    assert first.run_sync()["steps"] == 4
    arm = True
    p = Pipeline(sim_config(tmp_path, **{**RESTARTS, "pipeline.steps": 8}), prompts=PROMPTS, reward=reward,
                 tokenizer=False, console=False, resume=True)
    s = p.run_sync()
    assert s["error"] is None and s["steps"] == 8 and s["resumed_from_step"] == 4
    engine = built[-1]
    assert not engine.armed  # the set-up's load of version 4 did kill it
    assert s["engine_restarts"] == {"simulated-0": 1}
    assert (1, 4) in engine.loads  # the restarted engine loaded the checkpoint's version
    assert engine.violations == []  # and sampled nothing it had not loaded
    assert_accounted(p, s)
