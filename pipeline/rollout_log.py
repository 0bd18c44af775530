"""The append-only zarr store of every group that left the system, and what became of it.

Invariants:
- Every admitted group appears exactly once: trained (with the step that trained it), dropped
  or failed (with the reason). `append` refuses a group id already written or pending.
- Readers see only whole groups. A flush writes the flat token arrays first, then the
  per-completion arrays, then the per-group arrays, and commits last by rewriting the group's
  `committed` attribute (one atomic file replace in zarr's LocalStore). Array lengths alone
  cannot be the commit point: zarr's resize writes the new shape before the chunk data, so
  after a crash an array can be longer than what was actually written.
- Data beyond the committed counts (left by a crash mid-flush) is ignored by readers and
  trimmed when the store is reopened for appending, so new rows start at the right offsets.
- A flush writes at the committed offsets (resize, then assign a slice), so retrying a flush
  that failed half-way overwrites its partial output instead of duplicating it.

Layout (zarr v3 group; ragged data as flat arrays plus offsets):

    per group        group_id i64, prompt_id str, version i32, fate str, reason str, step i32,
                     engine str ("" without a generation), t_admitted / t_gen_start / t_gen_end /
                     t_done f64 (NaN when unknown), prompt_tok_off i64, prompt_tok_len i32,
                     comp_off i64 (first completion's row), comp_count i32
    per completion   reward f64 (NaN when not scored), finish_reason str, tok_off i64, tok_len i32
    flat             prompt_tokens i32, tokens i32, logprobs f32 ([sum tok_len])
    attrs            format_version, created_unix, meta (the caller's dict), committed counts

Token ids are stored as int32: enough for any vocabulary below 2**31 entries (larger ids are
refused at `append`); readers get int64 back, like `Completion.token_ids`.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import zarr

from pipeline.errors import ConfigError
from pipeline.faults import crash_point
from pipeline.types import GroupOutcome

log = structlog.get_logger(__name__)

FORMAT_VERSION = 1
FATES = ("trained", "dropped", "failed")

# Chunk lengths: a flush of a few hundred groups touches one or two chunks per array, and a
# chunk stays a few hundred KiB, so rewriting the partial last chunk on every flush is cheap.
GROUP_CHUNK = 4096
COMPLETION_CHUNK = 16384
TOKEN_CHUNK = 65536

_INT32_MAX = 2**31 - 1

# name -> (dtype, fill value); the section of each name fixes its length and chunking.
_GROUP_ARRAYS: dict[str, tuple[Any, Any]] = {
    "group_id": ("int64", -1),
    "prompt_id": (str, ""),
    "version": ("int32", -1),
    "fate": (str, ""),
    "reason": (str, ""),
    "step": ("int32", -1),
    "engine": (str, ""),
    "t_admitted": ("float64", np.nan),
    "t_gen_start": ("float64", np.nan),
    "t_gen_end": ("float64", np.nan),
    "t_done": ("float64", np.nan),
    "prompt_tok_off": ("int64", 0),
    "prompt_tok_len": ("int32", 0),
    "comp_off": ("int64", 0),
    "comp_count": ("int32", 0),
}
_COMPLETION_ARRAYS: dict[str, tuple[Any, Any]] = {
    "reward": ("float64", np.nan),
    "finish_reason": (str, ""),
    "tok_off": ("int64", 0),
    "tok_len": ("int32", 0),
}
_PROMPT_TOKEN_ARRAYS: dict[str, tuple[Any, Any]] = {"prompt_tokens": ("int32", 0)}
_TOKEN_ARRAYS: dict[str, tuple[Any, Any]] = {"tokens": ("int32", 0), "logprobs": ("float32", np.nan)}

# section -> (arrays, chunk length, key of its length in the `committed` attribute)
_SECTIONS = {
    "prompt_tokens": (_PROMPT_TOKEN_ARRAYS, TOKEN_CHUNK, "prompt_tokens"),
    "tokens": (_TOKEN_ARRAYS, TOKEN_CHUNK, "tokens"),
    "completions": (_COMPLETION_ARRAYS, COMPLETION_CHUNK, "completions"),
    "groups": (_GROUP_ARRAYS, GROUP_CHUNK, "groups"),
}


def _token_ids_int32(ids: Any, what: str) -> np.ndarray:
    arr = np.asarray(ids, dtype=np.int64).reshape(-1)
    if arr.size and (arr.min() < 0 or arr.max() > _INT32_MAX):
        raise ValueError(f"{what} has token ids outside [0, 2**31): min {arr.min()}, max {arr.max()}")
    return arr.astype(np.int32)


@dataclass(frozen=True, slots=True)
class _Row:
    """One outcome flattened into the store's columns (built at append, written at flush)."""

    scalars: dict[str, Any]  # per-group columns except the offsets
    prompt_tokens: np.ndarray  # [P] int32
    rewards: np.ndarray  # [n] float64
    finish_reasons: list[str]  # [n]
    tok_lens: np.ndarray  # [n] int32
    tokens: np.ndarray  # [sum tok_lens] int32
    logprobs: np.ndarray  # [sum tok_lens] float32


def _to_row(o: GroupOutcome) -> _Row:
    if o.fate not in FATES:
        raise ValueError(f"group {o.group_id}: fate must be one of {FATES}, got {o.fate!r}")
    if o.fate == "trained" and (o.step < 1 or o.reason):
        raise ValueError(f"group {o.group_id}: a trained group needs step >= 1 and reason '', "
                         f"got step {o.step} reason {o.reason!r}")
    if o.fate != "trained" and (o.step != -1 or not o.reason):
        raise ValueError(f"group {o.group_id}: a {o.fate} group needs step -1 and a reason, "
                         f"got step {o.step} reason {o.reason!r}")
    gen = o.generation
    comps = gen.completions if gen is not None else ()
    if o.rewards is None:
        rewards = np.full(len(comps), np.nan)
    else:
        rewards = np.asarray(o.rewards, dtype=np.float64).reshape(-1)
        if len(rewards) != len(comps):
            raise ValueError(f"group {o.group_id}: {len(rewards)} rewards for {len(comps)} completions")
    tok_lens = np.array([len(c.token_ids) for c in comps], dtype=np.int32)
    # one concatenation and one range check per group, not per completion (append is on the loop)
    tokens = _token_ids_int32(np.concatenate([np.asarray(c.token_ids).reshape(-1) for c in comps])
                              if comps else np.zeros(0, np.int64), f"group {o.group_id} completion")
    logprobs = (np.concatenate([np.asarray(c.logprobs).reshape(-1) for c in comps]).astype(np.float32, copy=False)
                if comps else np.zeros(0, np.float32))
    scalars = {
        "group_id": o.group_id,
        "prompt_id": o.prompt.id,
        "version": o.version,
        "fate": o.fate,
        "reason": o.reason,
        "step": o.step,
        "engine": gen.engine if gen is not None else "",
        "t_admitted": o.t_admitted,
        "t_gen_start": gen.t_start if gen is not None else np.nan,
        "t_gen_end": gen.t_end if gen is not None else np.nan,
        "t_done": o.t_done,
    }
    return _Row(
        scalars=scalars,
        prompt_tokens=_token_ids_int32(o.prompt.token_ids, f"group {o.group_id} prompt"),
        rewards=rewards,
        finish_reasons=[c.finish_reason for c in comps],
        tok_lens=tok_lens,
        tokens=tokens,
        logprobs=logprobs,
    )


def _offsets(start: int, lengths: np.ndarray) -> np.ndarray:
    """Start offsets of consecutive runs of `lengths`, the first at `start`."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return start + np.cumsum(lengths) - lengths


class RolloutLog:
    """Appends GroupOutcomes to a zarr store; opening an existing store continues it."""

    def __init__(self, path: str | Path, meta: dict[str, Any] | None = None, flush_every: int = 256) -> None:
        if flush_every < 1:
            raise ConfigError(f"flush_every must be >= 1, got {flush_every}")
        self.path = Path(path)
        self.flush_every = flush_every
        self._flush_lock = threading.Lock()  # flush is not reentrant and must not overlap itself
        self._pending_lock = threading.Lock()  # guards _pending, _ids, counters across threads
        self._pending: list[_Row] = []
        self._closed = False
        if (self.path / "zarr.json").exists():
            self._group = zarr.open_group(self.path, mode="r+")
            self._committed = self._repair(meta)
        else:
            self._group = self._create(meta)
            self._committed = {"groups": 0, "completions": 0, "prompt_tokens": 0, "tokens": 0}
        # Handles are kept: each lookup re-reads metadata, and resize updates a handle in place.
        self._arrays = {name: self._group[name] for arrays, _, _ in _SECTIONS.values() for name in arrays}
        self._load_index(self._committed["groups"])
        log.info("rollout_log_opened", path=str(self.path), groups=self._committed["groups"])

    def _load_index(self, n: int) -> None:
        """The ids and fate counters of the first `n` written groups (the caller holds the locks or is __init__)."""
        self._ids: set[int] = set(self._arrays["group_id"][:n].tolist())
        fates = self._arrays["fate"][:n].astype(object)
        reasons = self._arrays["reason"][:n].astype(object)
        self._fates = Counter(fates.tolist())
        self._reasons = Counter(f"{f}:{r}" for f, r in zip(fates, reasons))

    def _create(self, meta: dict[str, Any] | None) -> zarr.Group:
        group = zarr.open_group(self.path, mode="w-")
        for arrays, chunk, _ in _SECTIONS.values():
            for name, (dtype, fill) in arrays.items():
                group.create_array(name, shape=(0,), dtype=dtype, chunks=(chunk,), fill_value=fill)
        group.attrs.update({
            "format_version": FORMAT_VERSION,
            "created_unix": time.time(),
            "meta": dict(meta or {}),
            "committed": {"groups": 0, "completions": 0, "prompt_tokens": 0, "tokens": 0},
        })
        return group

    def _repair(self, meta: dict[str, Any] | None) -> dict[str, int]:
        """Check the format, trim data beyond the committed counts, merge the caller's meta."""
        attrs = dict(self._group.attrs)
        if attrs.get("format_version") != FORMAT_VERSION:
            raise ConfigError(f"rollout log {self.path} has format_version {attrs.get('format_version')!r}, "
                              f"this code reads and writes {FORMAT_VERSION}")
        committed = {k: int(v) for k, v in attrs["committed"].items()}
        for arrays, _, key in _SECTIONS.values():
            for name in arrays:
                arr = self._group[name]
                if arr.shape[0] < committed[key]:
                    raise ConfigError(f"rollout log {self.path}: array {name} has {arr.shape[0]} rows "
                                      f"but {committed[key]} are committed; the store is corrupt")
                if arr.shape[0] > committed[key]:
                    log.warning("rollout_log_trimmed", path=str(self.path), array=name,
                                rows=arr.shape[0], committed=committed[key])
                    arr.resize((committed[key],))
        if meta:
            self._group.attrs["meta"] = {**attrs.get("meta", {}), **meta}
        return committed

    def append(self, outcome: GroupOutcome) -> None:
        """Buffer one outcome (no I/O unless `flush_every` groups are now pending).

        Callers on the event loop should flush through `asyncio.to_thread` often enough that
        the automatic flush here, which writes on the calling thread, stays a backstop.
        """
        if self._closed:
            raise RuntimeError(f"rollout log {self.path} is closed")
        row = _to_row(outcome)
        with self._pending_lock:
            if outcome.group_id in self._ids:
                raise ValueError(f"group {outcome.group_id} is already in rollout log {self.path}")
            self._ids.add(outcome.group_id)
            self._pending.append(row)
            self._fates[outcome.fate] += 1
            self._reasons[f"{outcome.fate}:{outcome.reason}"] += 1
            due = len(self._pending) >= self.flush_every
        if due:
            self.flush()

    def flush(self) -> None:
        """Write every pending group and commit; safe to call from a worker thread."""
        with self._flush_lock:
            with self._pending_lock:
                rows = list(self._pending)
            if not rows:
                return
            t0 = time.monotonic()
            c = self._committed
            tok_lens = np.concatenate([r.tok_lens for r in rows])
            prompt_lens = np.array([len(r.prompt_tokens) for r in rows], dtype=np.int32)
            comp_counts = np.array([len(r.tok_lens) for r in rows], dtype=np.int32)
            columns: dict[str, np.ndarray] = {
                "prompt_tokens": np.concatenate([r.prompt_tokens for r in rows]),
                "tokens": np.concatenate([r.tokens for r in rows]),
                "logprobs": np.concatenate([r.logprobs for r in rows]),
                "reward": np.concatenate([r.rewards for r in rows]),
                "finish_reason": np.array([f for r in rows for f in r.finish_reasons], dtype=str),
                "tok_off": _offsets(c["tokens"], tok_lens),
                "tok_len": tok_lens,
                "prompt_tok_off": _offsets(c["prompt_tokens"], prompt_lens),
                "prompt_tok_len": prompt_lens,
                "comp_off": _offsets(c["completions"], comp_counts),
                "comp_count": comp_counts,
            }
            for name, (dtype, _) in _GROUP_ARRAYS.items():
                if name not in columns:
                    columns[name] = np.array([r.scalars[name] for r in rows], dtype=dtype)
            new = {
                "prompt_tokens": c["prompt_tokens"] + len(columns["prompt_tokens"]),
                "tokens": c["tokens"] + len(columns["tokens"]),
                "completions": c["completions"] + len(tok_lens),
                "groups": c["groups"] + len(rows),
            }
            self._write_section("prompt_tokens", columns, c, new)
            self._write_section("tokens", columns, c, new)
            self._write_section("completions", columns, c, new)
            self._write_section("groups", columns, c, new)
            crash_point("log.mid_flush")
            self._commit(new)
            crash_point("log.after_commit")
            self._committed = new
            with self._pending_lock:
                del self._pending[: len(rows)]
            log.debug("rollout_log_flushed", groups=len(rows), total=new["groups"],
                      seconds=round(time.monotonic() - t0, 4))

    def _write_section(self, section: str, columns: dict[str, np.ndarray],
                       old: dict[str, int], new: dict[str, int]) -> None:
        arrays, _, key = _SECTIONS[section]
        start, stop = old[key], new[key]
        if stop == start:
            return
        for name in arrays:
            arr = self._arrays[name]
            arr.resize((stop,))
            arr[start:stop] = columns[name]

    def _commit(self, new: dict[str, int]) -> None:
        # The single point at which the new rows become visible to readers.
        self._group.attrs["committed"] = new

    def truncate(self, groups: int) -> int:
        """Keep only the first `groups` groups (resume: what came after the checkpoint is redone).

        Returns how many groups were cut. Pending rows are refused: flush or close first.
        """
        with self._flush_lock, self._pending_lock:
            if self._pending:
                raise RuntimeError(f"rollout log {self.path}: truncate with {len(self._pending)} rows pending")
            c = self._committed
            if not 0 <= groups <= c["groups"]:
                raise ValueError(f"rollout log {self.path} has {c['groups']} groups, cannot keep {groups}")
            if groups == c["groups"]:
                return 0
            a = self._arrays
            if groups == 0:
                new = {"groups": 0, "completions": 0, "prompt_tokens": 0, "tokens": 0}
            else:
                g = groups - 1
                completions = int(a["comp_off"][g]) + int(a["comp_count"][g])
                tokens = int(a["tok_off"][completions - 1]) + int(a["tok_len"][completions - 1]) if completions else 0
                new = {"groups": groups, "completions": completions, "tokens": tokens,
                       "prompt_tokens": int(a["prompt_tok_off"][g]) + int(a["prompt_tok_len"][g])}
            self._commit(new)  # readers see the shorter log from here; the arrays are trimmed after
            self._committed = new
            for arrays, _, key in _SECTIONS.values():
                for name in arrays:
                    self._arrays[name].resize((new[key],))
            cut = c["groups"] - groups
            self._load_index(groups)
        log.warning("rollout_log_truncated", path=str(self.path), kept=groups, cut=cut)
        return cut

    def close(self) -> None:
        """Flush and stop accepting outcomes; calling it again does nothing."""
        if self._closed:
            return
        self.flush()
        self._closed = True
        log.info("rollout_log_closed", path=str(self.path), groups=self._committed["groups"])

    def __enter__(self) -> RolloutLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        with self._pending_lock:
            return len(self._ids)

    @property
    def pending(self) -> int:
        """Groups appended but not yet flushed."""
        with self._pending_lock:
            return len(self._pending)

    def counts(self) -> dict[str, int]:
        """Groups per fate, written and pending (every fate present, zero if none)."""
        with self._pending_lock:
            return {f: self._fates.get(f, 0) for f in FATES}

    def reasons(self) -> dict[str, int]:
        """Groups per "fate:reason" ("trained:" for trained groups), written and pending."""
        with self._pending_lock:
            return dict(self._reasons)


@dataclass(frozen=True, eq=False)
class Rollouts:
    """A committed snapshot of a rollout log as numpy arrays (string columns are object arrays)."""

    groups: dict[str, np.ndarray]  # per-group columns, each [G]
    completions: dict[str, np.ndarray]  # per-completion columns, each [C]
    prompt_tokens: np.ndarray  # [P] int32
    tokens: np.ndarray  # [T] int32
    logprobs: np.ndarray  # [T] float32
    attrs: dict[str, Any] = field(default_factory=dict)

    @property
    def num_groups(self) -> int:
        return len(self.groups["group_id"])

    def group(self, i: int) -> dict[str, Any]:
        """Group i in log order: its scalars, prompt tokens, rewards [n] and completions."""
        g = {name: col[i] for name, col in self.groups.items()}
        p0, pn = int(g["prompt_tok_off"]), int(g["prompt_tok_len"])
        c0, cn = int(g["comp_off"]), int(g["comp_count"])
        completions = []
        for j in range(c0, c0 + cn):
            t0, tn = int(self.completions["tok_off"][j]), int(self.completions["tok_len"][j])
            completions.append((self.tokens[t0:t0 + tn].astype(np.int64), self.logprobs[t0:t0 + tn].copy(),
                                str(self.completions["finish_reason"][j])))
        return {
            "group_id": int(g["group_id"]),
            "prompt_id": str(g["prompt_id"]),
            "version": int(g["version"]),
            "fate": str(g["fate"]),
            "reason": str(g["reason"]),
            "step": int(g["step"]),
            "engine": str(g["engine"]),
            "t_admitted": float(g["t_admitted"]),
            "t_gen_start": float(g["t_gen_start"]),
            "t_gen_end": float(g["t_gen_end"]),
            "t_done": float(g["t_done"]),
            "prompt_token_ids": self.prompt_tokens[p0:p0 + pn].astype(np.int64),
            "rewards": self.completions["reward"][c0:c0 + cn].copy(),
            "completions": completions,
        }

    def staleness(self) -> np.ndarray:
        """[trained groups] int64: trainer version at consumption (step - 1) minus sampled version."""
        trained = self.groups["fate"] == "trained"
        return (self.groups["step"][trained].astype(np.int64) - 1
                - self.groups["version"][trained].astype(np.int64))

    def to_records(self) -> list[dict[str, Any]]:
        """One flat dict per group (`pandas.DataFrame(r.to_records())`)."""
        records = []
        for i in range(self.num_groups):
            g = self.group(i)
            rewards = g.pop("rewards")
            completions = g.pop("completions")
            g["prompt_len"] = len(g.pop("prompt_token_ids"))
            g["n_completions"] = len(completions)
            g["num_tokens"] = sum(len(t) for t, _, _ in completions)
            g["rewards"] = rewards.tolist()
            g["reward_mean"] = float(np.nanmean(rewards)) if np.isfinite(rewards).any() else float("nan")
            records.append(g)
        return records


def read_rollouts(path: str | Path) -> Rollouts:
    """Read the committed groups of the log at `path`; data a crashed flush left is ignored."""
    path = Path(path)
    if not (path / "zarr.json").exists():
        raise FileNotFoundError(f"no rollout log at {path} (no zarr.json)")
    group = zarr.open_group(path, mode="r")
    attrs = dict(group.attrs)
    if attrs.get("format_version") != FORMAT_VERSION:
        raise ConfigError(f"rollout log {path} has format_version {attrs.get('format_version')!r}, "
                          f"this code reads {FORMAT_VERSION}")
    committed = attrs["committed"]

    def section(name: str) -> dict[str, np.ndarray]:
        arrays, _, key = _SECTIONS[name]
        out = {}
        for col, (dtype, _) in arrays.items():
            values = group[col][: committed[key]]
            out[col] = values.astype(object) if dtype is str else np.asarray(values)
        return out

    flat_tokens = section("tokens")
    return Rollouts(
        groups=section("groups"),
        completions=section("completions"),
        prompt_tokens=section("prompt_tokens")["prompt_tokens"],
        tokens=flat_tokens["tokens"],
        logprobs=flat_tokens["logprobs"],
        attrs=attrs,
    )
