"""Atomic, versioned adapter directories on a (shared) filesystem.

The trainer publishes each new policy version here; engines load a version by reading its
directory directly (vLLM's `LoRARequest`, peft's `load_adapter`). A store holds one kind of
version: LoRA adapters (`kind="lora"`), or whole models for full-weight updates
(`kind="full"`: what `save_pretrained` writes, read by every engine's weight loader).

Layout under `root`:

    root/v000007-1a2b3c4d/{adapter_config.json, adapter_model.safetensors, manifest.json}   (lora)
    root/v000007-1a2b3c4d/{config.json, model.safetensors, ..., manifest.json}              (full)
    root/.tmp-*/          in-progress publishes and deletions: never listed, removed on open

Invariants:
- A version directory appears only by `os.rename` of a complete temporary directory that already
  holds its manifest, so a reader never sees a half-written version; a publish killed at any point
  leaves only a `.tmp-*` directory, which is never listed. With `sync` (the default) its files and
  the rename are forced to disk first, so a version survives the machine's power loss too. The
  pipeline opens its store with `sync=False` (store.sync): a resume discards every version after
  its checkpoint and publishes the checkpoint's own again, so no version's durability is relied
  on, and a version torn by a power loss fails its manifest's hashes and is never loaded.
- Directory names are `v{version:06d}-{hash8}`, built only by the store; `hash8` is the first
  8 hex digits of the content hash, so a name is never reused for different weights.
- Content hash = sha256 over the sorted `(filename, file sha256)` pairs of the adapter files
  (every file but manifest.json), one `name NUL hexdigest LF` record per file.
- The manifest names the kind; a store refuses a version of the other kind (a LoRA adapter is
  not a model, and the reverse). Manifests without a kind were written by LoRA-only stores.
- Versions only increase: a publish of a version <= the newest this store has seen is refused.
- Adapters are read only from safetensors: pickle files (`*.bin`, `*.pt`, ...) are refused both
  at publish and at load.
- A deletion renames the version directory to `.tmp-del-*` before removing it, so a reader
  never sees a partially deleted version.
- A publish that fails (disk full, permission denied, ...) leaves no version directory and no
  temporary one behind, does not use up its version, and raises a StoreError naming the
  version, the root, the errno and what to do.
- No path outside a version directory is ever read: manifest file names are plain names (no
  `/`, `..`, NUL), version directories and adapter files that are symbolic links are refused,
  and files are opened with O_NOFOLLOW.
- A version directory that vanishes while it is being read (pruned, discarded) is
  AdapterNotFoundError; one whose files differ from its manifest is AdapterCorruptError.
- `verify_dir` hashes every file, except in the store that published the version: there a file
  whose identity (device, inode, size, mtime, ctime) is the one it had when the publish hashed
  it is those bytes; any write to it, replacement or truncation makes it hashed again. A whole
  model's version is read and hashed once per process, not twice.
- One publisher per root (the trainer). Engines on other processes or hosts open the same root
  with `readonly=True`: they never create, clean or delete anything there.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import json
import os
import re
import shutil
import stat
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Mapping

import structlog

from pipeline.store.durable import fsync_dir as _fsync_dir
from pipeline.store.durable import read_file as _read_file
from pipeline.store.durable import sha256_file as _sha256_file
from pipeline.store.durable import write_synced as _write_synced
from pipeline.errors import AdapterCorruptError, AdapterError, AdapterNotFoundError, StoreError
from pipeline.faults import crash_point
from pipeline.types import AdapterRef

log = structlog.get_logger(__name__)

MANIFEST = "manifest.json"
CONFIG = "adapter_config.json"
CONFIGS = {"lora": CONFIG, "full": "config.json"}  # kind -> the file a version of that kind must hold
MANIFEST_FORMAT = 1
TMP_PREFIX = ".tmp-"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle")  # torch.load/pickle can run code
_NAME_RE = re.compile(r"^v(\d{6,})-([0-9a-f]{8})$")
_HEX64_RE = re.compile(r"^[0-9a-f]{64}$")


def write_adapter(directory: Path, tensors: Mapping[str, Any], config: bytes) -> None:
    """A LoRA version's two files in `directory`: adapter_model.safetensors (the tensors) and
    adapter_config.json (`config`, as it is)."""
    from safetensors.torch import save_file

    save_file(dict(tensors), str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    (directory / CONFIG).write_bytes(config)


def _dir_name(version: int, content_sha256: str) -> str:
    return f"v{version:06d}-{content_sha256[:8]}"


def content_hash(files: Mapping[str, str]) -> str:
    """The content hash of an adapter: sha256 over the sorted (filename, file sha256) pairs."""
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(f"{name}\0{files[name]}\n".encode())
    return h.hexdigest()


def _errno_text(e: OSError) -> str:
    """`ENOSPC (No space left on device: '/path')`: the errno name first, so logs can be grepped."""
    if e.errno is None:
        return f"{type(e).__name__}: {e}"
    name = errno.errorcode.get(e.errno, f"errno {e.errno}")
    where = f": {e.filename!r}" if e.filename is not None else ""
    return f"{name} ({e.strerror or os.strerror(e.errno)}{where})"


def _write_hint(e: OSError, root: Path) -> str:
    """What an operator can do about a failed write under `root`."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"free space on the filesystem of {root} (or raise the quota), then publish again"
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"make {root} writable by this user (not a read-only mount), or choose another store root"
    if e.errno == errno.ENOENT:
        return f"check that {root} still exists and its filesystem is mounted"
    return f"check the filesystem of {root} (mounted, healthy, writable)"


def _identity(st: os.stat_result) -> tuple[int, ...]:
    """What changes whenever a file's bytes or the file itself do: a write changes its ctime (which
    no call can set back) and its mtime, a replacement its inode, a truncation its size."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _is_pickle(name: str) -> bool:
    return name.lower().endswith(PICKLE_SUFFIXES)


def _check_lookup_version(version: int) -> None:
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise ValueError(f"adapter version must be an int >= 0, got {version!r}")


class AdapterStore:
    """Publish, list, verify, wait for and prune adapter versions under one root directory."""

    def __init__(self, root: str | os.PathLike[str], base_model: str = "", keep_last: int = 2,
                 *, poll_interval: float = 0.5, readonly: bool = False, kind: str = "lora",
                 sync: bool = True) -> None:
        """Open (and, unless `readonly`, create and clean) the store at `root`.

        poll_interval: seconds between directory re-scans in `wait_for`; only the fallback for
            publishes by other processes (in-process publishes wake waiters at once).
        readonly: for readers (engines) sharing the root with a publisher elsewhere: nothing is
            created or removed, and `publish`/`prune` are refused.
        kind: "lora" (adapter directories) or "full" (whole models, for full-weight updates).
        sync: force each version's files and its rename to disk before `publish` returns (little
            for a LoRA version on a local disk, more on a shared one).
        """
        if kind not in CONFIGS:
            raise ValueError(f"kind must be one of {', '.join(CONFIGS)}, got {kind!r}")
        if keep_last < 0:
            raise ValueError(f"keep_last must be >= 0, got {keep_last}")
        if poll_interval <= 0:
            raise ValueError(f"poll_interval must be > 0, got {poll_interval}")
        try:
            self.root = Path(root).resolve()
        except (OSError, RuntimeError) as e:  # a symlink loop: RuntimeError before 3.13, OSError since
            raise StoreError(f"adapter store root {root} cannot be resolved: {e}") from e
        self.base_model = base_model
        self.keep_last = keep_last
        self.poll_interval = poll_interval
        self.readonly = readonly
        self.kind = kind
        self.sync = sync
        # publish/prune hold _write_lock for seconds (a save_pretrained); the event loop only ever
        # takes _state_lock, held for a few statements, so it never waits on a disk write
        self._write_lock = threading.Lock()
        self._state_lock = threading.Lock()  # guards the fields below
        self._newest_published = 0  # newest version this store has seen, even if pruned since
        self._pins: dict[int, int] = {}
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()
        # version directory this store published -> each file's identity when it was hashed
        # (`_identity`): verify_dir takes a file whose identity is unchanged as the bytes hashed
        self._hashed: dict[str, dict[str, tuple[int, ...]]] = {}
        if not readonly:
            self._open_for_writing()

    def _open_for_writing(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            # os.access ignores read-only mounts and ACL quirks; creating something is the real test
            probe = self.root / f"{TMP_PREFIX}probe-{uuid.uuid4().hex}"
            probe.mkdir()
            probe.rmdir()
            leftovers = [self.root / n for n in os.listdir(self.root) if n.startswith(TMP_PREFIX)]
        except OSError as e:
            raise StoreError(f"adapter store root {self.root} cannot be created or written: {_errno_text(e)}; "
                             f"{_write_hint(e, self.root)}") from e
        for path in leftovers:
            self._remove_tree(path)
            log.info("adapter_store_tmp_removed", path=str(path))

    @staticmethod
    def _remove_tree(path: Path) -> None:
        """Remove a directory (never following a link out of it) or a file.

        A version directory is flat (publish takes plain files only): its files are unlinked
        from one listing, a third of the system calls of shutil.rmtree; anything else goes
        through rmtree."""
        try:
            if not stat.S_ISDIR(os.lstat(path).st_mode):
                path.unlink()
                return
            with os.scandir(path) as it:
                entries = list(it)
            if any(e.is_dir(follow_symlinks=False) for e in entries):
                shutil.rmtree(path)
                return
            for e in entries:
                os.unlink(e.path)
            os.rmdir(path)
        except OSError as e:
            raise StoreError(f"cannot remove {path}: {_errno_text(e)}; {_write_hint(e, path.parent)}") from e

    # --- listing -------------------------------------------------------------------------

    def _scan(self) -> dict[int, list[str]]:
        """Version -> names of the directories that look like published versions (manifest or not)."""
        found: dict[int, list[str]] = {}
        try:
            with os.scandir(self.root) as it:
                entries = list(it)
        except FileNotFoundError:  # a readonly store may open before the publisher creates root
            return found
        except OSError as e:
            raise StoreError(f"cannot list the adapter store root {self.root}: {_errno_text(e)}; "
                             f"make it readable by this user") from e
        for entry in entries:
            m = _NAME_RE.match(entry.name)
            if m and entry.is_dir(follow_symlinks=False):
                found.setdefault(int(m.group(1)), []).append(entry.name)
        return found

    def _published(self) -> list[int]:
        return sorted(v for v, names in self._scan().items()
                      if any((self.root / n / MANIFEST).is_file() for n in names))

    def versions(self) -> list[int]:
        """Published versions (directories of the right name that hold a manifest), ascending."""
        return self._published()

    def latest(self) -> AdapterRef | None:
        """The newest published version, from its manifest (no file hashing); None if none."""
        for _ in range(3):
            published = self._published()
            if not published:
                return None
            try:
                return self.ref(published[-1])
            except AdapterNotFoundError:  # discarded between the listing and the read: list again
                continue
        raise AdapterNotFoundError(f"the newest version in {self.root} kept vanishing while it was read; "
                                   f"is another process deleting versions?")

    def _find(self, version: int) -> Path:
        names = self._scan().get(version, [])
        if not names:
            raise AdapterNotFoundError(
                f"adapter version {version} is not in the store {self.root}; available: {self._published()}")
        if len(names) > 1:
            raise AdapterCorruptError(
                f"adapter version {version} has {len(names)} directories in {self.root}: {sorted(names)}; "
                f"only one publisher may write a store")
        return self.root / names[0]

    def ref(self, version: int) -> AdapterRef:
        """The ref of a published version, read from its manifest without hashing files."""
        _check_lookup_version(version)
        if version == 0:
            return AdapterRef.base()
        path = self._find(version)
        manifest = self._read_manifest(path)
        return AdapterRef(version=version, name=path.name, path=str(path), sha256=manifest["content_sha256"])

    # --- verification --------------------------------------------------------------------

    def load(self, version: int) -> AdapterRef:
        """The ref of a published version after checking every file against its manifest."""
        _check_lookup_version(version)
        if version == 0:
            return AdapterRef.base()
        return self.verify_dir(self._find(version))

    def verify_dir(self, path: str | os.PathLike[str]) -> AdapterRef:
        """Check a version directory of this store in full and return its ref.

        Refuses a path that is not a version directory directly under root, a manifest that
        does not parse or does not match the directory name, a listed file that is missing or
        whose sha256 differs, and any unlisted safetensors or pickle file.
        """
        given = Path(path)
        # resolve the parent only: the version directory itself must not be a symlink, and
        # resolving it would follow one out of the root (the root is resolved already: a path
        # the store handed out is taken as it is)
        p = given if given.parent == self.root else given.parent.resolve() / given.name
        m = _NAME_RE.match(p.name)
        if p.parent != self.root or m is None:
            raise AdapterError(f"{path} is not a version directory of the adapter store {self.root}")
        try:
            mode = os.lstat(p).st_mode
        except FileNotFoundError:
            mode = 0
        if stat.S_ISLNK(mode):
            raise AdapterCorruptError(f"adapter {p.name}: {p} is a symbolic link; "
                                      f"version directories are written by the store, never linked")
        if not stat.S_ISDIR(mode):
            self._raise_if_vanished(p)
        manifest = self._read_manifest(p)
        theirs = manifest.get("base_model", "")
        if self.base_model and theirs and theirs != self.base_model:
            # the same model may be named by different paths on different hosts: say so, don't refuse
            log.warning("adapter_base_model_differs", adapter=p.name, manifest=theirs, store=self.base_model)
        files: dict[str, str] = manifest["files"]
        with self._state_lock:
            hashed = self._hashed.get(p.name, {})  # what this store hashed as it published them
        # one listing gives every file's type (no stat per file: each is a round trip on NFS)
        try:
            with os.scandir(p) as it:
                present = {e.name: e for e in it}
        except OSError as e:
            self._raise_if_vanished(p)
            raise AdapterCorruptError(f"adapter {p.name}: cannot list {p}: {_errno_text(e)}") from e
        for name, expected in sorted(files.items()):
            entry = present.get(name)
            if entry is not None and entry.is_symlink():
                raise AdapterCorruptError(f"adapter {p.name}: {name} is a symbolic link, not a file the store wrote")
            try:
                if entry is None or not entry.is_file(follow_symlinks=False):
                    actual = None
                elif name in hashed and _identity(entry.stat(follow_symlinks=False)) == hashed[name]:
                    actual = expected  # the very file this store hashed when it published it, untouched since
                else:
                    actual = _sha256_file(entry.path)
            except FileNotFoundError:  # deleted between the listing and the open: same as missing
                actual = None
            except OSError as e:
                self._raise_if_vanished(p)
                raise AdapterCorruptError(f"adapter {p.name}: cannot read {name}: {_errno_text(e)}") from e
            if actual is None:
                self._raise_if_vanished(p)
                raise AdapterCorruptError(f"adapter {p.name}: {name} is listed in the manifest but is missing")
            if actual != expected:
                raise AdapterCorruptError(
                    f"adapter {p.name}: {name} sha256 is {actual[:12]}.. but the manifest says {expected[:12]}..")
        for name in sorted(present):
            if name not in files and (name.endswith(".safetensors") or _is_pickle(name)):
                raise AdapterCorruptError(f"adapter {p.name}: {name} is not listed in the manifest")
        return AdapterRef(version=int(m.group(1)), name=p.name, path=str(p), sha256=manifest["content_sha256"])

    @staticmethod
    def _raise_if_vanished(path: Path) -> None:
        """AdapterNotFoundError if the version directory is not there (e.g. pruned while being read)."""
        if not path.is_dir():
            raise AdapterNotFoundError(
                f"adapter {path.name}: directory {path} does not exist (pruned or discarded?)")

    def _read_manifest(self, path: Path) -> dict[str, Any]:
        """Parse and check the manifest of a version directory against its name (no file hashing)."""
        m = _NAME_RE.match(path.name)
        if m is None:
            raise AdapterError(f"{path} is not a version directory (name v<version>-<hash8>)")
        name, version, hash8 = path.name, int(m.group(1)), m.group(2)
        try:
            raw = _read_file(path / MANIFEST)
        except FileNotFoundError as e:
            self._raise_if_vanished(path)
            raise AdapterCorruptError(f"adapter {name}: {MANIFEST} is missing") from e
        except OSError as e:
            self._raise_if_vanished(path)
            raise AdapterCorruptError(f"adapter {name}: cannot read {MANIFEST}: {_errno_text(e)}") from e
        try:
            manifest = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise AdapterCorruptError(f"adapter {name}: {MANIFEST} is not valid JSON: {e}") from e

        def bad(what: str) -> AdapterCorruptError:
            return AdapterCorruptError(f"adapter {name}: {MANIFEST} {what}")

        if not isinstance(manifest, dict):
            raise bad("is not a JSON object")
        if manifest.get("format") != MANIFEST_FORMAT:
            raise bad(f"has format {manifest.get('format')!r}, expected {MANIFEST_FORMAT}")
        if manifest.get("version") != version:
            raise bad(f"says version {manifest.get('version')!r} but the directory name says {version}")
        files = manifest.get("files")
        if not isinstance(files, dict) or not all(
                isinstance(k, str) and isinstance(v, str) and _HEX64_RE.match(v) for k, v in files.items()):
            raise bad("has no valid 'files' mapping of file name to sha256")
        for fname in files:
            if fname in (MANIFEST, "", ".", "..") or any(c in fname for c in "/\\\0"):
                raise bad(f"lists an invalid file name {fname!r}")
        kind = manifest.get("kind", "lora")
        if kind != self.kind:
            raise bad(f"says kind {kind!r} but this store holds {self.kind!r} versions "
                      f"({'full-weight models' if self.kind == 'full' else 'LoRA adapters'}): "
                      "trainer.update must match what the directory was published with")
        config = CONFIGS[self.kind]
        if config not in files or not any(f.endswith(".safetensors") for f in files):
            raise bad(f"must list {config} and at least one .safetensors file, lists {sorted(files)}")
        stated = manifest.get("content_sha256")
        computed = content_hash(files)
        if stated != computed:
            raise bad(f"content_sha256 is {str(stated)[:12]}.. but its file hashes give {computed[:12]}..")
        if computed[:8] != hash8:
            raise bad(f"content hash {computed[:12]}.. does not match the directory's hash {hash8}")
        return manifest

    # --- publishing ----------------------------------------------------------------------

    def publish(self, version: int, write: Callable[[Path], None]) -> AdapterRef:
        """Write a new version atomically and return its ref (blocking: run it in a thread).

        `write(tmpdir)` writes the adapter files (adapter_config.json and *.safetensors, e.g.
        peft's `save_pretrained`) into an empty directory on the same filesystem as root.
        """
        if self.readonly:
            raise StoreError(f"adapter store {self.root} was opened readonly; it cannot publish")
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise StoreError(f"a published adapter version must be an int >= 1, got {version!r}")
        t0 = time.monotonic()
        with self._write_lock:
            with self._state_lock:
                newest_seen = self._newest_published
            newest = max([newest_seen, *self._scan()])
            if version <= newest:
                raise StoreError(f"cannot publish adapter version {version} to {self.root}: "
                                 f"version {newest} is already published and versions only increase")
            tmp = self.root / f"{TMP_PREFIX}v{version:06d}-{uuid.uuid4().hex}"
            renamed = False
            stage = "creating the temporary directory"
            try:
                tmp.mkdir()
                stage = "writing the adapter files"
                write(tmp)
                stage = "hashing and syncing the adapter files"
                files, identities = self._hash_new_files(tmp)
                digest = content_hash(files)
                manifest = {"format": MANIFEST_FORMAT, "version": version, "kind": self.kind, "base_model": self.base_model,
                            "created": time.time(), "files": files, "content_sha256": digest}
                stage = "writing the manifest"
                _write_synced(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode(),
                              sync=self.sync)
                if self.sync:
                    stage = "syncing the version directory to disk"
                    _fsync_dir(tmp)
                crash_point("publish.before_rename")
                stage = "renaming the temporary directory into place"
                final = self.root / _dir_name(version, digest)
                os.rename(tmp, final)
                renamed = True
                if self.sync:
                    stage = "syncing the store root to disk"
                    _fsync_dir(self.root)
                crash_point("publish.after_rename")
            except BaseException as e:
                # nothing half-written may stay behind, whatever went wrong (a KeyboardInterrupt too);
                # a renamed version whose rename may not be durable is taken back: it was not published
                if renamed:
                    self._take_back(final)
                shutil.rmtree(tmp, ignore_errors=True)
                if isinstance(e, OSError):
                    raise StoreError(
                        f"publishing adapter version {version} to {self.root} failed while {stage} "
                        f"({tmp.name}): {_errno_text(e)}; nothing was published; {_write_hint(e, self.root)}") from e
                raise
            with self._state_lock:
                self._newest_published = version
                self._hashed[final.name] = identities
                waiters = list(self._waiters)
        for loop, event in waiters:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # the waiter's loop is closed: nobody is left to wake
                pass
        ref = AdapterRef(version=version, name=final.name, path=str(final), sha256=digest)
        log.debug("adapter_published", version=version, name=final.name, seconds=round(time.monotonic() - t0, 4))
        return ref

    def _take_back(self, final: Path) -> None:
        """Remove a version directory whose publish failed after its rename (best effort)."""
        try:
            self._delete_version([final.name])
        except StoreError as e:  # the publish already failed and says so; this only adds the leftover
            log.error("adapter_take_back_failed", path=str(final), error=str(e))

    def _hash_new_files(self, tmp: Path) -> tuple[dict[str, str], dict[str, tuple[int, ...]]]:
        """Check what `write` produced, hash it and (if `sync`) force it to disk: name -> sha256 of
        every file, and name -> the file's identity once hashed (`_identity`).

        One directory listing gives every file's type and each file is opened once, with one stat
        for its identity: on a shared filesystem every metadata operation is a round trip."""
        with os.scandir(tmp) as it:
            entries = sorted(it, key=lambda e: e.name)
        names = [e.name for e in entries]
        for entry in entries:
            if entry.is_symlink() or not entry.is_file(follow_symlinks=False):
                raise StoreError(f"adapter files must be plain files at the top level of {tmp}; {entry.name} is not")
            if "\\" in entry.name:  # the manifest refuses it on read, so it must not be published
                raise StoreError(f"adapter file name {entry.name!r} in {tmp} contains a backslash")
        pickles = [n for n in names if _is_pickle(n)]
        if pickles:
            raise StoreError(f"refusing to publish pickle files {pickles} in {tmp}: adapters are read only "
                             f"from safetensors (save with safe_serialization=True)")
        if MANIFEST in names:
            raise StoreError(f"{MANIFEST} in {tmp} is written by the store, not by the adapter writer")
        config = CONFIGS[self.kind]
        if config not in names:
            raise StoreError(f"refusing to publish {tmp}: {config} is missing (found {names}); "
                             f"a {self.kind} store publishes {'whole models' if self.kind == 'full' else 'LoRA adapters'}")
        if not any(n.endswith(".safetensors") for n in names):
            raise StoreError(f"refusing to publish {tmp}: no .safetensors file (found {names})")
        # each identity taken before its hash: a file changed while it is hashed no longer matches it
        identities = {e.name: _identity(os.stat(e.path, follow_symlinks=False)) for e in entries}
        return {e.name: _sha256_file(e.path, sync=self.sync) for e in entries}, identities

    # --- waiting -------------------------------------------------------------------------

    async def wait_for(self, version: int, timeout: float) -> AdapterRef:
        """Return the ref of `version` once it is published; TimeoutError after `timeout` seconds.

        An in-process publish wakes the waiter at once. Publishes by other processes on a
        shared filesystem are found by re-scanning every `poll_interval` seconds: polling is
        only the fallback for external publishers. Raises AdapterNotFoundError at once if a
        newer version is published but `version` is not there (it will never appear).
        """
        _check_lookup_version(version)
        if version == 0:
            return AdapterRef.base()
        deadline = time.monotonic() + timeout
        waiter = (asyncio.get_running_loop(), asyncio.Event())
        with self._state_lock:
            self._waiters.add(waiter)
        try:
            while True:
                # register first, then look: a publish in between still sets the event
                waiter[1].clear()
                published = await asyncio.to_thread(self._published)
                if version in published:
                    return await asyncio.to_thread(self.ref, version)
                if published and published[-1] > version:
                    raise AdapterNotFoundError(
                        f"adapter version {version} will never appear in {self.root}: version "
                        f"{published[-1]} is published and {version} is not (pruned?); available: {published}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"adapter version {version} was not published to {self.root} "
                                       f"within {timeout} s")
                try:
                    await asyncio.wait_for(waiter[1].wait(), timeout=min(left, self.poll_interval))
                except TimeoutError:  # poll interval elapsed: re-scan for an external publisher
                    pass
        finally:
            with self._state_lock:
                self._waiters.discard(waiter)

    # --- retention -----------------------------------------------------------------------

    def pin(self, version: int) -> None:
        """Keep `version` through `prune` until a matching `unpin` (reference counted)."""
        _check_lookup_version(version)
        with self._state_lock:
            self._pins[version] = self._pins.get(version, 0) + 1

    def unpin(self, version: int) -> None:
        _check_lookup_version(version)
        with self._state_lock:
            count = self._pins.get(version, 0)
            if count == 0:
                raise ValueError(f"adapter version {version} is not pinned")
            if count == 1:
                del self._pins[version]
            else:
                self._pins[version] = count - 1

    def prune(self, keep_from: int) -> list[int]:
        """Delete published versions < keep_from, except pinned ones and the newest keep_last.

        Returns the deleted versions, ascending.
        """
        if self.readonly:
            raise StoreError(f"adapter store {self.root} was opened readonly; it cannot prune")
        deleted: list[int] = []
        with self._write_lock:
            found = self._scan()
            newest = sorted(found)[-self.keep_last:] if self.keep_last else []
            with self._state_lock:
                pinned = {v for v, n in self._pins.items() if n > 0}
            for version in sorted(found):
                if version >= keep_from or version in newest or version in pinned:
                    continue
                self._delete_version(found[version])
                deleted.append(version)
        if deleted:
            log.debug("adapter_pruned", versions=deleted, keep_from=keep_from)
        return deleted

    def discard_after(self, version: int) -> list[int]:
        """Delete every version directory newer than `version`, so `version + 1` can be published again.

        For resuming: the trainer restarts from a checkpoint at `version`, and the versions it
        published after that checkpoint belong to a history that no longer exists. Pins do not
        protect them. Directories go newest first, each renamed away before it is removed, so a
        failure part way leaves versions 1..k for some k and a StoreError; calling again finishes.
        Returns the discarded versions, ascending.
        """
        if self.readonly:
            raise StoreError(f"adapter store {self.root} was opened readonly; it cannot discard versions")
        _check_lookup_version(version)
        with self._write_lock:
            found = self._scan()
            doomed = sorted((v for v in found if v > version), reverse=True)
            for v in doomed:
                self._delete_version(found[v])
            with self._state_lock:
                # lowered only once all are gone: after a failure the survivors still block reuse
                self._newest_published = min(self._newest_published, version)
        if doomed:
            log.info("adapter_discarded", versions=sorted(doomed), after=version)
        return sorted(doomed)

    def _delete_version(self, names: list[str]) -> None:
        """Rename each directory to `.tmp-del-*` (readers never see half of it), then remove it."""
        for name in names:
            with self._state_lock:
                self._hashed.pop(name, None)
            doomed = self.root / f"{TMP_PREFIX}del-{name}-{uuid.uuid4().hex}"
            try:
                os.rename(self.root / name, doomed)
            except OSError as e:
                raise StoreError(f"cannot delete adapter {self.root / name}: {_errno_text(e)}; "
                                 f"{_write_hint(e, self.root)}") from e
            self._remove_tree(doomed)
