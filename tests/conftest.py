"""What several test modules share: the repository's scripts, simulated runs, and the run's invariants.

Plain helpers are imported by name (`from conftest import sim_config`): pytest puts tests/ on
sys.path (it has no __init__.py), so this module is `conftest` to pytest and to the tests alike.
The tests live in folders named after the package's (tests/loop/ for pipeline/loop/), and a
module imports another's helpers by its name wherever it lives (`from test_trainer import
_group`): this module puts each folder on sys.path, so a module's name is its name everywhere
(names are unique across folders; tests/base/test_layout.py checks).
Fixtures here are found by pytest; a test module's own fixture of the same name takes precedence.

- Scripts: REPO, load_script (run.py or a benchmark, by path), run_py / start_run_py (`python
  run.py` in a child process, never inheriting a crash point: PIPELINE_CRASH_AT is set only by
  `crash=`).
- Simulated runs: sim_config, the config of a small run with the simulated engine and trainer.
- Invariants: assert_accounted (every started group is trained, dropped or failed, and logged
  exactly once), check_finished_run (a run resumed to its end trained every prompt exactly once).
- GPU results: keep_result writes figures under $OUT, the folder the device machine sends back.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import pytest

from pipeline.store.weights import AdapterStore
from pipeline.store.checkpoint import CheckpointStore
from pipeline.config.schema import RunConfig
from pipeline.config.io import load_config
from pipeline.observe.metrics import read_jsonl
from pipeline.store.rollout_log import Rollouts, read_rollouts

if TYPE_CHECKING:
    from pipeline.loop.orchestrator import Pipeline

REPO = Path(__file__).resolve().parents[1]
TEST_FOLDERS = sorted(d for d in Path(__file__).resolve().parent.iterdir() if d.is_dir() and any(d.glob("test_*.py")))
sys.path[1:1] = [str(d) for d in TEST_FOLDERS if str(d) not in sys.path]
CRASH_ENV = "PIPELINE_CRASH_AT"  # pipeline.faults: kill the process at a named point


# --------------------------------------------------------------------------- scripts


def load_script(path: Path, name: str) -> ModuleType:
    """Import a script that is not part of the package (run.py, a benchmark) from its path, as `name`."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_py_env(crash: str | None = None) -> dict[str, str]:
    """This process's environment for a child run.py: PIPELINE_CRASH_AT only if `crash` names a point."""
    env = {k: v for k, v in os.environ.items() if k != CRASH_ENV}
    if crash:
        env[CRASH_ENV] = crash
    return env


def run_py(*args: str, crash: str | None = None, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """`python run.py ARGS` from the repository root, to its end; stdout and stderr captured."""
    return subprocess.run([sys.executable, str(REPO / "run.py"), *args], cwd=REPO, env=run_py_env(crash),
                          capture_output=True, text=True, timeout=timeout)


def start_run_py(*args: str) -> subprocess.Popen[str]:
    """`python run.py ARGS` from the repository root, left running (to be signalled); pipes for its output."""
    return subprocess.Popen([sys.executable, str(REPO / "run.py"), *args], cwd=REPO, env=run_py_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_steps(proc: subprocess.Popen, out: Path, steps: int, limit_s: float = 60) -> None:
    """Wait until the run writing `out` has logged `steps` steps (failing if it exits or takes over limit_s)."""
    deadline = time.monotonic() + limit_s
    path = out / "metrics.jsonl"
    while not (path.exists() and path.read_text().count("\n") >= steps):  # whole lines only
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"no {steps} steps within {limit_s} s"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in tiny model (random weights, byte-level tokenizer), built once per test module."""
    from pipeline.models import builtin as models
    return models.build_model("tiny", tmp_path_factory.mktemp("models"))


def word_level_tokenizer(directory: Path, *, eos: str | None, eos_added: bool, with_json: bool = True,
                         in_map: bool = False, words: tuple[str, ...] = ("a", "b", "c", "[UNK]", "</s>")) -> None:
    """A small tokenizer saved by transformers, `words` its vocabulary (id = position; "[UNK]" among them):
    eos (if any) an added token or a plain vocabulary entry, named in tokenizer_config.json or only
    in special_tokens_map.json."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(words)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="[UNK]")), unk_token="[UNK]")
    if eos is not None:
        if eos_added:
            tok.add_special_tokens({"eos_token": eos})
        else:
            tok.eos_token = eos
    tok.save_pretrained(directory)
    if in_map:  # an older layout: the special tokens in special_tokens_map.json alone
        config = json.loads((directory / "tokenizer_config.json").read_text())
        (directory / "special_tokens_map.json").write_text(json.dumps({"eos_token": config.pop("eos_token")}))
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
    if not with_json:
        (directory / "tokenizer.json").unlink()


# --------------------------------------------------------------------------- simulated runs


def sim_config(tmp_path: Path, *, K: int = 1, B: int = 2, n: int = 2, steps: int = 6, latency: float = 0.0,
               concurrency: int = 0, step_s: float = 0.0, **extra: Any) -> RunConfig:
    """A run of the simulated engine and trainer writing to tmp_path/run: `steps` steps of B groups
    of n completions (4 tokens each), max_staleness K; `extra` dotted overrides win over the rest."""
    overrides = {
        "out": str(tmp_path / "run"), "engine.kind": "simulated", "trainer.kind": "simulated",
        "pipeline.steps": steps, "pipeline.batch_groups": B, "pipeline.max_staleness": K,
        "sampling.n": n, "engine.simulated.latency_s": latency, "engine.simulated.concurrency": concurrency,
        "engine.simulated.completion_tokens": 4, "trainer.step_s": step_s, "log.progress": False,
    }
    overrides.update(extra)
    return load_config(None, overrides)


# --------------------------------------------------------------------------- the run's invariants


def assert_accounted(p: Pipeline, summary: dict) -> Rollouts:
    """started = trained + dropped + failed, and the zarr log holds exactly one entry per group."""
    assert summary["accounting_ok"], summary
    r = read_rollouts(p.run_dir / "rollouts.zarr")
    assert r.num_groups == summary["groups_started"]
    assert len(set(r.groups["group_id"].tolist())) == r.num_groups
    fates = r.groups["fate"].tolist()
    assert fates.count("trained") == summary["groups_trained"]
    assert fates.count("failed") == sum(summary["groups_failed"].values())
    assert fates.count("dropped") == sum(summary["groups_dropped"].values())
    return r


def check_finished_run(out: Path, b: int, steps: int, k: int) -> dict:
    """A run of `steps` steps of `b` groups over a data set of b * steps prompts, resumed to its end:
    every prompt trained exactly once, nothing twice in the log, staleness <= k, stores that verify.
    Returns its summary (test_crash_resume.py after kill -9, the GPU tests after SIGTERM or a dead engine)."""
    prompts = b * steps
    summary = json.loads((out / "summary.json").read_text())
    assert summary["error"] is None and summary["accounting_ok"], summary
    assert summary["steps"] == steps and summary["checkpoint_step"] == steps

    r = read_rollouts(out / "rollouts.zarr")
    ids = r.groups["group_id"].tolist()
    assert len(ids) == len(set(ids)), f"groups repeated in the log: {[i for i, c in Counter(ids).items() if c > 1]}"
    fate = r.groups["fate"].tolist()
    trained = sorted(i for i, f in zip(ids, fate) if f == "trained")
    assert trained == list(range(prompts)), "every prompt of the data set is trained exactly once"
    prompt_ids = [p for p, f in zip(r.groups["prompt_id"].tolist(), fate) if f == "trained"]
    assert len(set(prompt_ids)) == prompts  # one epoch: each prompt once, none skipped
    trained_steps = [s for s, f in zip(r.groups["step"].tolist(), fate) if f == "trained"]
    assert Counter(trained_steps) == {s: b for s in range(1, steps + 1)}
    for s, v, f in zip(r.groups["step"].tolist(), r.groups["version"].tolist(), fate):
        if f == "trained":
            assert 0 <= (s - 1) - v <= k, "the staleness bound holds across the crash"
    assert summary["groups_started"] == len(ids) == summary["groups_logged"]

    assert [row["step"] for row in read_jsonl(out / "metrics.jsonl")] == list(range(1, steps + 1))
    store = AdapterStore(out / "adapters", readonly=True)
    assert store.versions() and max(store.versions()) == steps
    for v in store.versions():
        store.load(v)  # manifest and hashes verify
    assert not list((out / "adapters").glob(".tmp-*")) and not list((out / "checkpoints").glob(".tmp-*"))
    latest = CheckpointStore(out / "checkpoints").latest()
    assert latest is not None and latest.step == steps
    return summary


# --------------------------------------------------------------------------- GPU results


def keep_result(name: str, data: Any) -> None:
    """Write a GPU test's figures to $OUT/name, the folder the device machine sends back (nothing
    without $OUT): a str as it is, anything else as indented JSON."""
    out = os.environ.get("OUT")
    if not out:
        return
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / name).write_text(data if isinstance(data, str) else json.dumps(data, indent=1, default=str) + "\n")
