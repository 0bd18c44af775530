"""`EnvRunner` adapts any environment uniformly. Invariants:
- Sync methods run in a worker thread, never on the event loop; async ones are awaited. The
  threads are daemons of their own (`pipeline.threads.DaemonThreads`), one per call: a step
  that never returns holds neither a worker another call needs nor the process at exit.
- Every reset and step runs under `step_timeout_s`; one that takes longer raises
  `EnvTimeoutError` (reason "env_timeout"). One that raises, or returns something that is not a
  valid observation / EnvStep, raises `EnvError` (reason "env_error") naming the environment and
  keeping the original exception as `__cause__`. Both are RecoverableErrors: the group fails, the
  run goes on. Nothing else escapes, except cancellation.
- `step` returns an EnvStep whose reward is a finite float, whose done is a bool and whose
  observation is a string or a list of messages (None only with done). After an error, a
  timeout or `done`, the runner takes no further step.
- `close()` is safe to call twice and never raises: the episode's result is complete by then.
- A sync call that times out goes on in its thread until it returns (a thread cannot be stopped);
  its runner has finished, its result is dropped, and the run ends on time whatever it does. Past
  `pipeline.threads.MAX_ABANDONED` such calls at once the next call raises UserCodeStuckError, a
  FatalError: the run stops, naming them.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import math
from concurrent.futures import Executor
from typing import Any, Callable, Mapping

import numpy as np
import structlog

from pipeline.errors import FatalError
from pipeline.threads import USER_CODE
from pipeline.envs.protocol import ClosableEnvironment, EnvError, Environment, EnvironmentFactory, EnvStep, EnvTimeoutError, Observation

log = structlog.get_logger(__name__)


def _name(env: Any) -> str:
    return type(env).__name__


class EnvRunner:
    """One environment instance, made safe to await: off the loop, under a timeout, its output checked.

    `executor`: where sync methods run (None: a daemon thread per call, `pipeline.threads.USER_CODE`).
    The timeout counts from the call, so an executor with fewer workers than live episodes makes
    steps wait for a worker inside their timeout.
    """

    def __init__(self, env: Environment, *, step_timeout_s: float, executor: Executor | None = None) -> None:
        if not isinstance(env, Environment):
            raise TypeError(f"{_name(env)} is not an environment: it needs reset(row) and step(action)")
        self.env = env
        self.name = _name(env)
        self.step_timeout_s = step_timeout_s
        self.executor = executor
        self.steps = 0  # steps taken
        self.finished = False  # done, failed or closed: no further step
        self._closed = False

    @classmethod
    async def open(cls, factory: EnvironmentFactory, *, step_timeout_s: float,
                   executor: Executor | None = None) -> EnvRunner:
        """A runner over a new instance from `factory`, built off the loop under the timeout
        (a factory may start a process); EnvError/EnvTimeoutError as a step's."""
        where = getattr(factory, "__qualname__", None) or _name(factory)  # a class or function has one; a partial not
        env = await cls._timed(None, f"{where}()", step_timeout_s, executor, factory)
        return cls(env, step_timeout_s=step_timeout_s, executor=executor)

    @staticmethod
    async def _timed(runner: EnvRunner | None, what: str, timeout_s: float, executor: Executor | None,
                     fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args), awaited if async, else in a worker thread; EnvTimeoutError / EnvError if it fails."""
        deadline = asyncio.timeout(timeout_s)
        try:
            async with deadline:
                if inspect.iscoroutinefunction(fn):
                    out = await fn(*args)
                elif executor is None:  # a daemon thread; given up at the timeout, it is counted until it returns
                    out = await USER_CODE.run(fn, *args, what=f"environment {what}")
                else:
                    loop = asyncio.get_running_loop()
                    # contextvars travel with the call (as asyncio.to_thread does): log fields stay bound
                    out = await loop.run_in_executor(executor, contextvars.copy_context().run, fn, *args)
                if inspect.isawaitable(out):  # a sync method returning a coroutine: awaited here, on the loop
                    out = await out
                return out
        except (asyncio.CancelledError, FatalError):  # too many calls stuck for good: the run's problem, not the group's
            raise
        except Exception as e:  # the environment's bug or slowness fails its group, not the run
            if runner is not None:
                runner.finished = True
            if isinstance(e, TimeoutError) and deadline.expired():  # ours, not a timeout the environment raised
                raise EnvTimeoutError(f"environment {what} took longer than env.step_timeout_s = {timeout_s:g} s") \
                    from None
            raise EnvError(f"environment {what} raised {type(e).__name__}: {e}") from e

    async def reset(self, row: Mapping[str, Any]) -> Observation:
        """The episode's first observation (its prompt), checked."""
        if self.steps or self.finished:
            raise RuntimeError(f"environment {self.name} was reset after its episode started")
        obs = await self._timed(self, f"{self.name}.reset", self.step_timeout_s, self.executor, self.env.reset, row)
        checked = self._observation(obs, "reset")
        if checked is None:
            self.finished = True
            raise EnvError(f"environment {self.name}.reset returned None; it must return the first observation "
                           "(a string or a list of {role, content} messages)")
        return checked

    async def step(self, action: str) -> EnvStep:
        """The environment's reaction to the policy's turn, as a checked EnvStep."""
        if self.finished:
            raise RuntimeError(f"environment {self.name} stepped after its episode ended")
        out = await self._timed(self, f"{self.name}.step", self.step_timeout_s, self.executor, self.env.step, action)
        self.steps += 1
        step = self._env_step(out)
        self.finished = step.done
        return step

    async def close(self) -> None:
        """Close the environment if it can be closed; a failure is logged, never raised."""
        if self._closed:
            return
        self._closed = self.finished = True
        if not isinstance(self.env, ClosableEnvironment):
            return
        try:
            await self._timed(None, f"{self.name}.close", self.step_timeout_s, self.executor, self.env.close)
        except EnvError as e:  # the episode is complete; a close that fails loses nothing of it
            log.warning("env_close_failed", environment=self.name, error=str(e))

    def _fail(self, message: str) -> EnvError:
        self.finished = True
        return EnvError(f"environment {self.name}.{message}")

    def _observation(self, obs: Any, where: str) -> Observation | None:
        """obs as an Observation (a message dict becomes a list of one); EnvError if it is none."""
        if obs is None or isinstance(obs, str):
            return obs
        messages = [obs] if isinstance(obs, Mapping) else obs
        if isinstance(messages, (list, tuple)) and messages and all(
                isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            return [dict(m) for m in messages]
        raise self._fail(f"{where} returned an observation of {type(obs).__name__} {str(obs)[:80]!r}; it must be "
                         "a string, a {role, content} message or a non-empty list of them (content a string)")

    def _env_step(self, out: Any) -> EnvStep:
        if isinstance(out, EnvStep):
            obs, reward, done, info = out.observation, out.reward, out.done, out.info
        elif isinstance(out, (tuple, list)) and len(out) == 4:
            obs, reward, done, info = out
        else:
            raise self._fail(f"step returned {type(out).__name__} {str(out)[:80]!r}; it must return an EnvStep or "
                             "a tuple (observation, reward, done, info)")
        # bool is an int, and numpy scalars are not python floats: accept numbers, refuse flags and text
        if isinstance(reward, (bool, np.bool_)) or not isinstance(reward, (int, float, np.integer, np.floating)):
            raise self._fail(f"step returned a reward of {type(reward).__name__} {str(reward)[:40]!r}; "
                             "it must be a finite number")
        reward = float(reward)
        if not math.isfinite(reward):
            raise self._fail(f"step returned a non-finite reward ({reward})")
        if not isinstance(done, (bool, np.bool_)):
            raise self._fail(f"step returned done = {str(done)[:40]} ({type(done).__name__}); it must be a bool")
        done = bool(done)
        if info is None:
            info = {}
        if not isinstance(info, Mapping):
            raise self._fail(f"step returned info of {type(info).__name__}; it must be a dict (or None)")
        obs = self._observation(obs, "step")
        if obs is None and not done:
            raise self._fail("step returned no observation (None) for an episode that goes on; return '' "
                             "to add nothing, or done = True")
        return EnvStep(observation=obs, reward=reward, done=done, info=dict(info))
