"""The adapter store's invariants: a killed publish is never loaded, corruption is refused, versions only increase."""

from __future__ import annotations

import asyncio
import errno
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO
from safetensors.numpy import save_file

from pipeline.store import weights as adapter_store
from pipeline.store.weights import AdapterStore, content_hash
from pipeline.errors import AdapterCorruptError, AdapterError, AdapterNotFoundError, StoreError
from pipeline.types import AdapterRef


def writer(value: float = 0.0, extra: dict[str, bytes] | None = None, config: bool = True):
    """A write callback like peft's save_pretrained: adapter_config.json + adapter_model.safetensors."""

    def write(d: Path) -> None:
        save_file({"lora_A": np.full((2, 3), value, dtype=np.float32)}, str(d / "adapter_model.safetensors"))
        if config:
            (d / "adapter_config.json").write_text(json.dumps({"r": 2, "peft_type": "LORA"}))
        for name, data in (extra or {}).items():
            (d / name).write_bytes(data)

    return write


def tmp_entries(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(".tmp-"))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --- round trip ---------------------------------------------------------------------------


def test_publish_load_round_trip_with_real_files(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file as torch_save

    weights = {"base_model.model.layer.lora_A.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4)}

    def write(d: Path) -> None:
        torch_save(weights, str(d / "adapter_model.safetensors"))
        (d / "adapter_config.json").write_text(json.dumps({"r": 4, "peft_type": "LORA"}))

    root = tmp_path / "adapters"
    store = AdapterStore(root, base_model="tiny-model")
    assert store.versions() == [] and store.latest() is None
    t0 = time.time()
    ref = store.publish(1, write)

    assert re.fullmatch(r"v000001-[0-9a-f]{8}", ref.name), ref.name
    assert ref.name.endswith(ref.sha256[:8]) and len(ref.sha256) == 64
    assert ref.path == str(root.resolve() / ref.name) and os.path.isabs(ref.path)
    d = Path(ref.path)
    assert sorted(p.name for p in d.iterdir()) == ["adapter_config.json", "adapter_model.safetensors", "manifest.json"]
    manifest = json.loads((d / "manifest.json").read_text())
    files = {n: sha256(d / n) for n in ("adapter_config.json", "adapter_model.safetensors")}
    assert manifest["format"] == 1 and manifest["version"] == 1 and manifest["base_model"] == "tiny-model"
    assert manifest["files"] == files
    assert manifest["content_sha256"] == content_hash(files) == ref.sha256
    assert t0 - 1 <= manifest["created"] <= time.time() + 1

    assert store.load(1) == ref == store.ref(1) == store.latest()
    assert torch.equal(load_file(str(d / "adapter_model.safetensors"))["base_model.model.layer.lora_A.weight"],
                       weights["base_model.model.layer.lora_A.weight"])

    ref2 = store.publish(3, writer(1.0))
    assert ref2.name.startswith("v000003-") and ref2.sha256 != ref.sha256
    assert store.versions() == [1, 3]
    assert store.latest() == ref2 == store.load(3)
    assert store.ref(0) == store.load(0) == AdapterRef.base()
    # another store on the same root (a reader elsewhere) sees the same versions
    assert AdapterStore(root, readonly=True).load(3) == ref2
    assert tmp_entries(root) == []


def test_same_content_at_two_versions_gets_two_names(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path)
    a, b = store.publish(1, writer(0.5)), store.publish(2, writer(0.5))
    assert a.sha256 == b.sha256 and a.name != b.name and a.name[-8:] == b.name[-8:]


def test_lookup_of_absent_version_lists_available(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path)
    store.publish(1, writer())
    store.publish(2, writer(1.0))
    with pytest.raises(AdapterNotFoundError, match=r"version 5 .*available: \[1, 2\]"):
        store.load(5)
    with pytest.raises(AdapterNotFoundError):
        store.ref(5)
    with pytest.raises(ValueError, match="int >= 0"):
        store.load(-1)


# --- killed publishes ---------------------------------------------------------------------

CHILD = r"""
import json, sys, time
from pathlib import Path
import numpy as np
from safetensors.numpy import save_file
from pipeline.store import weights as s
root, version, marker, mode = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]

def block():
    marker.write_text("reached")
    time.sleep(60)

def write(d):
    (d / "adapter_config.json").write_text(json.dumps({"r": 2}))
    if mode == "write":
        block()
    save_file({"w": np.arange(6, dtype=np.float32)}, str(d / "adapter_model.safetensors"))

if mode == "hash":
    s._sha256_file = lambda path, **kw: block()
elif mode == "before_rename":
    real_fsync_dir = s._fsync_dir
    def fsync_dir(path):
        real_fsync_dir(path)
        if path.name.startswith(".tmp-"):
            block()
    s._fsync_dir = fsync_dir
elif mode == "on_go":
    while not marker.exists():
        time.sleep(0.01)
s.AdapterStore(root).publish(version, write)
"""


def start_child(root: Path, version: int, marker: Path, mode: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen([sys.executable, "-c", CHILD, str(root), str(version), str(marker), mode],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def wait_for_marker(proc: subprocess.Popen[bytes], marker: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not marker.exists():
        if proc.poll() is not None:
            raise AssertionError(f"child exited with {proc.returncode}: {proc.stderr.read().decode()}")
        assert time.monotonic() < deadline, "child never reached the kill point"
        time.sleep(0.01)


@pytest.mark.parametrize("kill_point, left_in_tmp", [
    ("write", ["adapter_config.json"]),  # the write callback has written one file
    ("hash", ["adapter_config.json", "adapter_model.safetensors"]),  # files complete, hashing
    ("before_rename", ["adapter_config.json", "adapter_model.safetensors", "manifest.json"]),  # all fsynced
])
def test_a_publish_killed_half_way_is_never_loaded(tmp_path: Path, kill_point: str, left_in_tmp: list[str]) -> None:
    root = tmp_path / "adapters"
    store = AdapterStore(root)
    v1 = store.publish(1, writer())
    marker = tmp_path / "marker"
    proc = start_child(root, 2, marker, kill_point)
    try:
        wait_for_marker(proc, marker)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL

    (tmp,) = tmp_entries(root)
    assert tmp.startswith(".tmp-v000002-")
    assert sorted(p.name for p in (root / tmp).iterdir()) == left_in_tmp  # the kill point was where we meant
    for s in (store, AdapterStore(root, readonly=True)):
        assert s.versions() == [1]
        assert s.latest() == v1
        with pytest.raises(AdapterNotFoundError):
            s.load(2)
        with pytest.raises(AdapterNotFoundError):
            s.ref(2)
        with pytest.raises(TimeoutError):
            asyncio.run(s.wait_for(2, timeout=0.05))
    assert tmp_entries(root) == [tmp]  # readers leave it alone

    reopened = AdapterStore(root)
    assert tmp_entries(root) == []
    assert reopened.versions() == [1]
    assert reopened.publish(2, writer(2.0)) == reopened.load(2)


def test_open_removes_leftover_deletions(tmp_path: Path) -> None:
    leftover = tmp_path / ".tmp-del-v000001-00000000-abc"
    leftover.mkdir()
    (leftover / "adapter_model.safetensors").write_bytes(b"x")
    AdapterStore(tmp_path)
    assert not leftover.exists()


def test_removal_never_follows_a_link_out_and_takes_nested_leftovers(tmp_path: Path) -> None:
    # what open() cleans is not always a flat version directory: a link, a nested tree
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.safetensors").write_bytes(b"k")
    root = tmp_path / "adapters"
    root.mkdir()
    (root / ".tmp-link").symlink_to(outside)
    nested = root / ".tmp-v000002-abc"
    (nested / "sub").mkdir(parents=True)
    (nested / "sub" / "x.safetensors").write_bytes(b"x")
    (nested / "link.safetensors").symlink_to(outside / "keep.safetensors")
    flat = root / ".tmp-del-v000001-00000000-abc"
    flat.mkdir()
    (flat / "adapter_model.safetensors").symlink_to(outside / "keep.safetensors")
    AdapterStore(root)
    assert os.listdir(root) == []
    assert (outside / "keep.safetensors").read_bytes() == b"k"


# --- corruption ---------------------------------------------------------------------------


def flip_byte(d: Path) -> None:
    p = d / "adapter_model.safetensors"
    data = bytearray(p.read_bytes())
    data[-1] ^= 0xFF
    p.write_bytes(bytes(data))


def edit_manifest(d: Path, **changes: object) -> None:
    m = json.loads((d / "manifest.json").read_text())
    m.update(changes)
    (d / "manifest.json").write_text(json.dumps(m))


def symlink_to_identical_copy(d: Path) -> None:
    """Same bytes, but read through a link to a file outside the version directory."""
    outside = d.parent.parent / "outside.safetensors"
    outside.write_bytes((d / "adapter_model.safetensors").read_bytes())
    (d / "adapter_model.safetensors").unlink()
    (d / "adapter_model.safetensors").symlink_to(outside)


def rehash_one_file(d: Path) -> None:
    """Change a file and its manifest entry consistently: only the content hash can tell."""
    flip_byte(d)
    m = json.loads((d / "manifest.json").read_text())
    m["files"]["adapter_model.safetensors"] = sha256(d / "adapter_model.safetensors")
    (d / "manifest.json").write_text(json.dumps(m))


@pytest.mark.parametrize("tamper, message", [
    (flip_byte, r"adapter_model\.safetensors sha256 is [0-9a-f]{12}\.\. but the manifest says [0-9a-f]{12}\.\."),
    (lambda d: (d / "manifest.json").unlink(), r"manifest\.json is missing"),
    (lambda d: edit_manifest(d, version=9), r"says version 9 but the directory name says 1"),
    (lambda d: (d / "adapter.bin").write_bytes(b"pickle"), r"adapter\.bin is not listed"),
    (lambda d: (d / "extra.safetensors").write_bytes(b"{}"), r"extra\.safetensors is not listed"),
    (lambda d: (d / "adapter_config.json").unlink(), r"adapter_config\.json is listed in the manifest but is missing"),
    (lambda d: (d / "manifest.json").write_text("{not json"), r"manifest\.json is not valid JSON"),
    (lambda d: edit_manifest(d, files={"adapter_config.json": "0" * 64, "../x.safetensors": "0" * 64}),
     r"invalid file name '\.\./x\.safetensors'"),
    (rehash_one_file, r"content_sha256 is [0-9a-f]{12}\.\. but its file hashes give"),
    (lambda d: (d / "optimizer.pt").write_bytes(b"pickle"), r"optimizer\.pt is not listed"),
    (lambda d: edit_manifest(d, files={"adapter_config.json": "0" * 64, "a\0.safetensors": "0" * 64}),
     r"invalid file name 'a\\x00\.safetensors'"),
    (lambda d: (d / "adapter_model.safetensors").unlink() or (d / "adapter_model.safetensors").mkdir(),
     r"adapter_model\.safetensors is listed in the manifest but is missing"),
    (symlink_to_identical_copy, r"adapter_model\.safetensors is a symbolic link"),
])
def test_a_corrupted_adapter_directory_is_refused_with_a_clear_error(tmp_path: Path, tamper, message: str) -> None:
    store = AdapterStore(tmp_path)
    ref = store.publish(1, writer())
    tamper(Path(ref.path))
    assert store.versions() == ([1] if (Path(ref.path) / "manifest.json").exists() else [])
    for check in (lambda: store.load(1), lambda: store.verify_dir(ref.path)):
        with pytest.raises(AdapterCorruptError, match=message) as info:
            check()
        assert ref.name in str(info.value)


def test_the_publishing_store_verifies_its_own_untouched_files_without_reading_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a full-weight version is a whole model: hashed once as it is published, not again by the
    # adapter loop's verify in the same process; any write, replacement or other reader hashes again
    store = AdapterStore(tmp_path)
    ref = store.publish(1, writer(1.0))
    real = adapter_store._sha256_file
    read: list[str] = []
    monkeypatch.setattr(adapter_store, "_sha256_file", lambda path, **kw: read.append(os.path.basename(path))
                        or real(path, **kw))
    assert store.verify_dir(ref.path) == ref and read == []
    assert AdapterStore(tmp_path, readonly=True).verify_dir(ref.path) == ref and len(read) == 2
    read.clear()
    f = Path(ref.path) / "adapter_model.safetensors"
    st = f.stat()
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))  # same size, and the mtime put back: the ctime still moved
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(AdapterCorruptError, match=r"adapter_model\.safetensors sha256 is"):
        store.verify_dir(ref.path)
    assert read == ["adapter_model.safetensors"]  # the untouched config was not read again


def test_a_renamed_directory_is_refused(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path)
    ref = store.publish(1, writer())
    moved = tmp_path / f"v000001-{'0' * 8}"
    os.rename(ref.path, moved)
    with pytest.raises(AdapterCorruptError, match="does not match the directory's hash 00000000"):
        store.load(1)
    os.rename(moved, tmp_path / f"v000004-{ref.sha256[:8]}")
    with pytest.raises(AdapterCorruptError, match="says version 1 but the directory name says 4"):
        store.latest()


def test_verify_dir_refuses_paths_outside_root(tmp_path: Path) -> None:
    root = tmp_path / "adapters"
    store = AdapterStore(root)
    ref = store.publish(1, writer())
    outside = tmp_path / "elsewhere" / ref.name
    outside.parent.mkdir()
    os.rename(ref.path, outside)
    with pytest.raises(AdapterError, match="not a version directory of the adapter store"):
        store.verify_dir(outside)
    with pytest.raises(AdapterError, match="not a version directory"):
        store.verify_dir(root / ".." / "elsewhere" / ref.name)
    with pytest.raises(AdapterError, match="not a version directory"):
        store.verify_dir(root / "not-a-version")
    os.rename(outside, ref.path)
    assert store.verify_dir(root / ".." / "adapters" / ref.name) == ref


# --- publish refusals and failures --------------------------------------------------------


@pytest.mark.parametrize("write, message", [
    (writer(extra={"adapter_model.bin": b"pickle"}), r"pickle files \['adapter_model\.bin'\]"),
    (writer(extra={"optimizer.pt": b"pickle"}), r"pickle files \['optimizer\.pt'\]"),
    (writer(config=False), r"adapter_config\.json is missing"),
    (lambda d: (d / "adapter_config.json").write_text("{}"), r"no \.safetensors file"),
    (writer(extra={"manifest.json": b"{}"}), r"manifest\.json .* is written by the store"),
    (lambda d: (writer()(d), (d / "default").mkdir()), r"plain files at the top level .* default is not"),
])
def test_publish_refuses_bad_adapter_files(tmp_path: Path, write, message: str) -> None:
    store = AdapterStore(tmp_path)
    with pytest.raises(StoreError, match=message):
        store.publish(1, write)
    assert store.versions() == [] and tmp_entries(tmp_path) == []
    assert store.publish(1, writer()).version == 1  # a refused publish does not use up the version


def test_publish_refuses_non_increasing_versions(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path, keep_last=0)
    for bad in (0, -1, True, 1.5):
        with pytest.raises(StoreError, match="int >= 1"):
            store.publish(bad, writer())  # type: ignore[arg-type]
    store.publish(2, writer())
    for bad in (2, 1):
        with pytest.raises(StoreError, match=f"cannot publish adapter version {bad} .* version 2 is already published"):
            store.publish(bad, writer(1.0))
    assert store.prune(keep_from=10) == [2] and store.versions() == []
    with pytest.raises(StoreError, match="already published"):
        store.publish(2, writer(1.0))  # never reuse a version, even one pruned since
    with pytest.raises(StoreError, match="already published"):
        store.publish(1, writer())
    assert store.publish(3, writer()).version == 3
    assert tmp_entries(tmp_path) == []


def os_error(code: int, filename: str | None = None) -> OSError:
    """An OSError as the kernel would raise it (OSError(EACCES, ...) is a PermissionError)."""
    return OSError(code, os.strerror(code), filename)


def fail_mkdir(mp: pytest.MonkeyPatch, prefix: str, code: int) -> None:
    """Creating a directory whose name starts with `prefix` fails with errno `code`."""
    real = Path.mkdir

    def mkdir(self: Path, *args, **kwargs) -> None:
        if self.name.startswith(prefix):
            raise os_error(code, str(self))
        real(self, *args, **kwargs)

    mp.setattr(Path, "mkdir", mkdir)


def fail_tmp_mkdir(mp: pytest.MonkeyPatch, root: Path) -> None:
    fail_mkdir(mp, ".tmp-v", errno.EACCES)


def fail_manifest_write(mp: pytest.MonkeyPatch, root: Path) -> None:
    """The disk fills up part way through the manifest: a partial manifest.json is on disk."""
    def write_synced(path: Path, data: bytes, sync: bool = True) -> None:
        assert Path(path).name == "manifest.json"
        Path(path).write_bytes(data[:1])
        raise os_error(errno.ENOSPC, str(path))

    mp.setattr(adapter_store, "_write_synced", write_synced)


def fail_file_fsync(mp: pytest.MonkeyPatch, root: Path) -> None:
    """Every fsync fails; an adapter file's is the first one a publish makes (as it hashes it)."""
    def fsync(fd: int) -> None:
        raise os_error(errno.EIO, f"fd {fd}")

    mp.setattr(os, "fsync", fsync)


def fail_rename(mp: pytest.MonkeyPatch, root: Path) -> None:
    real = os.rename

    def rename(src, dst) -> None:
        if Path(src).name.startswith(".tmp-v"):
            raise os_error(errno.EACCES, str(src))
        real(src, dst)

    mp.setattr(os, "rename", rename)


def fail_root_fsync(mp: pytest.MonkeyPatch, root: Path) -> None:
    """The rename happened but cannot be made durable: the version must be taken back."""
    real = adapter_store._fsync_dir

    def fsync_dir(path: Path) -> None:
        if Path(path) == root.resolve():
            assert any(n.startswith("v000002-") for n in os.listdir(root))  # the rename did happen
            raise os_error(errno.EIO, str(path))
        real(path)

    mp.setattr(adapter_store, "_fsync_dir", fsync_dir)


def disk_full_write(d: Path) -> None:
    writer(2.0)(d)
    raise os_error(errno.ENOSPC, str(d / "adapter_model.safetensors"))


@pytest.mark.parametrize("fault, write, stage, code, hint", [
    (fail_tmp_mkdir, None, "creating the temporary directory", errno.EACCES, "writable by this user"),
    (None, disk_full_write, "writing the adapter files", errno.ENOSPC, "free space on the filesystem"),
    (fail_manifest_write, None, "writing the manifest", errno.ENOSPC, "free space on the filesystem"),
    (fail_file_fsync, None, "hashing and syncing the adapter files", errno.EIO, "check the filesystem"),
    (fail_rename, None, "renaming the temporary directory into place", errno.EACCES, "writable by this user"),
    (fail_root_fsync, None, "syncing the store root to disk", errno.EIO, "check the filesystem"),
])
def test_an_os_error_at_any_publish_stage_is_a_clear_store_error_and_tears_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault, write, stage: str, code: int, hint: str) -> None:
    root = tmp_path / "adapters"
    store = AdapterStore(root)
    v1 = store.publish(1, writer())
    with monkeypatch.context() as mp:
        if fault is not None:
            fault(mp, root)
        with pytest.raises(StoreError) as info:
            store.publish(2, write or writer(2.0))
    message = str(info.value)
    for part in (f"publishing adapter version 2 to {root.resolve()} failed while {stage} (.tmp-v000002-",
                 f"{errno.errorcode[code]} ({os.strerror(code)}", "nothing was published", hint):
        assert part in message, (part, message)
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == code
    assert sorted(os.listdir(root)) == [v1.name]  # no temporary directory, no version directory
    for s in (store, AdapterStore(root, readonly=True)):
        assert s.versions() == [1] and s.latest() == v1
        with pytest.raises(AdapterNotFoundError):
            s.load(2)
    ref = store.publish(2, writer(2.0))  # the cause is gone: the version was not used up
    assert store.load(2) == ref and store.versions() == [1, 2]


def test_root_that_cannot_be_written_is_a_store_error_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fail_mkdir(monkeypatch, ".tmp-probe-", errno.EROFS)  # a read-only mount
    root = tmp_path / "adapters"
    with pytest.raises(StoreError) as info:
        AdapterStore(root)
    message = str(info.value)
    assert f"adapter store root {root} cannot be created or written: EROFS (" in message, message
    assert "writable by this user" in message
    assert AdapterStore(root, readonly=True).versions() == []  # a reader needs no write access

    monkeypatch.setattr(Path, "mkdir", lambda self, *a, **k: (_ for _ in ()).throw(os_error(errno.EACCES, str(self))))
    with pytest.raises(StoreError, match=rf"root {re.escape(str(tmp_path / 'other'))} cannot be created or written: "
                                         rf"EACCES \(Permission denied"):
        AdapterStore(tmp_path / "other")


def test_unlistable_root_is_a_store_error_not_an_os_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = AdapterStore(tmp_path, readonly=True)

    def scandir(path):
        raise os_error(errno.EACCES, str(path))

    monkeypatch.setattr(os, "scandir", scandir)
    with pytest.raises(StoreError, match=rf"cannot list the adapter store root {re.escape(str(tmp_path))}: EACCES"):
        store.versions()


# --- versions that vanish while they are read ---------------------------------------------


def test_a_version_deleted_after_listing_is_not_found_naming_its_path(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    store = AdapterStore(tmp_path)
    other = AdapterStore(tmp_path)  # e.g. the trainer discarding on resume while an engine reads
    real_scan = store._scan
    for version, lookup in ((1, store.load), (2, store.ref)):
        ref = store.publish(version, writer(float(version)))

        def stale_scan() -> dict[int, list[str]]:
            found = real_scan()
            other.discard_after(version - 1)  # the directory goes right after it was listed
            return found

        monkeypatch.setattr(store, "_scan", stale_scan)
        with pytest.raises(AdapterNotFoundError, match=rf"directory {re.escape(ref.path)} does not exist"):
            lookup(version)
        monkeypatch.setattr(store, "_scan", real_scan)
        assert not Path(ref.path).exists()

    with pytest.raises(AdapterNotFoundError, match=rf"directory {re.escape(ref.path)} does not exist"):
        store.verify_dir(ref.path)


def test_a_version_deleted_while_its_files_are_hashed_is_not_found(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    ref = AdapterStore(tmp_path).publish(1, writer())
    store = AdapterStore(tmp_path, readonly=True)  # a reader, which hashes every file it verifies
    real = adapter_store._sha256_file
    calls = []

    def sha256_file(path: str, **kw: bool) -> str:
        calls.append(os.path.basename(path))
        if len(calls) == 2:  # one file checked, the second about to be read
            AdapterStore(tmp_path).discard_after(0)
        return real(path, **kw)

    monkeypatch.setattr(adapter_store, "_sha256_file", sha256_file)
    with pytest.raises(AdapterNotFoundError, match=rf"directory {re.escape(ref.path)} does not exist"):
        store.load(1)
    assert len(calls) == 2


def test_latest_lists_again_when_the_newest_vanishes_under_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = AdapterStore(tmp_path)
    v1 = store.publish(1, writer())
    store.publish(2, writer(2.0))
    real = store._published
    listings = [real()]
    AdapterStore(tmp_path).discard_after(1)
    monkeypatch.setattr(store, "_published", lambda: listings.pop() if listings else real())
    assert store.latest() == v1
    assert listings == []  # the stale listing [1, 2] was used, then the fresh one


def test_a_failing_write_callback_propagates_and_leaves_nothing(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path)

    def write(d: Path) -> None:
        writer()(d)
        raise ValueError("model has no adapter")

    with pytest.raises(ValueError, match="model has no adapter"):
        store.publish(1, write)
    assert os.listdir(tmp_path) == []


def test_root_that_cannot_be_created_is_a_store_error(tmp_path: Path) -> None:
    (tmp_path / "a_file").write_text("")
    with pytest.raises(StoreError, match=r"adapter store root .*a_file/adapters cannot be created or written"):
        AdapterStore(tmp_path / "a_file" / "adapters")


def test_unwritable_root_is_a_store_error(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    root = tmp_path / "root"
    store = AdapterStore(root)
    store.publish(1, writer())
    locked.chmod(0o500)
    root.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("running as a user (root) whom chmod does not stop from writing")
        with pytest.raises(StoreError, match=r"root .*locked/adapters cannot be created or written.*Permission"):
            AdapterStore(locked / "adapters")
        with pytest.raises(StoreError, match=r"root .*locked cannot be created or written.*Permission"):
            AdapterStore(locked)
        with pytest.raises(StoreError, match=r"publishing adapter version 2 to .*root failed .*EACCES \(Permission"):
            store.publish(2, writer(1.0))
        assert store.versions() == [1] and tmp_entries(root) == []
        assert AdapterStore(root, readonly=True).load(1).version == 1  # readers need no write access
    finally:
        locked.chmod(0o700)
        root.chmod(0o700)


def test_readonly_store_neither_publishes_nor_prunes(tmp_path: Path) -> None:
    reader = AdapterStore(tmp_path / "not-yet", readonly=True)
    assert reader.versions() == [] and not (tmp_path / "not-yet").exists()
    with pytest.raises(StoreError, match="readonly"):
        reader.publish(1, writer())
    with pytest.raises(StoreError, match="readonly"):
        reader.prune(5)


# --- wait_for -----------------------------------------------------------------------------


def test_in_process_publish_from_a_thread_wakes_a_waiter_promptly(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path, poll_interval=30.0)  # a poll would take 30 s: only the wake-up can pass
    release = threading.Event()

    def slow_write(d: Path) -> None:
        assert release.wait(timeout=10.0)
        writer()(d)

    async def main() -> tuple[AdapterRef, AdapterRef, float]:
        publishing = asyncio.create_task(asyncio.to_thread(store.publish, 1, slow_write))
        await asyncio.sleep(0.05)  # the publish now holds its lock, inside the write callback
        t0 = time.monotonic()
        waiter = asyncio.create_task(store.wait_for(1, timeout=60.0))
        store.pin(1)  # neither registering a waiter nor pinning waits for the publish
        await asyncio.sleep(0.1)
        assert time.monotonic() - t0 < 1.0 and not waiter.done() and not publishing.done()
        release.set()
        ref = await publishing
        t_published = time.monotonic()
        got = await asyncio.wait_for(waiter, timeout=5.0)
        return ref, got, time.monotonic() - t_published

    ref, got, delay = asyncio.run(main())
    assert got == ref
    assert delay < 1.0, delay


def test_an_external_publish_is_found_by_polling(tmp_path: Path) -> None:
    root = tmp_path / "adapters"
    store = AdapterStore(root, poll_interval=0.05)
    go = tmp_path / "go"
    proc = start_child(root, 1, go, "on_go")

    async def main() -> AdapterRef:
        waiter = asyncio.create_task(store.wait_for(1, timeout=30.0))
        await asyncio.sleep(0.1)
        assert not waiter.done()
        go.write_text("")
        return await waiter

    try:
        ref = asyncio.run(main())
        assert proc.wait(timeout=30) == 0, proc.stderr.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    assert ref.version == 1 and store.load(1) == ref


def test_wait_for_times_out_naming_the_version(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path, poll_interval=0.05)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"adapter version 3 was not published .* within 0\.2 s"):
        asyncio.run(store.wait_for(3, timeout=0.2))
    assert 0.2 <= time.monotonic() - t0 < 3.0


def test_wait_for_existing_base_and_skipped_versions(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path, poll_interval=30.0)
    ref = store.publish(2, writer())
    assert asyncio.run(store.wait_for(2, timeout=1.0)) == ref
    assert asyncio.run(store.wait_for(0, timeout=0.0)) == AdapterRef.base()
    with pytest.raises(AdapterNotFoundError, match="version 1 will never appear"):
        asyncio.run(store.wait_for(1, timeout=5.0))


# --- retention ----------------------------------------------------------------------------


def test_prune_keeps_pinned_versions_and_the_newest_keep_last(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path, keep_last=2)
    refs = {v: store.publish(v, writer(float(v))) for v in range(1, 7)}
    store.pin(2)
    store.pin(2)
    store.pin(3)
    store.unpin(3)

    assert store.prune(keep_from=5) == [1, 3, 4]
    assert store.versions() == [2, 5, 6]
    assert not any(Path(refs[v].path).exists() for v in (1, 3, 4))
    assert tmp_entries(tmp_path) == []
    assert store.load(2) == refs[2]

    store.unpin(2)
    assert store.prune(keep_from=5) == []  # still pinned once
    store.unpin(2)
    with pytest.raises(ValueError, match="not pinned"):
        store.unpin(2)
    assert store.prune(keep_from=100) == [2]  # 5 and 6 are the newest two
    assert store.versions() == [5, 6]
    assert store.prune(keep_from=0) == []


# --- discarding versions on resume ---------------------------------------------------------


def test_discard_after_removes_newer_versions_so_they_can_be_published_again(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path, keep_last=0)
    refs = {v: store.publish(v, writer(float(v))) for v in range(1, 6)}
    store.pin(4)  # pins keep versions through prune, not through a discard
    broken = tmp_path / f"v000009-{'0' * 8}"  # a version directory without a manifest goes too
    broken.mkdir()
    assert store.discard_after(2) == [3, 4, 5, 9]
    assert store.versions() == [1, 2] and store.latest() == refs[2]
    assert sorted(os.listdir(tmp_path)) == sorted([refs[1].name, refs[2].name])  # no .tmp-del-* left
    with pytest.raises(StoreError, match="version 2 is already published"):
        store.publish(2, writer(9.0))
    new3 = store.publish(3, writer(30.0))  # the resumed trainer's next version
    assert new3.sha256 != refs[3].sha256 and store.load(3) == new3 and store.versions() == [1, 2, 3]
    assert asyncio.run(store.wait_for(3, timeout=1.0)) == new3

    assert store.discard_after(3) == []  # nothing newer: the newest seen stays
    with pytest.raises(StoreError, match="version 3 is already published"):
        store.publish(3, writer(31.0))


def test_discard_after_in_a_fresh_process_and_after_prune(tmp_path: Path) -> None:
    first = AdapterStore(tmp_path, keep_last=0)
    for v in range(1, 5):
        first.publish(v, writer(float(v)))
    assert first.prune(keep_from=3) == [1, 2]
    resumed = AdapterStore(tmp_path)  # the restarted trainer: it has seen nothing yet
    assert resumed.discard_after(1) == [3, 4]
    assert resumed.versions() == []
    assert resumed.publish(2, writer(20.0)).version == 2  # 2 was pruned, but it is after the checkpoint
    assert resumed.discard_after(0) == [2] and resumed.versions() == []
    assert resumed.publish(1, writer(10.0)).version == 1


def test_discard_after_that_fails_part_way_keeps_blocking_reuse(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = AdapterStore(tmp_path)
    for v in range(1, 6):
        store.publish(v, writer(float(v)))
    real = os.rename
    renamed: list[str] = []

    def rename(src, dst) -> None:
        if renamed:  # the second deletion fails
            raise os_error(errno.EACCES, str(src))
        renamed.append(Path(src).name)
        real(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(StoreError, match=rf"cannot delete adapter {re.escape(str(tmp_path))}/v000004-.*EACCES"):
        store.discard_after(2)
    monkeypatch.undo()
    assert renamed[0].startswith("v000005-")  # newest first: what is left is still a prefix
    assert store.versions() == [1, 2, 3, 4] and tmp_entries(tmp_path) == []
    with pytest.raises(StoreError, match="version 5 is already published"):  # the newest this store saw
        store.publish(3, writer(30.0))
    with pytest.raises(StoreError, match="version 4 is already published"):  # the newest left on disk
        AdapterStore(tmp_path).publish(3, writer(30.0))
    assert store.discard_after(2) == [3, 4]  # calling again finishes
    assert store.publish(3, writer(30.0)).version == 3


def test_discard_after_refuses_readonly_stores_and_bad_versions(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path)
    store.publish(1, writer())
    with pytest.raises(StoreError, match="readonly"):
        AdapterStore(tmp_path, readonly=True).discard_after(0)
    for bad in (-1, "0", True, 1.0, None):
        with pytest.raises(ValueError, match="int >= 0"):
            store.discard_after(bad)  # type: ignore[arg-type]
    assert store.versions() == [1]


# --- full-weight versions -------------------------------------------------------------------


def model_writer(value: float = 0.0):
    """A write callback like a model's save_pretrained: config.json + model.safetensors."""

    def write(d: Path) -> None:
        save_file({"model.embed_tokens.weight": np.full((4, 3), value, dtype=np.float32)}, str(d / "model.safetensors"))
        (d / "config.json").write_text(json.dumps({"model_type": "qwen2"}))

    return write


def test_a_full_store_publishes_and_verifies_model_directories(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path / "a", kind="full")
    ref = store.publish(1, model_writer(1.0))
    manifest = json.loads((Path(ref.path) / "manifest.json").read_text())
    assert manifest["kind"] == "full" and set(manifest["files"]) == {"config.json", "model.safetensors"}
    assert store.verify_dir(ref.path) == ref
    with pytest.raises(StoreError, match="config.json is missing"):
        store.publish(2, writer())  # a LoRA adapter is not a model
    assert store.versions() == [1]


def test_a_store_refuses_a_version_of_the_other_kind(tmp_path: Path) -> None:
    full = AdapterStore(tmp_path / "a", kind="full")
    ref = full.publish(1, model_writer())
    with pytest.raises(AdapterCorruptError, match="kind 'full'.*'lora'.*trainer.update"):
        AdapterStore(tmp_path / "a", readonly=True).verify_dir(ref.path)
    lora = AdapterStore(tmp_path / "b")
    lref = lora.publish(1, writer())
    with pytest.raises(AdapterCorruptError, match="kind 'lora'.*'full'"):
        AdapterStore(tmp_path / "b", readonly=True, kind="full").verify_dir(lref.path)
    with pytest.raises(ValueError, match="kind must be one of lora, full"):
        AdapterStore(tmp_path / "c", kind="weights")


def test_a_manifest_without_a_kind_is_a_lora_adapter(tmp_path: Path) -> None:
    """Stores written before full-weight updates existed still load."""
    store = AdapterStore(tmp_path / "a")
    ref = store.publish(1, writer())
    path = Path(ref.path) / "manifest.json"
    manifest = json.loads(path.read_text())
    del manifest["kind"]
    path.write_text(json.dumps(manifest))
    assert store.verify_dir(ref.path) == ref


def test_a_store_without_sync_publishes_without_one_fsync_and_still_refuses_a_torn_version(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """store.sync = false (the pipeline's default): no fsync on the publish path; the manifest's
    hashes, not the disk's durability, keep a torn version from loading."""
    calls: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(fd), real(fd))[1])
    synced = AdapterStore(tmp_path / "synced")
    synced.publish(1, writer())
    assert len(calls) >= 4  # each file, the manifest, the directory, the root
    calls.clear()
    store = AdapterStore(tmp_path / "unsynced", sync=False)
    ref = store.publish(1, writer(1.0))
    assert calls == []
    assert store.verify_dir(ref.path) == ref
    # what a power loss can leave of an unsynced file: its length, not its bytes
    path = Path(ref.path) / "adapter_model.safetensors"
    path.write_bytes(b"\0" * path.stat().st_size)
    with pytest.raises(AdapterCorruptError, match="sha256"):
        store.verify_dir(ref.path)


def test_the_pipeline_opens_its_store_unsynced_unless_store_sync(tmp_path: Path) -> None:
    from pipeline.config.io import load_config
    from pipeline.loop.session import open_session

    for value in (False, True):
        cfg = load_config(None, {"out": str(tmp_path / f"run-{value}"), "store.sync": value})
        session = open_session(cfg, tmp_path / f"run-{value}", total=4, fingerprint={}, model_path=None,
                               resume=False, force=False)
        assert session.store.sync is value
