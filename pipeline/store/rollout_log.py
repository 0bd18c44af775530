"""The append-only zarr store of every group that left the system, and what became of it.

Invariants:
- Every admitted group appears exactly once: trained (with the step that trained it), dropped
  or failed (with the reason). `append` refuses a group id already written or pending.
- Evaluation groups (fate "eval") have negative ids, the step of their round, and a reason only
  when they failed ("" when scored); they are never trained and count in no training total.
- Readers see only whole groups. A flush writes the flat token arrays first, then the
  per-completion arrays, then the per-group arrays, and commits last by rewriting the group's
  `committed` attribute (one atomic file replace in zarr's LocalStore). Array lengths alone
  cannot be the commit point: zarr's resize writes the new shape before the chunk data, so
  after a crash an array can be longer than what was actually written.
- Data beyond the committed counts (left by a crash mid-flush) is ignored by readers and
  trimmed when the store is reopened for appending, so new rows start at the right offsets.
  While the log is open, arrays are also longer than committed on purpose: a flush grows an
  array to the end of a chunk, so most flushes skip a resize; `close` trims them.
- A flush writes at the committed offsets (grow if needed, then assign a slice), so retrying a
  flush that failed half-way overwrites its partial output instead of duplicating it.
- Every completion token has a `mask` value (True where the policy sampled it, False on the
  environment's tokens of a multi-turn episode; all True for a single turn) and every completion
  a `turns` count, so `read_rollouts` gives `mask` aligned with `tokens` and `turns` per
  completion whichever store it reads.
- Format versions: 3 is written. An older store lacks what later versions added (version 1: the
  mask, turns and env_reward arrays, every completion a single turn; versions 1 and 2: the
  last_version array) and is read as if it held their fill values (mask True, turns 1,
  env_reward NaN, last_version -1); opening one for appending (a resumed run) upgrades it in
  place: the missing arrays are created at the committed lengths holding those values (no chunk
  written: they are the fill values), and format_version becomes 3 last, so an upgrade cut short
  is simply done again.
- `last_version` is the newest version whose weights may have sampled a group's tokens: its own
  `version` unless an in-flight full-weight swap carried it on (`Generation.last_version`); -1
  without a generation, or in a store older than format 3.

Layout (zarr v3 group; ragged data as flat arrays plus offsets):

    per group        group_id i64, prompt_id str, version i32, last_version i32, fate str, reason str, step i32,
                     engine str ("" without a generation), t_admitted / t_gen_start / t_gen_end /
                     t_done f64 (NaN when unknown), prompt_tok_off i64, prompt_tok_len i32,
                     comp_off i64 (first completion's row), comp_count i32
    per completion   reward f64 (NaN when not scored), finish_reason str, tok_off i64, tok_len i32,
                     turns i32 (policy turns; 1 for a single turn), env_reward f64 (the environment's
                     summed reward; NaN without an environment)
    flat             prompt_tokens i32, tokens i32, logprobs f32, mask bool ([sum tok_len]; logprobs
                     is 0 where mask is False)
    attrs            format_version, created_unix, meta (the caller's dict), committed counts

Token ids are stored as int32: enough for any vocabulary below 2**31 entries (larger ids are
refused at `append`); readers get int64 back, like `Completion.token_ids`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from itertools import chain
from operator import attrgetter
from pathlib import Path
from typing import Any, NoReturn, Sequence

import numpy as np
import structlog
import zarr
from zarr.codecs import BloscCodec
from zarr.core.sync import sync as zarr_sync  # what Array's own methods use to run on zarr's loop

from pipeline.errors import ConfigError
from pipeline.faults import crash_point
from pipeline.types import GroupOutcome

log = structlog.get_logger(__name__)

# 2: per-token mask, per-completion turns and env_reward (multi-turn episodes)
# 3: per-group last_version (in-flight full-weight swaps: the newest version a group may span)
FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)  # older ones read (and upgrade on append) with the fill values of what they lack
FATES = ("trained", "dropped", "failed", "eval")

# Chunk lengths: a flush of a few hundred groups touches one or two chunks per array, and a
# chunk stays a few hundred KiB. Every flush still rewrites the partial last chunk of each of
# the 25 arrays (decoding and re-encoding up to a chunk of strings for the string ones): tens of
# milliseconds per flush whatever its size, which is why flushes are batched.
GROUP_CHUNK = 4096
COMPLETION_CHUNK = 16384
TOKEN_CHUNK = 65536

_INT32_MAX = 2**31 - 1

# Numeric arrays: lz4 after bit-shuffling encodes token-id chunks several times faster than zarr's
# default zstd (level 3), to about the same size; logprobs barely compress either way (docs/architecture.md#measurements-behind-the-code). String arrays keep the default (vlen-utf8 + zstd). Readers
# need nothing new: zarr records each array's codecs, and older stores keep theirs.
_NUMERIC_COMPRESSOR = BloscCodec(cname="lz4", clevel=5, shuffle="bitshuffle")

# name -> (dtype, fill value); the section of each name fixes its length and chunking.
_GROUP_ARRAYS: dict[str, tuple[Any, Any]] = {
    "group_id": ("int64", -1),
    "prompt_id": (str, ""),
    "version": ("int32", -1),
    "last_version": ("int32", -1),
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
    "turns": ("int32", 1),
    "env_reward": ("float64", np.nan),
}
_PROMPT_TOKEN_ARRAYS: dict[str, tuple[Any, Any]] = {"prompt_tokens": ("int32", 0)}
_TOKEN_ARRAYS: dict[str, tuple[Any, Any]] = {"tokens": ("int32", 0), "logprobs": ("float32", np.nan),
                                             "mask": ("bool", True)}
# What each format version added; their fill values are what an older store's rows were (single
# turns; last_version -1: not recorded, each group one version's sample as far as it knew).
_ADDED = {2: ("turns", "env_reward", "mask"), 3: ("last_version",)}


def _missing(version: int) -> set[str]:
    """The arrays a store of format `version` lacks (those later versions added)."""
    return {name for v, names in _ADDED.items() if v > version for name in names}

# section -> (arrays, chunk length, key of its length in the `committed` attribute)
_SECTIONS = {
    "prompt_tokens": (_PROMPT_TOKEN_ARRAYS, TOKEN_CHUNK, "prompt_tokens"),
    "tokens": (_TOKEN_ARRAYS, TOKEN_CHUNK, "tokens"),
    "completions": (_COMPLETION_ARRAYS, COMPLETION_CHUNK, "completions"),
    "groups": (_GROUP_ARRAYS, GROUP_CHUNK, "groups"),
}


def _flat(parts: list[Any], dtype: np.dtype) -> np.ndarray:
    """[sum of lengths] `parts` (1-d arrays or sequences) back to back as one array of `dtype`.

    Joining the raw bytes costs a few times less than np.concatenate for the usual hundreds of
    small arrays (one per completion); it is taken only when every part is an array of exactly
    `dtype`, and bytes.join refuses non-contiguous arrays. Anything else is cast by numpy.
    """
    try:
        if set(map(attrgetter("dtype"), parts)) <= {dtype}:
            return np.frombuffer(b"".join(parts), dtype)
    except (AttributeError, TypeError):
        pass  # lists, or arrays bytes.join cannot take: the casting path below handles them
    if not parts:
        return np.zeros(0, dtype)
    return np.concatenate([np.asarray(p).reshape(-1) for p in parts]).astype(dtype, copy=False)


_I64, _F32, _F64, _BOOL = np.dtype(np.int64), np.dtype(np.float32), np.dtype(np.float64), np.dtype(bool)

# The per-group values an append gathers as one tuple per group, in this order (the offsets are
# computed at flush).
_ROW = ("group_id", "prompt_id", "version", "last_version", "fate", "reason", "step", "engine", "t_admitted",
        "t_gen_start", "t_gen_end", "t_done", "prompt_tok_len", "comp_count")


@dataclass(slots=True)
class _Block:
    """The outcomes of one `append_many` call, flattened (built at append, never changed, written at flush).

    G groups, C completions, P prompt tokens, T completion tokens. Per-group values stay one
    tuple per group (one comprehension builds them all; flush transposes them into columns).
    Short columns are tuples rather than small arrays, which cost more to build than they hold
    for a one-group call, or lists, which the garbage collector keeps scanning while pending.
    """

    rows: tuple[tuple[Any, ...], ...]  # [G] tuples in _ROW order
    tok_lens: tuple[int, ...]  # [C]
    finish_reasons: tuple[str, ...]  # [C]
    rewards: np.ndarray  # [C] float64
    turns: tuple[int, ...]  # [C]
    env_rewards: tuple[float, ...]  # [C], NaN without an environment
    prompt_tokens: np.ndarray  # [P] int32
    tokens: np.ndarray  # [T] int32
    logprobs: np.ndarray  # [T] float32
    mask: np.ndarray  # [T] bool


_INT32_MAX_U64 = np.uint64(_INT32_MAX)


def _in_int32(ids: np.ndarray) -> bool:
    # negative ids wrap to huge unsigned values, so one max checks both ends
    return not ids.size or bool(ids.view(np.uint64).max() <= _INT32_MAX_U64)


def _raise_out_of_range(ids: np.ndarray, ends: np.ndarray, outcomes: Sequence[GroupOutcome]) -> NoReturn:
    """Refuse token ids that int32 cannot hold, naming the first group with one.

    ids: [P + T] int64, every group's prompt ids then every group's completion ids;
    ends: [2G] end offset in ids of each of those 2G runs.
    """
    first = int(np.flatnonzero((ids < 0) | (ids > _INT32_MAX))[0])
    run = int(np.searchsorted(ends, first, side="right"))
    bad = ids[(int(ends[run - 1]) if run else 0):int(ends[run])]
    G = len(outcomes)
    raise ValueError(f"group {outcomes[run % G].group_id} {'prompt' if run < G else 'completion'} has token ids "
                     f"outside [0, 2**31): min {bad.min()}, max {bad.max()}")


def _last_version(g: Any) -> int:
    """A generation's newest version (its own unless an in-flight swap carried it on); -1 without one."""
    if g is None:
        return -1
    return g.version if g.last_version is None else g.last_version


def _check_fate(o: GroupOutcome) -> None:
    if o.fate not in FATES:
        raise ValueError(f"group {o.group_id}: fate must be one of {FATES}, got {o.fate!r}")
    if o.fate == "trained" and (o.step < 1 or o.reason):
        raise ValueError(f"group {o.group_id}: a trained group needs step >= 1 and reason '', "
                         f"got step {o.step} reason {o.reason!r}")
    if o.fate == "eval" and (o.step < 0 or o.group_id >= 0):
        raise ValueError(f"group {o.group_id}: an eval group needs step >= 0 and a negative id, "
                         f"got step {o.step} id {o.group_id}")
    if o.fate in ("dropped", "failed") and (o.step != -1 or not o.reason):
        raise ValueError(f"group {o.group_id}: a {o.fate} group needs step -1 and a reason, "
                         f"got step {o.step} reason {o.reason!r}")


def _to_block(outcomes: Sequence[GroupOutcome]) -> _Block:
    """Check and flatten outcomes; raises ValueError naming a bad group.

    Column-wise over the whole call, since append runs on the event loop: a comprehension per
    field, one join and one range check for all prompt and completion token ids together;
    per-group work happens only to name the group once a check has failed.
    """
    if not all((o.fate == "trained" and o.step >= 1 and not o.reason)
               or (o.fate in ("dropped", "failed") and o.step == -1 and o.reason)
               or (o.fate == "eval" and o.step >= 0 and o.group_id < 0) for o in outcomes):
        for o in outcomes:
            _check_fate(o)  # raises at the first bad one, saying why
    gens = [o.generation for o in outcomes]
    per_group = [g.completions if g is not None else () for g in gens]
    comp_counts = list(map(len, per_group))
    comps = list(chain.from_iterable(per_group))
    token_ids = [c.token_ids for c in comps]
    tok_lens = tuple(map(len, token_ids))
    prompts = [o.prompt.token_ids for o in outcomes]
    prompt_lens = list(map(len, prompts))
    P = sum(prompt_lens)
    ids = _flat([np.fromiter(chain.from_iterable(prompts), np.int64, count=P), *token_ids], _I64)
    logprobs = _flat([c.logprobs for c in comps], _F32)
    T = len(logprobs)
    if len(ids) != P + T or T != sum(tok_lens):  # what a 2-d token_ids or logprobs leaves
        raise ValueError(f"groups {outcomes[0].group_id}..{outcomes[-1].group_id}: every completion needs "
                         f"1-d token_ids and logprobs of equal length")
    if not _in_int32(ids):
        tok_ends = np.concatenate([[0], np.cumsum(tok_lens, dtype=np.int64)])
        _raise_out_of_range(ids, np.concatenate([np.cumsum(prompt_lens), P + tok_ends[np.cumsum(comp_counts)]]),
                            outcomes)
    ids = ids.astype(np.int32)
    masks = [c.mask for c in comps]
    if all(m is None for m in masks):  # single turns: no per-completion array to build
        mask = np.ones(T, dtype=bool)
    else:
        mask = _flat([np.ones(n, dtype=bool) if m is None else m for m, n in zip(masks, tok_lens)], _BOOL)
        if len(mask) != T:  # what a 2-d mask leaves
            raise ValueError(f"groups {outcomes[0].group_id}..{outcomes[-1].group_id}: every completion's mask "
                             f"must be 1-d, one value per token")

    rewards = [np.full(n, np.nan) if o.rewards is None else o.rewards for o, n in zip(outcomes, comp_counts)]
    try:
        rewards_fit = list(map(len, rewards)) == comp_counts
    except TypeError:  # a scalar has no len; the check below names its group
        rewards_fit = False
    if not rewards_fit:
        for o, r, n in zip(outcomes, rewards, comp_counts):
            if np.size(r) != n:
                raise ValueError(f"group {o.group_id}: {np.size(r)} rewards for {n} completions")

    nan = np.nan
    rows = tuple([(o.group_id, o.prompt.id, o.version, _last_version(g), o.fate, o.reason, o.step,
                   g.engine if g is not None else "", o.t_admitted,
                   g.t_start if g is not None else nan, g.t_end if g is not None else nan, o.t_done, p, c)
                  for o, g, p, c in zip(outcomes, gens, prompt_lens, comp_counts)])
    return _Block(
        rows=rows,
        tok_lens=tok_lens,
        finish_reasons=tuple([c.finish_reason for c in comps]),
        rewards=_flat(rewards, _F64),
        turns=tuple([c.turns for c in comps]),
        env_rewards=tuple([nan if c.env_reward is None else c.env_reward for c in comps]),
        prompt_tokens=ids[:P],
        tokens=ids[P:],
        logprobs=logprobs,
        mask=mask,
    )


def _columns(blocks: list[_Block], committed: dict[str, int]) -> dict[str, np.ndarray]:
    """Every array's rows for `blocks`, the offsets continuing from the `committed` counts."""
    per_group = dict(zip(_ROW, zip(*chain.from_iterable(b.rows for b in blocks))))
    columns: dict[str, np.ndarray] = {
        "prompt_tokens": _flat([b.prompt_tokens for b in blocks], np.dtype(np.int32)),
        "tokens": _flat([b.tokens for b in blocks], np.dtype(np.int32)),
        "logprobs": _flat([b.logprobs for b in blocks], _F32),
        "mask": _flat([b.mask for b in blocks], _BOOL),
        "reward": _flat([b.rewards for b in blocks], _F64),
        "turns": np.fromiter(chain.from_iterable(b.turns for b in blocks), np.int32),
        "env_reward": np.fromiter(chain.from_iterable(b.env_rewards for b in blocks), np.float64),
        "finish_reason": np.array(list(chain.from_iterable(b.finish_reasons for b in blocks)), dtype=object),
        "tok_len": np.fromiter(chain.from_iterable(b.tok_lens for b in blocks), np.int32),
    }
    columns["tok_off"] = _offsets(committed["tokens"], columns["tok_len"])
    for name, (dtype, _) in _GROUP_ARRAYS.items():
        if name in per_group:
            columns[name] = np.array(per_group[name], dtype=object if dtype is str else dtype)
    columns["prompt_tok_off"] = _offsets(committed["prompt_tokens"], columns["prompt_tok_len"])
    columns["comp_off"] = _offsets(committed["completions"], columns["comp_count"])
    return columns


def _create_array(group: zarr.Group, name: str, dtype: Any, fill: Any, chunk: int, length: int,
                  overwrite: bool = False) -> None:
    group.create_array(name, shape=(length,), dtype=dtype, chunks=(chunk,), fill_value=fill, overwrite=overwrite,
                       compressors="auto" if dtype is str else _NUMERIC_COMPRESSOR)


def _check_version(path: Path, attrs: dict[str, Any]) -> int:
    """The store's format version, one of READABLE_VERSIONS (ConfigError otherwise)."""
    version = attrs.get("format_version")
    if version not in READABLE_VERSIONS:
        raise ConfigError(f"rollout log {path} has format_version {version!r}, this code reads "
                          f"{', '.join(map(str, READABLE_VERSIONS))} and writes {FORMAT_VERSION}")
    return int(version)


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
        self._pending: list[_Block] = []
        self._pending_groups = 0  # groups in _pending
        self._pending_tokens = 0  # completion tokens in _pending
        self._closed = False
        if (self.path / "zarr.json").exists():
            self._group = zarr.open_group(self.path, mode="r+")
            self._committed = self._repair(meta)
        else:
            self._group = self._create(meta)
            self._committed = {"groups": 0, "completions": 0, "prompt_tokens": 0, "tokens": 0}
        # Handles are kept: each lookup re-reads metadata, and resize updates a handle in place.
        # write_empty_chunks: store every chunk rather than scan each one for all-fill first.
        self._arrays = {name: self._group[name].with_config({"write_empty_chunks": True})
                        for arrays, _, _ in _SECTIONS.values() for name in arrays}
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
                _create_array(group, name, dtype, fill, chunk, 0)
        group.attrs.update({
            "format_version": FORMAT_VERSION,
            "created_unix": time.time(),
            "meta": dict(meta or {}),
            "committed": {"groups": 0, "completions": 0, "prompt_tokens": 0, "tokens": 0},
        })
        return group

    def _repair(self, meta: dict[str, Any] | None) -> dict[str, int]:
        """Check the format, trim data beyond the committed counts, upgrade an older store, merge
        the caller's meta."""
        attrs = dict(self._group.attrs)
        version = _check_version(self.path, attrs)
        missing = _missing(version)
        committed = {k: int(v) for k, v in attrs["committed"].items()}
        trimmed = []
        for arrays, _, key in _SECTIONS.values():
            for name in arrays:
                if name in missing:
                    continue
                arr = self._group[name]
                if arr.shape[0] < committed[key]:
                    raise ConfigError(f"rollout log {self.path}: array {name} has {arr.shape[0]} rows "
                                      f"but {committed[key]} are committed; the store is corrupt")
                if arr.shape[0] > committed[key]:
                    trimmed.append(name)
                    arr.resize((committed[key],))
        if trimmed:  # the last writer did not close the log: a crash, or a kill between flushes
            log.warning("rollout_log_trimmed", path=str(self.path), arrays=trimmed, committed=committed)
        if version < FORMAT_VERSION:
            self._upgrade(committed, version, missing)
        if meta:
            self._group.attrs["meta"] = {**attrs.get("meta", {}), **meta}
        return committed

    def _upgrade(self, committed: dict[str, int], version: int, missing: set[str]) -> None:
        """An older format to this one: the arrays it lacks, `committed` long, each holding its fill
        value (mask True, turns 1, env_reward NaN, last_version -1: what its rows were), then the version."""
        for arrays, chunk, key in _SECTIONS.values():
            for name, (dtype, fill) in arrays.items():
                if name in missing:  # overwrite: an upgrade cut short may have left one behind
                    _create_array(self._group, name, dtype, fill, chunk, committed[key], overwrite=True)
        self._group.attrs["format_version"] = FORMAT_VERSION
        log.info("rollout_log_upgraded", path=str(self.path), old_version=version, version=FORMAT_VERSION)

    def append(self, outcome: GroupOutcome) -> None:
        """Buffer one outcome; `append_many([outcome])`."""
        self.append_many((outcome,))

    def append_many(self, outcomes: Sequence[GroupOutcome]) -> None:
        """Buffer several outcomes, all or none (no I/O unless `flush_every` groups are now pending).

        Raises ValueError naming the group if any outcome is inconsistent or its id is already
        written, pending or repeated in `outcomes`; nothing is appended then. Callers on the
        event loop should flush through `asyncio.to_thread` often enough that the automatic
        flush here, which writes on the calling thread, stays a backstop.
        """
        if self._closed:
            raise RuntimeError(f"rollout log {self.path} is closed")
        if not outcomes:
            return
        block = _to_block(outcomes)
        ids = [row[0] for row in block.rows]
        with self._pending_lock:
            if not self._ids.isdisjoint(ids) or len(set(ids)) != len(ids):
                seen: set[int] = set()
                for gid in ids:  # only now find the id to name
                    if gid in self._ids:
                        raise ValueError(f"group {gid} is already in rollout log {self.path}")
                    if gid in seen:
                        raise ValueError(f"group {gid} appears twice in one append to rollout log {self.path}")
                    seen.add(gid)
            self._ids.update(ids)
            self._pending.append(block)
            self._pending_groups += len(ids)
            self._pending_tokens += len(block.tokens)
            self._fates.update([o.fate for o in outcomes])
            self._reasons.update([f"{o.fate}:{o.reason}" for o in outcomes])
            due = self._pending_groups >= self.flush_every
        if due:
            self.flush()

    def flush(self) -> None:
        """Write every pending group and commit; safe to call from a worker thread."""
        with self._flush_lock:
            with self._pending_lock:
                blocks = list(self._pending)
            if not blocks:
                return
            t0 = time.monotonic()
            c = self._committed
            columns = _columns(blocks, c)
            groups = len(columns["group_id"])
            new = {
                "prompt_tokens": c["prompt_tokens"] + len(columns["prompt_tokens"]),
                "tokens": c["tokens"] + len(columns["tokens"]),
                "completions": c["completions"] + len(columns["tok_len"]),
                "groups": c["groups"] + groups,
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
                del self._pending[: len(blocks)]
                self._pending_groups -= groups
                self._pending_tokens -= len(columns["tokens"])
            log.debug("rollout_log_flushed", groups=groups, total=new["groups"],
                      seconds=round(time.monotonic() - t0, 4))

    def _write_section(self, section: str, columns: dict[str, np.ndarray],
                       old: dict[str, int], new: dict[str, int]) -> None:
        """Write the section's new rows at the committed offsets, every array at once.

        Each array write is a round trip to zarr's event loop with per-chunk work in threads;
        issuing them together overlaps those waits. An array too short is grown to the end of
        the chunk holding its new last row, so most flushes skip the metadata rewrite of a
        resize. Returns only when every write has finished or failed, so a retried flush
        never races a write still running.
        """
        arrays, chunk, key = _SECTIONS[section]
        start, stop = old[key], new[key]
        if stop == start:
            return
        capacity = -(-stop // chunk) * chunk

        async def write(name: str) -> None:
            arr = self._arrays[name].async_array
            if arr.shape[0] < stop:
                await arr.resize((capacity,))
            await arr.setitem(slice(start, stop), columns[name])

        async def write_all() -> list[BaseException | None]:
            return await asyncio.gather(*(write(name) for name in arrays), return_exceptions=True)

        for result in zarr_sync(write_all()):
            if isinstance(result, BaseException):
                raise result

    def _trim(self) -> None:
        """Cut every array to its committed length (the caller holds the flush lock)."""
        for arrays, _, key in _SECTIONS.values():
            for name in arrays:
                arr = self._arrays[name]
                if arr.shape[0] != self._committed[key]:
                    arr.resize((self._committed[key],))

    def _commit(self, new: dict[str, int]) -> None:
        # The single point at which the new rows become visible to readers.
        self._group.attrs["committed"] = new

    def truncate(self, groups: int) -> int:
        """Keep only the first `groups` groups (resume: what came after the checkpoint is redone).

        Returns how many groups were cut. Pending rows are refused: flush or close first.
        """
        with self._flush_lock, self._pending_lock:
            if self._pending:
                raise RuntimeError(f"rollout log {self.path}: truncate with {self._pending_groups} groups pending")
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
            self._trim()
            cut = c["groups"] - groups
            self._load_index(groups)
        log.warning("rollout_log_truncated", path=str(self.path), kept=groups, cut=cut)
        return cut

    def close(self) -> None:
        """Flush and stop accepting outcomes; calling it again does nothing."""
        if self._closed:
            return
        self.flush()
        with self._flush_lock:
            self._trim()  # a closed store's arrays are exactly as long as what is committed
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
            return self._pending_groups

    @property
    def pending_tokens(self) -> int:
        """Completion tokens of the groups appended but not yet flushed."""
        with self._pending_lock:
            return self._pending_tokens

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
    logprobs: np.ndarray  # [T] float32; 0 where mask is False
    mask: np.ndarray  # [T] bool: True where the policy sampled the token, False on environment tokens
    attrs: dict[str, Any] = field(default_factory=dict)

    @property
    def num_groups(self) -> int:
        return len(self.groups["group_id"])

    def group(self, i: int) -> dict[str, Any]:
        """Group i in log order: its scalars, prompt tokens, rewards [n], completions (token ids,
        log-probs, finish reason), masks (per completion [T] bool), turns [n] and env_rewards [n]."""
        g = {name: col[i] for name, col in self.groups.items()}
        p0, pn = int(g["prompt_tok_off"]), int(g["prompt_tok_len"])
        c0, cn = int(g["comp_off"]), int(g["comp_count"])
        completions, masks = [], []
        for j in range(c0, c0 + cn):
            t0, tn = int(self.completions["tok_off"][j]), int(self.completions["tok_len"][j])
            completions.append((self.tokens[t0:t0 + tn].astype(np.int64), self.logprobs[t0:t0 + tn].copy(),
                                str(self.completions["finish_reason"][j])))
            masks.append(self.mask[t0:t0 + tn].copy())
        return {
            "group_id": int(g["group_id"]),
            "prompt_id": str(g["prompt_id"]),
            "version": int(g["version"]),
            "last_version": int(g["last_version"]),
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
            "masks": masks,
            "turns": self.completions["turns"][c0:c0 + cn].astype(np.int64),
            "env_rewards": self.completions["env_reward"][c0:c0 + cn].copy(),
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
            masks = g.pop("masks")
            g["prompt_len"] = len(g.pop("prompt_token_ids"))
            g["n_completions"] = len(completions)
            g["num_tokens"] = sum(len(t) for t, _, _ in completions)
            g["num_sampled_tokens"] = int(sum(m.sum() for m in masks))
            g["turns"] = g["turns"].tolist()
            g["env_rewards"] = g["env_rewards"].tolist()
            g["rewards"] = rewards.tolist()
            g["reward_mean"] = float(np.nanmean(rewards)) if np.isfinite(rewards).any() else float("nan")
            records.append(g)
        return records


def read_rollouts(path: str | Path) -> Rollouts:
    """Read the committed groups of the log at `path`; data a crashed flush left is ignored.

    An older store (never modified here) reads with the fill values of the arrays it lacks.
    """
    path = Path(path)
    if not (path / "zarr.json").exists():
        raise FileNotFoundError(f"no rollout log at {path} (no zarr.json)")
    group = zarr.open_group(path, mode="r")
    attrs = dict(group.attrs)
    missing = _missing(_check_version(path, attrs))
    committed = attrs["committed"]

    def section(name: str) -> dict[str, np.ndarray]:
        arrays, _, key = _SECTIONS[name]
        out = {}
        for col, (dtype, fill) in arrays.items():
            if col in missing:
                out[col] = np.full(committed[key], fill, dtype=dtype)
                continue
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
        mask=flat_tokens["mask"],
        attrs=attrs,
    )
