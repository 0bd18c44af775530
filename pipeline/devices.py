"""Where a process's work runs: the GPUs its children see, and the CPU priority of its compute.

CUDA_VISIBLE_DEVICES is one per process, shared by the threads that start child processes.

A child process takes a copy of the environment when it starts. A vLLM engine narrows
CUDA_VISIBLE_DEVICES to its own GPU while its engine core starts (in a worker thread, so the
event loop runs on), and the trainer process is spawned at the same moment of set-up: started
inside that window, the trainer would see only the engine's GPU ("invalid device ordinal" on
cuda:1, seen on two GPUs).

Invariant: the environment is narrowed only inside `visible_devices`, and every start of a child
process that may use a GPU holds `ENV_LOCK`, which `visible_devices` holds too, so a child never
starts with another's narrowed view.

A trainer process on the CPU takes `trainer_threads` torch threads (trainer.threads = 0): all
the cores where its phase runs alone (max_staleness 0) and the engine's half of them is not
computing on the CPU, the other half otherwise, and one on a model too narrow to split.

CPU compute that shares cores with the event loop (a transformers engine's torch thread on the
CPU, a trainer process on the CPU) can run under Linux SCHED_IDLE (`sched_idle`, opt-in): the
loop, waking, then takes the core at once instead of at the next scheduler tick.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from typing import Iterator, Sequence

from pipeline.errors import ConfigError

ENV_LOCK = threading.Lock()


def check_cuda_devices(named: Sequence[tuple[str, str]]) -> None:
    """ConfigError for the first (config key, device) naming a CUDA device this machine does not have.

    Said at set-up, before anything is built or loaded: torch's own error would come later and name
    no key. Counts the devices through NVML, without initialising the CUDA driver (imports torch only
    for a "cuda:N"): torch.cuda.is_available() calls cuInit, after which a forked child (vLLM's
    engine core under VLLM_WORKER_MULTIPROC_METHOD=fork) cannot use CUDA."""
    wanted = [(key, device) for key, device in named if device.startswith("cuda")]
    if not wanted:
        return
    import torch

    count = torch.cuda.device_count()  # 0 without CUDA; cudaGetDeviceCount only where NVML fails
    for key, device in wanted:
        if count == 0:
            raise ConfigError(f'{key} = "{device}" but this machine has no CUDA device')
        if int(device.partition(":")[2]) >= count:
            raise ConfigError(f'{key} = "{device}" but this machine has {count} CUDA device'
                              f'{"s" if count > 1 else ""} (cuda:0 to cuda:{count - 1})')


_CUDA_ERROR_NOT_INITIALIZED = 3


def cuda_driver_initialized() -> bool:
    """Whether this process has initialised the CUDA driver (cuInit), by torch or by anything else.

    A forked child of such a process cannot use CUDA. vLLM checks only torch's own state before it
    forks its engine core; torch.cuda.is_available() calls cuInit without torch counting CUDA as
    initialised. The driver answers cuDeviceGetCount with CUDA_ERROR_NOT_INITIALIZED until cuInit,
    and the question initialises nothing. False where there is no driver."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    count = ctypes.c_int()
    return driver.cuDeviceGetCount(ctypes.byref(count)) != _CUDA_ERROR_NOT_INITIALIZED


@contextlib.contextmanager
def visible_devices(value: str) -> Iterator[None]:
    """Set CUDA_VISIBLE_DEVICES inside the block (holding ENV_LOCK); restore it (or its absence) after."""
    with ENV_LOCK:
        old = os.environ.get("CUDA_VISIBLE_DEVICES")
        os.environ["CUDA_VISIBLE_DEVICES"] = value
        try:
            yield
        finally:
            if old is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = old


def sched_idle(tid: int = 0) -> bool:
    """Put thread `tid` (0: the calling one), and the threads it starts later, under Linux SCHED_IDLE.

    Under a normal policy, even at nice 19, a thread computing beside the event loop can keep the
    core until the next scheduler tick when the loop wakes; idle-scheduled, the engine's thread and
    the trainer process leave the loop's lag lower, at some throughput at low K (likely because the
    kernel counts a core that runs only idle-scheduled threads as free when it places a waking
    thread, so the two tiers meet on one core; not verified). Such threads also get only the
    cycles that other programs leave. Hence opt-in (engine.transformers.sched_idle,
    trainer.sched_idle; figures in docs/architecture.md#measurements-behind-the-code).
    Returns False where the platform has no SCHED_IDLE or refuses it.
    """
    policy = getattr(os, "SCHED_IDLE", None)
    if policy is None:
        return False
    try:
        os.sched_setscheduler(tid, policy, os.sched_param(0))
    except OSError:  # a sandbox that forbids the call: the thread keeps its policy, only slower to yield
        return False
    return True


def lower_process_priority(nice: int, idle: bool) -> None:
    """Every thread of this process (imports may have started some, OpenBLAS's pool among them),
    and the threads they start later: niceness at least `nice`, and SCHED_IDLE when `idle`."""
    task = "/proc/self/task"
    for tid in (int(t) for t in os.listdir(task)) if os.path.isdir(task) else (0,):
        try:
            os.setpriority(os.PRIO_PROCESS, tid, max(nice, os.getpriority(os.PRIO_PROCESS, tid)))
        except ProcessLookupError:  # the thread ended since the listing: nothing left to lower
            continue
        if idle:
            sched_idle(tid)


# Below this width a CPU step's ops are too small to share out: the built-in tiny model (d = 64)
# trains faster on one thread than on two, the small one (d = 256) faster on two (docs/architecture.md#measurements-behind-the-code).
WIDE_ENOUGH_TO_SPLIT = 256


def cpu_cores() -> int:
    """The cores this process may run on (its affinity where the platform says, else all)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def trainer_threads(requested: int, *, max_staleness: int, engine_on_cpu: bool, hidden_size: int | None,
                    cores: int | None = None) -> int:
    """The torch threads of a trainer process on the CPU: `requested` if set (> 0), else where they pay.

    One on a model narrower than WIDE_ENOUGH_TO_SPLIT; all the cores at max_staleness 0 (training
    and generation take turns) or when no engine computes on the CPU; otherwise the cores the
    engine's half (Runtime.share_cpu) leaves."""
    if requested > 0:
        return requested
    cores = cores or cpu_cores()
    if hidden_size is not None and hidden_size < WIDE_ENOUGH_TO_SPLIT:
        return 1
    if max_staleness == 0 or not engine_on_cpu:
        return cores
    return max(1, cores - cores // 2)
